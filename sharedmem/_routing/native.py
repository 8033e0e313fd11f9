"""Loading the routing allocator: ``router.cpp`` compiled with ``torch.utils.cpp_extension``
at first use (about half a minute, once; PyTorch caches the build under
``$TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``) and installed as c10's CPU
allocator. Where it cannot be built (no C++ compiler, no ninja) or is turned off
(``SHAREDMEM_ROUTING=0``), ``native()`` gives ``None`` with one warning, and pooled steps plan
with ``out=`` kernels only, as before the router existed.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["build", "loaded", "native", "routing_enabled", "would_load"]

_SOURCE = Path(__file__).with_name("router.cpp")
_NAME = "sharedmem_routing"
_lock = threading.Lock()
_loaded: list[Any] = []  # [module or None] once tried


def routing_enabled() -> bool:
    """Whether the environment allows the router (``SHAREDMEM_ROUTING=0`` turns it off)."""
    return os.environ.get("SHAREDMEM_ROUTING", "1").strip().lower() not in ("0", "false", "off")


def native() -> Any | None:
    """The compiled router, installed as the CPU allocator; ``None`` where it is off or could
    not be built (warned once)."""
    if _loaded:
        return _loaded[0]
    with _lock:
        if not _loaded:
            _loaded.append(_load())
    return _loaded[0]


def loaded() -> Any | None:
    """The router if ``native()`` has loaded it already (never builds it)."""
    return _loaded[0] if _loaded else None


def would_load() -> bool:
    """Whether ``native()`` gives (or would give) a router, without building or installing
    it: the outcome where it was tried, else whether the environment allows one."""
    return _loaded[0] is not None if _loaded else routing_enabled()


def _load() -> Any | None:
    if not routing_enabled():
        return None
    module = build(_NAME, _SOURCE, "routing allocator")
    if module is not None and not module.install():
        _warn_fallback("routing allocator", RuntimeError("c10 kept another CPU allocator"))
        return None
    return module


def build(name: str, source: Path, what: str) -> Any | None:
    """``source`` compiled as the extension module ``name`` (cached by PyTorch), or ``None``
    with one warning where it cannot be built."""
    try:
        from torch.utils import cpp_extension

        with _build_lock(Path(cpp_extension._get_build_directory(name, verbose=False))):
            return cpp_extension.load(
                name=name,
                sources=[str(source)],
                extra_cflags=["-O2", f"-DSHAREDMEM_CORE={_header_digest()}"],
                verbose=False,
            )
    except Exception as error:  # no compiler, no ninja, a failed build: fall back, say so once
        _warn_fallback(what, error)
        return None


def _header_digest() -> str:
    """A digest of ``route_core.h``, passed as a define: PyTorch rebuilds a cached extension
    when its sources or flags change, and the header the sources include is neither."""
    core = _SOURCE.with_name("route_core.h").read_bytes()
    return hashlib.sha256(core).hexdigest()[:16]


def _warn_fallback(what: str, error: BaseException) -> None:
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    warnings.warn(
        f"sharedmem: the {what} could not be built or installed "
        f"({type(error).__name__}: {first}); pooled steps fall back to planning out= "
        "kernels only, and the rest of each step is allocated beside the pool. Install a "
        "C++ compiler and ninja (once) to serve whole steps from the pool, or set "
        "SHAREDMEM_ROUTING=0 to silence this.",
        RuntimeWarning,
        stacklevel=5,
    )


@contextlib.contextmanager
def _build_lock(directory: Path) -> Iterator[None]:
    """One build at a time, across processes, with a lock the system drops when its holder
    dies. PyTorch's own lock is a file that a build killed part way (Ctrl-C during the first
    compile) leaves behind, and every later build then waits on it forever: holding ours, any
    such file is stale, and is removed."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "sharedmem.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (directory / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
