"""Acquiring a view in steady state: ``pool.tensor`` against ``torch.empty`` of the same bytes.

The hot path of a custom loop asks the pool for every activation of every step. Targets
(DESIGN §7): at most 0.25x ``torch.empty`` of 64 MiB and at most 1.0x ``torch.empty`` of
1 KiB on CPU; at most 1.0x on CUDA.

    python benchmarks/bench_fast_path.py [--quick] [--device cpu] [--json PATH]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Progress, Row, cheapest_empty, interleaved, row, script_main

import sharedmem as sm

# (label, elements of float32, target ratio) per device kind
CASES = {
    "cpu": [("1 KiB", 256, 1.0), ("64 MiB", 16 << 20, 0.25)],
    "cuda": [("1 KiB", 256, 1.0), ("64 MiB", 16 << 20, 1.0)],
}


def run(quick: bool = False, device: str = "cpu", progress: Progress | None = None) -> list[Row]:
    pool = sm.BufferPool(device)
    cuda = device.startswith("cuda")
    rows = []
    for label, numel, target in CASES["cuda" if cuda else "cpu"]:
        shape = (numel,)
        pool.tensor(label, shape)  # warm: the buffer exists and the fast path is primed

        def pooled(label: str = label, numel: int = numel) -> torch.Tensor:
            # A shape built per call, as a loop builds (batch, features) each step: the fast
            # path checks it element by element, where a constant tuple would be matched by
            # identity and flatter the figure.
            return pool.tensor(label, (numel,))

        times = interleaved(
            {"pool": pooled, "empty": cheapest_empty(shape, device)},
            rounds=10 if quick else 40,
            number=200 if quick else 1000,
            progress=progress,
            label=f"pool.tensor {label}",
        )
        ratio = times["pool"] / times["empty"]
        rows.append(
            row(
                f"pool.tensor {label} ({device})",
                times["pool"],
                "s",
                baseline=times["empty"],
                target=f"<= {target}x torch.empty",
                ok=ratio <= target,
            )
        )
    return rows


def main(argv: list[str] | None = None) -> list[Row]:
    return script_main(__doc__, run, "view acquisition on {device}, steady state", argv)


if __name__ == "__main__":
    main()
