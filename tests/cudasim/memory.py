"""The simulated device's memory: a real reserved host range as its address space.

One large ``PROT_NONE`` / ``MAP_NORESERVE`` host mapping (made once per process through libc,
since Python's ``mmap`` module cannot pass ``MAP_NORESERVE``) stands for the device's virtual
address space. Device addresses are host addresses inside it, so a "device" tensor is host
memory at the simulated device address: pages are made readable and writable (``mprotect``)
only when they are mapped *and* given access, and are dropped and protected again when they
are unmapped. Touching device memory that is unmapped, or mapped without access, is therefore a
real fault (SIGSEGV), as it is an illegal address on a GPU.

Physical memory is a count against a configured capacity; reservations come out of the
address range first-fit. Each record here is what the driver keeps: reservations, handles
(``cuMemCreate``), mappings, ``cudaMalloc`` allocations and host registrations.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import mmap
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

PAGE = mmap.PAGESIZE
# cuMemGetAllocationGranularity: the recommended granularity is what current GPUs report; the
# minimum (what sizes and addresses must be multiples of) is smaller here, so that a backend
# that asks for one and uses the other is found out.
GRANULARITY = 2 << 20
MINIMUM_GRANULARITY = 64 << 10
FRESH = 0xA5  # fresh device memory is not cleared on a GPU: here it holds this byte
ADDRESS_SPACE = 1 << 40  # 1 TiB of host address space; reserving it costs no memory

_PROT_NONE, _PROT_READ, _PROT_WRITE = 0, 1, 2
_MAP_PRIVATE, _MAP_ANONYMOUS, _MAP_NORESERVE = 0x02, 0x20, 0x4000
_MADV_DONTNEED = 4

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def _checked(result: int, what: str) -> None:
    if result != 0:
        raise OSError(ctypes.get_errno(), f"cudasim: {what} failed")


_base: int | None = None
_base_lock = threading.Lock()


def address_space() -> int:
    """The start of the process's simulated device address range (reserved once)."""
    global _base
    with _base_lock:
        if _base is None:
            flags = _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE
            address = _libc.mmap(None, ADDRESS_SPACE, _PROT_NONE, flags, -1, 0)
            if address in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), "cudasim: reserving the address space failed")
            _base = int(address)
        return _base


def make_accessible(address: int, size: int) -> None:
    _checked(_libc.mprotect(address, size, _PROT_READ | _PROT_WRITE), "mprotect")


def make_read_only(address: int, size: int) -> None:
    _checked(_libc.mprotect(address, size, _PROT_READ), "mprotect")


def fill_fresh(address: int, size: int) -> None:
    """What fresh device memory holds: not zeros (cudaMalloc and cuMemCreate do not clear)."""
    ctypes.memset(address, FRESH, size)


def make_inaccessible(address: int, size: int) -> None:
    """Drop the pages' content (the physical memory goes back) and fault on any access."""
    _checked(_libc.madvise(address, size, _MADV_DONTNEED), "madvise")
    _checked(_libc.mprotect(address, size, _PROT_NONE), "mprotect")


class Critical:
    """A lock for the driver's records that also holds off Python's garbage collector.

    The real driver is C code that no finalizer interrupts. Here a collection could run in
    the middle of a call and free a memory (its finalizer calls the driver again, on this
    thread) while the records are half changed; so the collector waits until no thread is
    inside.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._inside = 0
        self._was_enabled = False

    def __enter__(self) -> None:
        self._lock.acquire()
        if self._inside == 0:
            self._was_enabled = gc.isenabled()
            gc.disable()
        self._inside += 1

    def __exit__(self, *exc: object) -> None:
        self._inside -= 1
        if self._inside == 0 and self._was_enabled:
            gc.enable()
        self._lock.release()


@dataclass
class Handle:
    """Physical memory from ``cuMemCreate``."""

    size: int
    device: int
    mappings: int = 0
    released: bool = False


@dataclass
class Mapping:
    size: int
    handle: int
    access: dict[int, bool] = field(default_factory=dict)  # device -> may write (cuMemSetAccess)


@dataclass
class Reservation:
    size: int
    mappings: dict[int, Mapping] = field(default_factory=dict)  # address -> mapping


class DeviceMemory:
    """Everything the simulated driver keeps about one device's memory.

    Args:
        capacity: bytes of physical memory; a request beyond what is free is refused.
        pinned_capacity: bytes of host memory that can be registered at once.
    """

    def __init__(self, capacity: int, pinned_capacity: int) -> None:
        self.capacity = capacity
        self.pinned_capacity = pinned_capacity
        self.used = 0  # physical bytes held: handles, cudaMalloc, the caching allocator
        self.base = address_space()
        self.address_space = ADDRESS_SPACE
        self.free_ranges: list[tuple[int, int]] = [(self.base, ADDRESS_SPACE)]  # sorted
        self.reservations: dict[int, Reservation] = {}
        self.handles: dict[int, Handle] = {}
        self.allocations: dict[int, int] = {}  # cudaMalloc'd address -> size
        self.allocated_on: dict[int, int] = {}  # cudaMalloc'd address -> device
        self.registered: dict[int, int] = {}  # host address -> size (cuMemHostRegister)
        self.next_handle = 1
        self.peers = True  # cuDeviceCanAccessPeer answers this for every pair of devices
        self.lock = Critical()
        # What went wrong on the devices (an illegal address, memory given back under queued
        # work): on a GPU a sticky error that kills the context; here a record every test's
        # teardown checks, and the devices listed fail every later synchronization.
        self.faults: list[str] = []
        self.faulted: set[int] = set()
        # Who still queues work over a range (set by the streams): a description, or None.
        self.queued_users: Callable[[int, int], str | None] = lambda address, size: None
        # Stream captures underway: stream handle -> (capturing thread, mode), and the ones
        # an unsafe call has invalidated.
        self.captures: dict[int, tuple[int, str]] = {}
        self.invalidated: set[int] = set()

    def capture_forbids(self, thread: int) -> list[int]:
        """The captures that forbid ``thread`` a potentially unsafe call now: any capture in
        global mode on any thread, and one in thread-local mode on ``thread`` itself
        (``cudaStreamBeginCapture``, "stream capture mode")."""
        return [
            stream
            for stream, (owner, mode) in self.captures.items()
            if mode == "global" or (mode == "thread_local" and owner == thread)
        ]

    def capture_refuses(self, thread: int) -> bool:
        """Whether an unsafe call from ``thread`` is refused now; the call invalidates every
        capture that forbids it, as on a GPU."""
        forbidding = self.capture_forbids(thread)
        self.invalidated.update(forbidding)
        return bool(forbidding)

    def fault(self, device: int, why: str) -> None:
        self.faults.append(f"cuda:{device}: {why}")
        self.faulted.add(device)

    def gone(self, address: int, size: int, what: str, device: int) -> None:
        """``[address, address + size)`` is given back: queued work over it is a fault."""
        user = self.queued_users(address, size)
        if user is not None:
            self.fault(device, f"{what} of {size:,} bytes at {address:#x} while {user}")

    # ---- address space ----------------------------------------------------------------------

    def take_range(self, size: int, alignment: int) -> int | None:
        """First-fit ``size`` bytes at a multiple of ``alignment``; ``None`` when none fits."""
        for i, (start, length) in enumerate(self.free_ranges):
            at = -(-start // alignment) * alignment
            if at + size <= start + length:
                pieces = [(start, at - start), (at + size, start + length - at - size)]
                self.free_ranges[i : i + 1] = [p for p in pieces if p[1] > 0]
                return at
        return None

    def give_range(self, address: int, size: int) -> None:
        ranges = sorted([*self.free_ranges, (address, size)])
        merged: list[tuple[int, int]] = []
        for start, length in ranges:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((start, length))
        self.free_ranges = merged

    def reservation_at(self, address: int, size: int) -> tuple[int, Reservation] | None:
        """The reservation that holds all of ``[address, address + size)``."""
        for start, reservation in self.reservations.items():
            if start <= address and address + size <= start + reservation.size:
                return start, reservation
        return None

    # ---- physical memory --------------------------------------------------------------------

    def charge(self, size: int) -> bool:
        """Take ``size`` physical bytes; ``False`` (nothing taken) past the capacity."""
        if self.used + size > self.capacity:
            return False
        self.used += size
        return True

    def handle_gone(self, key: int) -> None:
        """Free a handle's memory once it is released and no longer mapped."""
        handle = self.handles[key]
        if handle.released and handle.mappings == 0:
            del self.handles[key]
            self.used -= handle.size

    def is_device_memory(self, address: int, size: int, device: int | None = None) -> bool:
        """Whether ``[address, address + size)`` is device memory that may be touched (from
        ``device``, when given: VMM access is granted per device, cuMemSetAccess)."""
        for start, length in self.allocations.items():
            if start <= address and address + size <= start + length:
                return device is None or self.peer_ok(device, self.allocated_on[start])
        found = self.reservation_at(address, size)
        if found is None:
            return False
        covered = 0
        for at, mapping in found[1].mappings.items():
            overlap = min(at + mapping.size, address + size) - max(at, address)
            if overlap > 0:
                writable = (
                    mapping.access.values() if device is None else [mapping.access.get(device)]
                )
                if not any(writable):
                    return False
                covered += overlap
        return covered == size

    def peer_ok(self, device: int, owner: int) -> bool:
        """Whether ``device`` reaches ``cudaMalloc`` memory of ``owner`` (PyTorch enables peer
        access where the devices can)."""
        return device == owner or self.peers

    def device_of(self, address: int) -> int | None:
        """The device whose memory is at ``address``, or ``None`` (not device memory)."""
        for start, length in self.allocations.items():
            if start <= address < start + length:
                return self.allocated_on[start]
        found = self.reservation_at(address, 1)
        for at, mapping in found[1].mappings.items() if found else ():
            if at <= address < at + mapping.size:
                return self.handles[mapping.handle].device
        return None

    def is_registered(self, address: int, size: int) -> bool:
        """Whether registrations (one, or several back to back) cover the whole range."""
        end = address
        for at, length in sorted(self.registered.items()):
            if at <= end < at + length:
                end = at + length
        return end >= address + size

    def spans_registrations(self, address: int, size: int) -> bool:
        """Whether the range touches registered host memory without lying inside one
        registration: a GPU refuses a copy over it (``cudaErrorInvalidValue``, seen on an
        H100), as the driver resolves a pinned host range to one registration."""
        touching = [
            (at, length)
            for at, length in self.registered.items()
            if at < address + size and address < at + length
        ]
        inside = any(at <= address and address + size <= at + n for at, n in touching)
        return bool(touching) and not inside

    def leaks(self) -> list[str]:
        """What is still held: after every memory is gone, a backend that leaks shows here."""
        found = [f"reservation {a:#x} ({r.size:,} bytes)" for a, r in self.reservations.items()]
        found += [f"handle {k} ({h.size:,} bytes)" for k, h in self.handles.items()]
        found += [f"cudaMalloc {a:#x} ({n:,} bytes)" for a, n in self.allocations.items()]
        found += [f"host registration {a:#x} ({n:,} bytes)" for a, n in self.registered.items()]
        return found
