"""Peak memory of one train step: the pooled executor against eager, on a set of real shapes.

The measure of DESIGN §8: the peak of the running sum of the allocator's events over one step
(``torch.profiler`` with ``profile_memory=True``, its memory timeline in order), relative to what
was live at the step's start, plus, for the pooled step, the pool's ``reserved_bytes``. Each
model is measured with gradients set to ``None`` first, then with the gradients the last call
made, zeroed in place (as gradient accumulation holds them), then with gradients replaced by
fresh tensors (``GRADS``). Models (``step_models``): a ResNet-style CNN, a depthwise
MobileNet-style CNN, an MLP, a small transformer encoder, and GPT-2, BERT and Llama from
``transformers`` where it is installed, all at small sizes (CPU, float32).
The full run (not ``--quick``) also measures ``torch.compile(model)``'s step the same way
(tens of seconds of compiling per model on 2 CPU cores).

Targets (DESIGN §7): pooled peak <= 1.0x eager (and a page, as the sweep judges) on every
model in every gradient state, median <= 0.85x (gradients ``None``); step time (gradients set
to ``None`` each step, interleaved, median) <= 1.0x eager over the set. A pooled call's
figure leaves out what tensors of earlier calls hold in the arena (the gradients present), as
eager's leaves them out as live at the call's start.

    python benchmarks/bench_step_memory.py [--quick] [--device cpu] [--json PATH]
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Progress, Row, arena_held, interleaved, row, script_main, smoke_models
from step_models import CASES, Case
from sweep_default_loop import PAGE  # a call may be a page over eager's, as the sweep judges

import sharedmem as sm
from sharedmem.testing import allocator_peak

# The gradients' state before each measured call: set to ``None`` (PyTorch's default loop);
# present, those the last call made, zeroed in place (``zero_grad(set_to_none=False)``, and
# as gradient accumulation holds them); replaced by fresh tensors the user made
# (``p.grad = torch.zeros_like(p)``), beside the arena that held the ``None`` state's.
GRADS = ("none", "present", "replaced")


def _compiled_peak(case: Case, batch: int) -> int | None:
    """The same train step through ``torch.compile(model)`` (gradients set to ``None``), after
    two warm-up steps; ``None`` where it does not compile."""
    _, make, data, loss_fn = case
    torch.manual_seed(0)
    model = make()
    compiled = torch.compile(model)
    x, y = data(batch)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        loss_fn(compiled(x), y).backward()

    try:
        step()
        step()
    except Exception:  # a model Inductor cannot compile here: no figure, said in the table
        return None
    model.zero_grad(set_to_none=True)
    return allocator_peak(lambda: loss_fn(compiled(x), y).backward())


def _figures(case: Case, batch: int, device: str, rounds: int, number: int) -> dict[str, float]:
    _, make, data, loss_fn = case
    torch.manual_seed(0)
    eager = make()
    pooled = make()
    pooled.load_state_dict(eager.state_dict())
    x, y = data(batch)
    pool = sm.BufferPool(device)
    step = sm.pooled_train_step(pooled, loss_fn, pool=pool)

    def eager_step() -> None:
        loss_fn(eager(x), y).backward()

    def set_grads(grads: str) -> None:
        for model in (eager, pooled):
            model.zero_grad(set_to_none=grads == "none")
            if grads == "replaced":
                for p in model.parameters():
                    p.grad = torch.zeros_like(p)

    figures: dict[str, float] = {}
    for grads in GRADS:
        set_grads(grads)
        step(x, y)  # with gradients present the step adds into them: its own graph, traced here
        eager_step()
        set_grads(grads)
        figures[f"eager {grads}"] = allocator_peak(eager_step)
        # Less what tensors of earlier calls hold in the arena (the gradients present): eager
        # holds the same outside its measure, as live at the call's start.
        held = arena_held(pool)
        peak = allocator_peak(lambda: step(x, y))
        figures[f"pooled {grads}"] = peak + pool.stats()["reserved_bytes"] - held

    def timed(run: Callable[[], object], model: nn.Module) -> Callable[[], None]:
        def one() -> None:
            model.zero_grad(set_to_none=True)
            run()

        return one

    times = interleaved(
        {"eager": timed(eager_step, eager), "pooled": timed(lambda: step(x, y), pooled)},
        rounds=rounds,
        number=number,
    )
    figures["eager time"], figures["pooled time"] = times["eager"], times["pooled"]
    return figures


def run(quick: bool = False, device: str = "cpu", progress: Progress | None = None) -> list[Row]:
    if device.startswith("cuda"):
        return [row("step memory (cuda)", 0, "", target="CPU only for now: skipped", ok=None)]
    batch = 8 if quick else 32
    rows, ratios, speeds = [], [], []
    # torch.compile takes tens of seconds per model on 2 CPU cores: the full run only.
    compile_too = not quick and device == "cpu"
    beats = compared = 0
    names = smoke_models(tuple(case[0] for case in CASES), "mlp")
    for case in (case for case in CASES if case[0] in names):
        if progress is not None:
            progress.say(f"step memory: {case[0]} at batch {batch}")
        figures = _figures(case, batch, device, rounds=5 if quick else 15, number=2 if quick else 3)
        for grads in GRADS:
            eager, pooled = figures[f"eager {grads}"], figures[f"pooled {grads}"]
            ratio = pooled / eager
            if grads == "none":
                ratios.append(ratio)
            rows.append(
                row(
                    f"{case[0]} peak, grads {grads} ({device})",
                    pooled,
                    "B",
                    baseline=eager,
                    target="<= 1.0x eager + a page",
                    ok=pooled <= eager + PAGE,
                )
            )
        if compile_too:
            if progress is not None:
                progress.say(f"step memory: {case[0]} through torch.compile")
            compiled = _compiled_peak(case, batch)
            pooled = figures["pooled none"]
            if compiled is not None:
                beats += pooled <= compiled
                compared += 1
            rows.append(
                row(
                    f"{case[0]} pooled peak vs torch.compile's ({device})",
                    pooled,
                    "B",
                    baseline=compiled or 0,
                    target="did not compile" if compiled is None else "",
                )
            )
        speeds.append(figures["pooled time"] / figures["eager time"])
        rows.append(
            row(
                f"{case[0]} step time ({device})",
                figures["pooled time"] * 1e3,
                "ms",
                baseline=figures["eager time"] * 1e3,
            )
        )
    median = statistics.median(ratios)
    rows.append(row("median pooled/eager peak", median, "x", target="<= 0.85x", ok=median <= 0.85))
    speed = statistics.median(speeds)
    rows.append(row("median pooled/eager step time", speed, "x", target="<= 1.0x", ok=speed <= 1.0))
    if compile_too:
        rows.append(
            row(
                "models where pooled <= torch.compile",
                beats,
                f"of {compared}",
                target=">= half",
                ok=2 * beats >= compared,
            )
        )
    return rows


if __name__ == "__main__":
    script_main(__doc__, run, "train step peak memory on {device}")
