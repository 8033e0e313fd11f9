"""``benchmarks/floor_bound.py``: the least any schedule of a region of same-sized pointwise ops
holds at once (what the step's floor, one op at a time, undercounts), searched by hand-made
regions and on a traced GPT-2-style MLP, and never above what a plan measures."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import floor_bound as fb

import sharedmem as sm

F = nn.functional
B = 1 << 20  # one tensor of the region


def _region(reads: dict[str, tuple[str, ...]], handed_on: set[str], made: set[str]) -> fb.Region:
    """Every op pointwise except those reading nothing of the region (its matrix products)."""
    pointwise = {n: bool(args) for n, args in reads.items()}
    return fb.Region(reads, pointwise, frozenset(handed_on), B, frozenset(made))


# GPT-2's tanh GELU (transformers' NewGELUActivation) and its backward, as autograd records them:
# x = fc(...), y = 0.5x * (1 + tanh(c * (x + 0.044715 x^3))), g = the gradient of y.
TANH_GELU = {
    "x": (), "h": ("x",), "p3": ("x",), "m13": ("p3",), "a17": ("x", "m13"), "m14": ("a17",),
    "t": ("m14",), "a18": ("t",), "y": ("h", "a18"), "g": (), "m16": ("g", "h"),
    "m17": ("g", "a18"), "tb": ("m16", "t"), "m18": ("tb",), "m19": ("m18",), "p5": ("x",),
    "m20": ("p5",), "m21": ("m19", "m20"), "a20": ("m18", "m21"), "m22": ("m17",),
    "a21": ("a20", "m22"),
}  # fmt: skip
BACKWARD = {"g", "m16", "m17", "tb", "m18", "m19", "p5", "m20", "m21", "a20", "m22", "a21"}


def test_a_fused_gelu_backward_needs_two_tensors_at_once_and_the_decomposed_one_three() -> None:
    # The floor counts one op at a time: a pointwise op written over a dying operand holds
    # two. The fused backward is one such op; the decomposed one has no order (with any
    # recomputation) in which fewer than three of its tensors are alive at some moment.
    fused = _region({"x": (), "g": (), "gb": ("g", "x")}, {"gb"}, {"g", "gb"})
    assert fb.fewest_alive(fused) == 2 * B
    decomposed = _region(TANH_GELU, {"y", "a21"}, BACKWARD)
    assert fb.fewest_alive(decomposed) == 3 * B
    # The gradients made before the backward count where a backward value is alive: the
    # three are, so the bound is both.
    assert fb.fewest_alive(decomposed, after_backward=5 * B) == 8 * B
    # Without the write over a dying operand, one more.
    plain = fb.Region(TANH_GELU, dict.fromkeys(TANH_GELU, False), frozenset({"y", "a21"}), B,
                      frozenset(BACKWARD))  # fmt: skip
    assert fb.fewest_alive(plain) == 4 * B


class TanhGeluBlock(nn.Module):
    """GPT-2's MLP: its tanh GELU written out, as transformers writes it."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h = 0.5 * h * (1.0 + torch.tanh(0.7978845608 * (h + 0.044715 * torch.pow(h, 3.0))))
        return x + self.proj(h)


def test_the_region_of_a_traced_tanh_gelu_bounds_what_its_least_memory_plan_measures() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(TanhGeluBlock(), TanhGeluBlock(), nn.Flatten(), nn.Linear(64 * 32, 10))
    x, y = torch.randn(8, 64, 32), torch.randint(0, 10, (8,))
    pool = sm.BufferPool("cpu")
    step = sm.pooled_train_step(model, F.cross_entropy, pool=pool, recompute=sm.Recompute.MOST)
    step.memory_plan(x, y)
    (traced,) = step._traced.values()
    gm = traced.gm
    seeds = [n for n in gm.graph.nodes if n.target is torch.ops.aten.tanh_backward.default]
    made = fb._made_before(gm)
    found = fb.regions(gm, seeds)
    assert len(found) == 2
    big = 8 * 64 * 128 * 4  # the MLP's width
    bounds = []
    for _, region, start in found:
        assert region.nbytes == big and len(region.reads) == len(TANH_GELU)
        assert region.handed_on and region.backward < set(region.reads)
        bounds.append(fb.fewest_alive(region, made[start]))
        assert bounds[-1] == 3 * big + made[start]
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        step(x, y)
    last = step.last_call
    assert last is not None and max(bounds) <= last.measured_peak, (bounds, last)


class InPlaceGeluBlock(TanhGeluBlock):
    """The same GELU with its tanh's argument scaled in place."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        inner = 0.7978845608 * (h + 0.044715 * torch.pow(h, 3.0))
        inner.mul_(1.0)
        return x + self.proj(0.5 * h * (1.0 + torch.tanh(inner)))


def test_a_region_with_an_in_place_write_is_refused_not_bounded() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(InPlaceGeluBlock(), nn.Flatten(), nn.Linear(64 * 32, 10))
    step = sm.pooled_train_step(model, F.cross_entropy, pool=sm.BufferPool("cpu"))
    step.memory_plan(torch.randn(8, 64, 32), torch.randint(0, 10, (8,)))
    (traced,) = step._traced.values()
    seeds = [n for n in traced.gm.graph.nodes if n.target is torch.ops.aten.tanh_backward.default]
    with pytest.raises(ValueError, match="in place: not bounded here"):
        fb.regions(traced.gm, seeds)
