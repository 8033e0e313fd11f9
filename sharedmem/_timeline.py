"""A pool's memory timeline: reserved and active bytes at the end of every phase.

Off by default. When on, each time a phase closes the pool appends one sample (a few dict
lookups and a sum over the buffers), so a training loop that opens a phase per step gets one
point per step. ``plot`` draws it with matplotlib, an optional extra (``sharedmem[plot]``).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ._errors import SharedMemError

__all__ = ["Sample", "Timeline"]


@dataclass(frozen=True)
class Sample:
    """The pool when a phase closed."""

    index: int  # 0, 1, 2 ... in the order phases closed
    phase: str
    seconds: float  # since recording started
    reserved_bytes: int
    device_reserved_bytes: int
    active_bytes: int
    peak_reserved_bytes: int  # the highest reserved total while the phase was open


class Timeline:
    def __init__(self) -> None:
        self._samples: list[Sample] = []
        self._start = time.perf_counter()
        self._lock = threading.Lock()

    def record(self, phase: str, stats: dict[str, int], peak: int) -> None:
        with self._lock:
            self._samples.append(
                Sample(
                    index=len(self._samples),
                    phase=phase,
                    seconds=time.perf_counter() - self._start,
                    reserved_bytes=stats["reserved_bytes"],
                    device_reserved_bytes=stats["device_reserved_bytes"],
                    active_bytes=stats["active_bytes"],
                    peak_reserved_bytes=peak,
                )
            )

    @property
    def samples(self) -> list[Sample]:
        with self._lock:
            return list(self._samples)

    def plot(self, path: str | Path, title: str) -> Path:
        """Write a PNG: reserved, peak and active bytes over the phases, coloured by phase."""
        try:
            import matplotlib

            matplotlib.use("Agg")  # files only: no display needed
            import matplotlib.pyplot as plt
        except ImportError:
            raise SharedMemError(
                "sharedmem: plotting the timeline needs matplotlib; "
                "install it with pip install 'sharedmem[plot]' (or pip install matplotlib)"
            ) from None
        samples = self.samples
        if not samples:
            raise SharedMemError(
                "sharedmem: the timeline is empty; create the pool with timeline=True and "
                "run some steps inside pool.phase(...) first"
            )
        mib = float(1 << 20)
        x = [s.index for s in samples]
        figure, axes = plt.subplots(figsize=(9, 4.5), dpi=110)
        axes.step(x, [s.reserved_bytes / mib for s in samples], where="post", label="reserved")
        peaks = [s.peak_reserved_bytes / mib for s in samples]
        axes.step(x, peaks, ":", where="post", label="peak in phase")
        axes.plot(x, [s.active_bytes / mib for s in samples], label="active")
        phases = sorted({s.phase for s in samples})
        palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for number, phase in enumerate(phases):
            colour = palette[(number + 3) % len(palette)]  # the first three draw the lines
            points = [s for s in samples if s.phase == phase]
            axes.scatter(
                [s.index for s in points],
                [s.active_bytes / mib for s in points],
                s=12,
                color=colour,
                label=f"phase {phase!r}",
                zorder=3,
            )
        axes.set_xlabel("phase closed (one per step)")
        axes.set_ylabel("MiB")
        axes.set_title(title)
        axes.set_ylim(bottom=0)
        axes.grid(alpha=0.3)
        axes.legend(loc="lower right", fontsize="small")
        figure.tight_layout()
        target = Path(path)
        figure.savefig(target, format="png")
        plt.close(figure)
        return target
