"""How saved tensors travel between a pool's buffers and the device, per kind of device.

``EngineCopies`` serves ``cpu`` (copies done at once) and ``emulated`` (copies on the copy
engine thread, fenced by futures); ``CudaCopies`` runs them on a side stream, ordered against
the compute streams by events. Both go through ``SyncedMemory.download_async`` /
``upload_async``, so the pool's memory knows about every copy in flight and waits for it before
its bytes are written, grown or freed.
"""

from __future__ import annotations

import torch

from .._backends import Fence
from .._synced import SyncedMemory

__all__ = ["ALIGN", "CudaCopies", "EngineCopies", "Restored", "copies_for"]

# A restored tensor starts at the same address modulo this as the tensor that was saved, so a
# kernel that picks its algorithm by alignment (vectorized loads, cuBLAS heuristics) picks the
# same one, and results are bitwise those of the plain run. 512 is the CUDA allocator's block
# alignment; CPU allocations are 64-aligned, and a few hundred bytes of slack cover both.
ALIGN = 512


class Restored:
    """A device copy of a saved tensor's bytes, and what its reader must wait for."""

    __slots__ = ("fence", "stream", "tensor")

    def __init__(self, tensor: torch.Tensor, fence: Fence | None, stream: object) -> None:
        self.tensor = tensor  # the saved bytes on the device (uint8)
        self.fence = fence  # the copy that fills it, or None when it is done
        self.stream = stream  # the CUDA stream its memory belongs to (None elsewhere)


class EngineCopies:
    """Copies on ``cpu`` and ``emulated``: through the memory, fenced by its backend.

    The same protocol as on CUDA, where "the compute side waits" means the calling thread
    waits (the emulated device is the CPU), so CI runs every step of it.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def current(self) -> object:
        """The stream device work is issued on now (``None`` off CUDA)."""
        return None

    def aligned(self, nbytes: int, align: int) -> torch.Tensor:
        """A fresh device tensor of ``nbytes`` starting at ``align`` modulo ``ALIGN``; the
        pad is a multiple of the element size, since both addresses are."""
        raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, device=self.device)
        pad = (align - raw.data_ptr()) % ALIGN
        return raw[pad : pad + nbytes]

    def to_host(self, memory: SyncedMemory, source: torch.Tensor) -> Fence | None:
        """Start copying a saved tensor's bytes into the host side of ``memory``. The caller
        holds ``source`` until it ``retire``-s or ``discard``-s it."""
        return memory.download_async(source)

    def retire(self, held: Restored) -> None:
        """Order the compute side after the offload of ``held`` (a source and its copy's
        fence), so that the caller may drop the source and its memory be reused at once."""
        if held.fence is not None:
            held.fence.wait_device()

    def discard(self, tensor: torch.Tensor) -> None:
        """``tensor`` is dropped while a copy may still use it, with no compute-side wait."""
        # Off CUDA the copy engine holds its own reference until the copy is done.

    def restore(self, memory: SyncedMemory, align: int) -> Restored:
        """Start copying the host side of ``memory`` into a fresh device tensor."""
        target = self.aligned(memory.size, align)
        return Restored(target, memory.upload_async(target), None)

    def copy(self, memory: SyncedMemory, align: int) -> Restored:
        """Copy the device side of ``memory`` into a fresh device tensor (no offload)."""
        target = self.aligned(memory.size, align)
        target.copy_(memory.device_data())
        return Restored(target, None, None)

    def hand_over(self, restored: Restored) -> None:
        """Order the caller's use of ``restored`` after the copy that fills (or reads) it."""
        if restored.fence is not None:
            restored.fence.wait_device()


class CudaCopies(EngineCopies):
    """Copies on a CUDA device, on a side stream so that they overlap compute.

    The caching allocator works on the CPU's timeline: memory freed while another stream may
    still use it (``record_stream``) comes back only once the CPU sees that stream's work
    done, which, with the CPU queueing kernels far ahead, can be never before the step ends.
    So the copies keep memory stream-ordered on the compute stream instead:

    * an offload makes the side stream wait for the compute stream (the kernel that produced
      the saved tensor may still run), copies, and the caller holds the tensor; a few
      offloads later it ``retire``-s it: the compute stream waits for that copy's event, and
      the tensor is dropped, its memory free for the compute stream at once. The copy has a
      few layers of compute to hide behind; when the copies are slower than compute, compute
      waits for them and memory stays bounded.
    * a restore allocates its tensor on the compute stream, makes the side stream wait for
      the compute stream (that memory may still be in use by queued work), copies, and the
      reader waits for the copy's event. Freed after use, the memory is free for the compute
      stream at once.
    * a tensor dropped while a copy may still use it, with no compute-side wait (a prefetch
      nobody used, a graph dropped early), is ``record_stream``-ed on the side stream first.

    Copies are issued with the side stream current, so a backend that copies on the current
    stream or on the stream it is given copies on the side stream.
    """

    def __init__(self, device: torch.device) -> None:
        # Imported here: nothing of the CUDA backends loads unless a CUDA pool offloads.
        from .._backends.cuda_streams import side_stream

        super().__init__(device)
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        # The backends' side stream: a restore is then ordered after the offload of the same
        # bytes, and after any push_async / pull_async of the pool's own memories.
        self.stream = side_stream(self.index)

    def _fence(self) -> Fence:
        """The work queued on the side stream so far."""
        from .._backends.cuda_streams import EventFence

        return EventFence(self.stream.record_event(), self.index)

    def current(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.index)

    def to_host(self, memory: SyncedMemory, source: torch.Tensor) -> Fence | None:
        self.stream.wait_stream(self.current())
        with torch.cuda.stream(self.stream):
            fence = memory.download_async(source, stream=self.stream)
        # A backend without fences copied before returning; an event on the side stream
        # then still orders the compute side after anything it queued there.
        return fence or self._fence()

    def retire(self, held: Restored) -> None:
        if held.stream == self.current():
            super().retire(held)
        else:  # forward moved to another stream: the source's own stream cannot be made wait
            self.discard(held.tensor)

    def discard(self, tensor: torch.Tensor) -> None:
        tensor.record_stream(self.stream)

    def restore(self, memory: SyncedMemory, align: int) -> Restored:
        current = self.current()
        target = self.aligned(memory.size, align)  # on the compute stream, as its reader
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            fence = memory.upload_async(target, stream=self.stream)
        return Restored(target, fence or self._fence(), current)

    def copy(self, memory: SyncedMemory, align: int) -> Restored:
        restored = super().copy(memory, align)  # on the compute stream, as its reader
        restored.stream = self.current()
        return restored

    def hand_over(self, restored: Restored) -> None:
        super().hand_over(restored)
        current = self.current()
        if restored.stream != current:  # read on another stream than it was allocated for
            restored.tensor.record_stream(current)


def copies_for(device: str) -> EngineCopies:
    """The copies for a pool's device string (``cpu``, ``emulated``, ``cuda:N``)."""
    if device.startswith("cuda"):
        return CudaCopies(torch.device(device))
    return EngineCopies(torch.device("cpu"))  # emulated device views are CPU tensors
