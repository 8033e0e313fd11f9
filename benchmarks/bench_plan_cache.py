"""What a pool keeps per signature: a small MLP's train step through ``pool.step()``, each
call with a new batch size, against the same code without the pool, each in a fresh process.

Per mode: the process's resident memory (``/proc/self/statm``) after a warm-up and after the
calls, the growth between them, and for the pooled run the pool's figures (reserved bytes,
``cached_plans``, ``evicted_plans``). The pool keeps at most ``sm.PLAN_CACHE_SIZE`` block
signatures' plans and recordings, least recently used dropped, so the growth stays bounded
however many signatures a run meets. oneDNN's cache of kernels per shape is turned off in both
processes (``ONEDNN_PRIMITIVE_CACHE_CAPACITY=0``): it is PyTorch's own, grows alike in both
modes (about +0.8 MB a batch size with it on) and would hide what the pool keeps.

    python benchmarks/bench_plan_cache.py            # 600 calls, batch sizes 1..600
    python benchmarks/bench_plan_cache.py 2000       # 2000 calls
"""

from __future__ import annotations

import gc
import json
import os
import sys

import torch
from harness import child_json
from torch import nn


def _rss() -> int:
    gc.collect()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _child(mode: str, calls: int) -> dict[str, int]:
    import sharedmem as sm

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 10))
    pool = sm.BufferPool("cpu")

    def step(batch: int) -> None:
        x = torch.randn(batch, 64)
        model.zero_grad()  # PyTorch's default: gradients set to None
        if mode == "pooled":
            with pool.step("train", x):
                model(x).square().sum().backward()
        else:
            model(x).square().sum().backward()

    for _ in range(3):  # warm-up: the router built and loaded, torch's kernels touched
        step(calls + 1)
    before = _rss()
    for batch in range(1, calls + 1):  # every call a new signature
        step(batch)
    after = _rss()
    out = {"rss_before": before, "rss_after": after, "growth": after - before}
    if mode == "pooled":
        stats = pool.stats()
        out |= {k: stats.get(k, 0) for k in ("reserved_bytes", "cached_plans", "evicted_plans")}
    return out


def measure(calls: int) -> dict[str, dict[str, int]]:
    """Each mode in a fresh process, so neither's memory counts in the other's."""
    return {
        mode: child_json(
            [__file__, "--child", mode, str(calls)],
            f"bench_plan_cache: the {mode} process",
            ONEDNN_PRIMITIVE_CACHE_CAPACITY="0",
        )
        for mode in ("eager", "pooled")
    }


def main(argv: list[str]) -> None:
    if argv[:1] == ["--child"]:
        print(json.dumps(_child(argv[1], int(argv[2]))))
        return
    calls = int(argv[0]) if argv else 600
    result = measure(calls)
    mb = 1e6
    for mode, figures in result.items():
        extra = ""
        if mode == "pooled":
            extra = (
                f", pool reserved {figures['reserved_bytes'] / mb:.1f} MB, cached_plans "
                f"{figures['cached_plans']}, evicted_plans {figures['evicted_plans']}"
            )
        print(
            f"{mode:7} {calls} calls, a new batch size each: resident "
            f"{figures['rss_before'] / mb:.1f} -> {figures['rss_after'] / mb:.1f} MB, "
            f"growth {figures['growth'] / mb:+.1f} MB{extra}"
        )
    over = (result["pooled"]["growth"] - result["eager"]["growth"]) / mb
    print(f"pooled growth beyond eager's: {over:+.1f} MB (target: at most +10 MB)")


if __name__ == "__main__":
    main(sys.argv[1:])
