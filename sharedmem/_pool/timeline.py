"""A pool's memory timeline: reserved and active bytes at the end of every phase.

Off by default. When on, each time a phase closes the pool appends one sample (the ledger's
figures and a sum of the buffers' sizes), so a training loop that opens a phase per step gets
one point per step. Memory stays bounded on runs of any length: past ``MAX_SAMPLES`` every
other sample is dropped, evenly thinning the whole run. ``plot`` draws it with matplotlib, an
optional extra (``sharedmem[plot]``), without touching pyplot's global state.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .._errors import SharedMemError

__all__ = ["MAX_SAMPLES", "Sample", "Timeline"]

MAX_SAMPLES = 20_000  # about 4 MiB of samples; plenty of points for any plot


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
    def __init__(self, max_samples: int = MAX_SAMPLES) -> None:
        self._samples: list[Sample] = []
        self._closed = 0  # phases closed since recording started
        self._keep_every = 1  # record every n-th phase close (doubles as samples thin out)
        self._max = max(2, max_samples)
        self._start = time.perf_counter()
        self._lock = threading.Lock()

    def record(self, phase: str, stats: dict[str, int], peak: int) -> None:
        with self._lock:
            index = self._closed
            self._closed += 1
            if index % self._keep_every:
                return
            if len(self._samples) >= self._max:
                self._keep_every *= 2
                self._samples = [s for s in self._samples if s.index % self._keep_every == 0]
                if index % self._keep_every:
                    return
            self._samples.append(
                Sample(
                    index=index,
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
            # A bare Figure draws to a file with no pyplot and no backend switch, so the
            # user's own matplotlib set-up (a notebook, an interactive window) is left alone.
            from matplotlib import rcParams
            from matplotlib.figure import Figure
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
        figure = Figure(figsize=(9, 4.5), dpi=110)
        axes = figure.subplots()
        axes.step(x, [s.reserved_bytes / mib for s in samples], where="post", label="reserved")
        peaks = [s.peak_reserved_bytes / mib for s in samples]
        axes.step(x, peaks, ":", where="post", label="peak in phase")
        axes.plot(x, [s.active_bytes / mib for s in samples], label="active")
        phases = sorted({s.phase for s in samples})
        palette = rcParams["axes.prop_cycle"].by_key()["color"]
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
        return target
