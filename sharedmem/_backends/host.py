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

from ._base import Backend, Block, MovingBackend, round_up

__all__ = ["PageableBackend", "ReservedBackend", "default_reservation"]

PAGE = mmap.PAGESIZE
# Python's mmap module does not export MAP_NORESERVE on every build; the flag is 0x4000 on
# Linux for every architecture. Elsewhere we ask for a plain mapping and let the kernel decide.
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)
_MAP_FLAGS = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20) | _MAP_NORESERVE
_GIB = 1 << 30


def default_reservation() -> int:
    """Bytes of address space one host block reserves: the machine's physical memory.

    A block can never commit more than that, so within its reservation it never moves. The
    address space (128 TiB on x86-64) holds thousands of such reservations.
    """
    try:
        physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        physical = 16 * _GIB
    return round_up(max(physical, _GIB), _GIB)


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
        return Block(torch.empty(nbytes, dtype=torch.uint8), nbytes)


class ReservedBackend(Backend):
    """Host memory in a reserved address range: grows in place, gives pages back on shrink.

    Args:
        reservation: bytes of address space each block reserves (default: physical memory).
            A growth beyond it moves the block to a larger reservation and copies.
    """

    kind = "reserved"
    stable_address = True

    def __init__(self, *, device: str = "cpu", reservation: int | None = None) -> None:
        super().__init__(device=device, granularity=PAGE)
        self.reservation = round_up(reservation or default_reservation(), PAGE)

    def _map(self, nbytes: int) -> mmap.mmap | None:
        # Ask for the full reservation, then less: under strict overcommit or in a crowded
        # address space a smaller range may still fit. None means "use pageable memory".
        size = max(self.reservation, nbytes)
        while size >= nbytes:
            try:
                return mmap.mmap(-1, size, flags=_MAP_FLAGS)
            except (OSError, OverflowError, ValueError):
                size = round_up(size // 2, PAGE) if size > nbytes else 0
        return None

    def _allocate(self, nbytes: int) -> Block:
        mapping = self._map(nbytes)
        if mapping is None:
            return Block(torch.empty(nbytes, dtype=torch.uint8), nbytes)
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
            new = Block(torch.empty(nbytes, dtype=torch.uint8), nbytes)
            new.tensor[:keep].copy_(block.tensor[:keep])
            return new, keep
        _give_back(block, nbytes, block.capacity)
        return Block(block.tensor, nbytes, block.handle), 0

    def _free(self, block: Block) -> None:
        _give_back(block, 0, block.capacity)
