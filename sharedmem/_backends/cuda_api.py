"""The calls into cuda-python that the CUDA backends share: loading it (12.x and 13.x),
checking its ``(error, value)`` results, device attributes, making a device's context current.

Imported only when a CUDA device is asked for, and cuda-python only inside functions, so that
importing sharedmem and using ``cpu`` or ``emulated`` never touches CUDA.

**Contexts.** Driver and cuda-python runtime calls run with device N's primary context pushed
(the one PyTorch uses), so ``cuda:N`` allocates on device N whatever the current device is.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

from .._errors import SharedMemError
from .cuda_torch_ops import ops

__all__ = [
    "MATCH_ADVICE",
    "DeviceOutOfMemory",
    "attribute",
    "bindings",
    "can_access_peer",
    "check",
    "device_index",
    "error_name",
    "install_bindings",
    "on_device",
    "refuse_after_fork",
    "refuse_in_capture",
    "vmm_supported",
]

# The error codes that mean "no memory" in the driver and the runtime API.
_OOM_NAMES = frozenset({"CUDA_ERROR_OUT_OF_MEMORY", "cudaErrorMemoryAllocation"})
# The codes that mean this installation cannot do it at all: a driver older than the CUDA that
# cuda-python brings, no device, a stub library. Nothing sharedmem did wrong.
_SETUP_NAMES = frozenset(
    {
        "cudaErrorInsufficientDriver",
        "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
        "cudaErrorSystemDriverMismatch",
        "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE",
        "cudaErrorCompatNotSupportedOnDevice",
        "cudaErrorCallRequiresNewerDriver",
        "CUDA_ERROR_NO_DEVICE",
        "cudaErrorNoDevice",
        "CUDA_ERROR_STUB_LIBRARY",
        "cudaErrorStubLibrary",
        "CUDA_ERROR_NOT_SUPPORTED",
        "cudaErrorNotSupported",
    }
)
# The codes of a call that a stream capture forbids (and that invalidated the capture): on a GPU
# a capture on another thread is only seen this way, after the fact (see refuse_in_capture).
_CAPTURE_NAMES = frozenset(
    {
        "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
        "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
        "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",
        "cudaErrorStreamCaptureUnsupported",
        "cudaErrorStreamCaptureInvalidated",
        "cudaErrorStreamCaptureImplicit",
    }
)
# What to do when memory would grow (or go back) during a capture.
CAPTURE_ADVICE = (
    "Grow before capturing: run the step once before torch.cuda.graph (a warm-up), or reserve "
    "the memory by making each buffer its largest size and accessing it once before the "
    "capture; inside a capture sharedmem only reuses memory it already holds"
)
# What to do when cuda-python and the driver do not match.
MATCH_ADVICE = (
    "Install the cuda-python that matches the driver (pip install 'cuda-python<13' for a "
    "driver older than 580, the CUDA 12 ones), or upgrade the driver"
)


class DeviceOutOfMemory(Exception):
    """A CUDA call ran out of memory; ``retry_on_oom`` turns it into ``OutOfMemoryError``."""


# ---- cuda-python --------------------------------------------------------------------------


# A stand-in for cuda-python that a test installed (see ``install_bindings``), or None.
_installed: SimpleNamespace | None = None


def bindings() -> SimpleNamespace:
    """cuda-python's ``driver`` and ``runtime`` modules (12.x and 13.x import paths).

    Every CUDA backend loads them through here, so a test can put a stand-in in their place.
    """
    return _installed if _installed is not None else _load_bindings()


def install_bindings(stand_in: SimpleNamespace | None) -> SimpleNamespace | None:
    """Use ``stand_in`` (``driver`` and ``runtime``) instead of cuda-python, or cuda-python
    again with ``None``; returns the one it replaces. The per-device answers cached from the
    previous driver (device handles, contexts) are forgotten."""
    global _installed
    previous, _installed = _installed, stand_in
    _device_handle.cache_clear()
    _primary_context.cache_clear()
    return previous


@functools.cache
def _load_bindings() -> SimpleNamespace:
    try:
        from cuda.bindings import driver, runtime
    except ImportError as new_path:
        try:  # cuda-python before 12.6 named them cuda.cuda and cuda.cudart
            from cuda import cuda as driver
            from cuda import cudart as runtime
        except ImportError:
            raise SharedMemError(
                f"sharedmem: cuda-python cannot be imported ({new_path}); the 'vmm' and "
                "'cudart' backends and pinned host growth need it. Install the cuda-python "
                "that matches your driver (pip install 'cuda-python<13' for a driver older "
                "than 580, 'cuda-python>=13' otherwise), or use backend='torch'."
            ) from None
    return SimpleNamespace(driver=driver, runtime=runtime)


# Whether a context was made current in this process, and whether this process is a fork
# child of one that had: the driver's state is not inherited, and a call would fail obscurely or
# hang, so every driver call through on_device refuses with the reason instead.
_used = False
_forked_after_use = False


def _after_fork_in_child() -> None:
    global _forked_after_use
    _forked_after_use = _forked_after_use or _used


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def error_name(error: Any) -> str:
    """The name of a cuda-python error code (``CUDA_ERROR_OUT_OF_MEMORY``)."""
    return str(getattr(error, "name", error))


def check(result: tuple[Any, ...], what: str) -> Any:
    """The value of a cuda-python call's ``(error, value...)`` tuple; raises on an error.

    Raises ``DeviceOutOfMemory`` for the out-of-memory codes and ``SharedMemError`` otherwise.
    """
    error = result[0]
    if int(error) != 0:
        name = error_name(error)
        if name in _OOM_NAMES:
            raise DeviceOutOfMemory(f"{what}: {name}")
        if name in _CAPTURE_NAMES:
            raise SharedMemError(
                f"sharedmem: {what} failed with {name}: a CUDA graph is being captured (on this "
                f"thread or another), and the capture forbids it. {CAPTURE_ADVICE}."
            )
        if name in _SETUP_NAMES:
            raise SharedMemError(
                f"sharedmem: {what} failed with {name} ({int(error)}): this CUDA installation "
                "cannot do it (the driver, cuda-python and the device must fit together). "
                f"{MATCH_ADVICE}; or use backend='torch'."
            )
        raise SharedMemError(
            f"sharedmem: {what} failed with {name} ({int(error)}). An earlier fault on the "
            "device (an illegal memory access in any kernel) makes every later call fail; if "
            "the device is healthy, please report this to sharedmem with this message."
        )
    if len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]


def device_index(device: str) -> int:
    """The N of ``"cuda:N"``."""
    kind, _, index = device.partition(":")
    assert kind == "cuda" and index.isdigit(), device
    return int(index)


@functools.cache
def _device_handle(index: int) -> Any:
    driver = bindings().driver
    try:
        check(driver.cuInit(0), "cuInit")
        return check(driver.cuDeviceGet(index), f"cuDeviceGet({index})")
    except RuntimeError as error:  # the driver library itself cannot be loaded
        raise SharedMemError(
            f"sharedmem: cuda-python cannot reach the CUDA driver ({error}); use "
            "backend='torch', or install a cuda-python that matches the driver."
        ) from None


@functools.cache
def _primary_context(index: int) -> Any:
    # Retained once and never released: it is the context PyTorch uses too, alive as long
    # as the process.
    driver = bindings().driver
    return check(driver.cuDevicePrimaryCtxRetain(_device_handle(index)), "cuDevicePrimaryCtxRetain")


def attribute(index: int, name: str) -> int:
    """A ``CU_DEVICE_ATTRIBUTE_*`` of device ``index``."""
    driver = bindings().driver
    which = getattr(driver.CUdevice_attribute, name, None)
    if which is None:  # an older cuda-python that does not know the attribute
        raise SharedMemError(f"sharedmem: this cuda-python does not know {name}; upgrade it")
    return int(check(driver.cuDeviceGetAttribute(which, _device_handle(index)), name))


def can_access_peer(index: int, peer: int) -> bool:
    """Whether device ``index`` can access memory on device ``peer`` (cuDeviceCanAccessPeer)."""
    driver = bindings().driver
    found = driver.cuDeviceCanAccessPeer(_device_handle(index), _device_handle(peer))
    return bool(check(found, f"cuDeviceCanAccessPeer({index}, {peer})"))


def refuse_in_capture(action: str, device: str) -> None:
    """Raise before ``action`` (growing, pinning, giving back) while a CUDA graph is being
    captured: allocating, mapping or registering memory and synchronizing are not allowed
    then, and the first such call would invalidate the capture (CUDA_ERROR_STREAM_CAPTURE_
    UNSUPPORTED). Seen here: a capture on any stream of any thread on the stand-in; on a GPU,
    the current stream of this thread (PyTorch has no query for others; a capture elsewhere is
    seen by the driver's answer, which ``check`` turns into the same advice)."""
    if ops().capturing():
        raise SharedMemError(
            f"sharedmem: {action} on {device} is refused during a CUDA graph capture: it "
            f"would allocate, map or pin memory (or synchronize), which breaks the capture. "
            f"{CAPTURE_ADVICE}."
        )


def vmm_supported(index: int) -> bool:
    """Whether device ``index`` supports CUDA virtual memory management (cuMemCreate/Map)."""
    return attribute(index, "CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED") != 0


def refuse_after_fork() -> None:
    """Raise ``SharedMemError`` in a fork child of a process that had used CUDA (through
    sharedmem or PyTorch): no CUDA call can work there, and PyTorch's own refusal does not
    say what to do."""
    if _forked_after_use or ops().forked_after_init():
        raise SharedMemError(
            "sharedmem: this process was made by fork after its parent had used CUDA, and a "
            "CUDA context does not survive fork: its CUDA memories cannot be used here. Use the "
            "'spawn' start method (multiprocessing.set_start_method('spawn')), or create CUDA "
            "memories only in the child."
        )


@contextlib.contextmanager
def on_device(index: int) -> Iterator[None]:
    """Run the block with device ``index`` current, for PyTorch and for the driver.

    ``torch.cuda.device`` alone does not make a context current when the device equals the
    current one and nothing has used it yet; pushing the primary context does, and the
    runtime API (cuda-python's included) picks up the context current to the thread.
    """
    refuse_after_fork()
    global _used
    driver = bindings().driver
    context = _primary_context(index)
    _used = True
    with ops().device(index):
        check(driver.cuCtxPushCurrent(context), "cuCtxPushCurrent")
        try:
            yield
        finally:
            driver.cuCtxPopCurrent()
