"""The ledger of a pool: reserved bytes per side, the peak, the peaks of open phases, and
the traffic counters.

Backends report every change of capacity and every copy here (through ``AccountedBackend``),
so the figures are the physical bytes the pool holds, counted once, updated at every growth,
and the counters only ever go up: a memory that leaves the pool leaves its history behind.
"""

from __future__ import annotations

import threading

__all__ = ["COUNTERS", "Ledger"]

COUNTERS = ("num_grows", "grow_copy_bytes", "host_to_device_bytes", "device_to_host_bytes")


class Ledger:
    """Reserved bytes of a pool's host and device sides, and their peaks.

    Args:
        single: the device side is the host memory (``cpu``): one figure serves both.
    """

    def __init__(self, *, single: bool) -> None:
        # Re-entrant: a limit check holds it across the growth it allows, and the growth
        # reports back here.
        self.lock = threading.RLock()
        self.single = single
        self.host = 0
        self.device = 0
        self.peak = 0
        self.phase_peaks: dict[str, int] = {}  # open phases -> peak since they opened
        self.counters = dict.fromkeys(COUNTERS, 0)

    @property
    def total(self) -> int:
        return self.host + (0 if self.single else self.device)

    @property
    def device_reserved(self) -> int:
        return self.host if self.single else self.device

    def change(self, side: str, delta: int, transient: int = 0) -> None:
        """Record ``delta`` bytes more on ``side``; ``transient`` bytes were held on top
        of the new total for a moment (a moving growth holds old and new blocks at once)."""
        with self.lock:
            if side == "host":
                self.host += delta
            else:
                self.device += delta
            high = self.total + transient
            self.peak = max(self.peak, high)
            for phase, peak in self.phase_peaks.items():
                self.phase_peaks[phase] = max(peak, high)

    def count(self, key: str, n: int) -> None:
        """Add ``n`` to the traffic counter ``key`` (one of ``COUNTERS``)."""
        with self.lock:
            self.counters[key] += n

    def snapshot(self) -> dict[str, int]:
        """The traffic counters now."""
        with self.lock:
            return dict(self.counters)
