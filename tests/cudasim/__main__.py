"""``python -m cudasim ARGS`` (from ``tests/``): ``python -m sharedmem ARGS`` on the CUDA
stand-in, e.g. ``python -m cudasim stress --device cuda --backend vmm``."""

from __future__ import annotations

import sys

from sharedmem._cli.main import main

from . import SimulatedCuda


def run(argv: list[str]) -> int:
    """Run sharedmem's command line with the stand-in installed; fails on a leak or a fault.

    A ``--seed`` of the command seeds the stand-in's scheduler too (queued work run early)."""
    seed = int(argv[argv.index("--seed") + 1]) if "--seed" in argv else None
    with SimulatedCuda(seed=seed) as cuda:
        code = main(argv)
    leaks, faults = cuda.leaks(), cuda.faults
    if leaks or faults:
        print(f"cudasim: still held after the run: {leaks}; faults: {faults}", file=sys.stderr)
        return code or 1
    return code


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
