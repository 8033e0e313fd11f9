"""The host side of CUDA memories: page-locked (pinned), grown without moving.

Copies between host and device are only truly asynchronous from page-locked memory, and
allocating page-locked memory costs milliseconds a call, so the host side is pinned once per
growth and reused, never re-pinned per step. It is the reserved address range of ``host.py``
(a large ``MAP_NORESERVE`` mapping that grows in place) with the committed part registered
with ``cudaHostRegister``: each growth registers just the new part, shrinking unregisters what
lies beyond the new capacity (re-registering the shortened last range) and hands the pages
back with ``madvise``, releasing unregisters everything.

Trade-offs:

* One registration per growth. Registering costs roughly as much as touching the pages once
  (the driver locks and maps them), so a growth costs about what first use would anyway;
  a shrink that cuts a registration re-registers the part kept.
* Registered pages cannot be swapped out: pinning much more than the working set starves the
  rest of the system, as any pinned allocation does.
* The device is synchronized before anything is unregistered, so no copy still running can
  read or write pages that are no longer pinned.

Where the range cannot be reserved, or the device cannot register host memory
(``CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED`` is 0), blocks are pinned tensors from
PyTorch's host allocator (``pin_memory=True``), which move when they grow.
"""

from __future__ import annotations

import mmap
import warnings

import torch

from .._errors import OutOfMemoryError
from ._base import Block, MovingBackend
from .cuda import DeviceOutOfMemory, bindings, check, on_device
from .cuda_owner import Meter, reclaim
from .host import ReservedBackend

__all__ = ["PinnedPageableBackend", "PinnedReservedBackend", "split_ranges"]

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
    still registered when this object is collected is unregistered then.
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
        runtime = bindings().runtime
        with on_device(self.index):
            at = self.address + offset
            check(
                runtime.cudaHostRegister(at, size, runtime.cudaHostRegisterPortable),
                "cudaHostRegister",
            )
        self.ranges.append((offset, size))
        self.meter.add(size)

    def pin(self, end: int) -> None:
        """Register the range up to ``end``; raises ``OutOfMemoryError`` when refused."""
        if end > self.end:
            try:
                self._register(self.end, end - self.end)
            except DeviceOutOfMemory as error:
                raise _host_oom(end, self.meter, self.index, str(error)) from None

    def unpin(self, end: int) -> None:
        """Unregister everything at or beyond ``end``; the part below stays registered."""
        if end >= self.end:
            return
        runtime = bindings().runtime
        kept, dropped, cut = split_ranges(self.ranges, end)
        torch.cuda.synchronize(self.index)  # no copy may still use the pages we unpin
        with on_device(self.index):
            for offset, size in dropped:
                check(runtime.cudaHostUnregister(self.address + offset), "cudaHostUnregister")
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
    try:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
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
        tensor = torch.frombuffer(mapping, dtype=torch.uint8)
        pins = _Pins(mapping, tensor.data_ptr(), self.index, self.meter)
        pins.pin(nbytes)
        return Block(tensor, nbytes, pins)

    def _grow(self, block: Block, nbytes: int, keep: int) -> tuple[Block, int]:
        pins = block.handle
        if isinstance(pins, _Pins) and nbytes <= len(pins.mapping):
            pins.pin(nbytes)
            return Block(block.tensor, nbytes, pins), 0
        new = self._allocate(nbytes)
        new.tensor[:keep].copy_(block.tensor[:keep])
        self._free(block)
        return new, keep

    def _shrink(self, block: Block, nbytes: int, keep: int) -> tuple[Block, int]:
        pins = block.handle
        if not isinstance(pins, _Pins):  # a pinned-tensor fallback block
            new = Block(_pinned_tensor(nbytes, self.meter, self.index), nbytes)
            new.tensor[:keep].copy_(block.tensor[:keep])
            return new, keep
        pins.unpin(nbytes)  # unpinned pages first: pinned ones cannot be handed back
        pins.mapping.madvise(mmap.MADV_DONTNEED, nbytes, block.capacity - nbytes)
        return Block(block.tensor, nbytes, pins), 0

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
