"""The model sweep: every zoo model (``zoo.py``) through the pooled train step and eager.

Per model: whether the pooled step's loss and gradients equal eager's bit for bit, the peak
memory of one train step eager and pooled, and the estimate's error against each. Memory is
measured as DESIGN §8 says: the peak of the running sum of the allocator's events over one
step (``sm.testing.allocator_peak``), relative to what was live at its start (parameters and
inputs), plus the pool's ``reserved_bytes`` for the pooled step; gradients are set to
``None`` before each measured step. The estimate's figures are its train-step peaks less the
parameters and inputs (``sm.estimate`` without an optimizer), so that both sides count what
the step itself adds. Error = (estimate - measured) / measured: negative is an under-estimate.

Targets (DESIGN §7 and issue 25): zero crashes, every model bit-exact, pooled peak <= 1.0x
eager, the estimate within 3% (eager) and 2% (pooled) of measured and never under by more
than 1%.

    python benchmarks/bench_zoo.py [--models NAME,...] [--zoos torch,timm,...] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import zoo

import sharedmem as sm
from sharedmem.testing import allocator_peak

__all__ = ["Result", "measure", "sweep"]


@dataclass
class Result:
    """One model's figures (bytes), or why it has none (``crash``)."""

    name: str
    zoo: str
    bit_exact: bool = False
    eager_peak: int = 0
    pooled_peak: int = 0
    estimate_eager: int = 0
    estimate_pooled: int = 0
    seconds: float = 0.0
    crash: str = ""

    @property
    def ratio(self) -> float:
        return self.pooled_peak / self.eager_peak if self.eager_peak else float("nan")

    @property
    def eager_error(self) -> float:
        return self.estimate_eager / self.eager_peak - 1 if self.eager_peak else float("nan")

    @property
    def pooled_error(self) -> float:
        return self.estimate_pooled / self.pooled_peak - 1 if self.pooled_peak else float("nan")


def _call(model: nn.Module, inputs: Any) -> Any:
    if type(inputs) is tuple:
        return model(*inputs)
    if isinstance(inputs, dict):
        return model(**inputs)
    return model(inputs)


def _eager_step(model: nn.Module, inputs: Any, targets: Any, loss_fn: Any) -> Callable[[], Any]:
    def step() -> Any:
        out = _call(model, inputs)
        loss = out.loss if loss_fn is None else loss_fn(out, targets)
        loss.backward()
        return loss.detach()

    return step


def measure(entry: zoo.Model) -> Result:
    """Build ``entry`` twice (same weights), run both ways, and measure."""
    result = Result(entry.name, entry.zoo)
    started = time.perf_counter()
    torch.manual_seed(0)
    eager, inputs, targets, loss_fn = entry.build()
    pooled, *_ = entry.build()
    pooled.load_state_dict(eager.state_dict())
    eager.train()
    pooled.train()
    pool = sm.BufferPool("cpu")
    step = sm.pooled_train_step(pooled, loss_fn, pool=pool)
    run_eager = _eager_step(eager, inputs, targets, loss_fn)

    def run_pooled() -> torch.Tensor:
        return step(inputs) if loss_fn is None else step(inputs, targets)

    def zero() -> None:
        eager.zero_grad(set_to_none=True)
        pooled.zero_grad(set_to_none=True)

    # Bit for bit: the same random draws (dropout) on both sides.
    zero()
    torch.manual_seed(1)
    expected = run_eager()
    torch.manual_seed(1)
    loss = run_pooled()
    result.bit_exact = torch.equal(loss, expected) and all(
        (a.grad is None) == (b.grad is None) and (a.grad is None or torch.equal(a.grad, b.grad))
        for a, b in zip(eager.parameters(), pooled.parameters(), strict=True)
    )
    zero()
    result.eager_peak = allocator_peak(run_eager)
    zero()
    run_pooled()  # the steady state: buffers grown, nothing to trace
    zero()
    peak = allocator_peak(run_pooled)
    result.pooled_peak = peak + pool.stats()["reserved_bytes"]
    fresh, *_ = entry.build()
    fresh.load_state_dict(eager.state_dict())
    est = sm.estimate(fresh, inputs, targets, loss_fn=loss_fn)
    static = est.train_bytes["parameters"] + est.train_bytes["inputs"]
    result.estimate_eager = est.train_peak_eager - static
    result.estimate_pooled = est.train_peak_pooled - static
    result.seconds = time.perf_counter() - started
    return result


def sweep(models: list[zoo.Model], say: Callable[[str], None] = lambda line: None) -> list[Result]:
    """Measure every model; a model that raises is a ``Result`` with ``crash`` set."""
    results = []
    for entry in models:
        say(f"bench_zoo: {entry.name} ...")
        try:
            results.append(measure(entry))
        except Exception as error:  # a crash is a finding: record it and go on
            last = traceback.format_exception_only(error)[-1].strip()
            results.append(Result(entry.name, entry.zoo, crash=last))
        say(table(results[-1:]).splitlines()[1])
    return results


def table(results: list[Result]) -> str:
    head = (
        f"{'model':<28}{'exact':>6}{'eager peak':>14}{'pooled peak':>14}{'ratio':>7}"
        f"{'est eager':>11}{'est pooled':>11}"
    )
    rows = [head]
    for r in results:
        if r.crash:
            rows.append(f"{r.name:<28}  CRASH {r.crash}")
            continue
        rows.append(
            f"{r.name:<28}{'yes' if r.bit_exact else 'NO':>6}{r.eager_peak:>14,}"
            f"{r.pooled_peak:>14,}{r.ratio:>7.3f}{r.eager_error:>+11.1%}{r.pooled_error:>+11.1%}"
        )
    ran = [r for r in results if not r.crash]
    if ran:
        within = sum(-0.01 <= r.eager_error <= 0.03 for r in ran)
        within_pooled = sum(-0.01 <= r.pooled_error <= 0.02 for r in ran)
        rows.append(
            f"{len(results)} models, {len(results) - len(ran)} crashed, "
            f"{sum(r.bit_exact for r in ran)} bit-exact, "
            f"{sum(r.ratio <= 1.0 for r in ran)} pooled <= eager; estimate within target: "
            f"eager {within}, pooled {within_pooled} (of {len(ran)})"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", help="comma-separated model names (default: all)")
    parser.add_argument("--zoos", help="comma-separated zoos: torchvision,timm,transformers,torch")
    parser.add_argument("--json", help="also write the figures as JSON to this file")
    args = parser.parse_args(argv)
    models = zoo.zoo(tuple(args.zoos.split(",")) if args.zoos else None)
    for name, why in zoo.skipped().items():
        print(f"bench_zoo: skipping the {name} zoo: {why}", file=sys.stderr)
    if args.models:
        wanted = set(args.models.split(","))
        models = [m for m in models if m.name in wanted]
    results = sweep(models, say=lambda line: print(line, file=sys.stderr, flush=True))
    print(table(results))
    if args.json:
        payload = [
            {**asdict(r), "ratio": r.ratio, "eager_error": r.eager_error,
             "pooled_error": r.pooled_error}
            for r in results
        ]  # fmt: skip
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    failed = any(r.crash or not r.bit_exact for r in results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
