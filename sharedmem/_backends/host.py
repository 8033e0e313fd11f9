"""Host memory: a reserved virtual address range that grows in place, and a pageable fallback.

The reserved backend maps a large anonymous range once per block without reserving swap
(``MAP_NORESERVE``). The kernel commits a page only when it is first touched, so capacity can
grow behind the same address without copying a byte, and ``madvise(MADV_DONTNEED)`` hands the
pages beyond a new capacity back to the system on shrink and release. Views taken before a
growth stay valid.

Address space is finite (128 TiB on x86-64) and shared with everything else in the process,
so reservations are budgeted: while the process's live reservations stay under
``ADDRESS_BUDGET`` (or a quarter of ``ulimit -v``) a block reserves ``default_reservation()``
(4 GiB at most), beyond it only twice what it asks for. Under strict overcommit
(``vm.overcommit_memory=2``) the kernel charges every mapped byte whatever the flags, so there
a block maps only what it asks for. A block that outgrows its range moves once to a range
twice its new size, like a moving allocator: views taken before keep the old bytes. Where no
range can be mapped at all a block falls back to a plain pageable tensor.

The emulated device is built from these same classes: its blocks are separate mappings, so it
is a second memory space whose copies to and from the host are explicit.
"""

from __future__ import annotations

import functools
import mmap
import os
import resource
import sys
import threading
import weakref

import torch

from .._errors import OutOfMemoryError
from ._base import Backend, Block, MovingBackend, rewindow, round_up

__all__ = [
    "ADDRESS_BUDGET",
    "PageableBackend",
    "ReservedBackend",
    "address_space_reserved",
    "check_committable",
    "commit_limit",
    "default_reservation",
    "window",
]

PAGE = mmap.PAGESIZE
# Python's mmap module does not export MAP_NORESERVE on every build; the flag is 0x4000 on
# Linux for every architecture. Elsewhere we ask for a plain mapping and let the kernel decide.
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)
_MAP_FLAGS = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20) | _MAP_NORESERVE
_GIB = 1 << 30
# A quarter of x86-64's user address space: what our reservations may take at full size
# before new blocks reserve only twice their request. Far beyond any real working set
# (thousands of 4 GiB ranges), far from starving the rest of the process.
ADDRESS_BUDGET = 32 << 40


class _AddressSpace:
    """Bytes of address space held by live reserved ranges, process-wide."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reserved = 0

    def take(self, mapping: mmap.mmap) -> mmap.mmap:
        size = len(mapping)
        with self._lock:
            self.reserved += size
        # A mapping is unmapped when its last view is gone, whenever that is.
        weakref.finalize(mapping, self._give, size)
        return mapping

    def _give(self, size: int) -> None:
        with self._lock:
            self.reserved -= size


_address_space = _AddressSpace()


def address_space_reserved() -> int:
    """Bytes of address space the process's live host reservations hold now."""
    return _address_space.reserved


def default_reservation() -> int:
    """Bytes of address space a new host block reserves at least: 4 GiB, or the machine's
    physical memory where that is less (a block can never commit more than that).

    Within its reservation a block grows in place; a block asked for more reserves twice its
    size, and a growth past the reservation moves it once to a range twice as large. The cap,
    with ``ADDRESS_BUDGET``, keeps the process's address space usable however many blocks
    there are, also on machines with terabytes of memory.
    """
    return round_up(min(max(_physical_memory(), _GIB), 4 * _GIB), PAGE)


def _budget() -> int:
    """``ADDRESS_BUDGET``, or a quarter of the process's address-space limit (``ulimit -v``)
    where that is less: the rest is everyone else's."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return ADDRESS_BUDGET
    return min(ADDRESS_BUDGET, soft // 4)


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 4 * _GIB


@functools.cache
def commit_limit() -> int:
    """The most bytes one host block may hold: the machine's memory plus its swap.

    ``MAP_NORESERVE`` skips the kernel's own check of that, so without this a 64 TiB request
    would "succeed" and the process would meet the out-of-memory killer on touching it.
    """
    swap = 0
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("SwapTotal:"):
                    swap = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    return _physical_memory() + swap


@functools.cache
def _strict_overcommit() -> bool:
    try:
        with open("/proc/sys/vm/overcommit_memory", encoding="ascii") as setting:
            return setting.read().strip() == "2"
    except OSError:
        return False


def check_committable(nbytes: int, device: str) -> None:
    """Refuse (``OutOfMemoryError``) a host block of more than ``commit_limit()`` bytes."""
    limit = commit_limit()
    if nbytes > limit:
        raise OutOfMemoryError(
            nbytes,
            0,
            None,
            device,
            f"that is more than this machine's memory and swap ({limit:,} bytes)",
        )


def _empty(nbytes: int, device: str) -> torch.Tensor:
    """``nbytes`` of pageable memory; an allocator failure becomes ``OutOfMemoryError``."""
    try:
        return torch.empty(nbytes, dtype=torch.uint8)
    except (RuntimeError, MemoryError) as error:
        if not isinstance(error, MemoryError) and "alloc" not in str(error).lower():
            raise
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise OutOfMemoryError(nbytes, 0, None, device, f"the allocator said: {first}") from None


def window(mapping: mmap.mmap, nbytes: int) -> torch.Tensor:
    """The first ``nbytes`` of ``mapping`` as a tensor whose storage is exactly those bytes.

    A new tensor per capacity, at the same address, so views taken before a growth stay
    valid; not one over the whole range, which ``torch.save``, pickling or ``deepcopy`` of any
    view would read in full (gigabytes of address space for a kilobyte view). The tensor holds
    the mapping alive (buffer export) while any view exists, so a view that outlives a
    release reads zeroed pages, never unmapped memory.
    """
    return torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)


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
        return Block(_empty(nbytes, self.memory_name), nbytes)


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
        """A range for at least ``nbytes``, sized by the policy in the module docstring."""
        check_committable(nbytes, self.memory_name)
        roomy = max(self.reservation, 2 * nbytes)
        if _strict_overcommit():
            sizes = [nbytes]  # every mapped byte is charged: take no more than asked
        elif _address_space.reserved + roomy > _budget():
            sizes = [2 * nbytes, nbytes]  # a crowded process: room to double, no more
        else:
            sizes = [roomy, 2 * nbytes, nbytes]
        # Where the kernel refuses a range, try the next smaller (not halving from 4 GiB: that
        # would spend an address-space limit on the first few blocks). None: pageable memory.
        for size in sorted(set(sizes), reverse=True):
            try:
                return _address_space.take(mmap.mmap(-1, size, flags=_MAP_FLAGS))
            except (OSError, OverflowError, ValueError):
                continue
        return None

    def _allocate(self, nbytes: int) -> Block:
        mapping = self._map(nbytes)
        if mapping is None:
            return Block(_empty(nbytes, self.memory_name), nbytes)
        return Block(window(mapping, nbytes), nbytes, mapping)

    def will_move(self, block: Block, nbytes: int) -> bool:
        return not (isinstance(block.handle, mmap.mmap) and self.round(nbytes) <= len(block.handle))

    def _grow(self, block: Block, nbytes: int, keep: int) -> tuple[Block, int]:
        if isinstance(block.handle, mmap.mmap) and nbytes <= len(block.handle):
            check_committable(nbytes, self.memory_name)
            return Block(
                rewindow(block.tensor, window(block.handle, nbytes)), nbytes, block.handle
            ), 0
        # Past the range: move, as a moving allocator does. The old range is not zeroed:
        # views taken before keep reading the old bytes, and it goes with the last of them.
        new = self._allocate(nbytes)
        new.tensor[:keep].copy_(block.tensor[:keep])
        return new, keep

    def _shrink(self, block: Block, nbytes: int, keep: int) -> tuple[Block, int]:
        if not isinstance(block.handle, mmap.mmap):  # a pageable fallback block
            new = Block(_empty(nbytes, self.memory_name), nbytes)
            new.tensor[:keep].copy_(block.tensor[:keep])
            return new, keep
        _give_back(block, nbytes, block.capacity)
        return Block(rewindow(block.tensor, window(block.handle, nbytes)), nbytes, block.handle), 0

    def _free(self, block: Block) -> None:
        _give_back(block, 0, block.capacity)
