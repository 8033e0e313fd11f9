"""Where an accumulation call frees each gradient it makes, predicted against measured.

``pool.step(..., params=...)`` plans a block's first call with gradients present from the
block's recording with them ``None`` (``sharedmem._pool.blocks.accumulating``): the same
allocations, each new gradient added into the held one and freed. This runs a zoo model's
default loop through ``pool.step()`` (``none`` x2, then one accumulation call) and compares,
for every gradient the prediction frees, how many allocations the call made while it lived:
predicted by the fixed guess (``accumulating`` without notes: the third allocation after it)
and by the prediction the call was planned by (the recording call's notes of where the engine
stored each gradient), against the accumulation call's own recording. ``early`` is the
harmful miss: the plan puts a later allocation in bytes the gradient still holds.

    python benchmarks/accumulation_frees.py [NAME ...]    # default: ResNet-18, GPT-2

(The zoo is optional: run with its packages on ``PYTHONPATH``; see ``benchmarks/zoo.py``.)
"""

from __future__ import annotations

import bisect
import difflib
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: F401  (its import quiets Kineto's per-profile log lines)
from bench_default_loop import build
from bench_routing import _call, _loss

import sharedmem as sm
from sharedmem._pool.blocks import accumulating
from sharedmem._routing import Recording


def _ordered(recording: Recording) -> Recording:
    order = sorted(range(len(recording.sizes)), key=recording.alloc_at.__getitem__)
    return Recording(
        [recording.sizes[i] for i in order],
        [recording.alloc_at[i] for i in order],
        [recording.free_at[i] for i in order],
    )


def _lived(recording: Recording, i: int) -> int:
    """Allocations made while the ``i``-th allocation (in order) lived."""
    return bisect.bisect_left(recording.alloc_at, recording.free_at[i]) - i - 1


def verdicts(made: Recording, predicted: Recording, real: Recording) -> Counter[str]:
    """Per gradient ``predicted`` frees (it outlived ``made``): exact, early or late against
    ``real``, matched allocation for allocation by size (the engine's copies in ``made``
    may be missing from ``real``). All three in allocation order."""
    matcher = difflib.SequenceMatcher(None, list(predicted.sizes), list(real.sizes), False)
    pairs = {b.a + k: b.b + k for b in matcher.get_matching_blocks() for k in range(b.size)}
    counts: Counter[str] = Counter()
    for i, j in pairs.items():
        if made.free_at[i] < 0 and predicted.free_at[i] >= 0 and real.free_at[j] >= 0:
            guess, truth = _lived(predicted, i), _lived(real, j)
            counts["exact" if guess == truth else "early" if guess < truth else "late"] += 1
    return counts


def run(name: str) -> tuple[Counter[str], Counter[str]]:
    """The fixed guess's and the notes' verdicts on ``name``'s first accumulation call."""
    model, inputs, targets, loss_fn = build(name)
    model.train()
    pool = sm.BufferPool("cpu")

    def train() -> None:
        with pool.step("train", inputs, targets, params=model):
            _loss(_call(model, inputs), targets, loss_fn).backward()

    for _ in range(2):
        model.zero_grad(set_to_none=True)
        train()
    train()  # the first call with the gradients present
    routes = pool._blocks.routes()
    route_made = next(r for k, r in routes.items() if not any(k[3]))
    first = next(r for k, r in routes.items() if any(k[3]))
    assert route_made.recording is not None and first.recording is not None
    assert first.predicted is not None  # the notes' prediction, which the call was planned by
    made = Counter(p.numel() * p.element_size() for p in model.parameters() if p.grad is not None)
    recorded = _ordered(route_made.recording)
    real = _ordered(first.recording)
    guessed = _ordered(accumulating(route_made.recording, made))
    noted = _ordered(first.predicted)
    return verdicts(recorded, guessed, real), verdicts(recorded, noted, real)


def main(names: list[str]) -> None:
    torch.manual_seed(0)
    print(f"{'model':28}{'fixed guess':>22}{'noted':>22}   (exact / early / late)")
    for name in names or ["tv_resnet18", "hf_gpt2"]:
        guess, noted = run(name)
        cells = [f"{c['exact']} / {c['early']} / {c['late']}" for c in (guess, noted)]
        print(f"{name:28}{cells[0]:>22}{cells[1]:>22}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
