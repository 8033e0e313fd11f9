"""BufferPool: named buffers that every net and every step share, with a limit and stats."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import torch

from ._adaptors import AccountedBackend, LimitedBackend
from ._backends import Backend, Placement, resolve
from ._blob import Blob
from ._devices import DeviceLike
from ._errors import SharedMemError
from ._ledger import Ledger
from ._phases import PhaseBook
from ._report import biggest_buffers, format_report
from ._synced import SyncedMemory
from ._timeline import Sample, Timeline
from ._validate import ShapeLike, check_name, check_nbytes

__all__ = ["BufferPool"]

_T = TypeVar("_T")

# What the fast path remembers per name: the shape and dtype it was asked for, the memory
# and its version stamp when the view was made, the view, and the blob. The blob is checked
# to still use that memory: share_data switches a name to another memory without changing
# either memory's stamp.
_Entry = tuple[object, torch.dtype, SyncedMemory, int, torch.Tensor, Blob]


def _call(method: weakref.WeakMethod[Callable[..., _T]], *args: object) -> _T:
    bound = method()
    assert bound is not None, "the pool is gone"  # only the pool's own parts call this
    return bound(*args)


class BufferPool:
    """Named buffers shared by every net and every step, grown to the largest request.

    A name is one memory: a training net and an evaluation net, or every batch size of one
    net, that ask for the same name get the same bytes, grown to the largest request ever
    seen and then left in place. ``tensor`` is the hot path of a custom loop: in steady state
    (same name, shape and dtype as last time, nothing moved) it costs a dictionary lookup.

    Views are valid until the next access that changes the buffer; on a moving backend a
    growth leaves old views on the old storage. Ask for the view every step.

    Threads may acquire, grow and read buffers of one pool at once. Two threads writing one
    buffer (or reshaping one name differently) at the same time race on the bytes, as they
    would on one tensor: that is the caller's to avoid.

    Args:
        device: ``"cpu"``, ``"emulated"``, ``"cuda"``, ``"cuda:N"`` or a ``torch.device``.
        limit: a cap on reserved device bytes (on ``cpu``, on the one memory); ``None``: none.
        backend: the device-side allocator by name (see ``sm.backend_names``).
        adaptors: callables that wrap a backend in another (features by composition, such as
            fault injection); applied to both sides, first innermost.
        timeline: record reserved and active bytes each time a phase closes (see
            ``record_timeline``).

    Example::

        >>> import torch, sharedmem as sm
        >>> pool = sm.BufferPool("cpu")
        >>> x = pool.tensor("fc1.out", (256, 1024))      # train net, batch 256
        >>> y = pool.tensor("fc1.out", (250, 1024))      # eval net, batch 250: same bytes
        >>> x.data_ptr() == y.data_ptr(), pool.stats()["num_buffers"]
        (True, 1)
    """

    def __init__(
        self,
        device: DeviceLike = "cpu",
        *,
        limit: int | None = None,
        backend: str | None = None,
        adaptors: Sequence[Callable[[Backend], Backend]] = (),
        timeline: bool = False,
    ) -> None:
        self._base = resolve(device, backend)
        self._limit = None if limit is None else check_nbytes(limit, "limit")
        self._ledger = Ledger(single=self._base.accel is None)
        self._blobs: dict[str, Blob] = {}
        self._high_water: dict[str, int] = {}
        self._fast: dict[str, _Entry] = {}
        self._fast_host: dict[str, _Entry] = {}
        self._lock = threading.Lock()  # guards creating names, not using them
        # Weak method references: no reference cycle through the phase book, so a pool that
        # goes out of scope frees its memory at once, not at the next cyclic collection.
        counters = weakref.WeakMethod(self._counters)
        self._phases = PhaseBook(self._ledger, lambda: _call(counters))
        self._timeline: Timeline | None = None
        self.record_timeline(timeline)
        self._counts: dict[str, int] = {}  # named byte counters of layers on top (count())
        host, accel = self._base.host, self._base.accel
        for adapt in adaptors:  # e.g. fault injection, innermost first
            host = adapt(host)
            accel = None if accel is None else adapt(accel)
        # The host side of a two-sided device is accounted but never limited.
        self._host = AccountedBackend(host, self._ledger, "host")
        self._accel = None if accel is None else AccountedBackend(accel, self._ledger, "device")

    # ---- names -----------------------------------------------------------------------------

    @property
    def device(self) -> str:
        return self._base.device

    def names(self) -> list[str]:
        """The buffer names, in the order they were first asked for."""
        return list(self._blobs)

    def __contains__(self, name: object) -> bool:
        return name in self._blobs

    def __len__(self) -> int:
        return len(self._blobs)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._blobs))

    def __repr__(self) -> str:
        return (
            f"BufferPool(device={self.device!r}, buffers={len(self)}, "
            f"reserved={self._ledger.total:,}, limit={self._limit})"
        )

    def _placement(self, name: str) -> Placement:
        # Each name gets adaptors that know it, so an out-of-memory error can name the buffer.
        limited = self._host if self._accel is None else self._accel
        # The backends must not keep the pool alive: a memory frees its blocks when it is
        # collected (SyncedMemory's finalizer holds its sides, and so these callbacks).
        pool = weakref.ref(self)

        def limit() -> int | None:
            alive = pool()
            return None if alive is None else alive._limit

        def explain(label: str, allocator_failed: bool) -> str:
            alive = pool()
            return "" if alive is None else alive._explain(label, allocator_failed)

        guarded = LimitedBackend(limited, self._ledger, limit, explain, name, self.device)
        if self._accel is None:
            return Placement(self.device, guarded, None)
        return Placement(self.device, self._host, guarded)

    def blob(
        self, name: str, shape: ShapeLike | None = None, dtype: torch.dtype | None = None
    ) -> Blob:
        """The named blob, created on first use (shape ``(0,)``, float32 unless given).

        A given ``shape`` or ``dtype`` is applied (O(1)); the memory grows on the next access.
        """
        blob = self._blobs.get(name)
        if blob is None:
            check_name(name)
            with self._lock:
                blob = self._blobs.get(name)
                if blob is None:
                    blob = Blob((0,), name=name, placement=self._placement(name))
                    self._blobs[name] = blob
        if dtype is not None:
            blob.astype(dtype)
        if shape is not None:
            blob.reshape(shape)
        return blob

    # ---- the hot path ------------------------------------------------------------------

    def tensor(
        self, name: str, shape: ShapeLike, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """The named buffer's device-side view, with write intent; the hot path of a loop.

        Each call returns a new tensor object (an alias of the same bytes), so changing one
        view's metadata in place (``resize_``, ``t_``) cannot disturb the next call's.
        """
        entry = self._fast.get(name)
        if (
            entry is not None
            and entry[0] == shape
            and entry[1] is dtype
            and entry[2].version == entry[3]
            and entry[5]._data is entry[2]  # not since left by share_data
        ):
            return entry[4].detach()
        return self._acquire(self._fast, name, shape, dtype, Blob.mutable_data)

    def host_tensor(
        self, name: str, shape: ShapeLike, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """The named buffer's host-side view, with write intent (staging, offload)."""
        entry = self._fast_host.get(name)
        if (
            entry is not None
            and entry[0] == shape
            and entry[1] is dtype
            and entry[2].version == entry[3]
            and entry[5]._data is entry[2]
        ):
            return entry[4].detach()
        return self._acquire(self._fast_host, name, shape, dtype, Blob.mutable_host_data)

    def _acquire(
        self,
        cache: dict[str, _Entry],
        name: str,
        shape: ShapeLike,
        dtype: torch.dtype,
        access: Callable[[Blob], torch.Tensor],
    ) -> torch.Tensor:
        blob = self.blob(name, shape, dtype)
        memory = blob.data_memory
        # Remember the shape as the caller spells it (a tuple, an int) when that compares
        # equal next time; anything else (a list) as the normalised size.
        key = shape if isinstance(shape, (tuple, int)) else blob.shape
        with memory._lock:  # the view and its stamp must describe the same state
            view = access(blob)
            cache[name] = (key, dtype, memory, memory.version, view, blob)
        if blob.nbytes > self._high_water.get(name, 0):
            self._high_water[name] = blob.nbytes
        return view.detach()

    # ---- limit, trimming ---------------------------------------------------------------

    @property
    def limit(self) -> int | None:
        """The cap on reserved device bytes, or ``None``."""
        return self._limit

    def set_limit(self, nbytes: int | None) -> None:
        """Set or clear (``None``) the cap on reserved device bytes.

        A limit below what is reserved now frees nothing; it refuses further growth.
        """
        self._limit = None if nbytes is None else check_nbytes(nbytes, "limit")

    def trim(self) -> int:
        """Shrink every buffer to its current size; returns the bytes given back."""
        self._forget_views()
        return sum(memory.shrink_to_fit() for memory in self._memories())

    def release(self) -> int:
        """Free every buffer's memory (names stay, content goes); returns the bytes freed."""
        self._forget_views()
        return sum(memory.release() for memory in self._memories())

    def _forget_views(self) -> None:
        # The fast path's cached views would keep old blocks of moving backends (and of CUDA
        # backends that free with the last view) alive after they were given back.
        self._fast.clear()
        self._fast_host.clear()

    def count_unpooled(self, nbytes: int) -> None:
        """Record bytes a layer on top of the pool had to allocate outside it."""
        self.count("unpooled_bytes", nbytes)

    def count(self, key: str, nbytes: int) -> None:
        """Add ``nbytes`` to the counter ``key`` of ``stats()`` (for layers built on the pool,
        such as activation offload); the report shows every counter that is not zero."""
        check_name(key)
        n = check_nbytes(nbytes)
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + n

    # ---- stats -----------------------------------------------------------------------------

    def _memories(self) -> list[SyncedMemory]:
        # Blobs may share memories (share_data): count each memory once.
        seen: dict[int, SyncedMemory] = {}
        for blob in list(self._blobs.values()):
            for memory in (blob.data_memory, blob.grad_memory):
                seen.setdefault(id(memory), memory)
        return list(seen.values())

    def _counters(self) -> dict[str, int]:
        totals = dict.fromkeys(
            ("num_grows", "grow_copy_bytes", "host_to_device_bytes", "device_to_host_bytes"), 0
        )
        for memory in self._memories():
            totals["num_grows"] += memory.num_grows
            totals["grow_copy_bytes"] += memory.grow_copy_bytes
            totals["host_to_device_bytes"] += memory.host_to_device_bytes
            totals["device_to_host_bytes"] += memory.device_to_host_bytes
        return totals

    def stats(self) -> dict[str, int]:
        """The pool's figures, all ints (bytes unless named otherwise).

        ``reserved_bytes`` counts unique physical bytes on both sides; ``active_bytes`` is the
        logical size of every buffer that holds memory, capped at what it holds;
        ``high_water_bytes`` the sum of each name's largest request.
        """
        ledger = self._ledger
        active = sum(min(m.size, max(m.host_capacity, m.device_capacity)) for m in self._memories())
        return {
            "num_buffers": len(self._blobs),
            "reserved_bytes": ledger.total,
            "device_reserved_bytes": ledger.device_reserved,
            "host_reserved_bytes": ledger.host,
            "active_bytes": active,
            "peak_reserved_bytes": ledger.peak,
            "high_water_bytes": sum(list(self._high_water.values())),
            **self._counters(),
            "unpooled_bytes": 0,
            **self._counts,
        }

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Attribute growth, peaks and traffic inside the block to the phase ``name``.

        Phases may nest and repeat; ``phase_stats()`` adds up every time a phase was open.
        """
        check_name(name)
        with self._phases.open(name):
            yield

    def phase_stats(self) -> dict[str, dict[str, int]]:
        """Per phase: ``entries``, ``peak_reserved_bytes``, ``added_reserved_bytes`` (both
        sides), ``added_device_bytes`` and the traffic counters (``num_grows``,
        ``grow_copy_bytes``, ``host_to_device_bytes``, ``device_to_host_bytes``), summed over
        every time the phase was open."""
        return self._phases.stats()

    def record_timeline(self, on: bool = True) -> None:
        """Start (afresh) or stop recording the memory timeline.

        While on, every time a phase closes the pool records reserved, active and peak
        bytes: open a phase per step (``with pool.phase("train"):``) to get one point per step.
        """
        if on:
            self._timeline = Timeline()
            sample = weakref.WeakMethod(self._sample)
            self._phases.on_close = lambda phase, peak: _call(sample, phase, peak)
        else:
            self._timeline = None
            self._phases.on_close = None

    def _sample(self, phase: str, peak: int) -> None:
        if self._timeline is not None:
            self._timeline.record(phase, self.stats(), peak)

    @property
    def timeline(self) -> list[Sample]:
        """The recorded samples (empty when the timeline is off)."""
        return [] if self._timeline is None else self._timeline.samples

    def plot_timeline(self, path: str | Path) -> Path:
        """Write the memory timeline as a PNG (needs matplotlib: ``sharedmem[plot]``)."""
        if self._timeline is None:
            raise SharedMemError(
                "sharedmem: no timeline was recorded; create the pool with timeline=True "
                "or call pool.record_timeline() before the steps"
            )
        return self._timeline.plot(path, f"BufferPool on {self.device}")

    def report(self) -> str:
        """A table a person reads: every buffer, biggest first, totals last."""
        return format_report(self.device, self._blobs, self._high_water, self.stats())

    def _explain(self, label: str, allocator_failed: bool) -> str:
        text = f"buffer {label!r} could not grow; biggest buffers: {biggest_buffers(self._blobs)}"
        return text + ("\n" + self.report() if allocator_failed else "")
