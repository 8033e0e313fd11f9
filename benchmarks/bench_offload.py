"""Activation offload: ``sm.save_on_pool(offload=True)`` against no offload and against
``torch.autograd.graph.save_on_cpu(pin_memory=True)``, for a CNN and an MLP.

Per step (forward and backward, gradients kept allocated between steps): the peak of device
memory above what the model holds anyway (``torch.cuda.max_memory_allocated`` plus the pool's
device bytes), and the step time; medians over interleaved repetitions. Targets (DESIGN §7):
device activation memory at most 0.30x no offload, step time at most 1.15x no offload, and
faster than ``save_on_cpu``.

    python benchmarks/bench_offload.py [--quick] [--device cuda] [--json PATH]

Without a GPU it says it skipped the GPU figures and exits 0; ``--device emulated`` (or
``cpu``) reports the step-time overhead there, for orientation only.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Progress, Row, row, script_main

import sharedmem as sm

Context = Callable[[], contextlib.AbstractContextManager[object]]


def mlp(width: int, depth: int) -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))


def cnn(widths: tuple[int, ...]) -> torch.nn.Module:
    """VGG-like: two conv-BN-ReLU per stage, then a 2x2 max-pool."""
    layers: list[torch.nn.Module] = []
    channels = 3
    for width in widths:
        for _ in range(2):
            layers += [
                torch.nn.Conv2d(channels, width, 3, padding=1, bias=False),
                torch.nn.BatchNorm2d(width),
                torch.nn.ReLU(inplace=True),
            ]
            channels = width
        layers.append(torch.nn.MaxPool2d(2))
    layers += [torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(channels, 10)]
    return torch.nn.Sequential(*layers)


def workloads(quick: bool) -> dict[str, tuple[Callable[[], torch.nn.Module], tuple[int, ...]]]:
    """name -> (model factory, input shape)."""
    if quick:
        return {
            "CNN": (lambda: cnn((32, 64, 128)), (16, 3, 64, 64)),
            "MLP": (lambda: mlp(1024, 6), (2048, 1024)),
        }
    return {
        "CNN": (lambda: cnn((64, 128, 256, 512)), (32, 3, 128, 128)),
        "MLP": (lambda: mlp(4096, 8), (4096, 4096)),
    }


def _cases(pool: sm.BufferPool, cuda: bool) -> dict[str, Context]:
    return {
        "none": contextlib.nullcontext,
        # pinned host memory needs CUDA; elsewhere save_on_cpu copies to pageable memory
        "save_on_cpu": lambda: torch.autograd.graph.save_on_cpu(pin_memory=cuda),
        "save_on_pool": lambda: sm.save_on_pool(pool, offload=True),
    }


def _measure(
    model: torch.nn.Module,
    x: torch.Tensor,
    cases: dict[str, Context],
    rounds: int,
    cuda: bool,
    progress: Progress,
) -> tuple[dict[str, float], dict[str, int]]:
    """Median step seconds and peak activation bytes of each case, interleaved."""

    def step(context: Context) -> None:
        model.zero_grad(set_to_none=False)  # gradients stay allocated: not activations
        with context():
            loss = model(x).float().square().mean()
        loss.backward()

    sync: Callable[[], None] = torch.cuda.synchronize if cuda else (lambda: None)
    for context in cases.values():  # warm-up: allocator caches, pinned growth, cuDNN plans
        for _ in range(2):
            step(context)
    times: dict[str, list[float]] = {name: [] for name in cases}
    peaks: dict[str, int] = dict.fromkeys(cases, 0)
    names = list(cases)
    for index in range(rounds):
        for name in names if index % 2 == 0 else names[::-1]:
            sync()
            base = torch.cuda.memory_allocated() if cuda else 0
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            step(cases[name])
            sync()
            times[name].append(time.perf_counter() - start)
            if cuda:
                peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated() - base)
        progress.tick(f"offload: round {index + 1}/{rounds}")
    return {name: statistics.median(v) for name, v in times.items()}, peaks


def run(quick: bool = False, device: str = "cuda", progress: Progress | None = None) -> list[Row]:
    """The figures on ``device``; ``[]`` for a CUDA device where no GPU is usable.

    On ``cpu`` / ``emulated`` only step times of the small workloads are reported, for
    orientation: there is no separate device memory to save, and the copies compete with
    compute for the same cores.
    """
    cuda = device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        return []
    progress = progress or Progress.quiet()
    pool = sm.BufferPool(device)
    torch_device = device if cuda else "cpu"
    cases = _cases(pool, cuda)
    rows: list[Row] = []
    rounds = 5 if quick else 15
    for label, (make, shape) in workloads(quick or not cuda).items():
        progress.say(f"offload: {label} ...")
        torch.manual_seed(0)
        model = make().to(torch_device)
        x = torch.randn(shape, device=torch_device)
        times, peaks = _measure(model, x, cases, rounds, cuda, progress)
        grows = pool.stats()["num_grows"]
        _measure(model, x, {"save_on_pool": cases["save_on_pool"]}, 2, cuda, progress)
        host_grows = pool.stats()["num_grows"] - grows
        rows += _rows(label, device, times, peaks, pool, host_grows, cuda)
        del model, x
    return rows


def _rows(
    label: str,
    device: str,
    times: dict[str, float],
    peaks: dict[str, int],
    pool: sm.BufferPool,
    host_grows: int,
    cuda: bool,
) -> list[Row]:
    pooled, plain, soc = times["save_on_pool"], times["none"], times["save_on_cpu"]
    rows: list[Row] = []
    if cuda:
        device_bytes = pool.stats()["device_reserved_bytes"]
        mine = peaks["save_on_pool"] + device_bytes
        rows += [
            row(
                f"{label} activation memory, save_on_pool / none",
                mine,
                "bytes",
                baseline=peaks["none"],
                target="<= 0.30x",
                ok=mine <= 0.30 * peaks["none"],
            ),
            row(
                f"{label} activation memory, save_on_cpu / none",
                peaks["save_on_cpu"],
                "bytes",
                baseline=peaks["none"],
            ),
        ]
    rows += [
        row(
            f"{label} step time, save_on_pool / none ({device})",
            pooled,
            "s",
            baseline=plain,
            target="<= 1.15x" if cuda else "orientation",
            ok=pooled <= 1.15 * plain if cuda else None,
        ),
        row(
            f"{label} step time, save_on_pool / save_on_cpu ({device})",
            pooled,
            "s",
            baseline=soc,
            target="< 1.00x" if cuda else "orientation",
            ok=pooled < soc if cuda else None,
        ),
        row(
            f"{label} step time, save_on_cpu / none ({device})",
            soc,
            "s",
            baseline=plain,
        ),
        row(
            f"{label} host buffer grows after warm-up",
            host_grows,
            "",
            target="== 0",
            ok=host_grows == 0,
        ),
    ]
    return rows


def main(argv: list[str] | None = None) -> list[Row]:
    return script_main(
        __doc__, run, "activation offload on {device} (median step)", argv, device="cuda"
    )


if __name__ == "__main__":
    main()
