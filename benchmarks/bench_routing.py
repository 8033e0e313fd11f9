"""A whole train step served from the pool: ``pool.step()`` around each zoo model's own
forward and backward (no tracing), against the same code without it, side by side.

Per model and per gradient state at the step's start (``None``, as after
``zero_grad()``; present, as after ``zero_grad(set_to_none=False)`` or during accumulation):

- the share of the step's allocation bytes served from the arena (the router's counts; what
  outlives the step, the gradients made with ``None`` and the loss, counts on both sides);
- the step's peak, pooled / eager: the allocator's events (DESIGN §8), plus the pool's reserved
  bytes for the pooled step; and the excess in bytes, pooled less eager (the target: at most
  one page, 4,096 B);
- the arena against the max-live lower bound of what it serves;
- whether the gradients are bit for bit eager's;
- step time, pooled / eager (interleaved medians).

    python benchmarks/bench_routing.py                # every model the installed zoos build
    python benchmarks/bench_routing.py resnet18 gpt2  # only these
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from zoo import skipped, zoo

import sharedmem as sm
from sharedmem.testing import allocator_peak


def _call(model: torch.nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, tuple):
        return model(*inputs)
    if isinstance(inputs, dict):
        return model(**inputs)
    return model(inputs)


def _loss(out: Any, targets: Any, loss_fn: Callable[..., torch.Tensor] | None) -> torch.Tensor:
    if loss_fn is not None:
        return loss_fn(out, targets)
    loss = out.loss if hasattr(out, "loss") else out["loss"]
    assert isinstance(loss, torch.Tensor)
    return loss


def measure(name: str, build: Callable[[], Any], present: bool, reps: int = 7) -> dict[str, Any]:
    torch.manual_seed(0)
    model, inputs, targets, loss_fn = build()
    model.train()
    pool = sm.BufferPool("cpu")

    def eager() -> None:
        _loss(_call(model, inputs), targets, loss_fn).backward()

    def pooled() -> None:
        with pool.step("train", inputs, targets):
            eager()

    def fresh() -> None:
        model.zero_grad(set_to_none=not present)

    for run in (eager, pooled, eager, pooled, pooled):  # warm up; the pool records
        fresh()
        run()
    fresh()
    torch.manual_seed(1)  # the same dropout masks for both
    eager_peak = allocator_peak(eager)
    expected = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    fresh()
    torch.manual_seed(1)
    pooled_peak = allocator_peak(pooled) + pool.stats()["reserved_bytes"]
    exact = all(
        (a is None and p.grad is None) or (a is not None and torch.equal(a, p.grad))
        for a, p in zip(expected, model.parameters(), strict=True)
    )
    (route,) = pool._blocks.routes().values()
    times: dict[str, list[float]] = {"eager": [], "pooled": []}
    for _ in range(reps):
        for label, run in (("eager", eager), ("pooled", pooled)):
            fresh()
            start = time.perf_counter()
            run()
            times[label].append(time.perf_counter() - start)
    assert route.plan is not None and route.recording is not None
    allocated = route.recording.total_bytes
    served = route.last.get("served_bytes", 0)  # of the last call, not a profiled one
    return {
        "model": name,
        "grads": "present" if present else "None",
        "served": served / allocated if allocated else 1.0,
        "peak": pooled_peak / eager_peak,
        "excess": pooled_peak - eager_peak,
        "arena_over_max_live": route.plan.need / route.plan.lower_bound - 1
        if route.plan.lower_bound
        else 0.0,
        "exact": exact,
        "time": statistics.median(times["pooled"]) / statistics.median(times["eager"]),
    }


def main(names: list[str]) -> None:
    models = [m for m in zoo() if not names or m.name in names]
    for zoo_name, why in skipped().items():
        print(f"skipped {zoo_name}: {why}")
    print(f"{'model':28} {'grads':8} {'served':>7} {'peak':>6} {'excess B':>10} "
          f"{'arena/max-live':>15} {'exact':>6} {'time':>6}")  # fmt: skip
    rows = []
    for entry in models:
        for present in (False, True):
            try:
                row = measure(entry.name, entry.build, present)
            except Exception as error:  # one model's failure is a line, not the end of the run
                print(f"{entry.name:28} failed: {type(error).__name__}: {error}")
                continue
            rows.append(row)
            print(
                f"{row['model']:28} {row['grads']:8} {row['served']:7.1%} {row['peak']:6.3f} "
                f"{row['excess']:+10d} {row['arena_over_max_live']:+15.1%} "
                f"{row['exact']!s:>6} {row['time']:6.3f}",
                flush=True,
            )
    for grads in ("None", "present"):
        chosen = [r for r in rows if r["grads"] == grads]
        if chosen:
            print(
                f"grads {grads}: served median {statistics.median(r['served'] for r in chosen):.1%}"
                f" (min {min(r['served'] for r in chosen):.1%}), peak median "
                f"{statistics.median(r['peak'] for r in chosen):.3f} (max "
                f"{max(r['peak'] for r in chosen):.3f}, most "
                f"{max(r['excess'] for r in chosen):+,} B), time median "
                f"{statistics.median(r['time'] for r in chosen):.3f}, "
                f"{sum(r['exact'] for r in chosen)}/{len(chosen)} bit-exact"
            )


if __name__ == "__main__":
    main(sys.argv[1:])
