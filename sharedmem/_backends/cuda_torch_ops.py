"""The PyTorch side of the CUDA backends, behind one small interface.

Everything the CUDA backends ask of ``torch.cuda`` goes through ``ops()``: wrapping a device
address as a tensor, allocating from the caching allocator, streams, events, synchronizing,
emptying the cache, the device's size. On a GPU that is ``TorchCudaOps``, plain PyTorch. A
test may ``install`` another implementation (the CUDA stand-in under ``tests/cudasim``, whose
"device" tensors are host memory at the simulated device address), so that every CUDA path
runs, and is checked, on a machine without a GPU. The calls into cuda-python need no seam:
``cuda_api.bindings`` is the single place they are loaded from.

Streams and events are PyTorch's objects (or the stand-in's, with the same methods:
``wait_stream``, ``wait_event``, ``record_event``; ``record``, ``synchronize``).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["TorchCudaOps", "install", "ops"]


class TorchCudaOps:
    """``torch.cuda`` as the CUDA backends use it; the stand-in overrides every method."""

    def device_count(self) -> int:
        """How many CUDA devices can be used (0 where CUDA is not available)."""
        # is_available asks the driver for a device count without creating a context.
        return torch.cuda.device_count() if torch.cuda.is_available() else 0

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def tensor_device(self, index: int) -> torch.device:
        """The device of the tensors that hold device ``index``'s bytes."""
        return torch.device("cuda", index)

    def wrap(self, memory: Any, index: int) -> torch.Tensor:
        """A tensor over ``memory``'s ``__cuda_array_interface__``, without copying.

        PyTorch keeps a reference to ``memory`` in the storage's deleter.
        """
        return torch.as_tensor(memory, device=self.tensor_device(index))

    def empty(self, nbytes: int, index: int) -> torch.Tensor:
        """``nbytes`` from the caching allocator of device ``index``."""
        return torch.empty(nbytes, dtype=torch.uint8, device=self.tensor_device(index))

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of page-locked host memory from PyTorch's host allocator."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is in page-locked host memory."""
        return tensor.is_pinned()

    @contextlib.contextmanager
    def device(self, index: int) -> Iterator[None]:
        """Device ``index`` is PyTorch's current device in the block."""
        with torch.cuda.device(index):
            yield

    def current_stream(self, index: int) -> Any:
        return torch.cuda.current_stream(index)

    def new_stream(self, index: int) -> Any:
        return torch.cuda.Stream(device=index)  # type: ignore[no-untyped-call]

    def own_stream(self, stream: object, index: int) -> Any:
        """``stream`` as a stream object of this implementation, or ``None`` when it is not
        one it knows (``cuda_streams`` then checks it as PyTorch's)."""
        return None

    def copy_on(self, stream: Any, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue the copy of ``src`` into ``dst`` on ``stream``."""
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def used_on(self, tensor: torch.Tensor, stream: Any) -> None:
        """Tell the caching allocator that ``stream`` uses ``tensor``."""
        tensor.record_stream(stream)

    def new_event(self) -> Any:
        return torch.cuda.Event()  # type: ignore[no-untyped-call]

    def synchronize(self, index: int) -> None:
        torch.cuda.synchronize(index)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def capturing(self) -> bool:
        """Whether a CUDA graph is being captured on this thread's current stream."""
        if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            return False
        return torch.cuda.is_current_stream_capturing()

    def forked_after_init(self) -> bool:
        """Whether this process is a fork child of one that had initialised CUDA (through
        PyTorch or anything else PyTorch saw): no CUDA call can work here."""
        return bool(torch.cuda._is_in_bad_fork())

    def mem_get_info(self, index: int) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(index)
        return int(free), int(total)

    def memory_reserved(self, index: int) -> int:
        """What PyTorch's caching allocator holds on device ``index`` (0 where a pluggable
        allocator, the CUDA router, replaced it: those keep no statistics)."""
        try:
            return int(torch.cuda.memory_reserved(index))
        except RuntimeError:
            return 0

    def routing_upstream(self) -> tuple[int, int]:
        """The addresses of the two C calls the CUDA router gets memory with where no plan
        serves: the runtime's stream-ordered ``cudaMallocAsync`` and ``cudaFreeAsync`` (what
        PyTorch's own ``backend:cudaMallocAsync`` uses), from the runtime PyTorch loaded.

        The runtime's, not the driver's ``cuMemAllocAsync``: PyTorch runs backward on a device
        thread of its own, which has no current context where the device is the runtime's
        default (PyTorch then skips setting it); the driver's calls fail there
        (``CUDA_ERROR_INVALID_CONTEXT``, seen on an H100: the first allocation of backward),
        where the runtime makes the device's primary context current itself."""
        runtime = ctypes.CDLL(_loaded_cudart())
        alloc = ctypes.cast(runtime.cudaMallocAsync, ctypes.c_void_p).value
        free = ctypes.cast(runtime.cudaFreeAsync, ctypes.c_void_p).value
        assert alloc is not None and free is not None, "the CUDA runtime lacks cudaMallocAsync"
        return alloc, free

    def install_allocator(self, library: str, alloc: str, free: str) -> None:
        """Make the C functions ``alloc`` and ``free`` of the shared library ``library``
        PyTorch's CUDA allocator (``RuntimeError`` once PyTorch's allocator was used)."""
        from torch.cuda import memory

        pluggable = memory.CUDAPluggableAllocator(library, alloc, free)
        memory.change_current_allocator(pluggable)

    def total_memory(self, index: int) -> int:
        return int(torch.cuda.get_device_properties(index).total_memory)


def _loaded_cudart() -> str:
    """The path of the CUDA runtime library this process loaded with PyTorch (its wheels
    carry their own), else the system's; loading it again returns the same library."""
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
        for line in maps:
            path = line.split(maxsplit=5)[-1].strip()
            if os.path.basename(path).startswith("libcudart.so"):
                return path
    found = ctypes.util.find_library("cudart")
    if found is None:
        raise RuntimeError("sharedmem: the CUDA runtime library (libcudart) is not loaded here")
    return found


_active: TorchCudaOps = TorchCudaOps()


def ops() -> TorchCudaOps:
    """The implementation of the PyTorch side in use (PyTorch's own unless a test installed
    another)."""
    return _active


def install(implementation: TorchCudaOps) -> TorchCudaOps:
    """Use ``implementation`` from now on; returns the one it replaces (to put back)."""
    global _active
    previous, _active = _active, implementation
    return previous
