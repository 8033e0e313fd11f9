"""Acquiring a view in steady state: ``pool.tensor`` against ``torch.empty`` of the same bytes.

The hot path of a custom loop asks the pool for every activation of every step. Targets
(DESIGN §7): at most 0.25x ``torch.empty`` of 64 MiB and at most 1.0x ``torch.empty`` of
1 KiB on CPU; at most 1.0x on CUDA.

    python benchmarks/bench_fast_path.py [--quick] [--device cpu] [--json PATH]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Row, interleaved, print_rows, row, write_json

import sharedmem as sm

# (label, elements of float32, target ratio) per device kind
CASES = {
    "cpu": [("1 KiB", 256, 1.0), ("64 MiB", 16 << 20, 0.25)],
    "cuda": [("1 KiB", 256, 1.0), ("64 MiB", 16 << 20, 1.0)],
}


def run(quick: bool = False, device: str = "cpu") -> list[Row]:
    pool = sm.BufferPool(device)
    torch_device = "cpu" if device in ("cpu", "emulated") else device
    rows = []
    for label, numel, target in CASES["cpu" if torch_device == "cpu" else "cuda"]:
        shape = (numel,)
        pool.tensor(label, shape)  # warm: the buffer exists and the fast path is primed

        def pooled(label: str = label, shape: tuple[int] = shape) -> torch.Tensor:
            return pool.tensor(label, shape)

        # The baseline in its cheapest spelling: on CPU without a device argument.
        def empty(shape: tuple[int] = shape) -> torch.Tensor:
            return (
                torch.empty(shape)
                if torch_device == "cpu"
                else torch.empty(shape, device=torch_device)
            )

        times = interleaved(
            {"pool": pooled, "empty": empty},
            rounds=10 if quick else 40,
            number=200 if quick else 1000,
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rows = run(args.quick, args.device)
    print_rows("view acquisition, steady state (median per call)", rows)
    if args.json:
        write_json(args.json, rows, device=args.device, torch=torch.__version__)
    return rows


if __name__ == "__main__":
    main()
