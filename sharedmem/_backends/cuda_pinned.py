"""The host side of CUDA memories: page-locked (pinned), grown without moving.

Copies between host and device are only truly asynchronous from page-locked memory, and
allocating page-locked memory costs milliseconds a call, so the host side is pinned once per
growth and reused, never re-pinned per step. It is the reserved address range of ``host.py``
(a large ``MAP_NORESERVE`` mapping that grows in place) with the committed part registered
through the driver API (``cuMemHostRegister``): each growth registers just the new part,
shrinking unregisters what lies beyond the new capacity (re-registering the shortened last
range) and hands the pages back with ``madvise``, releasing unregisters everything. As on the
plain reserved range, each block's tensor spans exactly its capacity (``host.window``).

The driver API, not a runtime: cuda-python's runtime is the CUDA of cuda-python's version and
refuses an older driver, and PyTorch's runtime keeps a failed registration as its "last error"
and raises it at the next kernel launch. The driver API answers with the driver PyTorch runs
on and keeps no such state. Where a trial registration of one page fails (cuda-python missing
or unable to reach the driver, or ``CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED`` is 0),
blocks are pinned tensors from PyTorch's host allocator (``pin_memory=True``), which move when
they grow: the host side works wherever PyTorch does.

Trade-offs:

* One registration for the whole committed part, always. A copy whose host range spans two
  registrations is refused by the driver (``cudaErrorInvalidValue``, measured on an H100 with
  driver 580: a memory grown in 16 steps could not be copied at all), so a growth
  unregisters what was pinned and registers the whole new range at once, and a shrink
  re-registers the part kept. Registering costs roughly as much as touching the pages once
  (the driver locks and maps them); re-registering on growth adds the old part's cost again,
  and every device is synchronized first (below), which a growth of a geometric series
  amortizes.
* Registered pages cannot be swapped out: pinning much more than the working set starves the
  rest of the system, as any pinned allocation does. A growth past the machine's memory and
  swap is refused before anything is registered.
* Every device is synchronized before anything is unregistered, so no copy still running can
  read or write pages that are no longer pinned (see ``cuda_owner`` for why no narrower wait;
  the registration is portable, so any device's copy may use the pages).
* A growth past the reserved range moves the block, as on the plain reserved range: views
  taken before keep the old bytes. The old range is unregistered when the old block is
  collected (at once, normally), so it is pageable from then on; it is unmapped with its last
  view. ``release`` and ``shrink_to_fit`` hand the pages back: views reaching there read zeros.
"""

from __future__ import annotations

import mmap
import warnings

import torch

from .._errors import OutOfMemoryError, SharedMemError
from ._base import Block, MovingBackend, rewindow
from .cuda_api import DeviceOutOfMemory, bindings, check, on_device, refuse_in_capture
from .cuda_owner import Meter, reclaim
from .cuda_torch_ops import ops
from .host import ReservedBackend, check_committable, window

__all__ = [
    "PinnedPageableBackend",
    "PinnedReservedBackend",
    "registration_works",
    "split_ranges",
]

Range = tuple[int, int]  # (offset, size) of one registration


def split_ranges(ranges: list[Range], end: int) -> tuple[list[Range], list[Range], Range | None]:
    """Which registrations survive unpinning everything at or beyond ``end``.

    Returns the ranges kept as they are, the ranges to unregister (last first), and the part
    of a range that straddles ``end`` to register again, or ``None``.
    """
    kept = [r for r in ranges if r[0] + r[1] <= end]
    dropped = [r for r in ranges if r[0] + r[1] > end][::-1]
    cut = next(((o, end - o) for o, _ in dropped if o < end), None)
    return kept, dropped, cut


def _register_range(index: int, address: int, size: int) -> None:
    driver = bindings().driver
    with on_device(index):  # the driver API needs a current context
        check(
            driver.cuMemHostRegister(address, size, driver.CU_MEMHOSTREGISTER_PORTABLE),
            f"cuMemHostRegister({size:,} bytes)",
        )


def _unregister_range(index: int, address: int) -> None:
    with on_device(index):
        check(bindings().driver.cuMemHostUnregister(address), "cuMemHostUnregister")


def registration_works(index: int) -> bool:
    """Whether host memory can be registered for device ``index`` here (one page, once)."""
    page = mmap.mmap(-1, mmap.PAGESIZE)
    address = torch.frombuffer(page, dtype=torch.uint8).data_ptr()
    try:
        _register_range(index, address, mmap.PAGESIZE)
    except (SharedMemError, DeviceOutOfMemory, RuntimeError):
        return False  # RuntimeError: cuda-python cannot load the driver library
    _unregister_range(index, address)
    return True


def _host_oom(requested: int, meter: Meter, index: int, why: str) -> OutOfMemoryError:
    detail = (
        f"Could not pin host memory for cuda:{index} ({why}); sharedmem has "
        f"{meter.held:,} bytes pinned. Pinned memory cannot be swapped out, so the system "
        "may refuse more; free other pinned buffers or raise the locked-memory limit."
    )
    return OutOfMemoryError(requested, meter.held, None, "cpu", detail)


class _Pins:
    """The registered parts of one reserved host range, contiguous from its start.

    Holds the mapping, so the pages are always unregistered before they are unmapped; what is
    still registered when this object is collected (with the last block that uses it) is
    unregistered then.
    """

    def __init__(self, mapping: mmap.mmap, address: int, index: int, meter: Meter) -> None:
        self.mapping = mapping
        self.address = address
        self.index = index
        self.meter = meter
        self.ranges: list[Range] = []

    @property
    def end(self) -> int:
        return self.ranges[-1][0] + self.ranges[-1][1] if self.ranges else 0

    def _register(self, offset: int, size: int) -> None:
        _register_range(self.index, self.address + offset, size)
        self.ranges.append((offset, size))
        self.meter.add(size)

    def pin(self, end: int) -> None:
        """Register the range up to ``end`` as one registration (a copy may not span two);
        raises ``OutOfMemoryError`` when refused, with what was pinned still pinned."""
        kept = self.end
        if end <= kept:
            return
        refuse_in_capture(f"pinning {end:,} bytes of host memory", f"cuda:{self.index}")
        self.unpin(0)
        try:
            self._register(0, end)
        except DeviceOutOfMemory as error:
            if kept:
                self._register(0, kept)
            raise _host_oom(end, self.meter, self.index, str(error)) from None

    def unpin(self, end: int) -> None:
        """Unregister everything at or beyond ``end``; the part below stays registered."""
        if end >= self.end:
            return
        refuse_in_capture(f"unpinning host memory beyond {end:,} bytes", f"cuda:{self.index}")
        kept, dropped, cut = split_ranges(self.ranges, end)
        # No copy may still use the pages we unpin. The registration is portable: a copy of
        # any device may use them, so every device is waited for, not only this one.
        for device in range(ops().device_count()):
            ops().synchronize(device)
        for offset, size in dropped:
            _unregister_range(self.index, self.address + offset)
            self.ranges.remove((offset, size))
            self.meter.sub(size)
        assert self.ranges == kept, (self.ranges, kept)
        if cut is not None and cut[1] > 0:
            try:
                self._register(*cut)
            except Exception as error:  # the pages are still there, only copies get slower
                warnings.warn(f"sharedmem: could not pin host memory again: {error}", stacklevel=2)

    def close(self) -> None:
        self.unpin(0)

    def __del__(self) -> None:
        if getattr(self, "ranges", None):
            reclaim(self.close)


def _pinned_tensor(nbytes: int, meter: Meter, index: int) -> torch.Tensor:
    refuse_in_capture(f"pinning {nbytes:,} bytes of host memory", f"cuda:{index}")
    try:
        return ops().pinned_empty(nbytes)
    except RuntimeError as error:
        if "out of memory" not in str(error).lower():
            raise
        raise _host_oom(nbytes, meter, index, str(error).splitlines()[0]) from None


class PinnedReservedBackend(ReservedBackend):
    """Pinned host memory in a reserved address range: grows in place, pinned per growth.

    Attributes:
        meter: bytes registered now (``held``) and at most (``peak``).
    """

    kind = "pinned"
    stable_address = True

    def __init__(self, index: int, *, reservation: int | None = None) -> None:
        super().__init__(reservation=reservation)
        self.index = index
        self.meter = Meter()

    def _allocate(self, nbytes: int) -> Block:
        mapping = self._map(nbytes)
        if mapping is None:  # no range to reserve: a pinned tensor, which moves when it grows
            return Block(_pinned_tensor(nbytes, self.meter, self.index), nbytes)
        tensor = window(mapping, nbytes)
        pins = _Pins(mapping, tensor.data_ptr(), self.index, self.meter)
        pins.pin(nbytes)
        return Block(tensor, nbytes, pins)

    def will_move(self, block: Block, nbytes: int) -> bool:
        pins = block.handle
        return not (isinstance(pins, _Pins) and self.round(nbytes) <= len(pins.mapping))

    def _grow(self, block: Block, nbytes: int, keep: int) -> tuple[Block, int]:
        pins = block.handle
        if isinstance(pins, _Pins) and nbytes <= len(pins.mapping):
            # MAP_NORESERVE skips the kernel's own check; pinning past it meets the OOM killer.
            check_committable(nbytes, self.device)
            pins.pin(nbytes)
            return Block(rewindow(block.tensor, window(pins.mapping, nbytes)), nbytes, pins), 0
        # Past the range: move. The old block is not freed: views taken before keep its bytes
        # (DESIGN §4), and its registration goes when the old block is collected.
        new = self._allocate(nbytes)
        new.tensor[:keep].copy_(block.tensor[:keep])
        return new, keep

    def _shrink(self, block: Block, nbytes: int, keep: int) -> tuple[Block, int]:
        pins = block.handle
        if not isinstance(pins, _Pins):  # a pinned-tensor fallback block
            new = Block(_pinned_tensor(nbytes, self.meter, self.index), nbytes)
            new.tensor[:keep].copy_(block.tensor[:keep])
            return new, keep
        pins.unpin(nbytes)  # unpinned pages first: pinned ones cannot be handed back
        pins.mapping.madvise(mmap.MADV_DONTNEED, nbytes, block.capacity - nbytes)
        return Block(rewindow(block.tensor, window(pins.mapping, nbytes)), nbytes, pins), 0

    def _free(self, block: Block) -> None:
        pins = block.handle
        if isinstance(pins, _Pins):
            pins.unpin(0)
            # A view that outlives the release reads zeros, as with the plain reserved range.
            pins.mapping.madvise(mmap.MADV_DONTNEED, 0, block.capacity)


class PinnedPageableBackend(MovingBackend):
    """Pinned tensors from PyTorch's host allocator; they move (and copy) when they grow."""

    kind = "pinned-pageable"

    def __init__(self, index: int) -> None:
        super().__init__(device="cpu", granularity=512)
        self.index = index
        self.meter = Meter()  # stays empty: PyTorch's host allocator keeps the account

    def _allocate(self, nbytes: int) -> Block:
        return Block(_pinned_tensor(nbytes, self.meter, self.index), nbytes)
