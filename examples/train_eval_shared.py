"""Train in float32 and evaluate in bfloat16 at twice the batch, on the same buffers.

A custom loop in the Caffe style: every activation and gradient is a named pool buffer that
the layers write with ``out=`` operations. The evaluation net asks for the same names with
another shape and dtype; a name is one memory, so evaluation at batch 256 in bfloat16 fits in
the bytes that training at batch 128 in float32 already holds, and adds nothing.

    python examples/train_eval_shared.py --device emulated --steps 100
"""

from __future__ import annotations

import argparse

import torch

import sharedmem as sm


def forward(
    pool: sm.BufferPool, w1: torch.Tensor, w2: torch.Tensor, x: torch.Tensor
) -> torch.Tensor:
    """hidden = relu(x @ w1); logits = hidden @ w2, written into the pool's buffers."""
    batch, dtype = x.shape[0], x.dtype
    hidden = pool.tensor("hidden", (batch, w1.shape[1]), dtype)
    torch.mm(x, w1.to(dtype), out=hidden)
    torch.clamp_min(hidden, 0.0, out=hidden)
    logits = pool.tensor("logits", (batch, w2.shape[1]), dtype)
    return torch.mm(hidden, w2.to(dtype), out=logits)


def train_step(
    pool: sm.BufferPool, w1: torch.Tensor, w2: torch.Tensor, x: torch.Tensor, y: torch.Tensor
) -> float:
    """One SGD step on softmax cross-entropy; gradients live in the pool too."""
    batch = x.shape[0]
    logits = forward(pool, w1, w2, x)
    dlogits = pool.tensor("logits.grad", logits.shape)
    torch.softmax(logits, 1, out=dlogits)
    loss = -float(torch.log(dlogits.gather(1, y.view(-1, 1))).mean())
    dlogits.scatter_add_(1, y.view(-1, 1), torch.full((batch, 1), -1.0)).div_(batch)
    hidden = pool.tensor("hidden", (batch, w1.shape[1]))
    dhidden = pool.tensor("hidden.grad", hidden.shape)
    torch.mm(dlogits, w2.t(), out=dhidden)
    dhidden.mul_(hidden > 0)
    w2 -= 0.1 * (hidden.t() @ dlogits)
    w1 -= 0.1 * (x.t() @ dhidden)
    return loss


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu, emulated, cuda or cuda:N")
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args(argv)

    generator = torch.Generator().manual_seed(0)
    features, hidden, classes = 64, 512, 4
    centers = torch.randn(classes, features, generator=generator) * 0.25
    w1 = torch.randn(features, hidden, generator=generator) / features**0.5
    w2 = torch.randn(hidden, classes, generator=generator) / hidden**0.5

    def batch(size: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.randint(0, classes, (size,), generator=generator)
        return centers[y] + torch.randn(size, features, generator=generator), y

    pool = sm.BufferPool(args.device)
    losses = []
    for step in range(args.steps):
        with pool.phase("train"):
            losses.append(train_step(pool, w1, w2, *batch(128)))
        if (step + 1) % 25 == 0:
            with pool.phase("eval"), torch.no_grad():
                x, y = batch(256)
                logits = forward(pool, w1, w2, x.to(torch.bfloat16))
                accuracy = float((logits.argmax(1) == y).float().mean())
            recent = sum(losses[-25:]) / 25
            print(f"step {step + 1:>4}  train loss {recent:.3f}  eval accuracy {accuracy:.3f}")

    phases = pool.phase_stats()
    train_bytes = phases["train"]["added_device_bytes"]
    eval_bytes = phases["eval"]["added_device_bytes"]
    print(pool.report())
    print(f"train net: {train_bytes:,} bytes; eval (bfloat16, twice the batch) adds {eval_bytes:,}")
    return {
        "first_loss": sum(losses[:10]) / 10,
        "last_loss": sum(losses[-10:]) / 10,
        "accuracy": accuracy,
        "train_bytes": train_bytes,
        "eval_bytes": eval_bytes,
    }


if __name__ == "__main__":
    main()
