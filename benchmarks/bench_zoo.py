"""The model sweep: every zoo model (``zoo.py``) through the pooled train step and eager.

Per model: whether the pooled step's loss and gradients equal eager's bit for bit, the peak
memory of one train step eager and pooled, and the estimate's error against each. Memory is
measured as DESIGN §8 says: the peak of the running sum of the allocator's events over one
step (``sm.testing.allocator_peak``), relative to what was live at its start (parameters and
inputs), plus the pool's ``reserved_bytes`` for the pooled step; gradients are set to
``None`` before each measured step. The floor is a peak no placement of the pooled call's
allocations goes below (``Recording.floor``: what outlives the call, gradients mostly, beside
the largest allocation made with it), against eager's. The estimate's figures are its
train-step peaks less the parameters and inputs (``sm.estimate`` without an optimizer), so
that both sides count what the step itself adds. Error = (estimate - measured) / measured:
negative is an under-estimate.

Targets (DESIGN §7 and issues 24, 25): zero crashes, every model bit-exact, pooled peak <=
1.0x eager (median <= 0.85x), the estimate within 3% (eager) and 2% (pooled) of measured
and never under by more than 1%.

    python benchmarks/bench_zoo.py [--quick] [--json PATH]     (--quick: recurrent and
                                                               transformers models only)
"""

from __future__ import annotations

import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import zoo
from harness import Progress, Row, row, script_main

import sharedmem as sm
from sharedmem.testing import allocator_peak

__all__ = ["Result", "measure", "medians", "run", "sweep"]


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
    floor: int = 0  # what outlives the pooled call beside the largest allocation made with it
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
    result.floor = max(
        (c.route.recording.floor() for c in step._cache.values() if c.route and c.route.recording),
        default=0,
    )
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


def medians(ran: list[Result]) -> tuple[float, float]:
    """The median pooled / eager peak of the models that ran, and their median floor."""
    return (
        statistics.median(r.ratio for r in ran),
        statistics.median(r.floor / r.eager_peak for r in ran),
    )


def table(results: list[Result]) -> str:
    head = (
        f"{'model':<28}{'exact':>6}{'eager peak':>14}{'pooled peak':>14}{'ratio':>7}"
        f"{'floor':>7}{'est eager':>11}{'est pooled':>11}"
    )
    rows = [head]
    for r in results:
        if r.crash:
            rows.append(f"{r.name:<28}  CRASH {r.crash}")
            continue
        rows.append(
            f"{r.name:<28}{'yes' if r.bit_exact else 'NO':>6}{r.eager_peak:>14,}"
            f"{r.pooled_peak:>14,}{r.ratio:>7.3f}{r.floor / r.eager_peak:>7.3f}"
            f"{r.eager_error:>+11.1%}{r.pooled_error:>+11.1%}"
        )
    ran = [r for r in results if not r.crash]
    if ran:
        within = sum(-0.01 <= r.eager_error <= 0.03 for r in ran)
        within_pooled = sum(-0.01 <= r.pooled_error <= 0.02 for r in ran)
        median, floor = medians(ran)
        rows.append(
            f"{len(results)} models, {len(results) - len(ran)} crashed, "
            f"{sum(r.bit_exact for r in ran)} bit-exact, "
            f"{sum(r.ratio <= 1.0 for r in ran)} pooled <= eager; estimate within target: "
            f"eager {within}, pooled {within_pooled} (of {len(ran)}); median ratio "
            f"{median:.3f}, median floor {floor:.3f}"
        )
    return "\n".join(rows)


def run(quick: bool = False, device: str = "cpu", progress: Progress | None = None) -> list[Row]:
    """The sweep as rows: per model its peaks (pooled against eager) and the estimate's
    errors; ``quick`` measures the recurrent and transformers models only (the small ones)."""
    if device != "cpu":
        return [row("model sweep", 0, "", target="CPU only (allocator events): skipped")]
    models = zoo.zoo(("torch", "transformers") if quick else None)
    say = progress.say if progress is not None else (lambda line: None)
    for name, why in zoo.skipped().items():
        say(f"skipping the {name} zoo: {why}")
    results = sweep(models, say=say)
    print(table(results), file=sys.stderr)
    rows = []
    for r in results:
        if r.crash:
            rows.append(row(f"{r.name}: crashed", 0, "", target=r.crash[:60], ok=False))
            continue
        rows.append(row(f"{r.name}: bit-exact", float(r.bit_exact), "", ok=r.bit_exact))
        rows.append(
            row(
                f"{r.name}: pooled peak",
                r.pooled_peak,
                "B",
                baseline=r.eager_peak,
                target="<= 1.0x eager",
                ok=r.ratio <= 1.0,
            )
        )
        for what, error, most in (
            ("eager", r.eager_error, 0.03),
            ("pooled", r.pooled_error, 0.02),
        ):
            rows.append(
                row(
                    f"{r.name}: {what} estimate error",
                    100 * error,
                    "%",
                    target=f"-1% .. +{most:.0%}",
                    ok=-0.01 <= error <= most,
                )
            )
    ran = [r for r in results if not r.crash]
    if ran:
        median, floor = medians(ran)
        rows.append(
            row("median pooled / eager peak", median, "x", target="<= 0.85x", ok=median <= 0.85)
        )
        rows.append(row("median floor / eager peak", floor, "x", target="what placement can reach"))
    return rows


if __name__ == "__main__":
    script_main(__doc__, run, "model sweep on {device}")
