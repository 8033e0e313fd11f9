"""Phases: attribute a pool's growth, peaks and traffic to named parts of a run."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from .ledger import COUNTERS, Ledger, Traffic

__all__ = ["PhaseBook"]


class PhaseBook:
    """What each phase added up to over every time it was open.

    A phase is pool-wide: it is open from the moment the first opening (in any thread) enters
    until the last one leaves, and that whole span counts once. Nested openings of the same
    name, in one thread or several, extend the span; they are not counted twice.

    Args:
        ledger: the pool's ledger (reserved bytes, open phases' peaks, traffic counters).
        on_close: called with the phase's name and peak each time a span closes.
    """

    def __init__(self, ledger: Ledger, on_close: Callable[[str, int], None] | None = None) -> None:
        self._ledger = ledger
        self.on_close = on_close  # hears (phase, peak) each time a phase closes
        self._totals: dict[str, dict[str, int]] = {}
        self._depth: dict[str, int] = {}
        # Per open phase: the traffic counters, reserved and device bytes when it opened.
        self._start: dict[str, tuple[Traffic, int, int]] = {}
        self._lock = threading.Lock()

    @contextmanager
    def open(self, name: str) -> Iterator[None]:
        with self._lock:
            depth = self._depth.get(name, 0)
            self._depth[name] = depth + 1
            if depth == 0:
                self._begin(name)
        peak = None
        try:
            yield
        finally:
            with self._lock:
                self._depth[name] -= 1
                if self._depth[name] == 0:  # the last one out closes the span
                    del self._depth[name]
                    peak = self._end(name)
            if peak is not None and self.on_close is not None:
                self.on_close(name, peak)

    def _begin(self, name: str) -> None:
        self._start[name] = self._ledger.open_phase(name)

    def _end(self, name: str) -> int:
        counters, reserved_before, device_before = self._start.pop(name)
        after, peak, reserved_after, device_after = self._ledger.close_phase(name)
        totals = self._totals.setdefault(
            name,
            {"entries": 0, "peak_reserved_bytes": 0}
            | dict.fromkeys(("added_reserved_bytes", "added_device_bytes"), 0)
            | dict.fromkeys(COUNTERS, 0),
        )
        totals["entries"] += 1
        totals["peak_reserved_bytes"] = max(totals["peak_reserved_bytes"], peak)
        totals["added_reserved_bytes"] += reserved_after - reserved_before
        totals["added_device_bytes"] += device_after - device_before
        for key, n in after.since(counters).as_dict().items():
            totals[key] += n
        return peak

    def stats(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {name: dict(totals) for name, totals in self._totals.items()}
