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
    python benchmarks/bench_resident.py --steps 100
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
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
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(
        [sys.executable, "-c", CHILD, way, str(warmup), str(steps)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"bench_resident: the {way} process failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    results = {}
    for way in WAYS:
        print(f"bench_resident: {way} ...", file=sys.stderr, flush=True)
        results[way] = run_one(way, args.warmup, args.steps)
    eager = results["eager"]
    print(
        f"{'way in':<20} {'RSS warm':>12} {'RSS end':>12} {'peak RSS':>12} {'beyond eager':>14}"
        f" {'share':>7} {'pool':>12}  losses"
    )
    for way in WAYS:
        r = results[way]
        beyond = r["end"]["VmRSS"] - eager["end"]["VmRSS"]
        share = beyond / eager["end"]["VmRSS"]
        same = "bit-exact" if r["losses"] == eager["losses"] else "DIFFER"
        verdict = "" if way == "eager" else ("met" if share <= TARGET else "MISSED")
        print(
            f"{way:<20} {r['warm']['VmRSS']:>12,} {r['end']['VmRSS']:>12,} "
            f"{r['end']['VmHWM']:>12,} {beyond:>14,} {share:>7.1%} {r['pool_reserved']:>12,}"
            f"  {same} {verdict}"
        )
    print(f"target: beyond eager at most {TARGET:.0%} of eager's resident memory (DESIGN §7)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
