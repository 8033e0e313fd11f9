"""Device memory through CUDA virtual memory management: grows in place, copies nothing.

Each block reserves a large virtual address range once (``cuMemAddressReserve``; by default
the device's memory capped at 32 GiB, or twice the request if more) and backs only its
capacity with physical memory, in chunks of the device's recommended granularity
(``cuMemCreate`` + ``cuMemMap``, then one ``cuMemSetAccess`` over the new part). Growing
maps more chunks behind the same address: no byte is copied, every view taken before stays
valid, and the physical peak of a growth is the new capacity, not old + new. A growth beyond
the reservation moves the block to a reservation twice its new size and copies, like a moving
backend: rare with the default, and O(log n) times for a buffer that keeps growing.

Shrinking synchronizes the device (unmapping does not wait for work in flight, unlike
``cudaFree``) and unmaps and releases the chunks beyond the new capacity. Each block's tensor
spans exactly its capacity, at the reservation's address: a growth or shrink wraps a new one,
so views taken before stay valid, and ``torch.save`` or ``deepcopy`` of a view never reads
unmapped address space. A view taken before ``shrink_to_fit`` that reaches beyond the new
capacity must not be used: on the GPU that is an illegal address, not zeros as on the host.
Releasing is deferred to the last view (see ``cuda_owner``), so a view that outlives
``release`` stays valid.

Only an out-of-memory answer of ``cuMemAddressReserve`` or ``cuMemCreate`` counts as running
out of memory (the cache is emptied and the call retried, then ``OutOfMemoryError``), and an
invalid-value answer of ``cuMemAddressReserve``, which the reference documents beside it for a
range that cannot be had; any other error is a ``SharedMemError`` that names it. A trial
reservation when the backend is built makes sure the driver serves these calls before ``vmm``
is chosen.

Access is granted per device (``cuMemSetAccess``): to the owning device and to every device
that ``cuDeviceCanAccessPeer`` says can reach it, so a peer copy works as it does with
``cudaMalloc`` memory; any other device faults on the first touch, as on a GPU.

Trade-offs: capacities are multiples of the granularity (2 MiB on current GPUs), so a
100-byte buffer holds 2 MiB; many tiny buffers are better served by ``backend="torch"``.
Each chunk costs a few driver calls when it is mapped or unmapped; a ``VmmBackend`` built with
a larger ``chunk`` makes big growths cheaper and shrinking coarser.
"""

from __future__ import annotations

import contextlib
from typing import Any

from .._errors import SharedMemError
from ._base import Block, rewindow, round_up
from .cuda_api import (
    DeviceOutOfMemory,
    bindings,
    can_access_peer,
    check,
    device_index,
    error_name,
    on_device,
    refuse_in_capture,
)
from .cuda_owner import Meter, Owner, retry_on_oom
from .cuda_streams import CudaBackend
from .cuda_torch_ops import ops

__all__ = [
    "VmmBackend",
    "access_desc",
    "accessors",
    "allocation_prop",
    "reservation_sizes",
    "reserve_range",
]

# A reservation refused with either code may be the address space running out: the reference
# documents both for cuMemAddressReserve and does not say which an impossible size gets.
_RESERVE_FULL = frozenset({"CUDA_ERROR_OUT_OF_MEMORY", "CUDA_ERROR_INVALID_VALUE"})


def allocation_prop(index: int) -> Any:
    """``CUmemAllocationProp`` for plain device memory on device ``index``."""
    driver = bindings().driver
    prop = driver.CUmemAllocationProp()
    prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = index
    prop.requestedHandleTypes = driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
    return prop


def access_desc(index: int) -> Any:
    """``CUmemAccessDesc`` granting device ``index`` read and write access."""
    driver = bindings().driver
    desc = driver.CUmemAccessDesc()
    desc.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = index
    desc.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return desc


def accessors(index: int) -> list[int]:
    """The devices given access to device ``index``'s memory: itself, then every device that
    ``cuDeviceCanAccessPeer`` says can reach it (VMM access is per device: a device not
    granted faults on the first touch, where ``cudaMalloc`` memory would serve a peer copy)."""
    count = ops().device_count()
    return [index, *(d for d in range(count) if d != index and can_access_peer(d, index))]


def reservation_sizes(wanted: int, needed: int, granularity: int) -> list[int]:
    """The address range sizes to try, largest first: ``wanted``, halving down to ``needed``.

    A crowded address space may refuse the full reservation and still hold a smaller one.
    """
    sizes = [max(wanted, needed)]
    while sizes[-1] > needed:
        sizes.append(max(round_up(sizes[-1] // 2, granularity), needed))
    return sizes


def reserve_range(index: int, sizes: list[int], alignment: int) -> tuple[int, int]:
    """Reserve the first of ``sizes`` that the driver grants: ``(address, size)``.

    An answer that may mean a full address space (``CUDA_ERROR_OUT_OF_MEMORY`` or
    ``CUDA_ERROR_INVALID_VALUE``) moves on to the next (smaller) size, and raises
    ``DeviceOutOfMemory`` after the last; any other error raises ``SharedMemError``. The
    sizes and alignment are multiples of the granularity (the trial reservation when the
    backend is built proves the driver takes them), so an invalid value here is the size.
    """
    driver = bindings().driver
    error: Any = None
    with on_device(index):
        for size in sizes:
            error, address = driver.cuMemAddressReserve(size, alignment, 0, 0)
            if int(error) == 0:
                return int(address), size
            if error_name(error) not in _RESERVE_FULL:
                check((error,), f"cuMemAddressReserve({size:,})")
    raise DeviceOutOfMemory(f"cuMemAddressReserve({sizes[-1]:,}) failed with {error_name(error)}")


# Chunks are created and released through these two, so that a test can fail the k-th.
def _create_chunk(size: int, prop: Any) -> Any:
    return check(bindings().driver.cuMemCreate(size, prop, 0), "cuMemCreate")


def _release_chunk(handle: Any) -> None:
    check(bindings().driver.cuMemRelease(handle), "cuMemRelease")


class _Reservation(Owner):
    """A reserved address range whose first ``len(handles)`` chunks are mapped.

    Released (unmapped, then the range freed) when the last tensor viewing it is gone.
    """

    def __init__(self, index: int, address: int, nbytes: int, backend: VmmBackend) -> None:
        super().__init__(index, address, nbytes)
        self.chunk = backend.granularity
        self.prop = backend.prop
        self.access = backend.access
        self.meter: Meter = backend.meter
        self.handles: list[Any] = []  # chunk i is mapped at address + i * chunk

    @property
    def mapped(self) -> int:
        return len(self.handles) * self.chunk

    def map(self, nbytes: int) -> None:
        """Back the range up to ``nbytes`` with new chunks; on failure nothing changes."""
        driver = bindings().driver
        first, last = len(self.handles), -(-nbytes // self.chunk)
        if last <= first:
            return
        created: list[Any] = []
        mapped = 0
        with on_device(self.index):
            free, _total = check(driver.cuMemGetInfo(), "cuMemGetInfo")
            if (last - first) * self.chunk > free:
                # cuMemCreate never oversubscribes: fail before creating a single chunk.
                raise DeviceOutOfMemory(f"{(last - first) * self.chunk:,} bytes > {free:,} free")
            try:
                for i in range(first, last):
                    created.append(_create_chunk(self.chunk, self.prop))
                    at = self.address + i * self.chunk
                    check(driver.cuMemMap(at, self.chunk, 0, created[-1], 0), "cuMemMap")
                    mapped += 1
                start, size = self.address + first * self.chunk, (last - first) * self.chunk
                grant = driver.cuMemSetAccess(start, size, self.access, len(self.access))
                check(grant, "cuMemSetAccess")
            except BaseException:
                # Undo everything; the first error is the one to report, so these are not
                # checked.
                for i in range(first, first + mapped):
                    driver.cuMemUnmap(self.address + i * self.chunk, self.chunk)
                for handle in created:
                    with contextlib.suppress(Exception):
                        _release_chunk(handle)
                raise
        self.handles.extend(created)
        self.meter.add(len(created) * self.chunk)

    def unmap(self, nbytes: int) -> None:
        """Unmap and release every chunk at or beyond ``nbytes`` (rounded up to a chunk)."""
        driver = bindings().driver
        keep = -(-nbytes // self.chunk)
        if keep >= len(self.handles):
            return
        with on_device(self.index):
            # Unlike cudaFree, unmapping does not wait for kernels still using the pages.
            check(driver.cuCtxSynchronize(), "cuCtxSynchronize")
            while len(self.handles) > keep:
                at = self.address + (len(self.handles) - 1) * self.chunk
                check(driver.cuMemUnmap(at, self.chunk), "cuMemUnmap")
                _release_chunk(self.handles.pop())
                self.meter.sub(self.chunk)

    def _close(self) -> None:
        self.unmap(0)
        with on_device(self.index):
            check(bindings().driver.cuMemAddressFree(self.address, self.nbytes), "cuMemAddressFree")


class VmmBackend(CudaBackend):
    """Device memory in a reserved address range, mapped chunk by chunk as it grows.

    Args:
        device: ``"cuda:N"``.
        reservation: bytes of address space a block reserves at least (default: the device's
            memory, at most 32 GiB; twice the request when that is more). A growth beyond it
            moves the block to a larger reservation and copies.
        chunk: bytes mapped at a time, rounded up to the recommended granularity (default:
            the granularity); capacities are multiples of it.

    Attributes:
        meter: physical bytes mapped now (``held``) and at most (``peak``). PyTorch's memory
            statistics do not see this memory.
    """

    kind = "vmm"
    stable_address = True

    def __init__(
        self, device: str, *, reservation: int | None = None, chunk: int | None = None
    ) -> None:
        driver = bindings().driver
        index = device_index(device)
        self.prop = allocation_prop(index)
        self.access = [access_desc(each) for each in accessors(index)]
        recommended = driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
        with on_device(index):
            granule = int(
                check(
                    driver.cuMemGetAllocationGranularity(self.prop, recommended),
                    "cuMemGetAllocationGranularity",
                )
            )
        super().__init__(device, granularity=round_up(max(chunk or granule, granule), granule))
        self.alignment = granule
        # At least this much address space per block, twice the request when that is more:
        # the device's memory capped at 32 GiB, so thousands of buffers fit in the address
        # space that unified addressing shares with the host.
        total = ops().total_memory(index)
        self.reservation = self.round(reservation or min(total, 32 << 30))
        self.meter = Meter()
        self._trial()

    def _trial(self) -> None:
        """Reserve and free one granule, so that a driver that cannot is found out now."""
        try:
            address, size = reserve_range(self.index, [self.granularity], self.alignment)
        except DeviceOutOfMemory as error:
            raise SharedMemError(
                f"sharedmem: {self.memory_name} cannot reserve device address space for "
                f"backend='vmm' ({error}); use backend='cudart' or backend='torch'."
            ) from None
        with on_device(self.index):
            check(bindings().driver.cuMemAddressFree(address, size), "cuMemAddressFree")

    def _reserve(self, nbytes: int) -> _Reservation:
        wanted = max(self.reservation, self.round(2 * nbytes))
        sizes = reservation_sizes(wanted, nbytes, self.granularity)
        address, size = reserve_range(self.index, sizes, self.alignment)
        return _Reservation(self.index, address, size, self)

    def _allocate(self, nbytes: int) -> Block:
        def attempt() -> _Reservation:
            reservation = self._reserve(nbytes)
            try:
                reservation.map(nbytes)
            except BaseException:
                reservation.close()
                raise
            return reservation

        reservation = retry_on_oom(attempt, nbytes, self.memory_name)
        return Block(reservation.tensor(nbytes), nbytes, reservation)

    def will_move(self, block: Block, nbytes: int) -> bool:
        reservation = block.handle
        return not (
            isinstance(reservation, _Reservation) and self.round(nbytes) <= reservation.nbytes
        )

    def _grow(self, block: Block, nbytes: int, keep: int) -> tuple[Block, int]:
        reservation = block.handle
        assert isinstance(reservation, _Reservation), block
        if nbytes <= reservation.nbytes:
            retry_on_oom(lambda: reservation.map(nbytes), nbytes, self.memory_name)
            grown = rewindow(block.tensor, reservation.tensor(nbytes))
            return Block(grown, nbytes, reservation), 0
        new = self._allocate(nbytes)  # beyond the reservation: move, and copy what we keep
        new.tensor[:keep].copy_(block.tensor[:keep])
        self._free(block)
        return new, keep

    def _shrink(self, block: Block, nbytes: int, keep: int) -> tuple[Block, int]:
        reservation = block.handle
        assert isinstance(reservation, _Reservation), block
        refuse_in_capture(f"shrinking to {nbytes:,} bytes", self.memory_name)
        reservation.unmap(nbytes)
        return Block(rewindow(block.tensor, reservation.tensor(nbytes)), nbytes, reservation), 0

    def _free(self, block: Block) -> None:
        pass  # the reservation is unmapped and freed when its last view is gone (module doc)
