"""Randomized stress: verified operations a minute, and mismatches (DESIGN §7: at least
100,000 verified operations a minute, zero mismatches).

Runs ``python -m sharedmem stress`` for a fixed time on the device and reports its rate; the
runner's status line is the progress.

    python benchmarks/bench_stress.py [--quick] [--device emulated] [--json PATH]
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Progress, Row, row, script_main

from sharedmem._stress import StressConfig, run_stress


def run(
    quick: bool = False, device: str = "emulated", progress: Progress | None = None
) -> list[Row]:
    progress = progress or Progress.quiet()
    out = io.StringIO()  # the runner's report and summary: the rows below say the same
    result = run_stress(
        StressConfig(device, seconds=5.0 if quick else 60.0, seed=0), out, progress.stream()
    )
    if result.mismatches:  # the seed and the shortest failing sequence: never swallow them
        for line in out.getvalue().splitlines():
            progress.say(line)
    return [
        row(
            f"stress: verified ops a minute ({device})",
            result.per_minute,
            "ops/min",
            target=">= 100,000",
            ok=result.per_minute >= 100_000,
        ),
        row(
            f"stress: mismatches in {result.ops:,} ops ({device})",
            result.mismatches,
            "",
            target="== 0",
            ok=result.mismatches == 0,
        ),
    ]


def main(argv: list[str] | None = None) -> list[Row]:
    return script_main(__doc__, run, "stress on {device}", argv, device="emulated")


if __name__ == "__main__":
    main()
