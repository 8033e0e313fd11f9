"""A budget (or a fixed chunk count) on a pooled step of an FSDP2 model: the step's
``budget_policy`` (``_executor.fsdp_step.ShardedPolicy``).

Per signature it chooses, before running, how many chunks the batch runs in and which FSDP
units' forwards are checkpointed, from the sharded estimate (``sharded.sharded_train``) of one
chunk, run on fake tensors over the model as it is sharded (each parameter at its full shape,
FSDP2's hooks set aside while it runs: the estimate adds FSDP2's buffers itself). Chunks
first, the fewest that fit (1, 2, 4, ... up to the batch's examples); where chunks alone do
not reach the budget, every leaf unit's forward checkpointed, with the fewest chunks that then
fit. Chunks before the last skip FSDP2's gradient sync, so FSDP2 keeps every unit's unsharded
gradient from the first chunk's backward to the last's: a choice of several chunks adds those
bytes (the model's unsharded gradients, an upper bound) to the chunk's estimate.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .._errors import OutOfMemoryError
from .._executor.fsdp import fsdp_modules
from .._executor.fsdp_step import ShardedChoice, ShardedTrainStep, checkpointing, leaf_units
from .._pool.report import human_bytes
from .budget import budget_bytes, check_budget
from .chunking import Chunk, Splitter, reduction_of
from .fit import signature
from .live import round_for
from .sharded import sharded_train

__all__ = ["ShardedBudget", "sharded_train_step", "without_fsdp_hooks"]

# A choice as one number the ranks can reduce (the larger, the more frugal in the search's
# order: chunks first, then checkpointing with chunks): checkpointed * _CHUNKS + chunks.
_CHUNKS = 1 << 20
_FAILED = 1 << 40


class _Failed(ShardedChoice):
    """The least a rank's search found, none fitting its budget."""


def _ordinal(choice: ShardedChoice) -> int:
    if isinstance(choice, _Failed):
        return _FAILED
    return (_CHUNKS if choice.checkpointed else 0) + choice.chunks


@contextlib.contextmanager
def without_fsdp_hooks(model: nn.Module) -> Iterator[None]:
    """While inside, calling ``model`` runs no FSDP2 forward hook (no all-gather): what the
    estimate needs to run the model's forward on fake tensors. Every hook is back on the way
    out, in its order."""
    saved: list[tuple[dict[int, Any], dict[int, Any]]] = []
    for _, module in fsdp_modules(model):
        state = module._get_fsdp_state()  # type: ignore[operator]
        ids = {
            h.id
            for h in (state._pre_forward_hook_handle, state._post_forward_hook_handle)
            if h is not None
        }
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            saved.append((hooks, dict(hooks)))
            for key in ids & set(hooks):
                del hooks[key]
    try:
        yield
    finally:
        for hooks, before in saved:
            hooks.clear()
            hooks.update(before)


class ShardedBudget:
    """The chunks and checkpointed units of an FSDP2 step, per signature (see the module).

    Args:
        step: the step it chooses for.
        budget: bytes, a size or ``"free"`` (``None`` with a fixed count).
        chunks: a fixed chunk count (``None``: chosen by the budget).
        reduction: ``"mean"`` or ``"sum"`` where the loss does not say.
        splitter: how a batch is split.
    """

    def __init__(
        self,
        step: ShardedTrainStep,
        *,
        budget: object,
        chunks: int | None,
        reduction: object,
        splitter: Splitter,
    ) -> None:
        self.step = step
        self.budget: int | str | None = check_budget(budget, chunks)
        self.fixed = chunks
        self.splitter = splitter
        self.reduction, _ = reduction_of(step.loss_fn, reduction)
        self._choices: dict[tuple[object, ...], ShardedChoice] = {}
        self._labels: dict[str, ShardedChoice] = {}
        mesh = step._groups[0].mesh_info if step._groups else None
        self._world = torch.distributed.get_world_size() if mesh is None else mesh.shard_mesh_size
        self._group = None if mesh is None else mesh.shard_process_group
        params = list(step.model.parameters())
        self._device = params[0].device if params else torch.device("cpu")
        self._units = [p for p, _ in fsdp_modules(step.model) if p] + [""]
        self._leaves = leaf_units(step.model)
        rounding = round_for(str(self._device))
        # Every trainable parameter's unsharded gradient: what FSDP2 keeps between chunks.
        self._held = sum(rounding(p.numel() * p.element_size()) for p in params if p.requires_grad)

    @property
    def weighs(self) -> bool:
        return self.reduction == "mean" or self.splitter.user_split is not None

    @property
    def chosen(self) -> dict[str, int]:
        return {label: c.chunks for label, c in self._labels.items()}

    def budget_bytes(self) -> int | None:
        if self.budget is None:
            return None
        return budget_bytes(self.budget, self._device, self.step.pool)

    def split(self, inputs: object, targets: object, chunks: int) -> list[Chunk]:
        return self.splitter.split(inputs, targets, chunks)

    def choose(self, inputs: object, targets: object) -> ShardedChoice:
        key = signature(inputs, targets)
        choice = self._choices.get(key)
        if choice is None:
            examples = self.splitter.examples(inputs, targets)
            if self.fixed is not None:
                choice = self._agreed(inputs, targets, ShardedChoice(min(self.fixed, examples)))
            else:
                choice = self._agreed(inputs, targets, self._search(inputs, targets, examples))
            self._choices[key] = choice
            label = " ".join(
                str(tuple(t.shape))
                for t in torch.utils._pytree.tree_leaves((inputs, targets))
                if isinstance(t, torch.Tensor)
            )
            self._labels[label] = choice
        return choice

    def _search(self, inputs: object, targets: object, examples: int) -> ShardedChoice:
        budget = self.budget_bytes()
        assert budget is not None
        counts = [1]
        while counts[-1] * 2 < examples:
            counts.append(counts[-1] * 2)
        if examples > 1:
            counts.append(examples)
        least: ShardedChoice | None = None
        for checkpointed in ((), tuple(self._leaves)):
            if checkpointed == () or self._leaves:
                for chunks in counts:
                    peak = self.estimate(inputs, targets, chunks, checkpointed)
                    choice = ShardedChoice(chunks, checkpointed, peak)
                    if peak <= budget:
                        return choice
                    if least is None or peak < (least.estimated_peak or 0):
                        least = choice
        assert least is not None
        return _Failed(least.chunks, least.checkpointed, least.estimated_peak)

    def _agreed(self, inputs: object, targets: object, choice: ShardedChoice) -> ShardedChoice:
        """The one choice every rank of the mesh runs (each forward and backward gathers
        collectively, so all must run the same chunks): the most frugal of the ranks' own
        choices (their budgets, or batches, may differ), checked against this rank's budget;
        where one rank cannot fit, every rank refuses before running."""
        ordinal = self._most(_ordinal(choice))
        if ordinal < _FAILED and ordinal != _ordinal(choice):  # another rank's choice
            checkpointed = tuple(self._leaves) if ordinal >= _CHUNKS else ()
            choice = ShardedChoice(ordinal % _CHUNKS, checkpointed)
            budget = self.budget_bytes()
            if budget is not None:
                peak = self.estimate(inputs, targets, choice.chunks, checkpointed)
                fits = peak <= budget
                choice = (ShardedChoice if fits else _Failed)(choice.chunks, checkpointed, peak)
        if self.budget is not None and ordinal < _FAILED:  # does it fit every rank?
            ordinal = self._most(_ordinal(choice) if isinstance(choice, _Failed) else ordinal)
        if ordinal >= _FAILED:
            self._refuse(choice)
        return choice

    def _most(self, value: int) -> int:
        """The largest of every rank's ``value``."""
        reduced = torch.tensor([value], dtype=torch.int64)
        torch.distributed.all_reduce(reduced, torch.distributed.ReduceOp.MAX, group=self._group)
        return int(reduced.item())

    def _refuse(self, least: ShardedChoice) -> None:
        budget = self.budget_bytes() or 0
        if not isinstance(least, _Failed) or least.estimated_peak is None:
            raise OutOfMemoryError(
                0, 0, budget, str(self._device),
                summary=(
                    f"sharedmem: out of memory on {self._device} before running: another rank "
                    "of the mesh cannot fit this FSDP2 step in its budget (each runs the same "
                    "chunks). Nothing ran. To go on: give every rank the same budget, raise it, "
                    "or shrink an example"
                ),
            )  # fmt: skip
        chunks = f"{least.chunks} chunk{'s' if least.chunks > 1 else ''}"
        summary = (
            f"sharedmem: out of memory on {self._device} before running: this FSDP2 step "
            f"needs {human_bytes(least.estimated_peak)} per rank at the least ("
            f"{chunks}"
            + (", every leaf unit's forward checkpointed" if least.checkpointed else "")
            + f"), more than the budget of {human_bytes(budget)}. Nothing ran. To go on: "
            "raise the budget, shard over more ranks, or shrink an example"
        )
        raise OutOfMemoryError(least.estimated_peak, 0, budget, str(self._device), summary=summary)

    def estimate(
        self, inputs: object, targets: object, chunks: int, checkpointed: tuple[str, ...]
    ) -> int:
        """The sharded estimate of the step's per-rank peak in ``chunks`` chunks with the
        forwards of ``checkpointed`` computed again: one chunk's forward and backward (the
        biggest), plus, with several chunks, the unsharded gradients kept between them."""
        part = self.splitter.split(inputs, targets, chunks)[0] if chunks > 1 else None
        x, y = (inputs, targets) if part is None else (part.inputs, part.targets)
        model = self.step.model
        with without_fsdp_hooks(model), checkpointing(model, checkpointed):
            train = sharded_train(
                model, x, y, self.step.loss_fn, None, round_for(str(self._device)),
                world_size=self._world, units=self._units, gloo=self._device.type == "cpu",
            )  # fmt: skip
        return train.forward_backward + (self._held if chunks > 1 else 0)

    def report_lines(self) -> list[str]:
        head = f"budget {self.budget!r}" if self.fixed is None else f"fixed {self.fixed} chunks"
        rows = [f"chunks per batch signature ({head}):"]
        for label, c in self._labels.items():
            line = f"  {label:<48}{c.chunks:>6}"
            if c.checkpointed:
                line += f", {len(c.checkpointed)} units checkpointed"
            if c.estimated_peak is not None:
                line += f" (estimated {c.estimated_peak:,} bytes per rank)"
            rows.append(line)
        return rows


def sharded_train_step(
    model: nn.Module,
    loss_fn: Any,
    *,
    pool: Any,
    plan: str,
    prefix: str,
    policy: Any,
) -> ShardedTrainStep:
    """``sm.pooled_train_step`` on an FSDP2 model (``policy``: its checked ``budget=``,
    ``chunks=`` and ``recompute=``); what it cannot honour is refused before anything runs."""
    if policy.recompute is not None:
        raise ValueError(
            "sharedmem: recompute= chooses what a traced step computes again, and an FSDP2 "
            "model's step runs eagerly (its hooks gather and reduce): leave it out and give "
            "budget=, which checkpoints the FSDP units' forwards where chunks cannot reach it"
        )
    if plan != "liveness":
        raise ValueError(
            f"sharedmem: plan={plan!r} places a traced step's intermediates, and an FSDP2 "
            "model's step runs eagerly, served from the arena as recorded: leave plan= out"
        )
    step = ShardedTrainStep(model, loss_fn, pool, prefix)
    if policy.budgeted:
        chunking = policy.chunking
        step.budget_policy = ShardedBudget(
            step,
            budget=policy.budget,
            chunks=policy.fixed,
            reduction=chunking.reduction,
            splitter=chunking.splitter,
        )
    return step
