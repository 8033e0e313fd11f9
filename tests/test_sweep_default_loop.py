"""The default-loop sweep's verdicts (benchmarks/sweep_default_loop.py) on calls made up here:
which calls it holds to issue 33's targets, in bytes, and which it only reports."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import harness
import sweep_default_loop as sweep
import torch
from torch import nn

import sharedmem as sm
from sharedmem._routing import native
from sharedmem._routing.plan import ALIGN


def _call(state: str, eager: int, pooled: int, served: float) -> dict[str, Any]:
    return {"state": state, "eager": eager, "pooled": pooled, "peak": pooled / eager,
            "served": served}  # fmt: skip


def test_a_page_of_slack_is_judged_in_bytes_and_evaluation_calls_are_only_reported() -> None:
    big = 10**9  # a ratio of 1.000004 rounds to 1.000, a page and one byte above still misses
    calls = [
        _call("none", big, big + 4097, 0.50),  # first call of its state: its share not judged
        _call("none", big, big + 4096, 1.0),
        _call("present", 1000, 900, 0.10),  # first of its state
        _call("present", 1000, 1000, 0.985),
        _call("eval", 1000, 9000, 0.0),  # far above eager: reported, never a miss
        _call("none", big, big, 0.995),
    ]
    s = sweep.summarize({"exact": True, "calls": calls})
    assert [(c["call"], c["excess"]) for c in s["over"]] == [(0, 4097)]
    assert s["worst"]["call"] == 0 and s["worst"]["state"] == "none"
    assert s["served_none"] == {"min": 0.995, "median": 0.9975, "calls": 2}
    assert s["served_present"] == {"min": 0.985, "median": 0.985, "calls": 1}
    assert s["eval"]["worst"]["excess"] == 8000
    missed = sweep.misses("m", "pool.step", s)
    assert [m[2] for m in missed] == ["peak <= eager + 4096 B", "served present >= 99%"]
    assert "#0 none +4,097 B" in missed[0][3]


def test_a_result_that_is_not_bit_exact_or_has_no_steady_call_is_a_miss() -> None:
    s = sweep.summarize({"exact": False, "calls": [_call("none", 100, 100, 1.0)]})
    assert [m[2] for m in sweep.misses("m", "pooled_train_step", s)] == [
        "bit-exact",
        "served none >= 99%",
        "served present >= 99%",
    ]


@pytest.mark.skipif(native() is None, reason="the routing allocator did not build")
def test_held_gradients_count_the_whole_arena_units_they_fence() -> None:
    # A call's pooled peak leaves out what tensors of earlier calls hold in the arena at its
    # start (eager holds the same tensors outside its measure). Every arena address is on the
    # planner's 64-byte grid, so a held gradient of 140 bytes fences 192: that is what counts
    # (the requested bytes left the padding counted as the call's own).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))  # 140, 28, 84, 12 B
    pool = sm.BufferPool("cpu")
    x, y = torch.randn(4, 5), torch.randn(4, 3)
    seen = []
    for _ in range(4):
        model.zero_grad(set_to_none=True)
        with pool.step("train", x, y, params=model):
            nn.functional.mse_loss(model(x), y).backward()
        base, top = pool.arenas.base("act.0"), pool.stats()["reserved_bytes"]
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        inside = [g.nbytes for g in grads if base is not None and base <= g.data_ptr() < base + top]
        units = sum(-(-n // ALIGN) * ALIGN for n in inside)
        assert harness.arena_held(pool) == units, (inside, units)
        seen += inside
    assert seen and any(n % ALIGN for n in seen)  # the gradients were in the arena, padded
