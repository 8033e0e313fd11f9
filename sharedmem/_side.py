"""One side of a SyncedMemory: its block, how much of it is current, and the copy in flight;
and the head, which side holds the newest bytes."""

from __future__ import annotations

import enum

import torch

from ._backends import Backend, Block, Fence

__all__ = ["Head", "Side"]


class Head(enum.Enum):
    """Which side of a SyncedMemory holds the newest bytes."""

    UNINITIALIZED = "uninitialized"  # no side touched since creation or release
    AT_HOST = "at_host"  # the host holds every newest byte; the device may be stale
    AT_DEVICE = "at_device"  # the device holds every newest byte; the host may be stale
    SYNCED = "synced"  # both sides hold every newest byte


class Side:
    """The physical bytes of one side and what the state machine knows about them."""

    __slots__ = ("backend", "block", "fence", "valid")

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        # Grow-only: replaced by a larger block when an access needs more bytes than it has,
        # and by a smaller one (or None) only when shrink_to_fit or release asks.
        self.block: Block | None = None
        self.valid = 0  # this side holds the newest value of every byte below this mark
        self.fence: Fence | None = None  # a copy to or from this side that may still run

    @property
    def capacity(self) -> int:
        return 0 if self.block is None else self.block.capacity

    def view(self, size: int) -> torch.Tensor:
        if self.block is None:  # a fresh tensor: nobody's resize_ can change the next caller's
            return torch.empty(0, dtype=torch.uint8, device=self.backend.device)
        return self.block.tensor[:size]

    def settle(self) -> None:
        """Block until no copy touches this side's bytes."""
        if self.fence is not None:
            self.fence.wait_host()
            self.fence = None

    def order_device(self) -> None:
        """Order the device work issued from now on after the copy in flight, if any."""
        if self.fence is not None:
            self.fence.wait_device()
            self.fence = None

    def grow(self, nbytes: int) -> int:
        """Grow to at least ``nbytes``, keeping the current bytes; returns the bytes copied.

        A refused growth raises before anything changes: the old block stays in place.
        """
        self.settle()
        if self.block is None:
            self.block = self.backend.allocate(nbytes)
            return 0
        self.block, copied = self.backend.grow(self.block, nbytes, keep=self.valid)
        return copied

    def shrink(self, nbytes: int) -> int:
        """Give back what lies beyond ``nbytes``; returns the bytes freed."""
        if self.block is None:
            return 0
        self.settle()
        keep = min(self.valid, nbytes)
        before = self.block.capacity
        self.block, _ = self.backend.shrink(self.block, nbytes, keep)
        self.valid = keep
        return before - self.capacity

    def free(self) -> int:
        """Give back the whole block; returns the bytes freed."""
        if self.block is None:
            return 0
        self.settle()
        freed = self.block.capacity
        self.backend.free(self.block)
        self.block, self.valid = None, 0
        return freed
