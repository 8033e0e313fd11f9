"""``python -m sharedmem bench``: the benchmark suite of ``benchmarks/``, one table.

The suite lives beside the package in a source checkout (``benchmarks/``), where each figure is
measured side by side with its PyTorch baseline; this module finds it, runs what applies to
the device with progress lines on stderr, and prints one table on stdout (and optionally
writes JSON with the environment the figures depend on).
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

__all__ = ["run_bench"]


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


def run_bench(quick: bool, device: str, json_path: str | None) -> int:
    """Run the suite on ``device``; returns 0 when every target with a verdict was met."""
    device = normalize_device(device)
    suite = _suite_module()
    started = time.perf_counter()
    sections = suite.run_suite(quick, device, suite.Progress("bench"))
    info = suite.environment(device, quick)
    print()
    for title, rows in sections:
        suite.print_rows(title, rows)
        print()
    missed = [r["name"] for _, rows in sections for r in rows if r["ok"] is False]
    seconds = time.perf_counter() - started
    print(
        f"bench: {sum(len(rows) for _, rows in sections)} figures on {device}"
        f"{' (--quick)' if quick else ''}, {len(missed)} targets missed, {seconds:.0f} s; "
        + ", ".join(f"{k} {v}" for k, v in info.items() if k not in ("device", "quick"))
    )
    if json_path:
        payload = {
            "meta": {**info, "seconds": round(seconds, 1)},
            "sections": [{"title": t, "rows": r} for t, r in sections],
        }
        Path(json_path).write_text(json.dumps(payload, indent=2) + "\n")
        print(f"bench: wrote {json_path}")
    return 1 if missed else 0
