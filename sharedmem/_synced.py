"""SyncedMemory and Head: a grow-only buffer of bytes with a host side and a device side.

This module is the state machine and nothing else. The shape is Caffe's ``SyncedMemory``:
one enum says which side holds the newest bytes, and every transition lives in ``_to_host``
and ``_to_device``, each a ``match`` over all four heads. Two things are added because the
logical size here is a number any view may change:

* ``_written`` is the largest size ever written. Every byte below it has a value the invariant
  must keep; bytes at or above it have never been written and may hold anything.
* each side has a ``valid`` mark: that side holds the newest value of every byte below it.
  The head side always holds every newest byte (``valid >= _written``); the other side may
  hold only a prefix, for example after it was synced while the size was small. Copies only
  ever read from the head side, and only the part the other side lacks, so a side synced at a
  small size never passes its stale tail to the other side.
"""

from __future__ import annotations

import itertools
import threading
import weakref

import torch

from ._backends import Fence, Placement, resolve
from ._copying import reduce_memory, refuse_shallow_copy
from ._devices import DeviceLike
from ._side import Head, Side
from ._validate import check_byte_tensor, check_nbytes

__all__ = ["Head", "SyncedMemory"]

# Every state change takes a fresh stamp. Stamps are unique across all memories and threads
# (next() on a count is atomic under the GIL), so a cache that recorded a stamp can tell that
# anything at all happened since.
_stamps = itertools.count(1)


def _forget_sides(sides: tuple[Side, ...]) -> None:
    for side in sides:
        if side.block is not None:
            side.backend.forget(side.block)
            side.block = None


class SyncedMemory:
    """A grow-only block of bytes with a host side and a device side.

    Each side is allocated on its first access and grown only when an access needs more bytes
    than it physically has; nothing is freed unless ``shrink_to_fit`` or ``release`` asks.
    ``set_size`` changes the logical size in O(1) and never touches content.

    Access protocol: write only through the tensor returned by the latest ``mutable_*`` call,
    before any other access to this memory. Then every byte below the largest size ever written
    reads back the last value written to it, from either side.

    On ``cpu`` the device side is the host memory itself: device accessors return host memory,
    nothing is copied, and a touched memory is always ``SYNCED``.

    Args:
        nbytes: the initial logical size.
        device: ``"cpu"``, ``"emulated"``, ``"cuda"``, ``"cuda:N"`` or a ``torch.device``.
        backend: the device-side allocator by name (see ``sm.backend_names``); default: the
            device's stable-address backend.
        name: a label used in reports and error messages.

    Example::

        >>> import sharedmem as sm
        >>> m = sm.SyncedMemory(8, device="emulated")
        >>> m.mutable_host_data().fill_(7)[:2]
        tensor([7, 7], dtype=torch.uint8)
        >>> m.device_data()[:2], m.head
        (tensor([7, 7], dtype=torch.uint8), <Head.SYNCED: 'synced'>)
    """

    def __init__(
        self,
        nbytes: int = 0,
        *,
        device: DeviceLike = "cpu",
        backend: str | None = None,
        name: str = "",
        placement: Placement | None = None,
    ) -> None:
        self._size = check_nbytes(nbytes)
        self._placement = placement if placement is not None else resolve(device, backend)
        self.name = name
        self._host = Side(self._placement.host)
        # On cpu both sides are one object, so the device accessors are the host accessors.
        accel = self._placement.accel
        self._device = self._host if accel is None else Side(accel)
        self._head = Head.UNINITIALIZED
        self._written = 0
        self._peak_size = 0  # the largest size an accessor ever returned (the report's high water)
        self._lock = threading.RLock()
        self.version = next(_stamps)
        self.num_grows = 0
        self.grow_copy_bytes = 0
        self.host_to_device_bytes = 0
        self.device_to_host_bytes = 0
        # A memory nobody references any more leaves a pool's accounting (e.g. the memory a
        # blob dropped for share_data). Its bytes stay intact for views still in use and go
        # back with the last of them. Not at interpreter exit: the backends may be gone.
        weakref.finalize(self, _forget_sides, self._sides()).atexit = False

    # ---- queries -----------------------------------------------------------------------

    @property
    def size(self) -> int:
        """Logical size in bytes: what the accessors return."""
        return self._size

    @property
    def peak_size(self) -> int:
        """The largest logical size any accessor ever returned: the size's high-water mark."""
        return self._peak_size

    @property
    def lock(self) -> threading.RLock:
        """The memory's lock, re-entrant: hold it across calls that must not interleave with
        another thread's (a reshape, an access and a cached view of the result, say)."""
        return self._lock

    @property
    def host_capacity(self) -> int:
        """Physical bytes of the host side (0 until first touched)."""
        return self._host.capacity

    @property
    def device_capacity(self) -> int:
        """Physical bytes of the device side (on ``cpu``, the host memory's)."""
        return self._device.capacity

    @property
    def head(self) -> Head:
        return self._head

    @property
    def device(self) -> str:
        return self._placement.device

    @property
    def placement(self) -> Placement:
        return self._placement

    @property
    def reserved_bytes(self) -> int:
        """Unique physical bytes held, both sides (counted once on ``cpu``)."""
        extra = 0 if self._device is self._host else self._device.capacity
        return self._host.capacity + extra

    # ---- copies of the object (see _copying) ---------------------------------------------

    def __copy__(self) -> SyncedMemory:
        return refuse_shallow_copy(self)

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return reduce_memory(self)

    def __repr__(self) -> str:
        label = f"{self.name!r}, " if self.name else ""
        return (
            f"SyncedMemory({label}size={self._size:,}, head={self._head.name}, "
            f"host_capacity={self.host_capacity:,}, device_capacity={self.device_capacity:,}, "
            f"device={self.device!r})"
        )

    # ---- size ----------------------------------------------------------------------------

    def set_size(self, nbytes: int) -> None:
        """Set the logical size. O(1): never allocates, frees, clears or copies."""
        n = check_nbytes(nbytes)
        if n != self._size:
            with self._lock:  # an accessor in another thread must not see the size change
                self._size = n
                self._touch()

    # ---- accessors -----------------------------------------------------------------------

    def host_data(self) -> torch.Tensor:
        """The host bytes (1-D uint8, ``size`` long) for reading; syncs if the device is newer."""
        with self._lock:
            self._to_host(min(self._size, self._written))
            self._host.settle()
            return self._view(self._host)

    def mutable_host_data(self) -> torch.Tensor:
        """The host bytes for writing: as ``host_data``, then the host is the head."""
        with self._lock:
            self._to_host(self._written)  # the new head must hold every newest byte
            self._host.settle()
            self._wrote(self._host)
            return self._view(self._host)

    def device_data(self) -> torch.Tensor:
        """The device bytes (1-D uint8, ``size`` long) for reading; syncs if the host is newer.

        On CUDA the view is ordered after any copy in flight on the current stream.
        """
        if self._device is self._host:
            return self.host_data()
        with self._lock:
            self._to_device(min(self._size, self._written))
            self._device.order_device()
            return self._view(self._device)

    def mutable_device_data(self) -> torch.Tensor:
        """The device bytes for writing: as ``device_data``, then the device is the head."""
        if self._device is self._host:
            return self.mutable_host_data()
        with self._lock:
            self._to_device(self._written)
            self._device.order_device()
            self._wrote(self._device)
            return self._view(self._device)

    # ---- asynchronous copies ---------------------------------------------------------------

    def push_async(self, stream: object = None) -> None:
        """Start copying the host's newer bytes to the device and return at once.

        The next access to either side waits for the copy (the device side on its stream),
        so no reader ever sees half-copied bytes. A no-op when the device is up to date, and
        on ``cpu``.

        Args:
            stream: the CUDA stream to copy on; default: the backend's copy stream.
        """
        if self._device is self._host:
            return
        with self._lock:
            self._to_device(min(self._size, self._written), stream=stream, asynchronous=True)

    def pull_async(self, stream: object = None) -> None:
        """Start copying the device's newer bytes to the host and return at once.

        The next host access waits for the copy. See ``push_async``.
        """
        if self._device is self._host:
            return
        with self._lock:
            self._to_host(min(self._size, self._written), stream=stream, asynchronous=True)

    # Copies between the host side and device tensors outside the memory (activation offload):
    # the bytes come from or go to a tensor the memory does not own, while this state machine
    # keeps track of the copy in flight like its own.

    def download_async(self, source: torch.Tensor, stream: object = None) -> Fence | None:
        """Like ``pull_async``, from ``source`` (1-D uint8, ``size`` device bytes outside this
        memory) into the host side, which becomes the head as after a host write. Returns the
        copy's fence, or ``None`` once done (always on ``cpu``); keep ``source`` till then."""
        check_byte_tensor(source, self._size, "source")
        with self._lock:
            self._to_host(self._written)  # as mutable_host_data: the head holds every byte
            self._host.settle()  # a copy still reading these bytes finishes before we write
            target = self._host.view(self._size)
            self._wrote(self._host)
            if self._device is self._host:
                target.copy_(source)
                return None
            backend = self._device.backend
            fence = backend.download(target, source, stream=stream, asynchronous=True)
            self._host.fence = fence
            self.device_to_host_bytes += self._size
            self._touch()  # a copy in flight: a cached view must not skip waiting for it
            return fence

    def upload_async(self, target: torch.Tensor, stream: object = None) -> Fence | None:
        """Like ``push_async``, from the host side into ``target`` (1-D uint8, ``size`` device
        bytes outside this memory). Returns the fence its reader waits on, or ``None`` once
        done (always on ``cpu``); host writes and growth wait for the copy."""
        check_byte_tensor(target, self._size, "target")
        with self._lock:
            self._to_host(min(self._size, self._written))
            self._host.settle()
            source = self._host.view(self._size)
            if self._device is self._host:
                target.copy_(source)
                return None
            backend = self._device.backend
            fence = backend.upload(target, source, stream=stream, asynchronous=True)
            self._host.fence = fence  # the copy reads the host bytes
            self.host_to_device_bytes += self._size
            self._touch()
            return fence

    # ---- giving memory back ------------------------------------------------------------

    def shrink_to_fit(self) -> int:
        """Shrink both sides to the current size; returns the bytes given back.

        Content below the size survives; bytes beyond it are dropped for good. If shrinking a
        side fails (a moving backend allocates the smaller block), the error propagates with
        every byte below the size kept; a side shrunk before the failure stays shrunk.
        """
        with self._lock:
            # Drop the tail before any side gives bytes back: a side that shrinks and then sees
            # the other side's shrink fail no longer holds the tail, so no mark may still
            # promise it (the head side would claim bytes it lost, and the next sync would
            # copy from a side that lacks them).
            self._written = min(self._written, self._size)
            try:
                freed = sum(side.shrink(self._size) for side in self._sides())
            finally:
                if self._host.block is None and self._device.block is None:
                    self._head = Head.UNINITIALIZED
                self._touch()  # a block may have moved even if one side failed
            return freed

    def release(self) -> int:
        """Free both sides and drop all content; returns the bytes given back.

        The size is kept; the next access allocates afresh.
        """
        with self._lock:
            freed = sum(side.free() for side in self._sides())
            self._written = 0
            self._head = Head.UNINITIALIZED
            self._touch()
            return freed

    def release_device(self) -> int:
        """Free the device side without losing a byte; returns the bytes given back.

        The host first takes every byte only the device holds. On ``cpu`` there is no separate
        device memory and this returns 0.
        """
        return self._release_side(self._device, Head.AT_DEVICE, Head.AT_HOST)

    def release_host(self) -> int:
        """Free the host side without losing a byte; returns the bytes given back.

        The device first takes every byte only the host holds. On ``cpu`` there is no separate
        host memory to drop and this returns 0.
        """
        return self._release_side(self._host, Head.AT_HOST, Head.AT_DEVICE)

    def _release_side(self, side: Side, only_here: Head, after: Head) -> int:
        if self._device is self._host:
            return 0
        with self._lock:
            if side.block is None:
                return 0
            other = self._host if side is self._device else self._device
            if self._head is only_here:  # some newest bytes live only on this side
                self._reserve(other, self._written)
                self._fill(other, self._written)
            self._head = after
            self._touch()
            return side.free()

    # ---- the state machine -----------------------------------------------------------------

    def _to_host(self, upto: int, *, stream: object = None, asynchronous: bool = False) -> None:
        """Room on the host for ``size`` bytes, and the newest value of bytes below ``upto``."""
        self._reserve(self._host, max(self._size, upto))
        match self._head:
            case Head.UNINITIALIZED:
                # First touch: nothing was ever written, so there is nothing to copy.
                self._set_head(Head.SYNCED if self._device is self._host else Head.AT_HOST)
            case Head.AT_HOST:
                pass  # the host already holds every newest byte
            case Head.SYNCED:
                pass  # both sides hold every newest byte
            case Head.AT_DEVICE:
                self._fill(self._host, upto, stream, asynchronous)
                if self._host.valid >= self._written:
                    self._set_head(Head.SYNCED)

    def _to_device(self, upto: int, *, stream: object = None, asynchronous: bool = False) -> None:
        """Room on the device for ``size`` bytes, and the newest value of bytes below ``upto``."""
        self._reserve(self._device, max(self._size, upto))
        match self._head:
            case Head.UNINITIALIZED:
                self._set_head(Head.AT_DEVICE)
            case Head.AT_DEVICE:
                pass  # the device already holds every newest byte
            case Head.SYNCED:
                pass
            case Head.AT_HOST:
                self._fill(self._device, upto, stream, asynchronous)
                if self._device.valid >= self._written:
                    self._set_head(Head.SYNCED)

    def _wrote(self, side: Side) -> None:
        """Record a write intent on ``side``: it becomes the head for bytes below ``size``."""
        self._written = max(self._written, self._size)
        side.valid = self._written
        if side is self._device is self._host:
            self._set_head(Head.SYNCED)
            return
        other = self._device if side is self._host else self._host
        if self._size:
            # Stale from byte 0 on. It may still match beyond the size, but the head holds
            # every newest byte, so forgetting that costs at most a copy, never a byte.
            other.valid = 0
        self._set_head(Head.AT_HOST if side is self._host else Head.AT_DEVICE)

    def _view(self, side: Side) -> torch.Tensor:
        """The accessors' result: ``size`` bytes of ``side``, the size's high water noted."""
        if self._size > self._peak_size:
            self._peak_size = self._size
        return side.view(self._size)

    def _touch(self) -> None:
        """A new stamp: something a cached view depends on changed."""
        self.version = next(_stamps)

    def _set_head(self, head: Head) -> None:
        # A new stamp only when something changed: a read that changes nothing keeps the
        # views a cache (the pool's fast path) holds valid.
        if head is not self._head:
            self._head = head
            self._touch()

    # ---- mechanics -----------------------------------------------------------------------

    def _sides(self) -> tuple[Side, ...]:
        return (self._host,) if self._device is self._host else (self._host, self._device)

    def _reserve(self, side: Side, nbytes: int) -> None:
        """Grow ``side`` to at least ``nbytes``, keeping its current bytes at their offsets."""
        if nbytes > side.capacity:
            self.grow_copy_bytes += side.grow(nbytes)
            self.num_grows += 1
            self._touch()

    def _fill(
        self, dst: Side, upto: int, stream: object = None, asynchronous: bool = False
    ) -> None:
        """Copy into ``dst`` the bytes below ``upto`` that it lacks, from the head side."""
        start = dst.valid
        if upto <= start:
            return
        src = self._device if dst is self._host else self._host
        assert src.valid >= upto and src.block is not None and dst.block is not None
        # One copy in flight per memory: the accessors wait for it, so this rarely blocks.
        src.settle()
        dst.settle()
        target, source = dst.block.tensor[start:upto], src.block.tensor[start:upto]
        accel = self._device.backend
        if dst is self._host:
            fence = accel.download(target, source, stream=stream, asynchronous=asynchronous)
            self.device_to_host_bytes += upto - start
        else:
            fence = accel.upload(target, source, stream=stream, asynchronous=asynchronous)
            self.host_to_device_bytes += upto - start
        dst.fence = src.fence = fence
        dst.valid = upto
        self._touch()
