"""A pooled train step needs no more memory than eager, gradients present or not.

Measured as DESIGN §8 says: the peak of the allocator's events over one step, relative to
what was live when it began, plus the pool's reserved bytes; eager runs the same model side
by side. The pooled step plans every byte of the step on one timeline (the arena and what
runs beside it), and with gradients already present adds into them inside the graph.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import sharedmem as sm
from sharedmem.testing import allocator_peak


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 10))  # fmt: skip


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    )  # fmt: skip


def encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    return nn.Sequential(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
                         nn.Flatten(), nn.Linear(32 * 12, 10))  # fmt: skip


class Downsample(nn.Module):
    """ConvNeXt's downsampling: a layer norm over channels (channels last), then a 2x2
    convolution with stride 2, whose weight gradient comes out channels-last: ``p.grad`` gets
    it in the weight's layout, as autograd's ``AccumulateGrad`` copies it."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 32, 4, stride=4)
        self.norm = nn.LayerNorm(32)
        self.down = nn.Conv2d(32, 256, 2, stride=2)
        self.head = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.stem(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return self.head(self.down(x).mean((2, 3)))


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor]]] = {
    "mlp": (mlp, lambda: torch.randn(16, 64)),
    "cnn": (cnn, lambda: torch.randn(8, 3, 16, 16)),
    "encoder": (encoder, lambda: torch.randn(8, 12, 32)),
    "downsample": (Downsample, lambda: torch.randn(2, 3, 32, 32)),
}


@pytest.mark.parametrize("grads", ["none", "present", "replaced"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_the_pooled_step_peaks_at_most_at_eagers(name: str, grads: str) -> None:
    # "present": fresh gradients before every call; "replaced": the default loop's first call
    # (it makes the gradients in the arena), then fresh ones the user made before each call,
    # its first in that state measured too: the arena's room for the gradients they replaced
    # is given back, not kept beside them.
    make, data = CASES[name]
    torch.manual_seed(0)
    eager = make()
    pooled = copy.deepcopy(eager)
    x, y = data(), torch.randint(0, 10, (data().shape[0],))
    pool = sm.BufferPool("cpu")
    step = sm.pooled_train_step(pooled, F.cross_entropy, pool=pool)

    def eager_step() -> None:
        F.cross_entropy(eager(x), y).backward()

    def set_grads(fresh: bool) -> None:
        for model in (eager, pooled):
            model.zero_grad(set_to_none=True)
            if fresh:
                for p in model.parameters():
                    p.grad = torch.zeros_like(p)

    set_grads(grads == "present")
    step(x, y)  # traced and planned: the steady state is measured
    eager_step()
    for _ in range(2 if grads == "replaced" else 1):  # the state's first call, then steady
        set_grads(grads != "none")
        want = allocator_peak(eager_step)
        got = allocator_peak(lambda: step(x, y)) + pool.stats()["reserved_bytes"]
        # The arena is reserved in whole granules (pages): at most one more than the bytes.
        assert got <= want + pool.granularity, (name, grads, got, want)
        for p, q in zip(eager.parameters(), pooled.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), "gradients bit for bit"
            assert p.grad.stride() == q.grad.stride(), "and in eager's layout"


def test_gradients_added_in_the_graph_equal_eagers_accumulation() -> None:
    torch.manual_seed(0)
    eager, pooled = cnn(), cnn()
    pooled.load_state_dict(eager.state_dict())
    step = sm.pooled_train_step(pooled, F.cross_entropy, pool=sm.BufferPool("cpu"))
    for micro in range(3):  # the first with no gradients, then two added into them
        x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
        F.cross_entropy(eager(x), y).backward()
        step(x, y)
        for p, q in zip(eager.parameters(), pooled.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), micro
    grads = [p.grad for p in pooled.parameters()]
    step(x, y)
    assert all(p.grad is g for p, g in zip(pooled.parameters(), grads, strict=True)), (
        "added in place, as AccumulateGrad does"
    )
    summaries = [str(s) for s in step.plan_summaries()]
    assert len(summaries) == 2 and "adding into existing gradients" in summaries[1]


def test_a_frozen_parameter_with_a_stale_gradient_keeps_it() -> None:
    torch.manual_seed(0)
    model = mlp()
    frozen = model[0].weight
    frozen.requires_grad_(False)
    frozen.grad = torch.ones_like(frozen)
    step = sm.pooled_train_step(model, F.cross_entropy, pool=sm.BufferPool("cpu"))
    step(torch.randn(4, 64), torch.randint(0, 10, (4,)))
    step(torch.randn(4, 64), torch.randint(0, 10, (4,)))
    assert torch.equal(frozen.grad, torch.ones_like(frozen))  # as eager: untouched


def test_gradients_are_added_into_when_the_call_has_no_tensors() -> None:
    class Bias(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(3))

        def forward(self) -> torch.Tensor:  # step((), None): no arguments at all
            return self.w * 2

    model = Bias()
    eager = copy.deepcopy(model)
    step = sm.pooled_train_step(model, lambda out, y: out.sum(), pool=sm.BufferPool("cpu"))
    for _ in range(3):  # the second and third add into existing gradients
        step((), None)
        eager().sum().backward()
    assert torch.equal(model.w.grad, eager.w.grad)
