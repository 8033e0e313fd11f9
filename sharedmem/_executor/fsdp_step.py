"""``sm.pooled_train_step`` on an FSDP2 (``fully_shard``) model: the eager FSDP2 step, served
from the pool.

A traced step runs its own generated code, so FSDP2's hooks (all-gathers before each unit's
forward and backward, reduce-scatters after its backward) would never fire. An FSDP2 model's
step therefore runs as eager FSDP2 runs it, inside ``pool.step()`` (``prepare_fsdp``, done once
when the step is made): every allocation of the step's thread, FSDP2's all-gather and
reduce-scatter buffers among them, is recorded once per signature and then served from the
pool's arena. The bytes, collectives and their order are FSDP2's: losses and gradients equal
eager FSDP2's bit for bit.

A budget (or a fixed chunk count) is a policy the step owns (``ShardedPolicy``, made by
``_planning.fsdp_budget``), which answers one question per signature: how many chunks, and
which FSDP units' forwards to checkpoint (``ShardedChoice``). Chunks run one after the other,
each in its own block, with ``set_requires_gradient_sync(False)`` on all but the last (FSDP2
then keeps each unit's unsharded gradient until the last chunk's backward reduce-scatters it:
one reduce-scatter per step). Checkpointing wraps a unit's ``forward`` in
``torch.utils.checkpoint`` (non-reentrant) inside FSDP2's hooks, as torchtitan places it: the
unit's parameters are gathered around it, its activations are computed again in its backward,
the same ops on the same values (results unchanged).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .._pool import BufferPool
from .._validate import check_loss_fn
from .calling import OwnLoss, call_model, check_targets, plain_mapping
from .executor import with_route
from .fsdp import fsdp_modules, param_groups, prepare_fsdp
from .plan import PlanSummary
from .step import CallFigures

__all__ = ["ShardedChoice", "ShardedPolicy", "ShardedTrainStep", "checkpointing", "leaf_units"]


class ShardedChoice(NamedTuple):
    """How one signature's batch runs: ``chunks`` micro-batches, the forwards of the FSDP
    units ``checkpointed`` (module paths) computed again in backward, and the per-rank peak
    the sharded estimate gave that choice (``None``: not estimated, a fixed count)."""

    chunks: int
    checkpointed: tuple[str, ...] = ()
    estimated_peak: int | None = None


class ShardedPolicy(Protocol):
    """What a budget or a fixed chunk count adds to a sharded step (``_planning.fsdp_budget``
    makes it): a choice per signature, and how to weigh the chunks' losses."""

    budget: int | str | None

    def choose(self, inputs: object, targets: object) -> ShardedChoice:
        """The choice for this batch (made now if its signature has none yet)."""

    def budget_bytes(self) -> int | None:
        """The budget in bytes now (``None``: none, a fixed count)."""

    def split(self, inputs: object, targets: object, chunks: int) -> list[Any]:
        """``chunks`` parts of the batch, each with ``inputs``, ``targets`` and ``weight``."""

    @property
    def weighs(self) -> bool:
        """Whether each chunk's loss is weighted by its share (a mean-reduced loss)."""

    @property
    def chosen(self) -> dict[str, int]:
        """Chunks chosen so far, by signature."""

    def report_lines(self) -> list[str]:
        """What it chose, for ``report()``."""


def leaf_units(model: nn.Module) -> list[str]:
    """The FSDP2 units of ``model`` with no unit inside them, by path (the root excluded):
    the units whose forward a checkpoint can wrap (a unit inside a checkpointed forward would
    all-gather again when the forward is computed again)."""
    paths = [name for name, _ in fsdp_modules(model) if name]
    return [p for p in paths if not any(q.startswith(f"{p}.") for q in paths)]


@contextlib.contextmanager
def checkpointing(model: nn.Module, paths: Sequence[str]) -> Iterator[None]:
    """While inside, the forward of each module of ``paths`` runs under
    ``torch.utils.checkpoint`` (non-reentrant, the RNG state preserved as it does by
    default): its module hooks (FSDP2's gathers) stay outside, its activations are computed
    again in backward. The modules' own ``forward`` is restored on the way out."""
    modules = [model.get_submodule(p) for p in paths]
    own = [m.__dict__.get("forward") for m in modules]  # an instance attribute of its own
    for module in modules:
        forward = module.forward
        module.forward = functools.partial(checkpoint, forward, use_reentrant=False)
    try:
        yield
    finally:
        for module, before in zip(modules, own, strict=True):
            if before is None:
                del module.forward
            else:
                module.forward = before


class ShardedTrainStep:
    """A train step on an FSDP2 model, served from a pool: ``loss = step(inputs, targets)``.

    Made by ``sm.pooled_train_step`` for a model sharded with ``fully_shard``; see there.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: object,
        pool: BufferPool,
        prefix: str = "act.",
    ) -> None:
        root = dict(fsdp_modules(model)).get("")
        if root is None:
            raise TypeError(
                "sharedmem: a pooled step on an FSDP2 model needs fully_shard applied to the "
                f"model itself too ({type(model).__name__}), after its layers, as torchtitan "
                "does; or call sm.prepare_fsdp(model) and run its eager step inside "
                '`with pool.step("train", *inputs):`'
            )
        loss_fn = check_loss_fn(loss_fn)
        self.model = prepare_fsdp(model)
        self.pool = pool
        self.prefix = prefix
        self.own_loss = loss_fn is None
        self.loss_fn: Callable[[Any, Any], torch.Tensor] = OwnLoss() if loss_fn is None else loss_fn
        self.budget_policy: ShardedPolicy | None = None
        self.last_call: CallFigures | None = None
        self.last_choice = ShardedChoice(1)
        self._route: Any = None  # the route of the latest call's biggest chunk
        self._groups = [
            group for _, module in fsdp_modules(model) for group in param_groups(module)
        ]

    # ---- running ---------------------------------------------------------------------------

    def __call__(self, inputs: object, targets: object = None) -> torch.Tensor:
        """Run forward and backward as eager FSDP2 does (in chunks, checkpointing units, where
        a budget or a chunk count says), leave the sharded gradients in ``p.grad``, return the
        batch's loss (detached)."""
        inputs, targets = plain_mapping(inputs), check_targets(self.own_loss, targets)
        policy = self.budget_policy
        choice = ShardedChoice(1) if policy is None else policy.choose(inputs, targets)
        if choice.chunks == 1:
            parts = [(inputs, targets, 1.0)]
        else:
            assert policy is not None
            split = policy.split(inputs, targets, choice.chunks)
            parts = [(part.inputs, part.targets, part.weight) for part in split]
        weigh = len(parts) > 1 and policy is not None and policy.weighs
        synced = [group.reduce_grads for group in self._groups]  # the user's no-sync state
        total: torch.Tensor | None = None
        peaks: list[tuple[int, int, Any]] = []
        try:
            with checkpointing(self.model, choice.checkpointed):
                for k, (x, y, weight) in enumerate(parts):
                    last = k == len(parts) - 1
                    for group, sync in zip(self._groups, synced, strict=True):
                        group.reduce_grads = sync and last
                    # A chunk that reduce-scatters, or finds unsharded gradients kept, allocates
                    # another sequence: each kind its own block.
                    grads = self._unsharded_grads()
                    kind = "sync" if any(g.reduce_grads for g in self._groups) else "nosync"
                    kind += ".held" if grads else ""
                    held = self._beside_arena(grads)
                    with self.pool.step(
                        f"{self.prefix}fsdp.{kind}",
                        x,
                        y,
                        arena=f"{self.prefix}0",
                        params=self.model,
                    ):
                        loss = self.loss_fn(call_model(self.model, x), y)
                        if weigh:
                            loss = loss * weight
                        loss.backward()  # type: ignore[no-untyped-call]
                    loss = loss.detach()
                    total = loss if total is None else total + loss
                    peaks.append((held, k, self._latest_route()))
        finally:
            for group, sync in zip(self._groups, synced, strict=True):
                group.reduce_grads = sync
        assert total is not None
        self.last_choice = choice
        self._figures(inputs, targets, choice, peaks)
        return total

    def _latest_route(self) -> Any:
        """The route the block that just ran was served by (the most recently used)."""
        routes = list(self.pool._blocks.routes().values())
        return routes[-1] if routes else None

    def _arena_ranges(self) -> list[tuple[int, int]]:
        return [
            (base, base + self.pool.device_capacity(name))
            for name, base in self.pool.arenas.lanes(f"{self.prefix}0")
        ]

    def _unsharded_grads(self) -> list[torch.Tensor]:
        """The unsharded gradients FSDP2 keeps between chunks (or no-sync calls)."""
        grads = []
        for group in self._groups:
            for param in group.fsdp_params:
                unsharded = getattr(param, "_unsharded_param", None)
                for grad in (getattr(unsharded, "grad", None), param.unsharded_accumulated_grad):
                    if grad is not None:
                        grads.append(grad)
        return grads

    def _beside_arena(self, tensors: list[torch.Tensor]) -> int:
        """The bytes of ``tensors`` that lie beside the arena (those in it are in its bytes)."""
        ranges = self._arena_ranges()
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        return sum(
            nbytes
            for at, nbytes in storages.items()
            if not any(low <= at < high for low, high in ranges)
        )

    # ---- figures ---------------------------------------------------------------------------

    def _figures(
        self, inputs: object, targets: object, choice: ShardedChoice, peaks: list[Any]
    ) -> None:
        measured, beside, route, how = 0, 0, None, "no router: not measured"
        for held, _k, chunk_route in peaks:
            peak = None if chunk_route is None else chunk_route.last_peak
            if peak is None:
                continue
            if peak.total + held >= measured:
                measured, beside, route = peak.total + held, peak.beside_peak + held, chunk_route
            how = peak.how
        self._route = route
        planned = 0
        if route is not None and route.plan is not None:
            planned = route.plan.need + route.plan.beside_peak
        budget = None if self.budget_policy is None else self.budget_policy.budget_bytes()
        signature = ", ".join(
            f"{tuple(t.shape)}"
            for t in torch.utils._pytree.tree_leaves((inputs, targets))
            if isinstance(t, torch.Tensor)
        )
        self.last_call = CallFigures(
            signature=signature or "no tensors",
            planned_peak=planned,
            measured_peak=measured,
            measured=how,
            chunks=choice.chunks,
            budget=budget,
            budget_counted=self.pool.stats()["device_reserved_bytes"] + beside,
        )

    # ---- what it chose and what it held ----------------------------------------------------

    @property
    def budget(self) -> int | str | None:
        """The budget a call is held to (bytes, or ``"free"``); ``None`` without one."""
        return None if self.budget_policy is None else self.budget_policy.budget

    def chunks_for(self, inputs: object, targets: object = None) -> int:
        """The chunks a call with these inputs runs in (1 without a budget or count); chosen
        now if no call of that signature chose yet, with every rank of the mesh (call it on
        every rank: the ranks agree on one choice)."""
        if self.budget_policy is None:
            return 1
        return self.budget_policy.choose(plain_mapping(inputs), targets).chunks

    @property
    def chosen(self) -> dict[str, int]:
        """Chunks chosen so far, by signature (empty without a budget or count)."""
        return {} if self.budget_policy is None else self.budget_policy.chosen

    @property
    def checkpointed(self) -> tuple[str, ...]:
        """The FSDP units whose forward the latest call computed again in backward."""
        return self.last_choice.checkpointed

    @property
    def recomputing(self) -> bool:
        """Whether the latest call checkpointed units' forwards."""
        return bool(self.last_choice.checkpointed)

    def plan_summary(self) -> PlanSummary:
        """The latest call's route (its biggest chunk's): the allocations the arena serves,
        the arena's bytes against max-live, what is served beside it, and the peak, planned
        and measured. An eager step has no graph: ``nodes`` and ``pooled_values`` count the
        recorded allocations."""
        figures, route = self.last_call, self._route
        recording = None if route is None else route.recording
        if figures is None or route is None or route.plan is None or recording is None:
            signature = "no call yet" if figures is None else figures.signature
            return PlanSummary("routed", signature, 0, 0, 0, 0, 0, 0, 0, ())
        nodes = len(recording.sizes)
        summary = PlanSummary("routed", figures.signature, nodes, 0, 0, 0, 0, 0, 0, ())
        return dataclasses.replace(
            with_route(summary, route),
            planned_peak=figures.planned_peak,
            measured_peak=figures.measured_peak,
            measured=figures.measured,
        )

    def report(self) -> str:
        """A few lines a person reads: the latest call's per-rank peak, planned and measured
        (and whether it held its budget), its chunks and checkpointed units, then what a
        budget chose per signature."""
        rows = [f"{type(self).__name__} (eager FSDP2 in pool.step) on {self.pool.device!r}"]
        last = self.last_call
        rows.append("  " + ("no call yet" if last is None else last.describe()))
        if self.last_choice.checkpointed:
            units = ", ".join(repr(p) for p in self.last_choice.checkpointed)
            rows.append(f"  checkpointed FSDP units (forward computed again): {units}")
        if self.last_choice.estimated_peak is not None:
            rows.append(
                f"  sharded estimate of that choice: {self.last_choice.estimated_peak:,} bytes"
            )
        if self.budget_policy is not None:
            rows += ["  " + line for line in self.budget_policy.report_lines()]
        return "\n".join(rows)
