"""The CUDA half of the routing allocator: ``cuda_router.cpp`` compiled like the CPU router
(at first use, cached, no CUDA toolkit needed) and installed, on request, as PyTorch's CUDA
allocator for the whole process (``install_cuda_router``).

It is opt-in because PyTorch allows it only before the first CUDA allocation, and because it
replaces the caching allocator for everything: what no plan serves comes from the CUDA runtime's
stream-ordered allocator (``cudaMallocAsync``, the allocator of PyTorch's own
``backend:cudaMallocAsync`` setting), and PyTorch's allocator statistics
(``torch.cuda.memory_allocated``, ``memory_reserved``, the memory history) are not kept.
"""

from __future__ import annotations

import threading
import warnings
from pathlib import Path
from typing import Any

from .._backends import cuda_torch_ops
from .._errors import SharedMemError
from .native import build, routing_enabled

__all__ = ["ALLOC_SYMBOL", "FREE_SYMBOL", "cuda_router", "install_cuda_router"]

_SOURCE = Path(__file__).with_name("cuda_router.cpp")
_NAME = "sharedmem_cuda_routing"
# The C pair PyTorch's CUDAPluggableAllocator loads from the built library.
ALLOC_SYMBOL = "sharedmem_cuda_alloc"
FREE_SYMBOL = "sharedmem_cuda_free"

_lock = threading.Lock()
_installed: list[Any] = []  # [module] once installed


def cuda_router() -> Any | None:
    """The CUDA router if ``install_cuda_router`` installed it in this process, else ``None``."""
    return _installed[0] if _installed else None


def install_cuda_router() -> bool:
    """Serve pooled steps on CUDA from their pools' arenas, as on the CPU.

    Installs the CUDA half of the routing allocator as PyTorch's CUDA allocator for this
    process. Call it once, at the top of the program, before anything creates a CUDA tensor
    (PyTorch cannot swap an allocator it has used). Afterwards a pooled step on a CUDA pool
    records its allocation sequence on its first call and replays it from the pool's arena on
    later calls, routed by the step's stream (so backward's allocations, made on autograd's
    device thread, are routed too); every other CUDA allocation comes from the driver's
    stream-ordered allocator.

    Returns:
        ``True`` once installed (again: ``True``); ``False`` where there is no CUDA GPU or
        the router cannot be built (each with a warning), or where ``SHAREDMEM_ROUTING=0``
        turns routing off.

    Raises:
        SharedMemError: PyTorch's CUDA allocator was used already in this process.

    Example::

        import sharedmem as sm
        sm.install_cuda_router()          # first thing, before any CUDA tensor
        model = build_model().cuda()
        step = sm.pooled_train_step(model, loss_fn, sm.BufferPool("cuda"))
    """
    with _lock:
        if _installed:
            return True
        ops = cuda_torch_ops.ops()
        if not routing_enabled():
            return False
        if ops.device_count() == 0:
            warnings.warn(
                "sharedmem: install_cuda_router() found no CUDA GPU here; nothing is routed "
                "(CPU pools have their own router, built at first use)",
                RuntimeWarning,
                stacklevel=2,
            )
            return False
        module = build(_NAME, _SOURCE, "CUDA routing allocator")
        if module is None:
            return False
        module.set_upstream(*ops.routing_upstream())
        try:
            ops.install_allocator(module.__file__, ALLOC_SYMBOL, FREE_SYMBOL)
        except RuntimeError as error:
            raise SharedMemError(
                "sharedmem: install_cuda_router() came after PyTorch's CUDA allocator was used "
                f"in this process ({error}). Call it first thing in the program, before any "
                "CUDA tensor is created (the model's .cuda() or .to('cuda') included)."
            ) from error
        _installed.append(module)
        return True


def _forget() -> None:
    """Forget the installation (the CUDA stand-in, when a test ends, puts PyTorch's allocator
    back: nothing is routed to the router after)."""
    with _lock:
        _installed.clear()
