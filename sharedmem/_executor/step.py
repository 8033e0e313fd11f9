"""The two steps users run: a pooled train step and a pooled forward, with a graph per
signature (see ``executor`` for what a signature holds). Their public factories,
``sm.pooled_train_step`` and ``sm.pooled_forward``, live in ``_planning.steps``.

One class per job, whatever the arguments: a budget (or a fixed chunk count) is a policy the
step owns (``BudgetPolicy``, made by ``_planning.fit``), not another class; without one the
step pays nothing for it. Every step reports its latest call's peak, planned and measured
(``last_call``), in ``report()`` and ``plan_summary()`` alike.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch
import torch.utils._pytree as pytree

from .._errors import SharedMemError
from .._pool import BufferPool
from .._routing import CallPeak
from .._validate import check_loss_fn
from .accumulate import accumulating, obeys_layout, relayout, summed_in_place
from .binding import State
from .calling import OwnLoss, check_targets
from .cost import call_cost, graph_cost
from .distributed import GradientSync, after_forward, sync_buffers
from .executor import (
    Compiled,
    Executor,
    MemoryPlan,
    data_family,
    describe,
    returned_bytes,
    routed_summary,
)
from .plan import PlanSummary
from .policy import Recompute
from .trace import Traced, flatten, trace_forward, trace_train

__all__ = ["BudgetPolicy", "CallFigures", "PooledForward", "PooledTrainStep"]


class CallFigures(NamedTuple):
    """The latest call of a step, in bytes: what its plan said and what it held
    (``step.last_call``).

    Attributes:
        signature: the call's signature, in words.
        planned_peak: the plan's peak: its pool bytes (on a pool of its own) and the most
            beside the pool at once (``PlanSummary.planned_peak``); for a chunked call, its
            biggest chunk's.
        measured_peak: the call's peak as it ran: the bytes of the arena it was served from
            and the most bytes PyTorch's allocator held for it at once, as the routing
            allocator saw them (``measured`` says how); a chunked call's biggest chunk,
            with the gradients its earlier chunks made.
        measured: how ``measured_peak`` was measured, in words.
        chunks: the chunks the call ran in.
        recompute: what its plan computed again in backward.
        budget: the budget the call was held to, in bytes (``None``: no budget).
        budget_counted: what the budget counts of the call: the pool's reserved bytes (every
            buffer, the arena among them) and the most beside the pool at once.
    """

    signature: str
    planned_peak: int
    measured_peak: int
    measured: str
    chunks: int = 1
    recompute: Recompute = Recompute.OFF
    budget: int | None = None
    budget_counted: int = 0

    @property
    def held_budget(self) -> bool | None:
        """Whether the call held its budget (``None``: it had none)."""
        return None if self.budget is None else self.budget_counted <= self.budget

    def describe(self) -> str:
        """One line a person reads."""
        line = (
            f"latest call ({self.signature}): peak planned {self.planned_peak:,} bytes, "
            f"measured {self.measured_peak:,} bytes ({self.measured})"
        )
        if self.chunks > 1:
            line += f", in {self.chunks} chunks"
        if self.recompute.costly:
            line += f", recomputing {self.recompute.describe()}"
        if self.budget is not None:
            held = "held" if self.held_budget else "did NOT hold"
            line += (
                f"; {held} its budget of {self.budget:,} bytes (it counts "
                f"{self.budget_counted:,}: the pool's buffers and the most beside them)"
            )
        return line


class BudgetPolicy(Protocol):
    """What a budget or a fixed chunk count adds to a step (``_planning.fit`` makes them):
    the choice of chunks (and recomputation) per signature, and running a batch by it."""

    budget: int | str | None

    def run(self, inputs: object, targets: object) -> Any:
        """Run the batch as chosen."""

    def chunks_for(self, inputs: object, targets: object = None) -> int:
        """The chunks a call with these inputs runs in (chosen now if not yet)."""

    @property
    def chosen(self) -> dict[str, int]:
        """Chunks chosen so far, by signature."""

    @property
    def recompute(self) -> Recompute:
        """What the latest choice recomputes."""

    def report_lines(self) -> list[str]:
        """What it chose, for ``report()``."""


class _Step(Executor):
    """What both steps add to the executor: a budget policy where one was given, the latest
    call's figures, and the report."""

    def __init__(self, model: object, pool: BufferPool, plan: object, prefix: object) -> None:
        super().__init__(model, pool, plan, prefix)
        self.budget_policy: BudgetPolicy | None = None
        # The latest call, kept raw (figures are made when read: a call pays a tuple for
        # them), or a chunked call's figures, set by its budget policy.
        self._last_run: _Run | None = None
        self._last_chunked: CallFigures | None = None

    @property
    def last_call(self) -> CallFigures | None:
        """The latest call's figures: its peak, planned and measured, and with a budget
        whether it held it (``None`` before the first call)."""
        if self._last_chunked is not None:
            return self._last_chunked
        return None if self._last_run is None else self._figures(self._last_run)

    @last_call.setter
    def last_call(self, figures: CallFigures) -> None:
        self._last_chunked = figures

    def _ran(self, compiled: Compiled, budget: int | None, recompute: Recompute) -> None:
        """Keep what the call of ``compiled`` that just ran needs for its figures."""
        route = compiled.route
        peak = None if route is None else route.last_peak
        self._last_run = _Run(compiled, peak, self.pool.reserved_after({}), budget, recompute)
        self._last_chunked = None

    # ---- the budget, where there is one ---------------------------------------------------

    @property
    def budget(self) -> int | str | None:
        """The budget a call is held to (bytes, or ``"free"``); ``None`` without one."""
        return None if self.budget_policy is None else self.budget_policy.budget

    def chunks_for(self, inputs: object, targets: object = None) -> int:
        """The number of chunks a call with these inputs (and targets) runs in: 1 without a
        budget or chunk count; with one, chosen now (planned, not run) if no call of that
        signature chose yet."""
        if self.budget_policy is None:
            return 1
        return self.budget_policy.chunks_for(inputs, targets)

    @property
    def chosen(self) -> dict[str, int]:
        """Chunks chosen so far, by signature (batch shapes), in the order first seen
        (empty without a budget or chunk count)."""
        return {} if self.budget_policy is None else self.budget_policy.chosen

    @property
    def step(self) -> _Step:
        """Deprecated: the step itself (a budgeted step was once a wrapper around one)."""
        warnings.warn(
            "sharedmem: step.step is deprecated: a budgeted step is the step itself now; use "
            "the step directly (plan_summary(), memory_plan(), source() are on it)",
            DeprecationWarning,
            stacklevel=2,
        )
        return self

    # ---- figures --------------------------------------------------------------------------

    def plan_summary(self) -> PlanSummary:
        """What the graph of the latest call asks of the pool, what its plan saves, and its
        peak: planned, and measured in that call."""
        summary = super().plan_summary()
        figures = self._last_figures
        if figures is None:
            return summary
        return dataclasses.replace(
            summary, measured_peak=figures.measured_peak, measured=figures.measured
        )

    @property
    def _last_figures(self) -> CallFigures | None:
        """The latest unchunked call's figures (a chunked call's graph is a chunk's)."""
        last = self.last_call
        return last if last is not None and last.chunks == 1 else None

    def report(self) -> str:
        """A few lines a person reads: the latest call's peak, planned and measured (and
        whether it held its budget), then what a budget chose per signature."""
        rows = [f"{type(self).__name__} on {self.pool.device!r}"]
        rows.append("  " + ("no call yet" if self.last_call is None else self.last_call.describe()))
        if self.budget_policy is not None:
            rows += ["  " + line for line in self.budget_policy.report_lines()]
        return "\n".join(rows)

    def _figures(self, run: _Run) -> CallFigures:
        """The figures of the call ``run``."""
        compiled, peak = run.compiled, run.peak
        summary = compiled.summary
        planned = routed_summary(compiled).planned_peak
        if peak is not None:
            arena, beside = peak.arena_bytes, peak.beside_peak
            how = peak.how
        else:
            arena = sum(self.pool.device_capacity(name) for name in self.slot_names())
            beside = summary.planned_peak - summary.pooled_bytes
            how = "no router: the slot buffers and the plan's peak beside them"
        return CallFigures(
            signature=summary.signature,
            planned_peak=planned,
            measured_peak=arena + beside,
            measured=how,
            recompute=run.recompute,
            budget=run.budget,
            budget_counted=run.reserved + beside,
        )


class _Run(NamedTuple):
    """What a call leaves for its figures: its graph, the router's view of it, the pool's
    reserved bytes after it, its budget and its recomputation."""

    compiled: Compiled
    peak: CallPeak | None
    reserved: int
    budget: int | None
    recompute: Recompute


class PooledTrainStep(_Step):
    """A train step whose activations live in a pool: ``loss = step(inputs, targets)``.

    Made by ``sm.pooled_train_step``; see there.
    """

    def __init__(
        self,
        model: object,
        loss_fn: object,
        pool: BufferPool,
        plan: object = "liveness",
        prefix: object = "act.",
        *,
        recompute: Recompute = Recompute.OFF,
    ) -> None:
        super().__init__(model, pool, plan, prefix)
        self._trains = True
        loss_fn = check_loss_fn(loss_fn)  # callable as loss_fn(output, targets), before tracing
        self.own_loss = loss_fn is None
        self.loss_fn: Callable[[Any, Any], torch.Tensor] = OwnLoss() if loss_fn is None else loss_fn
        self._sync = None if self.ddp is None else GradientSync(self.ddp, pool, self.prefix)
        self._own_recompute = recompute  # the step's own; a budget chooses per signature instead

    def __call__(self, inputs: object, targets: object = None) -> torch.Tensor:
        """Run forward and backward, add the gradients into ``p.grad``, return the loss."""
        if self.budget_policy is not None:
            loss: torch.Tensor = self.budget_policy.run(inputs, targets)
            return loss
        return self._call(inputs, targets, self._own_recompute)

    @property
    def recompute(self) -> Recompute:
        """What the step computes again in backward: the ``recompute=`` it was made with, or
        with a budget, what the budget chose for the latest signature."""
        if self.budget_policy is not None:
            return self.budget_policy.recompute
        return self._own_recompute

    @property
    def recomputing(self) -> bool:
        """Whether the step recomputes costly ops (convolutions, matrix products) now."""
        return self.recompute.costly

    @property
    def recompute_heavy(self) -> bool | float:
        """Deprecated: ``recompute`` in the planner's spelling (``False``, ``True`` or the
        fraction of time it may add)."""
        warnings.warn(
            "sharedmem: step.recompute_heavy is deprecated: read step.recompute (a "
            "sharedmem.Recompute), or make the step with recompute=sm.Recompute.within(...)",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.recompute.heavy

    @recompute_heavy.setter
    def recompute_heavy(self, heavy: bool | float) -> None:
        warnings.warn(
            "sharedmem: setting step.recompute_heavy is deprecated: make the step with "
            "recompute=sm.Recompute.within(...) (or Recompute.MOST), or pass recompute= to "
            "memory_plan()",
            DeprecationWarning,
            stacklevel=2,
        )
        self._own_recompute = Recompute.adding(heavy)

    @property
    def unreached(self) -> dict[str, tuple[int, int, str]]:
        """Where a budget's recomputation alone could not meet it, by signature: the least
        peak it plans, and the floor no recomputation goes below (bytes, the op)."""
        return dict(getattr(self.budget_policy, "unreached", {}))

    @property
    def compared(self) -> dict[str, tuple[int, float, float]]:
        """Where ``exact=False`` compared chunks and recomputation, by signature: (chunks,
        the time they add, the time recomputation adds), modelled."""
        return dict(getattr(self.budget_policy, "compared", {}))

    def _call(
        self, inputs: object, targets: object, recompute: Recompute, *, budget: int | None = None
    ) -> torch.Tensor:
        """One run of the whole batch with ``recompute``, its figures in ``last_call``
        (``budget``: the bytes the call is held to, for them)."""
        if not torch.is_grad_enabled():
            raise RuntimeError(
                "sharedmem: the pooled train step was called with gradients disabled "
                "(under torch.no_grad() or torch.inference_mode()), where eager "
                "loss.backward() raises too; call it outside no_grad, or evaluate with "
                "sm.pooled_forward"
            )
        binding, state = self._state()
        x = flatten(inputs, "inputs")
        y = flatten(self.check_targets(targets), "targets")
        mode = self._mode()
        traced_key = (state.key, x.key, y.key, mode)
        hooked = _hooked(state.params)
        if hooked and self._sync is not None:
            raise SharedMemError(
                "sharedmem: a parameter of a DistributedDataParallel model has a gradient "
                "hook (register_hook or register_post_accumulate_grad_hook); the pooled step "
                "averages gradients inside its graph, before such a hook could run: remove "
                "the hook, or use DDP's own communication hooks"
            )
        # Gradients already there are added into inside the graph (see ``accumulate``); the
        # DDP path keeps them out of it, since its buckets average the new gradients alone.
        # A parameter with gradient hooks gets its new gradient alone: its hooks see that.
        present = (
            ()
            if self._sync is not None
            else tuple(
                p.grad is not None and not (hooked and hooked[i])
                for i, p in enumerate(state.params)
            )
        )
        key = (*traced_key, present, recompute)
        compiled = self._cache.get(key)
        if compiled is None:
            started = time.perf_counter()
            self._check_devices(state, x, y)
            label = describe("train step", x, y)
            if any(present):
                label += ", adding into existing gradients"
            n_data = len(x.tensors) + len(y.tensors)

            def build(traced: Traced) -> Compiled:
                return self._build(
                    self._with_grads(traced, state, present),
                    label=label,
                    n_data=n_data,
                    autocast=mode.autocast,
                    outputs_in_pool=False,
                    grad_ready=None if self._sync is None else self._sync.ready,
                    recompute=recompute,
                )

            # A signature that differs from an earlier one only in its data's sizes is
            # served by one graph traced with those sizes as symbols (``Executor.shared``).
            data = data_family(x, y)
            family = None if data is None else (state.key, data, mode)
            if family is not None and traced_key not in self._traced:
                compiled = self.shared(
                    family,
                    key[len(traced_key) :],
                    [*x.tensors, *y.tensors],
                    label,
                    lambda dims: self.capture.trace(
                        binding,
                        lambda: trace_train(
                            self.model, self.loss_fn, binding, state, x, y, dynamic=dims
                        ),
                    ),
                    build,
                )
            if compiled is None:
                traced = self._traced.get(traced_key) or self.capture.trace(
                    binding, lambda: trace_train(self.model, self.loss_fn, binding, state, x, y)
                )
                self.first_of(family, traced)
                compiled = build(traced)
            self._cache[key] = compiled
            self.capture_seconds += time.perf_counter() - started
        if self._sync is not None:
            self._sync.begin(state.params)
        held = [
            g
            for p, there in zip(state.params, present, strict=False)
            if there and (g := p.grad) is not None
        ]
        flat = [*state.params, *state.buffers, *held, *x.tensors, *y.tensors]
        loss, *grads = self._run(compiled, binding, flat, sum(g.nbytes for g in held))
        owned_grads = compiled.owned[1 : 1 + len(grads)]
        for i, (p, owned) in enumerate(zip(state.params, owned_grads, strict=True)):
            g, grads[i] = grads[i], None  # a copied gradient's original dies at once
            if g is None:
                continue
            if hooked and hooked[i]:
                g, owned = _before_accumulating(p, g, owned)
            if p.grad is None:
                # As autograd's AccumulateGrad: keep a fresh gradient that has the parameter's
                # layout as it is, copy anything else into the parameter's layout.
                p.grad = g if owned and obeys_layout(g, p) else torch.empty_like(p).copy_(g)
            else:
                p.grad.add_(g)
            del g
            if hooked and hooked[i] and p._post_accumulate_grad_hooks:
                for hook in list(p._post_accumulate_grad_hooks.values()):
                    hook(p)  # as autograd does once the gradient is accumulated
        if self._sync is not None:
            self._sync.finish()
        self._ran(compiled, budget, recompute)
        result: torch.Tensor = loss if compiled.owned[0] else loss.clone()
        return result

    def memory_plan(
        self,
        inputs: object,
        targets: object = None,
        *,
        with_grads: bool | None = None,
        recompute: Recompute | None = None,
    ) -> MemoryPlan:
        """The memory a call with ``inputs`` and ``targets`` would plan, traced but not run
        (nothing is allocated in the pool). ``with_grads``: planned as if every parameter
        had a ``.grad`` to add into (``True``: a chunk after the first), or none had
        (``False``); by default, as the parameters' ``.grad`` stand now. ``recompute``:
        planned with that recomputation (by default, the step's own: ``step.recompute``)."""
        policy = self.recompute if recompute is None else recompute
        traced, key, state = self._trace_for(inputs, targets)
        present: tuple[bool, ...] = ()
        if self._sync is None:
            present = tuple(
                p.grad is not None if with_grads is None else with_grads for p in state.params
            )
        recorded = self._recorded((*key, present, policy), returned_bytes(traced.gm))
        traced = self._with_grads(traced, state, present)
        return recorded or self._memory_plan(traced, outputs_in_pool=False, recompute=policy)

    def modelled_time(
        self, inputs: object, targets: object = None, *, per_call: bool = True
    ) -> float:
        """The modelled time of a call with ``inputs`` and ``targets`` as traced (before any
        recomputation), in flops: its ops' work and, with ``per_call``, the fixed cost of
        calling each (``cost.call_cost``); traced but not run."""
        graph = self._trace_for(inputs, targets)[0].gm.graph
        return call_cost(graph) if per_call else graph_cost(graph)

    def _trace_for(
        self, inputs: object, targets: object
    ) -> tuple[Traced, tuple[object, ...], State]:
        """The traced graph of a call with ``inputs`` and ``targets`` (traced once per
        signature), its key and the model's state."""
        binding, state = self._state()
        x, y = flatten(inputs, "inputs"), flatten(self.check_targets(targets), "targets")
        key = (state.key, x.key, y.key, self._mode())
        traced = self._traced.get(key)
        if traced is None:
            self._check_devices(state, x, y)
            traced = self.capture.trace(
                binding, lambda: trace_train(self.model, self.loss_fn, binding, state, x, y)
            )
            self._traced[key] = traced
        return traced, key, state

    def _with_grads(self, traced: Traced, state: State, present: tuple[bool, ...]) -> Traced:
        """``traced`` as it runs with the gradients ``present``: each fresh one made in its
        parameter's layout (``relayout``), the others added into ``p.grad`` (``accumulating``)."""
        fresh = [not there for there in present] if present else [True] * len(state.params)
        gm = summed_in_place(traced.gm, len(state.params))
        gm = relayout(gm, state.params, fresh)
        if any(present):
            first_data = len(state.params) + len(state.buffers)
            # A gradient planned for but not there yet (``memory_plan(with_grads=True)``)
            # stands in by its parameter: a gradient takes its parameter's layout.
            grads = [(p.grad if p.grad is not None else p) if there else None
                     for p, there in zip(state.params, present, strict=True)]  # fmt: skip
            gm = accumulating(gm, grads, first_data)
        return traced if gm is traced.gm else dataclasses.replace(traced, gm=gm)

    def _loss_functions(self) -> list[tuple[str, object]]:
        return [] if self.own_loss else [("loss_fn", self.loss_fn)]

    def check_targets(self, targets: object) -> object:
        """``targets``, refused where the step's loss is the model's own."""
        return check_targets(self.own_loss, targets)


def _hooked(params: list[torch.Tensor]) -> list[bool]:
    """Which parameters have gradient hooks (``register_hook``,
    ``register_post_accumulate_grad_hook``); empty where none has (the common case)."""
    hooks = [bool(p._backward_hooks) or bool(p._post_accumulate_grad_hooks) for p in params]
    return hooks if any(hooks) else []


def _before_accumulating(
    p: torch.Tensor, g: torch.Tensor, owned: bool
) -> tuple[torch.Tensor, bool]:
    """``p``'s new gradient ``g`` through its ``register_hook`` hooks, as autograd runs them
    before accumulating it, and whether the step owns the result (a hook's own tensor is
    copied, as it may keep it)."""
    hooks = p._backward_hooks
    if not hooks:
        return g, owned
    if not owned:  # a pool view: the hook may keep it
        g, owned = g.clone(), True
    for hook in list(hooks.values()):
        result = hook(g)
        if result is not None:
            g, owned = result, False
    return g, owned


class PooledForward(_Step):
    """A forward pass whose activations live in a pool: ``out = fwd(inputs)``.

    Made by ``sm.pooled_forward``; see there.
    """

    def __init__(
        self,
        model: object,
        pool: BufferPool,
        plan: object = "liveness",
        prefix: object = "act.",
        outputs_in_pool: object = False,
    ) -> None:
        super().__init__(model, pool, plan, prefix)
        if not isinstance(outputs_in_pool, bool):
            raise TypeError(
                f"sharedmem: outputs_in_pool must be a bool, got {type(outputs_in_pool).__name__}"
            )
        self.outputs_in_pool = outputs_in_pool

    @property
    def forward(self) -> PooledForward:
        """Deprecated: the forward itself (a budgeted forward was once a wrapper around one)."""
        warnings.warn(
            "sharedmem: fwd.forward is deprecated: a budgeted forward is the forward itself "
            "now; use it directly",
            DeprecationWarning,
            stacklevel=2,
        )
        return self

    def __call__(self, inputs: object) -> Any:
        """Run the forward without autograd and return the model's output."""
        if self.budget_policy is not None:
            return self.budget_policy.run(inputs, None)
        return self._call(inputs)

    def _call(self, inputs: object, *, budget: int | None = None) -> Any:
        """One run of the whole batch, its figures in ``last_call``."""
        binding, state = self._state()
        x = flatten(inputs, "inputs")
        mode = self._mode()
        key = (state.key, x.key, mode)
        compiled = self._cache.get(key)
        if compiled is None:
            self._check_devices(state, x)
            traced = self._traced.get(key) or self.capture.trace(
                binding, lambda: trace_forward(self.model, binding, state, x)
            )
            label = describe("train-mode forward" if self.model.training else "forward", x)
            n_data = len(x.tensors)
            compiled = self._build(
                traced,
                label=label,
                n_data=n_data,
                autocast=mode.autocast,
                outputs_in_pool=self.outputs_in_pool,
            )
            self._cache[key] = compiled
        if self.ddp is not None:
            sync_buffers(self.ddp)
        outputs = self._run(compiled, binding, [*state.params, *state.buffers, *x.tensors])
        if self.ddp is not None:
            after_forward(self.ddp, synced_backward=False)
        self._ran(compiled, budget, Recompute.OFF)
        assert compiled.out_spec is not None
        return pytree.tree_unflatten(outputs, compiled.out_spec)

    def memory_plan(self, inputs: object) -> MemoryPlan:
        """The memory a call with ``inputs`` would plan, traced but not run."""
        binding, state = self._state()
        x = flatten(inputs, "inputs")
        key = (state.key, x.key, self._mode())
        traced = self._traced.get(key)
        if traced is None:
            self._check_devices(state, x)
            traced = self.capture.trace(
                binding, lambda: trace_forward(self.model, binding, state, x)
            )
            self._traced[key] = traced
        recorded = self._recorded(key, returned_bytes(traced.gm))
        return recorded or self._memory_plan(traced, outputs_in_pool=self.outputs_in_pool)
