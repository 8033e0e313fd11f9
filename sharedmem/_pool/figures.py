"""The figures of a BufferPool: stats, phases, the memory timeline, the report, and the named
counters of layers built on the pool. A pool owns one ``PoolFigures`` and delegates to it."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from .._blob import Blob
from .._errors import SharedMemError
from .._synced import SyncedMemory
from .._validate import check_name, check_nbytes
from .ledger import Ledger
from .phases import PhaseBook
from .report import CORE_KEYS, biggest_buffers, format_report, is_bytes
from .timeline import Sample, Timeline

__all__ = ["PoolFigures", "unique_memories"]

_T = TypeVar("_T")


def _call(method: weakref.WeakMethod[Callable[..., _T]], *args: object) -> _T:
    bound = method()
    assert bound is not None, "the pool is gone"  # only the pool's own parts call this
    return bound(*args)


def unique_memories(blobs: dict[str, Blob]) -> list[SyncedMemory]:
    """Every memory of ``blobs``, once: blobs may share memories (share_data)."""
    seen: dict[int, SyncedMemory] = {}
    for blob in list(blobs.values()):
        for memory in (blob.data_memory, blob.grad_memory):
            seen.setdefault(id(memory), memory)
    return list(seen.values())


class PoolFigures:
    """Stats, phases, timeline and report of one pool, over the pool's names and ledger.

    Args:
        device: the pool's device string, for the report.
        blobs: the pool's names (the pool's own dict: new names show at once).
        ledger: the pool's ledger of reserved bytes and traffic.
        timeline: start recording the timeline at once.
    """

    def __init__(
        self, device: str, blobs: dict[str, Blob], ledger: Ledger, *, timeline: bool
    ) -> None:
        self.device = device
        self._blobs = blobs
        self._ledger = ledger
        self._phases = PhaseBook(ledger)
        self._timeline: Timeline | None = None
        self._counts: dict[str, int] = {}  # named counters of layers on top (count())
        self._lock = threading.Lock()  # guards the counters
        self.record_timeline(timeline)

    def count_unpooled(self, nbytes: int) -> None:
        """Record bytes one call of a layer on top of the pool had to allocate outside it:
        ``unpooled_bytes_total`` adds them up over every call, ``unpooled_bytes_per_call`` is
        the most one call allocated (what sits beside the pool at once, at most)."""
        self.count("unpooled_bytes_total", nbytes)
        with self._lock:
            most = self._counts.get("unpooled_bytes_per_call", 0)
            self._counts["unpooled_bytes_per_call"] = max(most, nbytes)

    def count(self, key: str, amount: int) -> None:
        """Add ``amount`` to the counter ``key`` of ``stats()`` (for layers built on the pool,
        such as activation offload); the report shows every counter that is not zero, in
        bytes where its name says ``bytes`` (``offloaded_bytes_total``), as a count otherwise
        (``replayed_calls``): see ``report.is_bytes``."""
        check_name(key, "counter name")
        if key in CORE_KEYS:
            raise ValueError(
                f"sharedmem: {key!r} is one of the pool's own figures and cannot be counted "
                "into; choose another counter name"
            )
        n = check_nbytes(amount, "nbytes" if is_bytes(key) else "a count")
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + n

    # ---- stats -----------------------------------------------------------------------------

    def _active_bytes(self) -> int:
        return sum(
            min(m.size, max(m.host_capacity, m.device_capacity))
            for m in unique_memories(self._blobs)
        )

    def stats(self) -> dict[str, int]:
        """The pool's figures, all ints: bytes where the name says ``bytes``, counts
        otherwise (``num_buffers``, ``num_grows``, ``replayed_calls``; ``report.is_bytes``).

        ``reserved_bytes`` counts unique physical bytes on both sides; ``active_bytes`` is the
        logical size of every buffer that holds memory, capped at what it holds;
        ``high_water_bytes`` the sum of each name's high-water mark: the largest size any
        view of its data ever had.
        """
        ledger = self._ledger
        return {
            "num_buffers": len(self._blobs),
            "reserved_bytes": ledger.total,
            "device_reserved_bytes": ledger.device_reserved,
            "host_reserved_bytes": ledger.host,
            "active_bytes": self._active_bytes(),
            "peak_reserved_bytes": ledger.peak,
            "high_water_bytes": sum(b.data_memory.peak_size for b in list(self._blobs.values())),
            **ledger.snapshot().as_dict(),
            "unpooled_bytes_total": 0,
            "unpooled_bytes_per_call": 0,
            **self._counts,
        }

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Attribute growth, peaks and traffic inside the block to the phase ``name``.

        Phases may nest and repeat; ``phase_stats()`` adds up every time a phase was open.
        """
        check_name(name, "phase name")
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
        Stopping keeps what was recorded (``timeline``, ``plot_timeline``).
        """
        if on:
            self._timeline = Timeline()
            sample = weakref.WeakMethod(self._sample)
            self._phases.on_close = lambda phase, peak: _call(sample, phase, peak)
        else:
            self._phases.on_close = None

    def _sample(self, phase: str, peak: int) -> None:
        if self._timeline is not None:
            self._timeline.record(phase, self._timeline_figures(), peak)

    def _timeline_figures(self) -> dict[str, int]:
        ledger = self._ledger
        return {
            "reserved_bytes": ledger.total,
            "device_reserved_bytes": ledger.device_reserved,
            "active_bytes": self._active_bytes(),
        }

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
        return format_report(self.device, self._blobs, self.stats())

    def explain(self, label: str, allocator_failed: bool) -> str:
        """What an out-of-memory error adds: the biggest buffers (and the report when the
        allocator itself failed)."""
        text = f"buffer {label!r} could not grow; biggest buffers: {biggest_buffers(self._blobs)}"
        return text + ("\n" + self.report() if allocator_failed else "")
