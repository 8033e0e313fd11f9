"""Phases: attribute a pool's growth, peaks and traffic to named parts of a run."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ._ledger import Ledger

__all__ = ["PhaseBook"]

_COUNTERS = ("num_grows", "grow_copy_bytes", "host_to_device_bytes", "device_to_host_bytes")


class PhaseBook:
    """What each phase added up to over every time it was open.

    Args:
        ledger: the pool's ledger (reserved bytes and open phases' peaks).
        counters: returns the pool's traffic counters now.
        on_close: called with the phase's name and peak each time it closes.
    """

    def __init__(
        self,
        ledger: Ledger,
        counters: Callable[[], dict[str, int]],
        on_close: Callable[[str, int], None] | None = None,
    ) -> None:
        self._ledger = ledger
        self._counters = counters
        self.on_close = on_close  # hears (phase, peak) each time a phase closes
        self._totals: dict[str, dict[str, int]] = {}
        self._depth: dict[str, int] = {}
        self._lock = threading.Lock()

    @contextmanager
    def open(self, name: str) -> Iterator[None]:
        with self._lock:
            depth = self._depth.get(name, 0)
            self._depth[name] = depth + 1
        if depth:  # already open (nested, or another thread): the outer opening counts it
            try:
                yield
            finally:
                with self._lock:
                    self._depth[name] -= 1
            return
        before = self._counters()
        with self._ledger.lock:
            reserved_before = self._ledger.total
            device_before = self._ledger.device_reserved
            self._ledger.phase_peaks[name] = reserved_before
        try:
            yield
        finally:
            after = self._counters()
            with self._ledger.lock:
                peak = self._ledger.phase_peaks.pop(name)
                reserved_after = self._ledger.total
                device_after = self._ledger.device_reserved
            with self._lock:
                self._depth[name] -= 1
                totals = self._totals.setdefault(
                    name,
                    {"entries": 0, "peak_reserved_bytes": 0}
                    | dict.fromkeys(("added_reserved_bytes", "added_device_bytes"), 0)
                    | dict.fromkeys(_COUNTERS, 0),
                )
                totals["entries"] += 1
                totals["peak_reserved_bytes"] = max(totals["peak_reserved_bytes"], peak)
                totals["added_reserved_bytes"] += reserved_after - reserved_before
                totals["added_device_bytes"] += device_after - device_before
                for key in _COUNTERS:
                    totals[key] += after[key] - before[key]
            if self.on_close is not None:
                self.on_close(name, peak)

    def stats(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {name: dict(totals) for name, totals in self._totals.items()}
