"""PyTorch's ``CUDAPluggableAllocator`` as the stand-in's "PyTorch" sees it: a pair of C
functions loaded by name from a shared library, called through the C ABI exactly as
``torch/csrc/cuda/CUDAPluggableAllocator.cpp`` calls them (``alloc(size, device, stream)`` on
the current stream; ``free(ptr, size, device, stream)`` with the stream the block was
allocated on, which the allocator keeps per block).

The stand-in has no tensors of its own to allocate, so a test asks for blocks directly, in the
order a step's kernels would (``allocate``, then ``Block.free`` or dropping the block)."""

from __future__ import annotations

import ctypes
import itertools
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .torch_ops import SimulatedStream, SimulatedTorchOps

__all__ = ["UPSTREAM_ALLOC", "UPSTREAM_FREE", "Block", "PluggableAllocator", "overlapping"]

# The upstream pair a router is given (cuMemAllocAsync and cuMemFreeAsync's C types).
UPSTREAM_ALLOC = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t, ctypes.c_void_p
)
UPSTREAM_FREE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_void_p)


@dataclass(eq=False)
class Block:
    """One allocation PyTorch holds: its pointer, size, device and stream."""

    allocator: PluggableAllocator
    ptr: int
    size: int
    device: int
    stream: int
    freed: bool = field(default=False)

    def free(self) -> None:
        if not self.freed:
            self.freed = True
            self.allocator.release(self)

    def __del__(self) -> None:
        self.free()


class PluggableAllocator:
    """The pair ``alloc``/``free`` of ``library``, called as PyTorch calls it."""

    def __init__(self, ops: SimulatedTorchOps, library: str, alloc: str, free: str) -> None:
        self._ops = ops
        self._library = ctypes.CDLL(library)
        self._alloc = getattr(self._library, alloc)
        self._alloc.restype = ctypes.c_void_p
        self._alloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        self._free = getattr(self._library, free)
        self._free.restype = None
        self._free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        self.used = False
        self._lock = threading.Lock()
        self.live: dict[int, Block] = {}  # by pointer: what PyTorch holds now

    def allocate(self, size: int, stream: SimulatedStream | None = None) -> Block:
        """``size`` bytes on ``stream`` (default: the current stream of the current device)."""
        self.used = True
        if stream is None:
            stream = self._ops.current_stream(self._ops.current_device())
        ptr = int(self._alloc(size, stream.device_index, stream.cuda_stream) or 0)
        block = Block(self, ptr, size, stream.device_index, stream.cuda_stream)
        if ptr:
            with self._lock:
                assert ptr not in self.live, f"{ptr:#x} handed out twice"
                self.live[ptr] = block
        return block

    def release(self, block: Block) -> None:
        if block.ptr:
            with self._lock:
                self.live.pop(block.ptr, None)
        self._free(block.ptr or None, block.size, block.device, block.stream)

    def ranges(self) -> list[tuple[int, int]]:
        """Every live block as (start, end), sorted."""
        with self._lock:
            return sorted((b.ptr, b.ptr + b.size) for b in self.live.values())


def overlapping(ranges: list[tuple[int, int]]) -> list[tuple[Any, Any]]:
    """Pairs of ranges (sorted by start) that overlap: what must never happen."""
    return [(a, b) for a, b in itertools.pairwise(ranges) if b[0] < a[1]]
