"""``python -m sharedmem bench``: the benchmark suite of ``benchmarks/``, one table.

The suite lives beside the package in a source checkout (``benchmarks/``), where each figure is
measured side by side with its PyTorch baseline; this module finds it, runs what applies to
the device with progress lines, and prints one table (and optionally writes JSON).
"""

from __future__ import annotations

import datetime
import importlib
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ._devices import normalize_device
from ._errors import SharedMemError

__all__ = ["run_bench"]


def _suite_module() -> Any:
    folder = Path(__file__).resolve().parent.parent / "benchmarks"
    if not (folder / "suite.py").is_file():
        raise SharedMemError(
            f"sharedmem: bench needs the benchmarks/ folder of a source checkout (looked in "
            f"{folder}); clone the repository and install it with ./dev setup"
        )
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    return importlib.import_module("suite")


def _environment(device: str) -> dict[str, str]:
    info = {
        "date": datetime.date.today().isoformat(),
        "device": device,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
    }
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def run_bench(quick: bool, device: str, json_path: str | None) -> int:
    """Run the suite on ``device``; returns 0 when every target with a verdict was met."""
    device = normalize_device(device)
    suite = _suite_module()
    started = time.perf_counter()

    def progress(line: str) -> None:
        print(f"bench: {line} ({time.perf_counter() - started:.0f} s)", flush=True)

    sections = suite.run_suite(quick, device, progress)
    info = _environment(device)
    print()
    for title, rows in sections:
        suite.print_rows(title, rows)
        print()
    missed = [r["name"] for _, rows in sections for r in rows if r["ok"] is False]
    print(
        f"bench: {sum(len(rows) for _, rows in sections)} figures on {device}, "
        f"{len(missed)} targets missed, {time.perf_counter() - started:.0f} s; "
        + ", ".join(f"{k} {v}" for k, v in info.items() if k != "device")
    )
    if json_path:
        payload = {"meta": info, "sections": [{"title": t, "rows": r} for t, r in sections]}
        Path(json_path).write_text(json.dumps(payload, indent=2) + "\n")
        print(f"bench: wrote {json_path}")
    return 1 if missed else 0
