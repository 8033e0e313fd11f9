"""Where a seq2seq model's training memory goes, phase by phase, beside the estimate.

A user porting an attention seq2seq model asked, step by step, why max-allocated rose after
the loss, what backward allocates beyond the saved tensors, and what takes the extra memory
after the first optimizer step. This trains a small GRU encoder-decoder with attention (it
learns to reverse a sequence) with Adam under ``sm.track_memory`` and prints its per-phase
table, then ``sm.estimate``'s figures for the same step, made before running, beside what
the tracker saw.

    python examples/where_memory_goes.py [--steps 6] [--batch 32] [--length 12]
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import sharedmem as sm

VOCAB = 500  # a decoder's output layer and loss are as wide as its vocabulary
USED = 32  # the tokens the data uses: learning to predict only those is a quick first gain


class Seq2Seq(nn.Module):
    """A GRU encoder, and a GRU-cell decoder that attends over the encoder's states (Luong's
    "general" score) at every target position, fed the true previous token (teacher forcing)."""

    def __init__(self, vocab: int = VOCAB, embed: int = 32, hidden: int = 64) -> None:
        super().__init__()
        self.src_embed = nn.Embedding(vocab, embed)
        self.tgt_embed = nn.Embedding(vocab, embed)
        self.encoder = nn.GRU(embed, hidden, batch_first=True)
        self.decoder = nn.GRUCell(embed + hidden, hidden)
        self.score = nn.Linear(hidden, hidden, bias=False)
        self.out = nn.Linear(2 * hidden, vocab)

    def forward(self, source: torch.Tensor, target_in: torch.Tensor) -> torch.Tensor:
        states, last = self.encoder(self.src_embed(source))  # (B, S, H), (1, B, H)
        hidden, context = last[0], torch.zeros_like(last[0])
        embedded = self.tgt_embed(target_in)
        logits = []
        for t in range(target_in.shape[1]):
            hidden = self.decoder(torch.cat([embedded[:, t], context], dim=1), hidden)
            scores = torch.bmm(states, self.score(hidden).unsqueeze(2)).squeeze(2)  # (B, S)
            weights = torch.softmax(scores, dim=1)
            context = torch.bmm(weights.unsqueeze(1), states).squeeze(1)
            logits.append(self.out(torch.cat([hidden, context], dim=1)))
        return torch.stack(logits, dim=1)  # (B, T, vocab)


def sequence_loss(logits: torch.Tensor, target_out: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target_out.reshape(-1))


def make_batch(batch: int, length: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Reverse a random sequence: token 0 starts the target, the model predicts the rest."""
    source = torch.randint(1, USED, (batch, length))
    target = source.flip(1)
    target_in = torch.cat([torch.zeros(batch, 1, dtype=torch.long), target[:, :-1]], dim=1)
    return (source, target_in), target


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=12)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = Seq2Seq()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    inputs, targets = make_batch(args.batch, args.length)
    # The estimate first: nothing is allocated to make it.
    est = sm.estimate(model, inputs, targets, loss_fn=sequence_loss, optimizer=opt)

    losses = []
    with sm.track_memory(model, opt) as tracker:
        for _ in range(args.steps):
            inputs, targets = make_batch(args.batch, args.length)
            opt.zero_grad()
            output = model(*inputs)  # held through backward, as the estimate assumes
            loss = sequence_loss(output, targets)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            del loss, output
    print(tracker.report())

    phases = tracker.phases
    # A steady step (the state exists); between phases the next batch and the last overlap.
    later = [p for p in phases if p.step == 1 and p.name != "other"]
    # Each category at its largest during the step; temporaries are the rest of the peak,
    # as in the estimate.
    tracked = {key: max(max(p.peak[key], p.live[key]) for p in later) for key in est.train_bytes}
    tracked_peak = max(p.peak_total for p in later)
    tracked["temporaries"] = tracked_peak - sum(
        n for key, n in tracked.items() if key != "temporaries"
    )
    print("\nthe estimate (made before running) beside the tracker (a steady step, step 1):")
    print(f"  {'':<20}{'estimate':>14}{'tracked':>14}")
    print(f"  {'train step peak':<20}{est.train_peak_eager:>14,}{tracked_peak:>14,}")
    for key, value in est.train_bytes.items():
        print(f"  {key:<20}{value:>14,}{tracked[key]:>14,}")
    print(f"\nloss {losses[0]:.3f} -> {losses[-1]:.3f} over {args.steps} steps")
    return {
        "phases": phases,
        "estimate": est,
        "tracked_peak": tracked_peak,
        "tracked": tracked,
        "first_loss": losses[0],
        "last_loss": losses[-1],
    }


if __name__ == "__main__":
    main()
