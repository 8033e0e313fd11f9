"""The process's memory beyond eager: what a pooled step costs the process as a whole.

A step's own peak (the allocator's events) leaves out what the pool's machinery keeps: traced
graphs, plans and recordings, the compiled router, the modules PyTorch's tracing imports. This
benchmark runs the same training loop in fresh processes, one per way in, and reads each
process's resident memory (``VmRSS``, and its high-water mark ``VmHWM``) after a warm-up and
at the end. The figure a user can check against ``top``: the pooled process's resident memory
beyond eager's, as a share of eager's.

The workload is a newcomer's transformer: ``nn.TransformerEncoder`` of 2 blocks (width 256, 4
heads, feed-forward 1024), batch 8, sequence 128, AdamW, PyTorch's default loop
(``zero_grad()`` sets the gradients to ``None``). Each process builds the model from the same
seed; the losses are compared bit for bit.

    python benchmarks/bench_resident.py           # 30 steps after a 5-step warm-up
    python benchmarks/bench_resident.py --quick   # 10 steps after 3
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Progress, Row, child_json, row, script_main

WAYS = ("eager", "pool.step", "pooled_train_step")
TARGET = 0.10  # DESIGN §7: beyond eager after warm-up, at most 10% of eager's resident memory

CHILD = r"""
import json, sys, torch
import sharedmem as sm

def resident() -> dict:
    fields = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) * 1024
    return fields

way, warmup, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
layer = torch.nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True)
model = torch.nn.Sequential(torch.nn.TransformerEncoder(layer, 2), torch.nn.Linear(256, 1000))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = [(torch.randn(8, 128, 256), torch.randint(0, 1000, (8, 128))) for _ in range(4)]

def loss_fn(out, y):
    return torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())

pool = sm.BufferPool("cpu")
if way == "pooled_train_step":
    step = sm.pooled_train_step(model, loss_fn, pool=pool)
elif way == "pool.step":
    def step(x, y):
        with pool.step("train", x, y):
            loss = loss_fn(model(x), y)
            loss.backward()
        return loss
else:
    def step(x, y):
        loss = loss_fn(model(x), y)
        loss.backward()
        return loss

losses = []
after_warmup = None
for i in range(warmup + steps):
    x, y = data[i % len(data)]
    opt.zero_grad()
    losses.append(float(step(x, y)))
    opt.step()
    if i + 1 == warmup:
        after_warmup = resident()
print(json.dumps({"warm": after_warmup, "end": resident(), "losses": losses,
                  "pool_reserved": pool.stats()["reserved_bytes"]}))
"""


def run_one(way: str, warmup: int, steps: int) -> dict[str, Any]:
    return child_json(
        ["-c", CHILD, way, str(warmup), str(steps)], f"bench_resident: the {way} process"
    )


def run(quick: bool = False, device: str = "cpu", progress: Progress | None = None) -> list[Row]:
    """Each way in, in a fresh process: resident memory at the end, beyond eager's."""
    if device != "cpu":
        return []  # the processes' resident memory is host memory: CPU only
    warmup, steps = (3, 10) if quick else (5, 30)
    results = {}
    for way in WAYS:
        if progress is not None:
            progress.say(f"{way} ({warmup} + {steps} steps, a fresh process) ...")
        results[way] = run_one(way, warmup, steps)
    eager = results["eager"]["end"]["VmRSS"]
    rows = [row("eager: resident memory after warm-up and the steps", eager, "bytes")]
    for way in WAYS[1:]:
        r = results[way]
        beyond = r["end"]["VmRSS"] - eager
        rows.append(
            row(
                f"{way}: resident beyond eager",
                max(beyond, 0),
                "bytes",
                baseline=eager,
                target=f"<= {TARGET:.2f}x eager's resident",
                ok=beyond <= TARGET * eager,
            )
        )
        same = r["losses"] == results["eager"]["losses"]
        rows.append(row(f"{way}: losses bit for bit eager's", float(same), "", ok=same))
    return rows


def main(argv: list[str] | None = None) -> list[Row]:
    return script_main(__doc__, run, "resident memory beyond eager on {device}", argv)


if __name__ == "__main__":
    main()
