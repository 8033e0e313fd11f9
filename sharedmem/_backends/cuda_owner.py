"""CUDA memory we allocate ourselves: who keeps it alive, when it is freed, running out of it.

Bytes from ``cudaMalloc`` or ``cuMemCreate`` belong to an ``Owner``. A block's tensor wraps the
owner through ``__cuda_array_interface__``, and PyTorch keeps a reference to it in the
storage's deleter, so every view of the block keeps the bytes valid. Freeing a block therefore
only drops our reference: the bytes go back to the device when the last view is gone, which is
at once when no view outlives the block, and never under a live tensor.

A block's tensor spans its capacity, not the whole owner: a reservation is mostly unmapped
address space, and ``torch.save``, pickling or ``deepcopy`` of a view read its whole storage.
``Owner.tensor(nbytes)`` wraps the first ``nbytes`` at the same address, so a view taken before
a growth stays valid and nothing is copied.

Giving memory back synchronizes the whole device first, also when the last view dies in a
finalizer. A narrower wait (an event on the stream the memory was last used on) is not enough:
the views are the user's tensors, used on any stream, and unmapping or unregistering pages
that a kernel or copy still touches is an illegal address that kills the CUDA context, not a
race on stale bytes. The cost is a host stall until the work already issued is done, paid only
when memory goes back (``shrink_to_fit``, ``release``, a moving growth, or the last view of
such memory dying), never in a steady-state loop. A memory caught in a reference cycle goes
back when the garbage collector runs, at a moment of its choosing: call ``release()`` to
choose it. During a CUDA graph capture, where synchronizing is illegal, the free waits for the
next allocation (``reclaim``).

A failed allocation empties PyTorch's cache once and tries again before it raises
``OutOfMemoryError``; blocks are immutable, so nothing held is lost.
"""

from __future__ import annotations

import sys
import threading
import warnings
from collections.abc import Callable
from typing import TypeVar

import torch

from .._errors import OutOfMemoryError, SharedMemError
from .cuda_api import DeviceOutOfMemory, device_index, refuse_in_capture
from .cuda_torch_ops import ops

__all__ = ["Meter", "Owner", "out_of_memory", "reclaim", "retry_on_oom", "run_pending"]

T = TypeVar("T")


class Meter:
    """Bytes a backend holds on its device now (``held``) and at most (``peak``).

    ``torch.cuda.max_memory_allocated`` does not see memory PyTorch did not allocate, so the
    backends that allocate for themselves count here; tests and benchmarks read it.
    """

    def __init__(self) -> None:
        # Reentrant: a finalizer may give bytes back while this thread is adding some.
        self._lock = threading.RLock()
        self.held = 0
        self.peak = 0

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.held += nbytes
            self.peak = max(self.peak, self.held)

    def sub(self, nbytes: int) -> None:
        with self._lock:
            self.held -= nbytes

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.held


_pending: list[Callable[[], None]] = []


def reclaim(release: Callable[[], None]) -> None:
    """Give memory back now, or once no CUDA graph is being captured on this thread.

    Freeing synchronizes the device, which is illegal during capture; a finalizer may run at
    any moment, so it is queued and the next allocation runs it.
    """
    if sys.is_finalizing():
        return  # the process is ending and the driver takes every byte back with it
    if ops().capturing():
        _pending.append(release)
        return
    try:
        release()
    except Exception as error:  # from a finalizer: nobody can catch it, so say it
        warnings.warn(f"sharedmem: could not free CUDA memory: {error}", RuntimeWarning, 2)


def run_pending() -> None:
    """Run the frees that were queued during a graph capture."""
    while _pending and not ops().capturing():
        reclaim(_pending.pop())


class Owner:
    """Device bytes we allocated, freed when the last tensor viewing them is gone.

    ``tensor()`` wraps them without copying; PyTorch keeps a reference to this object for as
    long as the storage lives (every view shares it), so freeing never runs under a view.
    Subclasses implement ``_close``.
    """

    def __init__(self, index: int, address: int, nbytes: int) -> None:
        self.index = index
        self.address = address
        self.nbytes = nbytes
        self.closed = False

    def tensor(self, nbytes: int | None = None) -> torch.Tensor:
        """A 1-D uint8 tensor over the first ``nbytes`` (default: all) that keeps this alive."""
        nbytes = self.nbytes if nbytes is None else nbytes
        assert 0 < nbytes <= self.nbytes, (nbytes, self.nbytes)
        device = ops().tensor_device(self.index)
        # With an explicit index PyTorch takes the device as given (older versions ask
        # cudaPointerGetAttributes); either way no byte is copied, which we check. PyTorch
        # keeps a reference to the window in the storage's deleter.
        tensor = ops().wrap(_Window(self, nbytes), self.index)
        if tensor.data_ptr() != self.address or tensor.device != device:
            raise SharedMemError(
                f"sharedmem: wrapping {nbytes:,} bytes at {self.address:#x} on {device} "
                f"gave a tensor at {tensor.data_ptr():#x} on {tensor.device}; this PyTorch "
                "does not wrap device memory in place. Use backend='torch'."
            )
        return tensor

    def close(self) -> None:
        if not self.closed:
            self._close()
            self.closed = True

    def _close(self) -> None:
        raise NotImplementedError

    def __del__(self) -> None:
        if not getattr(self, "closed", True):
            reclaim(self.close)


class _Window:
    """The first ``nbytes`` of an owner's memory as ``__cuda_array_interface__``.

    Holds the owner: the tensor wrapping this window holds the window, so the owner lives as
    long as any view of any of its windows.
    """

    __slots__ = ("nbytes", "owner")

    def __init__(self, owner: Owner, nbytes: int) -> None:
        self.owner = owner
        self.nbytes = nbytes

    @property
    def __cuda_array_interface__(self) -> dict[str, object]:
        return {
            "shape": (self.nbytes,),
            "typestr": "|u1",
            "data": (self.owner.address, False),
            "strides": None,
            "version": 3,
            "stream": None,  # nothing in flight when a block is wrapped
        }


def out_of_memory(requested: int, device: str, why: str = "") -> OutOfMemoryError:
    """The error for a refused allocation of ``requested`` bytes on ``device``."""
    index = device_index(device)
    try:
        free, total = ops().mem_get_info(index)
    except RuntimeError:  # a broken context cannot even say how full it is
        free = total = 0
    cached = ops().memory_reserved(index)
    detail = (
        f"{device} has {free:,} of {total:,} bytes free (reserved counts every process); "
        f"PyTorch's caching allocator holds {cached:,} bytes"
    )
    return OutOfMemoryError(requested, total - free, None, device, f"{detail}. {why}".strip())


def retry_on_oom(attempt: Callable[[], T], requested: int, device: str) -> T:
    """``attempt()``; when it runs out of memory, empty PyTorch's cache once and try again.

    Raises ``OutOfMemoryError`` when the second attempt fails too. ``attempt`` must leave
    nothing allocated when it fails. During a CUDA graph capture nothing is attempted: a
    ``SharedMemError`` says to grow before the capture.
    """
    refuse_in_capture(f"growing to {requested:,} bytes", device)
    run_pending()
    try:
        return attempt()
    except (DeviceOutOfMemory, torch.cuda.OutOfMemoryError):
        pass
    # Blocks PyTorch caches but does not use may be what stands in the way: give them back.
    ops().empty_cache()
    try:
        return attempt()
    except (DeviceOutOfMemory, torch.cuda.OutOfMemoryError) as error:
        why = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise out_of_memory(requested, device, f"({why})") from None
