"""``python -m cudasim ARGS`` (from ``tests/``): ``python -m sharedmem ARGS`` on the CUDA
stand-in, e.g. ``python -m cudasim stress --device cuda --backend vmm``."""

from __future__ import annotations

import sys

from sharedmem._cli.main import main

from . import SimulatedCuda


def run(argv: list[str]) -> int:
    """Run sharedmem's command line with the stand-in installed; fails on a leak."""
    with SimulatedCuda() as cuda:
        code = main(argv)
    leaks = cuda.leaks()
    if leaks:
        print(f"cudasim: still held after the run: {leaks}", file=sys.stderr)
        return code or 1
    return code


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
