"""A train step whose sequence length changes every step: one capture for every length.

The workload is a small causal transformer LM (issue 34): embedding and learned positions,
2 pre-norm blocks (width 128, 4 heads, MLP 512, dropout 0.1), a tied head, cross-entropy;
batch 8 with the sequence length drawn from 8..128 each step, and a short batch (2) every
tenth step. Eager and ``pooled_train_step`` run the same steps on copies of one model,
interleaved step by step in one process (the same seed before each), so every loss is
compared bit for bit and drift hits both alike. Figures:

* the steady step: the median step time over the steps after the first 30, pooled against
  eager's median (target at most 1.05x);
* the captures: the seconds the pooled step spent tracing and planning graphs over the run,
  and how many graphs it traced (``stats()``: ``captures``, ``symbolic_captures``); how many
  calls recorded their sequence, and how many planned one again (``replanned_calls``);
* resident growth: each way alone in a fresh process, resident memory (``VmRSS``) at the
  end less before the first step (target: at most eager's growth + 32 MB).

    python benchmarks/bench_varlen.py           # 150 steps
    python benchmarks/bench_varlen.py --quick   # 40 steps
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Progress, Row, child_json, row, script_main

STEADY_AFTER = 30
MB = 1 << 20

CHILD = r"""
import json, statistics, sys, time, copy
import torch
from torch import nn
import torch.nn.functional as F
import sharedmem as sm

class Block(nn.Module):
    def __init__(self, width, heads, hidden, p):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))
        self.drop = nn.Dropout(p)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q = q.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        k = k.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        v = v.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / (c // self.heads) ** 0.5)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = self.drop(att.masked_fill(mask, float("-inf")).softmax(-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.mlp(self.ln2(x)))

class LM(nn.Module):
    def __init__(self, vocab=512, width=128, heads=4, hidden=512, layers=2, p=0.1, most=128):
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(most, width)
        self.blocks = nn.Sequential(*(Block(width, heads, hidden, p) for _ in range(layers)))
        self.ln = nn.LayerNorm(width)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        return self.ln(self.blocks(x)) @ self.tok.weight.t()

def loss_fn(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())

def resident():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0

ways, steps, lengths_kind = sys.argv[1].split(","), int(sys.argv[2]), sys.argv[3]
torch.manual_seed(0)
base = LM()
g = torch.Generator().manual_seed(1)
batches = []
for i in range(steps):
    if lengths_kind == "two":
        b, t = (8, 128) if i % 10 != 9 else (8, 37)
    elif lengths_kind == "batch":
        b, t = (8 if i % 10 != 9 else 3), 64
    else:
        t = int(torch.randint(8, 129, (1,), generator=g))
        b = 8 if i % 10 != 9 else 2
    idx = torch.randint(0, 512, (b, t + 1), generator=g)
    batches.append((idx[:, :-1].contiguous(), idx[:, 1:].contiguous()))

runs = {}
for way in ways:
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if way == "pooled":
        pool = sm.BufferPool("cpu")
        step = sm.pooled_train_step(model, loss_fn, pool=pool)
    else:
        pool, step = None, None
        def step(x, y, model=model):
            loss = loss_fn(model(x), y)
            loss.backward()
            return loss
    runs[way] = (model, opt, step, pool)
start = resident()
times = {way: [] for way in ways}
losses = {way: [] for way in ways}
for i, (x, y) in enumerate(batches):
    order = ways if i % 2 == 0 else ways[::-1]
    for way in order:
        model, opt, step, pool = runs[way]
        torch.manual_seed(1000 + i)
        opt.zero_grad()
        t0 = time.perf_counter()
        loss = step(x, y)
        times[way].append(time.perf_counter() - t0)
        opt.step()
        losses[way].append(loss.item())
out = {"start": start, "end": resident(), "times": times, "losses": losses}
if "pooled" in runs:
    step, pool = runs["pooled"][2], runs["pooled"][3]
    out["stats"] = pool.stats()
    out["capture_seconds"] = getattr(step, "capture_seconds", None)
    out["fallback"] = getattr(step, "shape_fallback", None)
print(json.dumps(out))
"""


def run_child(ways: str, steps: int, lengths: str) -> dict[str, Any]:
    return child_json(["-c", CHILD, ways, str(steps), lengths], f"bench_varlen: the {ways} process")


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    return (ordered[n // 2] + ordered[(n - 1) // 2]) / 2


def case(lengths: str, steps: int, progress: Progress | None, *, resident: bool) -> list[Row]:
    """One workload: ``lengths`` is ``varlen`` (8..128 and a short batch), ``two`` (the train
    length and a short last batch) or ``batch`` (a changing batch size)."""
    if progress is not None:
        progress.say(f"{lengths}: eager and pooled, interleaved ({steps} steps) ...")
    both = run_child("eager,pooled", steps, lengths)
    times = both["times"]
    steady = max(1, min(STEADY_AFTER, steps // 3))
    eager = _median(times["eager"][steady:])
    pooled = _median(times["pooled"][steady:])
    stats = both["stats"]
    same = both["losses"]["eager"] == both["losses"]["pooled"]
    rows = [
        row(f"{lengths}: eager steady step", eager, "s"),
        row(
            f"{lengths}: pooled steady step / eager's",
            pooled / eager,
            "x",
            target="<= 1.05x",
            ok=pooled / eager <= 1.05,
        ),
        row(
            f"{lengths}: seconds spent capturing over {steps} steps",
            float(both["capture_seconds"] or 0.0),
            "s",
            target="<= 15 s",
            ok=float(both["capture_seconds"] or 0.0) <= 15,
        ),
        row(f"{lengths}: graphs traced", float(stats.get("captures", 0)), ""),
        row(f"{lengths}: of them symbolic", float(stats.get("symbolic_captures", 0)), ""),
        row(f"{lengths}: calls recorded", float(stats.get("recorded_calls", 0)), ""),
        # a plan made again for a length that had one (held ranges or the arena changed); a
        # new length's first plan is the family's, derived (``shared_plans``)
        row(f"{lengths}: calls planned again", float(stats.get("replanned_calls", 0)), ""),
        row(f"{lengths}: every loss bit for bit eager's", float(same), "", ok=same),
    ]
    if resident:
        growth = {}
        for way in ("eager", "pooled"):
            if progress is not None:
                progress.say(f"{lengths}: {way} alone for resident memory ...")
            alone = run_child(way, steps, lengths)
            growth[way] = alone["end"] - alone["start"]
        rows += [
            row(f"{lengths}: eager resident growth", growth["eager"], "bytes"),
            row(
                f"{lengths}: pooled resident growth",
                growth["pooled"],
                "bytes",
                baseline=growth["eager"],
                target="<= eager's + 32 MB",
                ok=growth["pooled"] <= growth["eager"] + 32 * MB,
            ),
        ]
    return rows


def run(quick: bool = False, device: str = "cpu", progress: Progress | None = None) -> list[Row]:
    """The variable-length LM, then the train length with a short batch, then a changing
    batch size."""
    if device != "cpu":
        return []
    steps = 40 if quick else 150
    rows = case("varlen", steps, progress, resident=True)
    rows += case("two", max(20, steps // 3), progress, resident=False)
    rows += case("batch", max(20, steps // 3), progress, resident=False)
    return rows


def main(argv: list[str] | None = None) -> list[Row]:
    return script_main(__doc__, run, "variable-length train step on {device}", argv)


if __name__ == "__main__":
    main()
