"""Host memory: a reserved virtual address range that grows in place, and a pageable fallback.

The reserved backend maps a large anonymous range once per block without reserving swap
(``MAP_NORESERVE``). The kernel commits a page only when it is first touched, so capacity can
grow behind the same address without copying a byte, and ``madvise(MADV_DONTNEED)`` hands the
pages beyond a new capacity back to the system on shrink and release. Views taken before a
growth stay valid. Where the range cannot be reserved (strict overcommit, address space
exhausted) a block falls back to a plain pageable tensor, which moves when it grows.

The emulated device is built from these same classes: its blocks are separate mappings, so it
is a second memory space whose copies to and from the host are explicit.
"""

from __future__ import annotations

import mmap
import os
import sys

import torch

from .._errors import OutOfMemoryError
from ._base import Backend, Block, MovingBackend, round_up

__all__ = ["PageableBackend", "ReservedBackend", "default_reservation"]

PAGE = mmap.PAGESIZE
# Python's mmap module does not export MAP_NORESERVE on every build; the flag is 0x4000 on
# Linux for every architecture. Elsewhere we ask for a plain mapping and let the kernel decide.
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)
_MAP_FLAGS = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20) | _MAP_NORESERVE
_GIB = 1 << 30


def default_reservation() -> int:
    """Bytes of address space a new host block reserves at least: 4 GiB, or the machine's
    physical memory where that is less (a block can never commit more than that).

    Within its reservation a block grows in place; a block asked for more reserves twice its
    size, and a growth past the reservation moves it once to a range twice as large. The cap
    keeps the address space (128 TiB on x86-64) good for tens of thousands of blocks, also on
    machines with terabytes of memory.
    """
    try:
        physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        physical = 4 * _GIB
    return round_up(min(max(physical, _GIB), 4 * _GIB), PAGE)


def _empty(nbytes: int, device: str) -> torch.Tensor:
    """``nbytes`` of pageable memory; an allocator failure becomes ``OutOfMemoryError``."""
    try:
        return torch.empty(nbytes, dtype=torch.uint8)
    except (RuntimeError, MemoryError) as error:
        if not isinstance(error, MemoryError) and "alloc" not in str(error).lower():
            raise
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise OutOfMemoryError(nbytes, 0, None, device, f"the allocator said: {first}") from None


def _give_back(block: Block, start: int, end: int) -> None:
    """Return the committed pages of ``block`` in [start, end) to the system."""
    assert start % PAGE == 0, start
    if end > start and isinstance(block.handle, mmap.mmap):
        block.handle.madvise(mmap.MADV_DONTNEED, start, end - start)


class PageableBackend(MovingBackend):
    """Plain pageable memory from PyTorch's CPU allocator. Moves and copies when it grows."""

    kind = "pageable"

    def __init__(self, *, device: str = "cpu") -> None:
        super().__init__(device=device, granularity=64)

    def _allocate(self, nbytes: int) -> Block:
        return Block(_empty(nbytes, self.device), nbytes)


class ReservedBackend(Backend):
    """Host memory in a reserved address range: grows in place, gives pages back on shrink.

    Args:
        reservation: bytes of address space a new block reserves at least (default:
            ``default_reservation()``); a block reserves twice its size when that is more. A
            growth beyond its reservation moves the block to a larger one and copies.
    """

    kind = "reserved"
    stable_address = True

    def __init__(self, *, device: str = "cpu", reservation: int | None = None) -> None:
        super().__init__(device=device, granularity=PAGE)
        self.reservation = round_up(reservation or default_reservation(), PAGE)

    def _map(self, nbytes: int) -> mmap.mmap | None:
        # Ask for the full reservation (room to double), then less, down to the request
        # itself: under strict overcommit or in a crowded address space a smaller range may
        # still fit. None means "use pageable memory".
        size = max(self.reservation, 2 * nbytes)
        while True:
            try:
                return mmap.mmap(-1, size, flags=_MAP_FLAGS)
            except (OSError, OverflowError, ValueError):
                if size <= nbytes:
                    return None
                size = max(round_up(size // 2, PAGE), nbytes)

    def _allocate(self, nbytes: int) -> Block:
        mapping = self._map(nbytes)
        if mapping is None:
            return Block(_empty(nbytes, self.device), nbytes)
        # The tensor holds the mapping alive (buffer export) for as long as any view exists,
        # so a view that outlives a release reads zeroed pages instead of unmapped memory.
        return Block(torch.frombuffer(mapping, dtype=torch.uint8), nbytes, mapping)

    def _grow(self, block: Block, nbytes: int, keep: int) -> tuple[Block, int]:
        if isinstance(block.handle, mmap.mmap) and nbytes <= len(block.handle):
            return Block(block.tensor, nbytes, block.handle), 0
        new = self._allocate(nbytes)
        new.tensor[:keep].copy_(block.tensor[:keep])
        self._free(block)
        return new, keep

    def _shrink(self, block: Block, nbytes: int, keep: int) -> tuple[Block, int]:
        if not isinstance(block.handle, mmap.mmap):  # a pageable fallback block
            new = Block(_empty(nbytes, self.device), nbytes)
            new.tensor[:keep].copy_(block.tensor[:keep])
            return new, keep
        _give_back(block, nbytes, block.capacity)
        return Block(block.tensor, nbytes, block.handle), 0

    def _free(self, block: Block) -> None:
        _give_back(block, 0, block.capacity)
