"""Train an ordinary PyTorch CNN with its activations in a pool, and evaluate on the same bytes.

The model, the loss and the optimizer are plain PyTorch. ``sm.pooled_train_step`` traces the
model's forward and backward into one ATen graph and runs it with its intermediates planned
into the pool's arena (where that does not raise the step's peak); ``sm.pooled_forward`` does
the same for evaluation, fitting into the arena training left, so evaluating adds (almost)
nothing to the pool. The last batch of
each epoch is smaller, as in a real data loader: a second signature, traced once, on the same
buffers. After the first steps the pool stops growing.

    python examples/pooled_training.py --device emulated --steps 120
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import sharedmem as sm


def make_model(classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Dropout(0.2),
        nn.Linear(32 * 4 * 4, 64),
        nn.ReLU(),
        nn.Linear(64, classes),
    )


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu, emulated, cuda or cuda:N")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--plan", default="liveness", choices=["liveness", "per_node"])
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    classes = 4
    # Synthetic images: each class is a fixed pattern under heavy noise.
    patterns = torch.randn(classes, 3, 16, 16, generator=generator)
    model_device = "cpu" if args.device in ("cpu", "emulated") else args.device

    def batch(size: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.randint(0, classes, (size,), generator=generator)
        x = patterns[y] + 2.0 * torch.randn(size, 3, 16, 16, generator=generator)
        return x.to(model_device), y.to(model_device)

    model = make_model(classes).to(model_device)
    pool = sm.BufferPool(args.device)
    step = sm.pooled_train_step(model, nn.CrossEntropyLoss(), pool=pool, plan=args.plan)
    evaluate = sm.pooled_forward(model, pool=pool, plan=args.plan)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    losses: list[float] = []
    accuracy = 0.0
    train_bytes = 0
    grows_after_warmup = 0
    for i in range(args.steps):
        size = args.batch if (i + 1) % 10 else args.batch // 2 + 3  # a short last batch
        grows = pool.stats()["num_grows"]
        model.train()
        with pool.phase("train"):
            optimizer.zero_grad()
            losses.append(step(*batch(size)).item())
            optimizer.step()
        train_bytes = train_bytes or pool.stats()["reserved_bytes"]
        if (i + 1) % 20 == 0:
            model.eval()
            with pool.phase("eval"):
                x, y = batch(args.batch - 14)
                accuracy = float((evaluate(x).argmax(1) == y).float().mean())
            recent = sum(losses[-20:]) / 20
            print(f"step {i + 1:>4}  train loss {recent:.3f}  eval accuracy {accuracy:.2f}")
        if i >= 20:
            grows_after_warmup += pool.stats()["num_grows"] - grows

    phases = pool.phase_stats()
    summary = step.plan_summaries()[0]
    print(f"\n{summary}\n")
    print(pool.report())
    eval_added = phases.get("eval", {}).get("added_reserved_bytes", 0)
    print(
        f"\nevaluation added {eval_added:,} bytes to the {train_bytes:,} that the first train "
        f"step reserved; {grows_after_warmup} growths after step 20"
    )
    return {
        "first_loss": sum(losses[:10]) / 10,
        "last_loss": sum(losses[-10:]) / 10,
        "eval_accuracy": accuracy,
        "train_bytes": train_bytes,
        "eval_added_bytes": eval_added,
        "grows_after_warmup": grows_after_warmup,
        "reserved_bytes": pool.stats()["reserved_bytes"],
        "unpooled_bytes_total": pool.stats()["unpooled_bytes_total"],
        "unpooled_bytes_per_call": pool.stats()["unpooled_bytes_per_call"],
        "saving": summary.saving,
    }


if __name__ == "__main__":
    main()
