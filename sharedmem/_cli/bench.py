"""``python -m sharedmem bench``: the benchmark suite of ``benchmarks/``, one table.

The suite lives beside the package in a source checkout (``benchmarks/``), where each figure is
measured side by side with its PyTorch baseline; this module finds it, runs what applies to
the device with progress lines on stderr, and prints one table on stdout (and optionally
writes JSON with the environment the figures depend on).

A run that finished exits 0 whatever its verdicts: the table is the result; a benchmark that
raised is one failed row, the others still run, and the run exits 1. ``--check`` makes a
missed target exit 1, except a timing figure (a time, a rate, a ratio of times) that missed by
less than the tolerance: on a small machine shared with other work such a figure moves from
run to run by about that much.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from pathlib import Path
from typing import Any

from .._devices import normalize_device
from .._errors import SharedMemError

__all__ = ["TIMING_TOLERANCE", "run_bench"]

# Run-to-run noise of a timing figure of ``bench --quick`` on a 2-core machine shared with
# other work: the default of ``--tolerance``.
TIMING_TOLERANCE = 0.15


def _suite_module() -> Any:
    folder = Path(__file__).resolve().parents[2] / "benchmarks"
    if not (folder / "suite.py").is_file():
        raise SharedMemError(
            f"sharedmem: bench needs the benchmarks/ folder of a source checkout (looked in "
            f"{folder}); clone the repository and install it with ./dev setup"
        )
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    return importlib.import_module("suite")


def run_bench(
    quick: bool,
    device: str,
    json_path: str | None,
    *,
    check: bool = False,
    tolerance: float = TIMING_TOLERANCE,
) -> int:
    """Run the suite on ``device`` and print its table. Returns 0 once it ran; with ``check``,
    1 where a target was missed (a timing figure: by more than ``tolerance``, a fraction)."""
    device = normalize_device(device)
    suite = _suite_module()
    started = time.perf_counter()
    sections = suite.run_suite(quick, device, suite.Progress("bench"))
    info = suite.environment(device, quick)
    print()
    for title, rows in sections:
        suite.print_rows(title, rows, tolerance)
        print()
    rows = [r for _, section in sections for r in section]
    missed = [r["name"] for r in rows if r["ok"] is False]
    failed = [r["name"] for r in rows if suite.missed(r, tolerance)]
    seconds = time.perf_counter() - started
    noise = f" ({len(missed) - len(failed)} within the timing tolerance)" if missed else ""
    print(
        f"bench: {len(rows)} figures on {device}{' (--quick)' if quick else ''}, "
        f"{len(missed)} targets missed{noise}, {seconds:.0f} s; "
        + ", ".join(f"{k} {v}" for k, v in info.items() if k not in ("device", "quick"))
    )
    print(
        f"bench: a timing figure (a time, a rate, a ratio of times) may miss its target by "
        f"{tolerance:.0%} before --check fails (run-to-run noise; --tolerance sets it); bytes "
        "and counts may not miss at all"
    )
    if json_path:
        payload = {
            "meta": {**info, "seconds": round(seconds, 1), "timing_tolerance": tolerance},
            "sections": [{"title": t, "rows": r} for t, r in sections],
        }
        Path(json_path).write_text(json.dumps(payload, indent=2) + "\n")
        print(f"bench: wrote {json_path}")
    broken = [r["name"] for r in rows if r["target"] == "runs" and r["ok"] is False]
    if broken:  # a benchmark that raised: the others ran, but the run did not finish
        print(f"bench: {len(broken)} benchmarks failed to run: " + "; ".join(broken))
        return 1
    if not check:
        return 0
    if failed:
        print(f"bench --check: FAILED, {len(failed)} targets missed: " + "; ".join(failed))
        return 1
    print("bench --check: passed, every target met (timing figures within the tolerance)")
    return 0
