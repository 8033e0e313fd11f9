"""Backend adaptors a pool wraps around its device's backends (RMM style: features by
composition). ``AccountedBackend`` reports every change of capacity, every growth and every
copy to the pool's ledger, and says when a block moved or went;
``LimitedBackend`` refuses a growth that would pass the pool's limit, and turns any
out-of-memory error into one that names the buffer and the biggest buffers of the pool.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from .._backends import Backend, Block, Fence
from .._errors import OutOfMemoryError
from .ledger import Ledger

__all__ = ["AccountedBackend", "BackendAdaptor", "LimitedBackend"]


class BackendAdaptor(Backend):
    """Forwards everything to ``upstream``; subclasses change what they need."""

    def __init__(self, upstream: Backend) -> None:
        # No Backend.__init__: the adaptor has no storage of its own, only its upstream's.
        self.upstream = upstream
        self.kind = upstream.kind
        self.stable_address = upstream.stable_address
        self.device = upstream.device
        self.granularity = upstream.granularity

    def _allocate(self, nbytes: int) -> Block:
        return self.upstream.allocate(nbytes)

    def _grow(self, block: Block, nbytes: int, keep: int) -> tuple[Block, int]:
        return self.upstream.grow(block, nbytes, keep)

    def _shrink(self, block: Block, nbytes: int, keep: int) -> tuple[Block, int]:
        new, copied = self.upstream.shrink(block, nbytes, keep)
        assert new is not None  # Backend.shrink frees (rather than shrinks) to zero
        return new, copied

    def _free(self, block: Block) -> None:
        self.upstream.free(block)

    def will_move(self, block: Block, nbytes: int) -> bool:
        return self.upstream.will_move(block, nbytes)

    def forget(self, block: Block) -> None:
        self.upstream.forget(block)

    def _copy(
        self,
        dst: torch.Tensor,
        src: torch.Tensor,
        *,
        to_device: bool,
        stream: object,
        asynchronous: bool,
    ) -> Fence | None:
        copy = self.upstream.upload if to_device else self.upstream.download
        return copy(dst, src, stream=stream, asynchronous=asynchronous)


class AccountedBackend(BackendAdaptor):
    """Reports every capacity change, growth and copy of one side to a ledger.

    Args:
        upstream: the side's backend.
        ledger: the pool's ledger.
        side: ``"host"`` or ``"device"``.
        on_move: called after a block moved (a moving growth or shrink) or was freed, so
            that nothing the pool caches keeps the old storage alive behind the ledger's back.
    """

    def __init__(
        self,
        upstream: Backend,
        ledger: Ledger,
        side: str,
        on_move: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(upstream)
        self.ledger = ledger
        self.side = side
        self.on_move = on_move

    def _allocate(self, nbytes: int) -> Block:
        block = super()._allocate(nbytes)
        self.ledger.change(self.side, block.capacity)
        self.ledger.grew()
        return block

    def _grow(self, block: Block, nbytes: int, keep: int) -> tuple[Block, int]:
        new, copied = super()._grow(block, nbytes, keep)
        # A block that moved was allocated while the old one was still held.
        moved = new.address != block.address
        self.ledger.change(self.side, new.capacity - block.capacity, block.capacity if moved else 0)
        self.ledger.grew(copied)
        if moved:
            self._moved()
        return new, copied

    def _shrink(self, block: Block, nbytes: int, keep: int) -> tuple[Block, int]:
        new, copied = super()._shrink(block, nbytes, keep)
        moved = new.address != block.address
        self.ledger.change(self.side, new.capacity - block.capacity, block.capacity if moved else 0)
        if moved:
            self._moved()
        return new, copied

    def _free(self, block: Block) -> None:
        super()._free(block)
        self.ledger.change(self.side, -block.capacity)
        self._moved()

    def _copy(
        self,
        dst: torch.Tensor,
        src: torch.Tensor,
        *,
        to_device: bool,
        stream: object,
        asynchronous: bool,
    ) -> Fence | None:
        fence = super()._copy(
            dst, src, to_device=to_device, stream=stream, asynchronous=asynchronous
        )
        self.ledger.copied(dst.numel(), to_device=to_device)
        return fence

    def _moved(self) -> None:
        if self.on_move is not None:
            self.on_move()

    def forget(self, block: Block) -> None:
        super().forget(block)
        self.ledger.change(self.side, -block.capacity)


class LimitedBackend(BackendAdaptor):
    """Refuses growth past ``limit()`` reserved bytes; names the buffer when memory runs out.

    Args:
        upstream: the accounted backend of the limited side.
        ledger: the pool's ledger (its lock makes check-and-grow atomic across threads).
        limit: returns the pool's current limit (``None``: no limit).
        explain: given the buffer's label and whether the allocator itself failed, returns
            the text that names the buffer and the biggest buffers of the pool.
        label: the buffer's name.
        device: the pool's device string, for the error.
    """

    def __init__(
        self,
        upstream: Backend,
        ledger: Ledger,
        limit: Callable[[], int | None],
        explain: Callable[[str, bool], str],
        label: str,
        device: str,
    ) -> None:
        super().__init__(upstream)
        self.ledger = ledger
        self.limit = limit
        self.explain = explain
        self.label = label
        self.device_name = device

    @contextmanager
    def _within_limit(self, freed: int, new: int, held: int) -> Iterator[None]:
        """Allow a growth to ``new`` bytes that gives back ``freed`` and holds ``held`` old
        bytes on top of the new block while it runs (a moving growth copies from the old)."""
        with self.ledger.lock:  # held across the growth: two threads cannot both pass
            limit = self.limit()
            reserved = self.ledger.device_reserved
            if limit is not None and reserved - freed + held + new > limit:
                detail = self.explain(self.label, False)
                if held:
                    detail = (
                        f"this backend moves when it grows: the old {held:,} bytes and the "
                        f"new {new:,} are held at once while it copies\n{detail}"
                    )
                raise OutOfMemoryError(new, reserved, limit, self.device_name, detail)
            try:
                yield
            except OutOfMemoryError as failure:
                # The allocator itself ran out: keep what it said, add the pool's side.
                detail = "\n".join(
                    part for part in (failure.detail, self.explain(self.label, True)) if part
                )
                raise OutOfMemoryError(
                    failure.requested, reserved, failure.limit, self.device_name, detail
                ) from None

    def _allocate(self, nbytes: int) -> Block:
        with self._within_limit(0, nbytes, 0):
            return super()._allocate(nbytes)

    def _grow(self, block: Block, nbytes: int, keep: int) -> tuple[Block, int]:
        # The limit caps what is held at any moment, the peak of a moving growth included (a
        # stable-address block moves too, once it outgrows its reserved range).
        held = block.capacity if self.will_move(block, nbytes) else 0
        with self._within_limit(block.capacity, nbytes, held):
            return super()._grow(block, nbytes, keep)
