"""The whole benchmark suite, as ``python -m sharedmem bench`` runs it.

Each entry is a module of this folder with ``run(quick, device) -> list[Row]`` and the
devices it applies to. CUDA-only measurements (bandwidth, offload) are skipped elsewhere;
their rows then simply do not appear.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Row, print_rows, row

__all__ = ["SUITE", "print_rows", "run_suite"]

# (title, module, which devices: "all" or "cuda")
SUITE = [
    ("view acquisition vs torch.empty", "bench_fast_path", "all"),
    ("memory: train+eval, variable shapes, growth", "bench_memory", "all"),
    ("randomized stress", "bench_stress", "all"),
    ("pooled graph executor vs eager", "bench_executor", "all"),
    ("CUDA: sync bandwidth, growth, views", "bench_cuda", "cuda"),
    ("activation offload vs save_on_cpu", "bench_offload", "cuda"),
]


def _cuda_rows(results: list[dict[str, Any]]) -> list[Row]:
    """bench_cuda reports richer records; keep the figure each DESIGN §7 target is about."""
    rows = []
    for r in results:
        if r["bench"] == "bandwidth":
            rows.append(
                row(
                    f"sync {r['direction']} {r['backend']} {r['bytes'] >> 20} MiB (GB/s)",
                    r["ours_gbps"],
                    "GB/s",
                    baseline=r["torch_gbps"],
                    target=">= 0.80x raw pinned copy",
                    ok=r["ratio"] >= 0.8,
                )
            )
        elif r["bench"] == "view":
            rows.append(
                row(
                    f"pool view {r['backend']} {r['bytes'] >> 20} MiB (cuda)",
                    r["ours_s"],
                    "s",
                    baseline=r["torch_s"],
                    target="<= 1.0x torch.empty",
                    ok=r["ratio"] <= 1.0,
                )
            )
        else:
            stable = r["backend"] == "vmm"
            rows.append(
                row(
                    f"growth {r['backend']} {r['bytes'] >> 20}->{r['grown_to'] >> 20} MiB: copied",
                    r["copied_bytes"],
                    "bytes",
                    target="== 0 (stable address)" if stable else "moving backend",
                    ok=r["copied_bytes"] == 0 if stable else None,
                )
            )
            rows.append(
                row(
                    f"growth {r['backend']}: peak / new capacity",
                    r["peak_over_new"],
                    "x",
                    target="== 1.00 (stable address)" if stable else "old + new",
                    ok=r["peak_over_new"] <= 1.0 if stable else None,
                )
            )
    return rows


def run_suite(
    quick: bool, device: str, progress: Callable[[str], None] = print
) -> list[tuple[str, list[Row]]]:
    """Run every applicable benchmark; ``progress`` hears what runs now."""
    sections = []
    cuda = device.startswith("cuda")
    applicable = [entry for entry in SUITE if entry[2] == "all" or cuda]
    for index, (title, name, _) in enumerate(applicable, start=1):
        progress(f"[{index}/{len(applicable)}] {title} ...")
        module = importlib.import_module(name)
        rows = module.run(quick, device)
        sections.append((title, _cuda_rows(rows) if name == "bench_cuda" else rows))
    return sections
