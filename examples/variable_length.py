"""Inference over batches of changing sequence length, on buffers that stop growing.

A token classifier (embedding, a per-token MLP, mean over the sequence, a linear head) runs
over a stream of batches whose length changes every step. Each activation is one named pool
buffer: it grows to the longest batch seen and then stays put. After a warm-up batch at the
longest length there is no growth at all, and the pool holds what the largest batch needs
(the sum of per-name high-water marks), not a copy per shape.

    python examples/variable_length.py --device emulated --batches 200
"""

from __future__ import annotations

import argparse

import torch

import sharedmem as sm


class TokenClassifier:
    def __init__(self, vocab: int, dim: int, hidden: int, classes: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.embedding = torch.randn(vocab, dim, generator=g)
        self.w1 = torch.randn(dim, hidden, generator=g) / dim**0.5
        self.w2 = torch.randn(hidden, classes, generator=g) / hidden**0.5

    def __call__(self, pool: sm.BufferPool, tokens: torch.Tensor) -> torch.Tensor:
        batch, length = tokens.shape
        dim, hidden = self.w1.shape
        embedded = pool.tensor("embedded", (batch * length, dim))
        torch.index_select(self.embedding, 0, tokens.reshape(-1), out=embedded)
        h = pool.tensor("hidden", (batch * length, hidden))
        torch.mm(embedded, self.w1, out=h)
        torch.clamp_min(h, 0.0, out=h)
        pooled = pool.tensor("pooled", (batch, hidden))
        torch.mean(h.view(batch, length, hidden), 1, out=pooled)
        logits = pool.tensor("logits", (batch, self.w2.shape[1]))
        return torch.mm(pooled, self.w2, out=logits)


def main(argv: list[str] | None = None) -> dict[str, int]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu, emulated, cuda or cuda:N")
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=512)
    args = parser.parse_args(argv)

    model = TokenClassifier(vocab=1000, dim=64, hidden=256, classes=5)
    pool = sm.BufferPool(args.device)
    g = torch.Generator().manual_seed(1)
    # Warm-up: one batch at the longest length grows every buffer to its high-water mark.
    with pool.phase("warm-up"):
        model(pool, torch.randint(0, 1000, (args.batch, args.max_length), generator=g))
    allocated_by_torch = 0  # what allocating each activation per step would have asked for
    with pool.phase("stream"):
        for _ in range(args.batches):
            length = int(torch.randint(1, args.max_length + 1, (1,), generator=g))
            tokens = torch.randint(0, 1000, (args.batch, length), generator=g)
            model(pool, tokens)
            allocated_by_torch += args.batch * (length * (64 + 256) + 256 + 5) * 4

    stats, phases = pool.stats(), pool.phase_stats()
    print(pool.report())
    reserved, high_water = stats["reserved_bytes"], stats["high_water_bytes"]
    print(
        f"{args.batches} batches of length 1..{args.max_length}: "
        f"{phases['warm-up']['num_grows']} grows in warm-up, "
        f"{phases['stream']['num_grows']} after; reserved {reserved:,} bytes for high-water "
        f"marks summing to {high_water:,} ({reserved / high_water - 1:.2%} over); "
        f"allocating per step would have asked for {allocated_by_torch:,} bytes in all"
    )
    return {
        "grows_after_warmup": phases["stream"]["num_grows"],
        "reserved_bytes": stats["device_reserved_bytes"],
        "high_water_bytes": stats["high_water_bytes"],
        "allocated_by_torch": allocated_by_torch,
    }


if __name__ == "__main__":
    main()
