"""Where a default-loop step's bytes go, and what planning the outliving ones would give.

PyTorch's default loop sets gradients to ``None`` before each step (``zero_grad()``), so
backward makes every gradient anew, and the gradients (and the loss) outlive the step. Today's
plan leaves what outlives a step to PyTorch's allocator; at the step's busiest tick (backward,
where gradients are made while activations are still live) an arena holding the activations
would then sit beside the gradients, above eager's peak, so the planner serves little or
nothing. This script records one steady call of ``pool.step()`` per model and reports, from
that recording (no run of the proposal; the figures are the planner's):

- bytes per call: dying (activations, temporaries) and outliving (gradients, loss);
- served today: the share of the call's bytes the router served in that call, and the
  call's peak (arena + beside) over eager's (the recording's max-live);
- planned with the outliving allocations in the arena (each held from its allocation to the
  call's end, fenced after it until the user frees it): the share the planner would serve
  and the peak it would reach, over eager's.

    python benchmarks/bench_outliving.py
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

import sharedmem as sm
from sharedmem._routing import Recording, choose_plan


def _cnn() -> tuple[nn.Module, Callable[[], tuple[torch.Tensor, ...]]]:
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(inplace=True),
        nn.Conv2d(16, 16, 3, padding=1),
        nn.GELU(),
        nn.Flatten(),
        nn.Linear(16 * 32 * 32, 10),
    )
    return model, lambda: (torch.randn(16, 3, 32, 32),)


def _mlp() -> tuple[nn.Module, Callable[[], tuple[torch.Tensor, ...]]]:
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU())
    return model, lambda: (torch.randn(64, 256),)


def _transformer() -> tuple[nn.Module, Callable[[], tuple[torch.Tensor, ...]]]:
    layer = nn.TransformerEncoderLayer(128, 4, 256, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    return model, lambda: (torch.randn(8, 64, 128),)


def _with_outliving_held_to_the_end(rec: Recording) -> Recording:
    end = 1 + max([*rec.alloc_at, *rec.free_at])
    return Recording(rec.sizes, rec.alloc_at, [f if f >= 0 else end for f in rec.free_at])


def measure(
    name: str, build: Callable[[], tuple[nn.Module, Callable[[], tuple[torch.Tensor, ...]]]]
) -> str:
    torch.manual_seed(0)
    model, inputs = build()
    pool = sm.BufferPool("cpu")
    args = inputs()
    for _ in range(4):  # the default loop: gradients set to None before each step
        model.zero_grad(set_to_none=True)
        before = pool.stats()
        with pool.step("train", *args):
            model(*args).square().sum().backward()
    (route,) = pool._blocks.routes().values()
    rec = route.recording
    assert rec is not None and route.plan is not None
    after = pool.stats()
    served = after.get("arena_served_bytes", 0) - before.get("arena_served_bytes", 0)
    eager = rec.live_peak()
    total, outliving = rec.total_bytes, rec.outliving_bytes
    today = route.plan.need + route.plan.beside_peak
    held = _with_outliving_held_to_the_end(rec)
    planned = choose_plan(held, granularity=pool.granularity)
    proposal = planned.need + planned.beside_peak
    return (
        f"{name:12} {total / 1e6:8.2f} MB/call, outliving {outliving / total:6.1%} | today: "
        f"served {served / total:6.1%}, peak {today / eager:5.3f}x eager | outliving planned: "
        f"served {planned.routed_bytes / total:6.1%}, peak {proposal / eager:5.3f}x eager "
        f"(arena {planned.need / 1e6:.2f} MB, eager peak {eager / 1e6:.2f} MB)"
    )


def main() -> None:
    for name, build in (("cnn", _cnn), ("mlp", _mlp), ("transformer", _transformer)):
        print(measure(name, build), flush=True)


if __name__ == "__main__":
    main()
