"""The saved tensors of one forward under ``save_on_pool`` (a step): pool buffers leased by
name, restores, prefetch, and giving buffers back when autograd lets go of them.

Lifetimes:

* A ``Slot`` is one distinct saved tensor (a tensor saved by several nodes, or a view inside
  it, is stored once). Its pool buffer ``<prefix>.<n>`` (``n``: its place in the step) is
  leased from the pool's ``Names`` while any ``Saved`` handle of it is alive; autograd drops
  the handles with the graph (after backward, unless ``retain_graph``), and the buffer goes
  back to be reused by a later step.
* A restored tensor is a fresh tensor from the device's allocator, never a view of a pool
  buffer: whoever holds it (the engine while a node runs, a double-backward graph, user code
  reading ``grad_fn._saved_self``) holds its memory, so no later step can overwrite it. The
  slot keeps it only until every save of that tensor has been unpacked in the current backward
  pass, which is how long the plain run keeps the original.

All state changes happen under the step's lock. A handle that dies (``__del__``, in whatever
thread drops the graph) only queues itself; the lock holder, or the dying handle when the lock
is free, applies the queue, so a collection that runs inside a locked section cannot change
state under it.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import TypeVar

import torch

from .._errors import SharedMemError
from .._pool import BufferPool
from .._synced import Head, SyncedMemory
from .copies import ALIGN, EngineCopies, Restored
from .names import Names

__all__ = ["OffloadStep", "Saved", "Slot"]

_T = TypeVar("_T")


class Slot:
    """One span of saved bytes: a saved tensor, and any saved view that lies inside it."""

    def __init__(
        self,
        step: OffloadStep,
        index: int,
        name: str,
        key: tuple[int, int],
        memory: SyncedMemory,
        tensor: torch.Tensor,
    ) -> None:
        self.step = step
        self.index = index  # place in the step's packing order
        self.name = name  # its pool buffer
        self.key = key  # the lease of that name
        self.memory = memory
        self.dtype = tensor.dtype
        self.start = tensor.data_ptr()  # address of the span's first byte, while it lived
        self.nbytes = memory.size
        self.align = self.start % ALIGN
        self.shape = tuple(tensor.shape)  # of its first save, for the in-place error
        # To refuse a tensor changed in place after it was saved, as autograd does without
        # hooks (with hooks it checks nothing). In-place ops bump a version counter shared by
        # a tensor, its views and its detach(); the tensor saved is mostly a local of
        # forward(), gone by backward, so the slot holds the counter itself.
        self.counter = _version_counter_of(tensor)
        self.version = tensor._version
        # Weak: while it lives, so does the storage, and its address names no other one; that
        # is when a later save can be matched to this slot. A view shares its base's storage
        # and the base lives as long as the bytes, while a saved temporary view (mm saves
        # h.t()) dies at once: so watch the base.
        watched = tensor if tensor._base is None else tensor._base
        self.origin = weakref.ref(watched)
        self.live = 0  # Saved handles alive
        self.seen_pass = -1  # the backward pass in which seen_count handles were unpacked
        self.seen_count = 0
        self.restored: Restored | None = None  # a device copy, prefetched or still needed
        self.prefetched = False  # restored by prefetch and not yet handed out
        self.released = False
        # While its offload may run: the saved bytes on the device, held so that their
        # memory is not reused under the copy, and the copy's fence. The last few of a
        # forward are still held when backward starts, and are handed back without a copy.
        self.source: Restored | None = None

    def holds(self, tensor: torch.Tensor, nbytes: int) -> bool:
        """Whether ``tensor`` (``nbytes`` of span) is this slot's bytes, unchanged since."""
        origin = self.origin()
        start = tensor.data_ptr()
        return (
            not self.released
            and origin is not None  # alive, so its storage is, and addresses are unique
            and self.counter._version == self.version
            and tensor.dtype == self.dtype
            and self.start <= start
            and start + nbytes <= self.start + self.nbytes
            and (start - self.start) % tensor.element_size() == 0
        )

    def check_unchanged(self) -> None:
        version = self.counter._version
        if version != self.version:
            raise SharedMemError(
                "sharedmem: one of the variables needed for gradient computation has been "
                f"modified by an inplace operation: a tensor of shape {self.shape} ({self.dtype}) "
                f"saved under save_on_pool is at version {version}; it was saved at version "
                f"{self.version}. Autograd refuses this without save_on_pool too: clone the "
                "tensor before changing it in place, or change it out of place."
            )


def _version_counter_of(tensor: torch.Tensor) -> torch.Tensor:
    """An empty tensor that shares ``tensor``'s version counter and none of its memory.

    ``detach()`` shares the counter (and the storage); assigning ``.data`` then swaps the
    storage and keeps the counter (PyTorch's NOTE [ Version Counter Sharing ]). Holding the
    detached alias itself would keep an offloaded tensor's device memory alive.
    """
    alias = tensor.detach()
    alias.data = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    return alias


class Saved:
    """What autograd stores for one save of a pooled tensor (the packed object): the slot,
    and where in the slot's bytes this save's tensor lies."""

    __slots__ = ("offset", "shape", "slot", "stride", "unpacked_pass")

    def __init__(self, slot: Slot, tensor: torch.Tensor) -> None:
        self.slot = slot
        self.shape = tensor.shape
        self.stride = tensor.stride()
        self.offset = (tensor.data_ptr() - slot.start) // tensor.element_size()
        self.unpacked_pass = -1

    def rebuild(self, raw: torch.Tensor) -> torch.Tensor:
        """This save's tensor, with its shape, strides and dtype, over the slot's ``raw`` bytes."""
        typed = raw.view(self.slot.dtype)
        return typed.as_strided(self.shape, self.stride, typed.storage_offset() + self.offset)

    def __del__(self) -> None:
        self.slot.step.dropped(self.slot, self.unpacked_pass)


class OffloadStep:
    """The slots of one forward under ``save_on_pool``, in the order they were saved.

    A block holds one step per forward: a forward that starts after a backward (a training
    loop inside one ``with``) gets a new step, numbered from 0 again (see ``spent``).
    """

    def __init__(
        self,
        pool: BufferPool,
        names: Names,
        copies: EngineCopies,
        *,
        offload: bool,
        depth: int,
        window: int,
    ) -> None:
        self.pool = pool
        self.names = names
        self.copies = copies
        self.offload = offload
        self.depth = depth  # restored-ahead tensors not yet handed out, at most
        self.window = window  # offloads whose source is still held, at most
        self.inflight: deque[Slot] = deque()  # slots holding their source, oldest first
        self.slots: list[Slot] = []
        # storage address -> the slots of it: a tensor saved again, or a view of a saved
        # tensor, is served from the same bytes
        self.seen: dict[int, list[Slot]] = {}
        self.pass_id = 0  # backward passes over this step's graph (retain_graph)
        self.cursor = sys.maxsize  # prefetch goes on below this slot index
        self.outstanding = 0  # prefetched and not yet handed out
        self.unpacked = False  # backward (or user code) has read a saved tensor of it
        self.live_slots = 0  # slots with a Saved handle alive
        self._lock = threading.Lock()
        self._dead: deque[tuple[Slot, int]] = deque()

    # ---- locking -------------------------------------------------------------------------

    def _locked(self, work: Callable[[], _T]) -> _T:
        try:
            with self._lock:
                try:
                    return work()
                finally:
                    self._reap()
        finally:
            self._flush()  # a handle may have died between the last reap and the release

    def _reap(self) -> None:
        while self._dead:
            slot, unpacked_pass = self._dead.popleft()
            self._drop(slot, unpacked_pass)

    def _flush(self) -> None:
        # Whoever finds the queue not empty and the lock free applies it; a holder always
        # flushes after releasing, so no entry is left behind.
        while self._dead and self._lock.acquire(blocking=False):
            try:
                self._reap()
            finally:
                self._lock.release()

    def dropped(self, slot: Slot, unpacked_pass: int) -> None:
        """A handle died. Applied now if the lock is free, else by the lock's holder."""
        self._dead.append((slot, unpacked_pass))
        self._flush()

    def spent(self) -> bool:
        """Whether its forward is over: a backward has begun, or its graph is gone. A new
        save then belongs to the next forward, which starts a step of its own."""
        return self._locked(lambda: self.unpacked or (bool(self.slots) and not self.live_slots))

    def close(self, *, retire: bool = False) -> None:
        """The forward is over: no more saves to match against. With ``retire`` the next
        forward is about to start, so the offloads still in flight are finished now (the
        compute side waits for them) rather than held on the device until backward."""

        def work() -> None:
            self.seen.clear()
            if retire:
                self._retire(keep=0)

        self._locked(work)

    # ---- packing -------------------------------------------------------------------------

    def pack(self, tensor: torch.Tensor, nbytes: int) -> Saved:
        """Store ``tensor`` (its ``nbytes``-byte span) in a pool buffer; one handle per save."""
        return self._locked(lambda: self._pack(tensor, nbytes))

    def _pack(self, tensor: torch.Tensor, nbytes: int) -> Saved:
        address = tensor.untyped_storage().data_ptr()
        # Slots whose tensor is gone can match nothing any more: their address may be a new
        # storage's by now (the allocator reuses it at once).
        same_storage = [s for s in self.seen.get(address, ()) if s.origin() is not None]
        slot = next((s for s in same_storage if s.holds(tensor, nbytes)), None)
        if slot is None:
            slot = self._store(tensor, nbytes)
            same_storage.append(slot)
        self.seen[address] = same_storage
        slot.live += 1
        return Saved(slot, tensor)

    def _store(self, tensor: torch.Tensor, nbytes: int) -> Slot:
        name, key = self.names.lease(len(self.slots))
        # The bytes from the tensor's first element to its last, whatever its strides: a
        # round trip then keeps shape, strides and dtype exactly (the plain run keeps at
        # least this span alive too, since a saved view holds its whole storage).
        span = nbytes // tensor.element_size()
        source = tensor.detach().as_strided((span,), (1,)).view(torch.uint8)
        held: Restored | None = None
        try:
            memory = self.names.memories.get(name)
            if memory is None or memory.size != nbytes:
                # Through the pool when the size changes: the blob's shape, the high-water
                # mark and the room follow. In steady state the memory is used directly.
                acquire = self.pool.host_tensor if self.offload else self.pool.tensor
                acquire(name, (nbytes,), torch.uint8)
                memory = self.names.memories[name] = self.pool.blob(name).data_memory
            if self.offload:
                stream = self.copies.current()
                held = Restored(source, self.copies.to_host(memory, source), stream)
                self.pool.count("offloaded_bytes_total", nbytes)
            else:
                memory.mutable_device_data().copy_(source)
                self.pool.count("pooled_bytes_total", nbytes)
        except BaseException:
            self.names.release(key)
            raise
        slot = Slot(self, len(self.slots), name, key, memory, tensor)
        # Until backward has it back, a hand-written pool.tensor(name) / host_tensor(name)
        # would silently corrupt the gradient: the pool refuses them.
        self.pool.protect(name, "save_on_pool (it holds a tensor saved for backward)")
        self.slots.append(slot)
        self.live_slots += 1
        if held is not None:
            slot.source = held
            self.inflight.append(slot)
            self._retire(keep=self.window)  # the oldest had a few layers to run behind
        return slot

    def _retire(self, keep: int) -> None:
        """Finish the oldest offloads until ``keep`` are in flight: the compute side waits for
        each copy, and the device memory it read is free again."""
        while len(self.inflight) > keep:
            slot = self.inflight.popleft()
            assert slot.source is not None
            self.copies.retire(slot.source)
            slot.source = None

    # ---- unpacking -----------------------------------------------------------------------

    def unpack(self, handle: Saved) -> torch.Tensor:
        """The saved tensor of ``handle`` on the device, restored or prefetched."""
        restored = self._locked(lambda: self._unpack(handle))
        self.copies.hand_over(restored)
        return handle.rebuild(restored.tensor)

    def _unpack(self, handle: Saved) -> Restored:
        slot = handle.slot
        if handle.unpacked_pass == self.pass_id:
            # This save was unpacked before in this pass: a new backward over a retained
            # graph (or user code reading grad_fn._saved_*). Prefetch starts from the top.
            self.pass_id += 1
            self.cursor = sys.maxsize
        handle.unpacked_pass = self.pass_id
        self.unpacked = True
        slot.check_unchanged()
        if slot.seen_pass != self.pass_id:
            slot.seen_pass, slot.seen_count = self.pass_id, 0
        slot.seen_count += 1
        restored = slot.restored
        if restored is None and slot.source is not None:
            # Still on the device (the end of forward is the start of backward): no copy;
            # the reader waits for the offload, as a retire would, before it can free it.
            restored, slot.source = slot.source, None
            self.inflight.remove(slot)
            self.pool.count("kept_bytes_total", slot.nbytes)
        elif restored is None:
            restored = self._restore(slot)
        elif slot.prefetched:
            slot.prefetched = False
            self.outstanding -= 1
        slot.restored = None if slot.seen_count >= slot.live else restored
        self._prefetch(slot.index)
        return restored

    def _restore(self, slot: Slot) -> Restored:
        if slot.memory.head is Head.UNINITIALIZED or slot.memory.size != slot.nbytes:
            raise SharedMemError(
                f"sharedmem: the pool buffer {slot.name!r} that holds a "
                "tensor saved for backward was released or reused while the graph still "
                "needed it (pool.release(), or a buffer of that name used by hand). Release "
                "the pool only after backward, and leave the offload.* / saved.* names to "
                "save_on_pool."
            )
        if self.offload:
            restored = self.copies.restore(slot.memory, slot.align)
        else:
            restored = self.copies.copy(slot.memory, slot.align)
        self.pool.count("restored_bytes_total", slot.nbytes)
        return restored

    def _prefetch(self, below: int) -> None:
        """Restore ahead the slots saved just before ``below``: backward needs them next."""
        index = min(self.cursor, below - 1)
        while self.outstanding < self.depth and index >= 0:
            slot = self.slots[index]
            if (
                not slot.released
                and slot.restored is None
                and slot.source is None
                and slot.seen_pass != self.pass_id
            ):
                slot.restored = self._restore(slot)
                slot.prefetched = True
                self.outstanding += 1
                self.pool.count("prefetched_bytes_total", slot.nbytes)
            index -= 1
        self.cursor = index

    # ---- giving back -----------------------------------------------------------------------

    def _drop(self, slot: Slot, unpacked_pass: int) -> None:
        slot.live -= 1
        if unpacked_pass >= 0 and unpacked_pass == slot.seen_pass:
            slot.seen_count -= 1  # it no longer waits for its unpack
        if slot.live == 0:
            if slot.prefetched:  # restored ahead for nothing: the graph went first
                self.outstanding -= 1
                slot.prefetched = False
                assert slot.restored is not None
                self.copies.discard(slot.restored.tensor)  # its copy may still run
            if slot.source is not None:  # the graph went before its offload was retired
                self.copies.discard(slot.source.tensor)
                self.inflight.remove(slot)
                slot.source = None
            slot.restored = None
            slot.released = True
            self.live_slots -= 1
            self.pool.unprotect(slot.name)
            self.names.release(slot.key)
        elif (
            slot.restored is not None
            and not slot.prefetched
            and slot.seen_pass == self.pass_id
            and slot.seen_count >= slot.live
        ):
            slot.restored = None  # every remaining save of it has been unpacked
