"""Gradient accumulation with a ResNet-style CNN: the same gradients as eager, in less memory.

A large effective batch as several micro-batches, each a forward and backward that adds into
``p.grad``, then one optimizer step: the plainest way to train a batch that does not fit. The
pooled step runs each micro-batch from one planned timeline (the arena and what runs beside
it), recomputes the ReLU outputs after its batch norms where backward reads them instead of
keeping them, and adds each gradient into ``p.grad`` right where backward makes it. This
script runs both side by side, measures each micro-batch's peak the way DESIGN §8 does (the
allocator's events, plus the pool's reserved bytes), and checks the gradients bit for bit.

    python examples/accumulate_in_less_memory.py --micro-batches 4 --batch 16
"""

from __future__ import annotations

import argparse
import copy
import functools

import torch
from torch import nn
from torch.nn import functional as F

import sharedmem as sm
from sharedmem.testing import allocator_peak


class Block(nn.Module):
    """A ResNet basic block."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.skip = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                      nn.BatchNorm2d(cout))  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.skip(x))


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
        Block(32, 32, 1), Block(32, 64, 2), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(64, 10),
    )  # fmt: skip


def eager_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    F.cross_entropy(model(x), y).backward()  # adds into p.grad, as accumulation wants


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16, help="examples per micro-batch")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    eager = make_model()
    pooled = copy.deepcopy(eager)
    pool = sm.BufferPool("cpu")
    step = sm.pooled_train_step(pooled, F.cross_entropy, pool=pool)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.05, momentum=0.9)
    opt_p = torch.optim.SGD(pooled.parameters(), lr=0.05, momentum=0.9)
    data = [
        (torch.randn(args.batch, 3, 32, 32), torch.randint(0, 10, (args.batch,)))
        for _ in range(args.micro_batches)
    ]
    step(*data[0])  # trace and plan both signatures first: the steady state is measured
    step(*data[0])
    pooled.zero_grad(set_to_none=True)
    peaks: list[tuple[int, int]] = []
    for k, (x, y) in enumerate(data):
        eager_peak = allocator_peak(functools.partial(eager_step, eager, x, y))
        reserved = pool.stats()["reserved_bytes"]
        pooled_peak = allocator_peak(functools.partial(step, x, y)) + reserved
        peaks.append((eager_peak, pooled_peak))
        print(f"micro-batch {k}: eager {eager_peak / 2**20:6.2f} MiB, pooled "
              f"{pooled_peak / 2**20:6.2f} MiB ({pooled_peak / eager_peak:.2f}x)")  # fmt: skip
    same = all(
        torch.equal(p.grad, q.grad)
        for p, q in zip(eager.parameters(), pooled.parameters(), strict=True)
    )
    print(f"accumulated gradients bit for bit equal to eager's: {same}")
    for summary in step.plan_summaries():
        print(summary)
    opt_e.step()
    opt_p.step()
    return {"peaks": peaks, "same_gradients": same, "summaries": step.plan_summaries()}


if __name__ == "__main__":
    main()
