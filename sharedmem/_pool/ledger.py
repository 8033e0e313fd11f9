"""The ledger of a pool: reserved bytes per side, the peak, the peaks of open phases, and
the traffic counters.

Backends report every change of capacity and every copy here (through ``AccountedBackend``),
so the figures are the physical bytes the pool holds, counted once, updated at every growth,
and the counters only ever go up: a memory that leaves the pool leaves its history behind.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields

__all__ = ["COUNTERS", "Ledger", "Traffic"]


@dataclass(slots=True)
class Traffic:
    """The pool's traffic counters: defined here once; ``stats()``, the phase totals and the
    report's rows are derived from these fields. They only ever go up."""

    num_grows: int = 0
    grow_copy_bytes: int = 0  # bytes copied to keep content on a moving growth
    host_to_device_bytes: int = 0
    device_to_host_bytes: int = 0

    def as_dict(self) -> dict[str, int]:
        return {key: getattr(self, key) for key in COUNTERS}

    def since(self, before: Traffic) -> Traffic:
        """What was counted between ``before`` and now."""
        return Traffic(*(getattr(self, k) - getattr(before, k) for k in COUNTERS))


COUNTERS = tuple(field.name for field in fields(Traffic))


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
        self._phase_peaks: dict[str, int] = {}  # open phases -> peak since they opened
        self._traffic = Traffic()

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
            for phase, peak in self._phase_peaks.items():
                self._phase_peaks[phase] = max(peak, high)

    def grew(self, copied: int = 0) -> None:
        """Count a growth that copied ``copied`` bytes to keep content."""
        with self.lock:
            self._traffic.num_grows += 1
            self._traffic.grow_copy_bytes += copied

    def copied(self, nbytes: int, *, to_device: bool) -> None:
        """Count a copy between the sides."""
        with self.lock:
            if to_device:
                self._traffic.host_to_device_bytes += nbytes
            else:
                self._traffic.device_to_host_bytes += nbytes

    def snapshot(self) -> Traffic:
        """The traffic counters now (a copy)."""
        with self.lock:
            return Traffic(*(getattr(self._traffic, k) for k in COUNTERS))

    def open_phase(self, name: str) -> tuple[Traffic, int, int]:
        """Start tracking the peak of phase ``name``; the counters, reserved and device bytes
        now, as one consistent reading."""
        with self.lock:
            self._phase_peaks[name] = self.total
            return self.snapshot(), self.total, self.device_reserved

    def close_phase(self, name: str) -> tuple[Traffic, int, int, int]:
        """Stop tracking phase ``name``: the counters, its peak, reserved and device bytes."""
        with self.lock:
            peak = self._phase_peaks.pop(name)
            return self.snapshot(), peak, self.total, self.device_reserved
