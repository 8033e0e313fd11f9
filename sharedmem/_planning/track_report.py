"""The tracker's record of a phase (``PhaseMemory``) and its report: per-phase tables, and
what the first step's phases added, in words.

The words answer the questions ``torch.cuda.memory_stats`` leaves open about a loop: what
the forward keeps, why the highest total rose at the loss, what backward holds beyond the
saved tensors, and what the extra memory after the first optimizer step is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .._pool.report import human_bytes
from .estimate import CATEGORIES

__all__ = ["PhaseMemory", "format_report"]


@dataclass(frozen=True)
class PhaseMemory:
    """One phase of a tracked loop, in bytes by category (``sm.estimate``'s ``CATEGORIES``).

    Every storage is counted once (views share it), by what it is: a parameter or buffer of
    the model, a ``.grad``, a tensor of ``optimizer.state``, an input (given to the model, or
    made before the forward and read by the loss), an activation (held by autograd for
    backward), else a temporary.

    Attributes:
        name: ``zero_grad``, ``forward``, ``loss``, ``backward``, ``step`` (found), a name
            given to ``MemoryTracker.phase``, or ``other``: between phases, where something
            was made or freed (a batch loaded, a result dropped).
        step: how many optimizer steps (without an optimizer: backward passes) had ended when
            the phase began.
        before: what was live when it began.
        live: what was live when it ended.
        peak: what was live at the moment the phase's total was highest.
    """

    name: str
    step: int
    before: dict[str, int]
    live: dict[str, int]
    peak: dict[str, int]

    @property
    def before_total(self) -> int:
        return sum(self.before.values())

    @property
    def live_total(self) -> int:
        return sum(self.live.values())

    @property
    def peak_total(self) -> int:
        return sum(self.peak.values())


_HEADINGS = ("params", "grads", "optim", "inputs", "saved", "temps")
_LEGEND = (
    "params: parameters and buffers; grads: .grad; optim: optimizer state; inputs: given to "
    "the model or read by the loss;\n  saved: activations autograd holds for backward; "
    "temps: everything else (results alive now, gradients on their way back)"
)
_SHOWN_STEPS = 2  # the first steps in full (the first differs), then the last one


def format_report(phases: Sequence[PhaseMemory], device: str) -> str:
    """The tables and the answers for ``phases`` (in order) recorded on ``device``."""
    lines = [f"memory by phase on {device}: each storage once, by what it is"]
    if not phases:
        return "\n".join([*lines, "  (no phase was recorded)"])
    # The last step with a phase of its own (what follows its end is shown with it).
    last = max((p.step for p in phases if p.name != "other"), default=phases[-1].step)
    shown = [p for p in phases if p.step < _SHOWN_STEPS or p.step >= last]
    lines += ["", "live at each phase's end:"]
    lines += _table(shown, "change", [(p.live, p.live_total - p.before_total) for p in shown])
    lines += ["", "at each phase's peak (the highest total during it):"]
    lines += _table(shown, "vs start", [(p.peak, p.peak_total - p.before_total) for p in shown])
    hidden = len(phases) - len(shown)
    if hidden:
        lines.append(f"  ({hidden} phases of steps {_SHOWN_STEPS}..{last - 1} not shown)")
    lines += ["", f"  {_LEGEND}", "", "the first step:"]
    lines += [f"  - {sentence}" for sentence in _answers(phases)]
    return "\n".join(lines)


def _table(
    phases: Sequence[PhaseMemory], change: str, figures: list[tuple[dict[str, int], int]]
) -> list[str]:
    head = f"  {'step':>4} {'phase':<12}{'total':>11}{change:>11}"
    rows = [head + "".join(f"{h:>11}" for h in _HEADINGS)]
    for phase, (by_category, delta) in zip(phases, figures, strict=True):
        cells = "".join(f"{human_bytes(by_category[c]):>11}" for c in CATEGORIES)
        total = f"{human_bytes(sum(by_category.values())):>11}{_signed(delta):>11}"
        rows.append(f"  {phase.step:>4} {phase.name[:12]:<12}{total}{cells}")
    return rows


def _signed(n: int) -> str:
    return ("+" if n > 0 else "-" if n < 0 else "") + human_bytes(abs(n))


def _answers(phases: Sequence[PhaseMemory]) -> list[str]:
    first = {}
    highest_before: dict[str, int] = {}
    highest = 0
    for phase in phases:
        if phase.name not in first:
            first[phase.name] = phase
            highest_before[phase.name] = highest
        highest = max(highest, phase.peak_total)
    answers = []
    forward = first.get("forward")
    if forward is not None:
        answers.append(
            f"forward: keeps {human_bytes(forward.live['activations'])} of activations for "
            f"backward; it peaked {human_bytes(forward.peak_total - forward.before_total)} "
            "above its start"
        )
    loss = first.get("loss")
    if loss is not None:
        before = highest_before["loss"]
        grew = {c: loss.peak[c] - loss.before[c] for c in ("activations", "temporaries")}
        made = (
            f"at its peak, on top of what the forward left: {_signed(grew['activations'])} "
            f"saved for backward by the loss, {_signed(grew['temporaries'])} temporaries"
        )
        if loss.peak_total > before:
            answers.append(
                f"loss: the highest total (max allocated) rose from {human_bytes(before)} to "
                f"{human_bytes(loss.peak_total)}; {made}"
            )
        else:
            answers.append(f"loss: the highest total did not rise ({made})")
    backward = first.get("backward")
    if backward is not None:
        start, top = backward.before, backward.peak
        rose = {c: _signed(top[c] - start[c]) for c in ("gradients", "temporaries")}
        answers.append(
            f"backward: peaked {human_bytes(backward.peak_total - backward.before_total)} above "
            f"its start; beyond the saved tensors, at the peak: temporaries "
            f"{rose['temporaries']} (gradients on their way back, partial sums included), "
            f".grad {rose['gradients']}; saved tensors went from "
            f"{human_bytes(start['activations'])} to {human_bytes(top['activations'])} at the "
            f"peak and {human_bytes(backward.live['activations'])} at the end"
        )
    steps = [p for p in phases if p.name == "step"]
    if steps:
        added = [p.live["optimizer_state"] - p.before["optimizer_state"] for p in steps]
        first_step = steps[0]
        params = first_step.live["parameters"] or 1
        answers.append(
            f"optimizer step: the first left "
            f"{_signed(first_step.live_total - first_step.before_total)} live; its new state "
            f"is {human_bytes(added[0])} ({added[0] / params:.2f}x the parameters)"
            + (f"; a later step's state grew {_signed(max(added[1:]))}" if len(steps) > 1 else "")
        )
    return answers or ["no forward, loss, backward or optimizer step was found"]
