"""The whole benchmark suite, as ``python -m sharedmem bench`` runs it.

Each entry is a module of this folder with ``run(quick, device, progress) -> list[Row]`` and
the devices it applies to. CUDA-only measurements (bandwidth, offload) are skipped elsewhere;
their rows then simply do not appear.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Progress, Row, environment, missed, print_rows, row

__all__ = ["SUITE", "Progress", "environment", "missed", "print_rows", "run_suite"]

# (title, module, which devices: "all" or "cuda")
SUITE = [
    ("view acquisition vs torch.empty", "bench_fast_path", "all"),
    ("memory: train+eval, variable shapes, growth", "bench_memory", "all"),
    ("randomized stress", "bench_stress", "all"),
    ("pooled graph executor vs eager", "bench_executor", "all"),
    ("train step peak memory: pooled vs eager", "bench_step_memory", "all"),
    ("data parallel: pooled DDP step vs eager DDP", "bench_distributed", "all"),
    ("CUDA: sync bandwidth, growth, views", "bench_cuda", "cuda"),
    ("activation offload vs save_on_cpu", "bench_offload", "cuda"),
]


def run_suite(quick: bool, device: str, progress: Progress) -> list[tuple[str, list[Row]]]:
    """Run every applicable benchmark; ``progress`` hears what runs now, and each benchmark
    ticks it during its long loops."""
    sections = []
    cuda = device.startswith("cuda")
    applicable = [entry for entry in SUITE if entry[2] == "all" or cuda]
    for index, (title, name, _) in enumerate(applicable, start=1):
        progress.say(f"[{index}/{len(applicable)}] {title} ...")
        try:
            rows: list[Row] = importlib.import_module(name).run(quick, device, progress)
        except Exception as error:  # the other benchmarks still run: one row says what broke
            progress.say(f"{title}: FAILED: {type(error).__name__}: {error}")
            message = f"FAILED to run: {type(error).__name__}: {str(error)[:300]}"
            rows = [row(message, float("nan"), "", target="runs", ok=False)]
        sections.append((title, rows))
    return sections
