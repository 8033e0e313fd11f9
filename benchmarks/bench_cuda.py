"""CUDA backends against PyTorch doing the same work, on one GPU (DESIGN §6).

Both sides run in one process, interleaved (the order alternates every repetition), and each
figure is the median of many repetitions; the ratio against the PyTorch baseline is printed
next to its target.

* ``bandwidth``: host->device and device->host through SyncedMemory's synchronous accessors
  (pinned host side, copy on the current stream, fence) against a raw ``copy_`` between a
  pinned tensor and a device tensor of the same size. Target: at least 80% of the baseline.
  Measured on a fresh memory (its host side pinned in one registration) and on one grown to
  the same size in 16 steps, page-aligned and not, so a copy spans 16 registered ranges: the
  host side of a growing buffer must stay as fast as a fresh one.
* ``growth``: a buffer holding ``a`` bytes grows to ``2a``: time, bytes copied, and the peak
  of physical device memory during the growth divided by the new capacity (1.0 means "peak =
  new capacity", old + new is 1.5). ``torch.cuda.max_memory_allocated`` does not see memory
  from ``cuMemCreate`` or ``cudaMalloc``, so those backends report their own mapped-bytes
  counter (``meter``); the change of ``torch.cuda.mem_get_info`` is printed as a cross-check.
* ``view``: acquiring the device view in steady state (``mutable_device_data``) against
  ``torch.empty`` of the same size. Target: no slower.

    python benchmarks/bench_cuda.py [--quick] [--json results.json] [--device cuda:0]

Without a GPU it prints a "skipped" line and exits 0. ``measure`` returns the full records
(built only by the ``*_record`` functions below), ``rows`` turns them into the table's rows,
and ``run`` does both for ``python -m sharedmem bench``.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Progress, Row, cheapest_empty, growth_rows, row, script_main

import sharedmem as sm

MiB = 1 << 20
Result = dict[str, Any]


def _backends(device: str) -> list[str]:
    """The device backends that can run here (vmm needs VMM support, cudart a cuda-python
    runtime the driver can run), in order of preference."""
    from sharedmem._backends.cuda import device_index, usable_backends

    return list(usable_backends(device_index(device)))


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


def _grown(device: str, backend: str, size: int, steps: int, misalign: int) -> sm.SyncedMemory:
    """A memory grown to ``size`` in ``steps`` growths of both sides (``misalign`` bytes past
    each step's even share, so the registered ranges do not line up with 2 MiB)."""
    m = sm.SyncedMemory(0, device=device, backend=backend)
    for i in range(1, steps + 1):
        m.set_size(min(size, i * size // steps + misalign))
        m.mutable_host_data().fill_(1)
        m.device_data()
    m.set_size(size)
    return m


def bench_bandwidth(
    device: str, backend: str, size: int, reps: int, layout: str = "fresh"
) -> list[Result]:
    """``layout``: ``"fresh"`` (one growth), ``"grown"`` or ``"grown+4K"`` (16 growths)."""
    if layout == "fresh":
        m = sm.SyncedMemory(size, device=device, backend=backend)
    else:
        m = _grown(device, backend, size, 16, 4096 if layout == "grown+4K" else 0)
    m.mutable_host_data().fill_(1)
    m.device_data()  # both sides allocated and synced: every measured step is one copy
    host = m.placement.host.kind  # "pinned" (registered range) or "pinned-pageable"
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
            bandwidth_record(direction, backend, size, t_ours, t_torch, host=host, layout=layout)
        )
    return results


def bandwidth_record(
    direction: str,
    backend: str,
    size: int,
    ours_s: float,
    torch_s: float,
    *,
    host: str = "pinned",
    layout: str = "fresh",
) -> Result:
    return {
        "bench": "bandwidth",
        "direction": direction,
        "backend": backend,
        "host": host,
        "layout": layout,
        "bytes": size,
        "ours_s": ours_s,
        "torch_s": torch_s,
        "ours_gbps": size / ours_s / 1e9,
        "torch_gbps": size / torch_s / 1e9,
        "ratio": torch_s / ours_s,  # our share of the baseline's bandwidth
    }


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
    result = growth_sample(
        seconds=seconds,
        copied=m.grow_copy_bytes,
        peak=peak,
        capacity=m.device_capacity,
        used_delta=free_before - torch.cuda.mem_get_info(device)[0],
        stable=m.placement.device_backend.stable_address,
    )
    m.release()
    return result


def growth_sample(
    *, seconds: float, copied: int, peak: int, capacity: int, used_delta: int, stable: bool
) -> Result:
    """One growth: its time, bytes copied, peak device bytes, new capacity, the change of
    ``torch.cuda.mem_get_info`` (a cross-check of the peak that needs no meter), and whether
    the backend keeps addresses stable."""
    return {
        "seconds": seconds,
        "copied": copied,
        "peak": peak,
        "capacity": capacity,
        "used_delta": used_delta,
        "stable": stable,
    }


def bench_growth(device: str, size: int, reps: int, progress: Progress) -> list[Result]:
    backends = _backends(device)
    runs: dict[str, list[Result]] = {b: [] for b in backends}
    for rep in range(reps + 1):  # the first round warms up and is dropped
        for backend in backends if rep % 2 else backends[::-1]:
            sample = _grow_once(device, backend, size)
            if rep:
                runs[backend].append(sample)
        progress.tick(f"growth: round {rep + 1}/{reps + 1}")
    baseline = statistics.median(r["seconds"] for r in runs["torch"])
    return [growth_record(backend, size, samples, baseline) for backend, samples in runs.items()]


def growth_record(backend: str, size: int, samples: list[Result], torch_s: float) -> Result:
    """The growths of one backend from ``size`` to ``2 * size``: medians, and the worst peak."""
    seconds = statistics.median(r["seconds"] for r in samples)
    return {
        "bench": "growth",
        "backend": backend,
        "stable_address": all(r["stable"] for r in samples),
        "bytes": size,
        "grown_to": 2 * size,
        "ours_s": seconds,
        "torch_s": torch_s,
        "ratio": seconds / torch_s,
        "copied_bytes": statistics.median(r["copied"] for r in samples),
        "peak_bytes": max(r["peak"] for r in samples),
        "capacity_bytes": max(r["capacity"] for r in samples),
        "used_delta_bytes": statistics.median(r["used_delta"] for r in samples),
    }


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
    # The same bytes as float32, spelled as cheaply as torch allows (a prebuilt torch.device).
    baseline = loop(cheapest_empty((size // 4,), device))
    ours(), baseline()
    t_ours, t_torch = _interleaved(ours, baseline, reps)
    return view_record(backend, size, t_ours, t_torch)


def view_record(backend: str, size: int, ours_s: float, torch_s: float) -> Result:
    return {
        "bench": "view",
        "backend": backend,
        "bytes": size,
        "ours_s": ours_s,
        "torch_s": torch_s,
        "ratio": ours_s / torch_s,
    }


def measure(quick: bool, device: str, progress: Progress | None = None) -> list[Result]:
    """Every measurement on ``device``, as full records; ``[]`` where no CUDA GPU is usable."""
    if not torch.cuda.is_available():
        return []
    progress = progress or Progress.quiet()
    device = sm.SyncedMemory(device=device).device  # "cuda" -> "cuda:N", checked
    sizes = [16 * MiB] if quick else [MiB, 16 * MiB, 256 * MiB]
    reps = 7 if quick else 31
    results: list[Result] = []
    for backend in _backends(device):
        for size in sizes:
            progress.say(f"cuda: bandwidth {backend} {size // MiB} MiB ...")
            results += bench_bandwidth(device, backend, size, reps)
        grown = 64 * MiB if quick else 256 * MiB
        for layout in ("grown", "grown+4K"):
            progress.say(f"cuda: bandwidth {backend} {grown // MiB} MiB, {layout} ...")
            results += bench_bandwidth(device, backend, grown, reps, layout)
        progress.say(f"cuda: view {backend} 64 MiB ...")
        results.append(bench_view(device, backend, 64 * MiB, reps, 200 if quick else 2000))
    progress.say("cuda: growth ...")
    results += bench_growth(device, 64 * MiB if quick else 512 * MiB, 3 if quick else 9, progress)
    return results


def rows(results: list[Result]) -> list[Row]:
    """The table's rows: the figure each DESIGN §7 target is about, with its verdict, and the
    rest of each record for orientation."""
    table: list[Row] = []
    for r in results:
        mib = r["bytes"] >> 20
        if r["bench"] == "bandwidth":
            shape = "" if r["layout"] == "fresh" else f", {r['layout']} in 16 steps"
            host = "" if r["host"] == "pinned" else f", host {r['host']}"
            table.append(
                row(
                    f"sync {r['direction']} {r['backend']} {mib} MiB{shape}{host} (GB/s)",
                    r["ours_gbps"],
                    "GB/s",
                    baseline=r["torch_gbps"],
                    target=">= 0.80x raw pinned copy",
                    ok=r["ratio"] >= 0.8,
                )
            )
        elif r["bench"] == "view":
            table.append(
                row(
                    f"pool view {r['backend']} {mib} MiB (cuda)",
                    r["ours_s"],
                    "s",
                    baseline=r["torch_s"],
                    target="<= 1.0x torch.empty",
                    ok=r["ratio"] <= 1.0,
                )
            )
        else:
            label = f"growth {r['backend']} {mib}->{r['grown_to'] >> 20} MiB"
            table += [
                row(f"{label}: time vs torch", r["ours_s"], "s", baseline=r["torch_s"]),
                *growth_rows(
                    label,
                    r["copied_bytes"],
                    r["peak_bytes"],
                    r["capacity_bytes"],
                    r["stable_address"],
                ),
                row(f"{label}: device used (mem_get_info)", r["used_delta_bytes"], "bytes"),
            ]
    return table


def run(quick: bool = False, device: str = "cuda", progress: Progress | None = None) -> list[Row]:
    return rows(measure(quick, device, progress))


def main(argv: list[str] | None = None) -> list[Row]:
    return script_main(__doc__, run, "CUDA backends on {device}", argv, device="cuda")


if __name__ == "__main__":
    main()
