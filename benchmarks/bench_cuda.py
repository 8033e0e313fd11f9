"""CUDA backends against PyTorch doing the same work, on one GPU (DESIGN §6).

Both sides run in one process, interleaved (the order alternates every repetition), and each
figure is the median of many repetitions; the ratio against the PyTorch baseline is printed
next to its target.

* ``bandwidth``: host->device and device->host through SyncedMemory's synchronous accessors
  (pinned host side, copy on the current stream, fence) against a raw ``copy_`` between a
  pinned tensor and a device tensor of the same size. Target: at least 80% of the baseline.
* ``growth``: a buffer holding ``a`` bytes grows to ``2a``: time, bytes copied, and the peak
  of physical device memory during the growth divided by the new capacity (1.0 means "peak =
  new capacity", old + new is 1.5). ``torch.cuda.max_memory_allocated`` does not see memory
  from ``cuMemCreate`` or ``cudaMalloc``, so those backends report their own mapped-bytes
  counter (``meter``); the change of ``torch.cuda.mem_get_info`` is printed as a cross-check.
* ``view``: acquiring the device view in steady state (``mutable_device_data``) against
  ``torch.empty`` of the same size. Target: no slower.

    python benchmarks/bench_cuda.py [--quick] [--json results.json] [--device cuda:0]

Without a GPU it prints a "skipped" line and exits 0. ``run(quick)`` is the entry point for
other tools (a ``sharedmem bench`` command).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import sharedmem as sm

MiB = 1 << 20
Result = dict[str, Any]


def _backends(device: str) -> list[str]:
    from sharedmem._backends.cuda import device_index, vmm_supported

    try:
        vmm = vmm_supported(device_index(device))
    except sm.SharedMemError:
        vmm = False
    return ["vmm", "cudart", "torch"] if vmm else ["cudart", "torch"]


def _interleaved(
    ours: Callable[[], float], baseline: Callable[[], float], reps: int
) -> tuple[float, float]:
    """Median seconds of each side, run alternately, the order flipping every repetition."""
    a: list[float] = []
    b: list[float] = []
    for rep in range(reps):
        if rep % 2:
            b.append(baseline())
            a.append(ours())
        else:
            a.append(ours())
            b.append(baseline())
    return statistics.median(a), statistics.median(b)


def _timed(step: Callable[[], object], device: str) -> float:
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    step()
    torch.cuda.synchronize(device)
    return time.perf_counter() - start


def bench_bandwidth(device: str, backend: str, size: int, reps: int) -> list[Result]:
    m = sm.SyncedMemory(size, device=device, backend=backend)
    m.mutable_host_data().fill_(1)
    m.device_data()  # both sides allocated and synced: every measured step is one copy
    pinned = torch.ones(size, dtype=torch.uint8, pin_memory=True)
    on_device = torch.empty(size, dtype=torch.uint8, device=device)

    def upload() -> float:
        m.mutable_host_data()  # the host becomes the head; nothing is copied here
        return _timed(m.device_data, device)

    def download() -> float:
        m.mutable_device_data()
        return _timed(m.host_data, device)

    def raw_upload() -> float:
        return _timed(lambda: on_device.copy_(pinned, non_blocking=True), device)

    def raw_download() -> float:
        return _timed(lambda: pinned.copy_(on_device, non_blocking=True), device)

    results = []
    for direction, ours, baseline in (("h2d", upload, raw_upload), ("d2h", download, raw_download)):
        ours(), baseline()  # warm-up
        t_ours, t_torch = _interleaved(ours, baseline, reps)
        results.append(
            {
                "bench": "bandwidth",
                "direction": direction,
                "backend": backend,
                "bytes": size,
                "ours_s": t_ours,
                "torch_s": t_torch,
                "ours_gbps": size / t_ours / 1e9,
                "torch_gbps": size / t_torch / 1e9,
                "ratio": t_torch / t_ours,  # our share of the baseline's bandwidth
                "target": ">= 0.80",
            }
        )
    return results


def _grow_once(device: str, backend: str, size: int) -> Result:
    """One growth from ``size`` to ``2 * size`` of a buffer holding ``size`` written bytes."""
    m = sm.SyncedMemory(size, device=device, backend=backend)
    m.mutable_device_data().fill_(1)
    gc.collect()
    torch.cuda.synchronize(device)
    meter = getattr(m.placement.accel, "meter", None)
    if meter is not None:
        meter.reset_peak()
        base = meter.held - m.device_capacity
    else:
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device) - m.device_capacity
    free_before = torch.cuda.mem_get_info(device)[0]
    m.set_size(2 * size)
    seconds = _timed(m.mutable_device_data, device)
    peak = (meter.peak if meter is not None else torch.cuda.max_memory_allocated(device)) - base
    result = {
        "seconds": seconds,
        "copied": m.grow_copy_bytes,
        "peak_over_new": peak / m.device_capacity,
        "used_delta": free_before - torch.cuda.mem_get_info(device)[0],
    }
    m.release()
    return result


def bench_growth(device: str, size: int, reps: int) -> list[Result]:
    backends = _backends(device)
    runs: dict[str, list[Result]] = {b: [] for b in backends}
    for rep in range(reps + 1):  # the first round warms up and is dropped
        for backend in backends if rep % 2 else backends[::-1]:
            run = _grow_once(device, backend, size)
            if rep:
                runs[backend].append(run)
    baseline = statistics.median(r["seconds"] for r in runs["torch"])
    results = []
    for backend, samples in runs.items():
        seconds = statistics.median(r["seconds"] for r in samples)
        results.append(
            {
                "bench": "growth",
                "backend": backend,
                "bytes": size,
                "grown_to": 2 * size,
                "ours_s": seconds,
                "torch_s": baseline,
                "ratio": seconds / baseline,
                "copied_bytes": statistics.median(r["copied"] for r in samples),
                "peak_over_new": max(r["peak_over_new"] for r in samples),
                "used_delta_bytes": statistics.median(r["used_delta"] for r in samples),
                "target": "copied 0, peak_over_new 1.0" if backend == "vmm" else "",
            }
        )
    return results


def bench_view(device: str, backend: str, size: int, reps: int, calls: int) -> Result:
    m = sm.SyncedMemory(size, device=device, backend=backend)
    m.mutable_device_data()

    def loop(step: Callable[[], object]) -> Callable[[], float]:
        def timed() -> float:
            start = time.perf_counter()
            for _ in range(calls):
                step()
            return (time.perf_counter() - start) / calls

        return timed

    ours = loop(m.mutable_device_data)
    baseline = loop(lambda: torch.empty(size, dtype=torch.uint8, device=device))
    ours(), baseline()
    t_ours, t_torch = _interleaved(ours, baseline, reps)
    return {
        "bench": "view",
        "backend": backend,
        "bytes": size,
        "ours_s": t_ours,
        "torch_s": t_torch,
        "ratio": t_ours / t_torch,
        "target": "<= 1.0",
    }


def run(quick: bool = False, device: str = "cuda") -> list[Result]:
    """Every measurement on ``device``; an empty list where no CUDA GPU is usable."""
    if not torch.cuda.is_available():
        return []
    device = sm.SyncedMemory(device=device).device  # "cuda" -> "cuda:N", checked
    sizes = [16 * MiB] if quick else [MiB, 16 * MiB, 256 * MiB]
    reps = 7 if quick else 31
    stamp = {
        "gpu": torch.cuda.get_device_name(device),
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
    }
    results: list[Result] = []
    for backend in _backends(device):
        for size in sizes:
            results += bench_bandwidth(device, backend, size, reps)
        results.append(bench_view(device, backend, 64 * MiB, reps, 200 if quick else 2000))
    results += bench_growth(device, 64 * MiB if quick else 512 * MiB, 3 if quick else 9)
    return [{**r, **stamp} for r in results]


def report(results: list[Result]) -> str:
    lines = []
    for r in results:
        if r["bench"] == "bandwidth":
            lines.append(
                f"bandwidth {r['direction']} {r['backend']:<6} {r['bytes'] // MiB:>5} MiB  "
                f"{r['ours_gbps']:7.2f} GB/s vs torch {r['torch_gbps']:7.2f} GB/s  "
                f"ratio {r['ratio']:.2f} (target {r['target']})"
            )
        elif r["bench"] == "view":
            lines.append(
                f"view      {r['backend']:<6} {r['bytes'] // MiB:>5} MiB  "
                f"{r['ours_s'] * 1e6:7.2f} us vs torch.empty {r['torch_s'] * 1e6:7.2f} us  "
                f"ratio {r['ratio']:.2f} (target {r['target']})"
            )
        else:
            lines.append(
                f"growth    {r['backend']:<6} {r['bytes'] // MiB:>5} -> "
                f"{r['grown_to'] // MiB} MiB  "
                f"{r['ours_s'] * 1e3:8.2f} ms (x{r['ratio']:.2f} of torch)  "
                f"copied {int(r['copied_bytes']):,} B  peak/new {r['peak_over_new']:.2f}  "
                f"device used +{int(r['used_delta_bytes']):,} B"
            )
    if results:
        lines.append(f"on {results[0]['gpu']}, {results[0]['date']}, torch {results[0]['torch']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--device", default="cuda", help="cuda or cuda:N")
    args = parser.parse_args(argv)
    results = run(args.quick, args.device)
    if results:
        print(report(results))
    else:
        print("bench_cuda: skipped: no CUDA GPU (torch.cuda.is_available() is False)")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
