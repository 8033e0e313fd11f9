"""Randomized stress: verified operations a minute, and mismatches (DESIGN §7: at least
100,000 verified operations a minute, zero mismatches).

Runs ``python -m sharedmem stress`` for a fixed time on the device and reports its rate.

    python benchmarks/bench_stress.py [--quick] [--device emulated] [--json PATH]
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Row, print_rows, row, write_json

from sharedmem._stress import StressConfig, run_stress


def run(quick: bool = False, device: str = "emulated") -> list[Row]:
    result = run_stress(
        StressConfig(device, seconds=10.0 if quick else 60.0, seed=0), io.StringIO(), io.StringIO()
    )
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
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default="emulated")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rows = run(args.quick, args.device)
    print_rows(f"stress on {args.device}", rows)
    if args.json:
        write_json(args.json, rows, device=args.device, torch=torch.__version__)
    return rows


if __name__ == "__main__":
    main()
