"""What both entry points share: checks, the signature cache, planning, running the graph.

A signature is everything a trace fixes: the shapes, strides, dtypes and devices of the
inputs (and targets), their non-tensor values, the model's structure (submodules and where
its tensors live), the training flag of every submodule, the parameters', buffers' and
tensor attributes' shapes, dtypes, devices and ``requires_grad``, and the modes that change
which ops a trace records (autocast and its dtype, the default dtype). The first call of a
signature traces, plans and generates code; later calls only look the signature up and run.
Python values a trace read besides (attributes, hooks, closures, globals) are guarded
(``capture``, ``guards``): when one changes, every graph is dropped and traced again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.fx import Node

from .._backends import round_up
from .._errors import SharedMemError
from .._pool import BufferPool
from .._routing import Route, choose_plan, routes_on
from .._routing.family import SharedPlans
from .._routing.kernels import measured_in
from .._routing.plan import Recording
from .._validate import check_name
from .binding import Binding, Place, State
from .capture import Capture
from .codegen import Runner, generate
from .distributed import grad_taps, unwrap
from .graph import Analysis, analyse, measured_scratch, op_name, op_sequence
from .placement import as_recording, place, timeline_peak
from .plan import PLANS, Lifetime, PlanSummary, assign_slots, merge
from .policy import Recompute
from .recompute import recompute
from .trace import TENSOR, Leaves, Traced

__all__ = ["Compiled", "Executor", "Family", "data_family", "describe"]


class MemoryPlan(NamedTuple):
    """A signature's memory, planned: the pool bytes its slots need (on an empty pool), the
    bytes of intermediates that ops without a native ``out=`` form allocate beside the pool in
    one call (all of them: an upper bound of what is live beside it at once), and the size
    each slot would be grown to on the pool as it is now (what a budget is checked against),
    and the bytes of the results a call hands back in fresh memory (loss and gradients, or
    the forward's outputs), and the most bytes of fresh results (unpooled intermediates and
    returned results) live at once during a call: the step's peak beside the pool; and the
    time the plan's recomputation adds, modelled, as a fraction of the step's own; and the
    most bytes one op needs at once, below which no plan or recomputation goes (its op)."""

    pooled_bytes: int
    unpooled_bytes: int
    slot_bytes: dict[str, int]
    returned_bytes: int
    beside_peak: int = 0
    recompute_cost: float = 0.0
    floor: int = 0  # ``PlanSummary.floor``
    floor_op: str = ""


class SlotPlan(NamedTuple):
    """Where a graph's planned intermediates live: a slot name per lifetime (``None`` for
    results the caller keeps and for those left to run as eager) and each slot's bytes."""

    slots: list[str | None]
    offsets: list[int]  # per lifetime, its byte offset in its slot
    slot_bytes: dict[str, int]
    lifetimes: list[Lifetime]  # of the planned values
    joined: list[Lifetime]  # after merging in-place pairs
    existing: dict[str, int]  # slot capacities before this plan
    eager: frozenset[int]  # lifetimes not pooled: their ops run as eager, allocating
    over: dict[int, Node]  # lifetimes not pooled that are written over a dying operand
    beside_peak: int  # the most bytes of fresh results live at once in a call
    unpooled_bytes: int  # bytes of intermediates allocated beside the pool per call
    unpooled_ops: tuple[str, ...]
    alone: dict[str, int]  # the bytes per slot the same plan needs on a pool of its own
    # A routed graph's allocation sequence as predicted (``as_recording``), or ``None``.
    predicted: Recording | None = None


@dataclass(frozen=True)
class Compiled:
    """One signature's graph, ready to run, and what the executor does with its outputs."""

    runner: Runner
    source: str
    summary: PlanSummary
    owned: tuple[bool, ...]
    unpooled_bytes: int
    stored: tuple[Place, ...]  # where the last len(stored) outputs are written back
    autocast: bool  # traced under autocast: the runner runs its ops as they were recorded
    out_spec: pytree.TreeSpec | None = None
    # Where every allocation of a call is served from the arena (the routing allocator);
    # ``None``: the slot plan alone (out= kernels into pool views, the rest beside the pool).
    route: Route | None = None
    n_data: int = 0  # the last n_data inputs are the call's data (may be pool views)


@dataclass
class Family:
    """The signatures that differ from one another only in the sizes of their data tensors:
    a graph traced with the dimensions that changed as symbols serves them all (see
    ``Executor.shared``).

    Attributes:
        sizes: the data tensors' sizes of the family's first call.
        dims: per data tensor, the dimensions traced as symbols (``None``: not yet).
        traced: that symbolic graph (made concrete at the sizes it was traced with).
        built: per compiled-step key beyond the signature (gradients present, recomputation),
            the step built from ``traced``: its runner serves every size.
        refused: why the family is not traced symbolically ("" while it may be).

    The symbolic graph must run the very ops of the first signature's graph: a symbolic
    trace runs some composite ops through their Python decompositions (PyTorch's python
    dispatcher), which may compute in another order than the C++ kernels eager runs (an
    LSTM's), and an op whose count follows a size (a loop over the sequence) fixes that size.
    """

    sizes: tuple[tuple[int, ...], ...]
    ops: tuple[object, ...] = ()  # the ops of the first signature's own graph
    dims: tuple[frozenset[int], ...] | None = None
    traced: Traced | None = None
    built: dict[tuple[object, ...], Compiled] = dataclasses.field(default_factory=dict)
    refused: str = ""
    # per key of ``built``: each size's route, with the candidate sizes at that size
    routes: dict[tuple[object, ...], list[tuple[list[int], Route]]] = dataclasses.field(
        default_factory=dict
    )
    derived: set[int] = dataclasses.field(default_factory=set)  # ids of derived recordings
    # per key of ``built``: the plans its routes share (one plan for every size)
    plans: dict[tuple[object, ...], SharedPlans] = dataclasses.field(default_factory=dict)
    # per key of ``built``: the recordings a ``size_rule`` was made from, and that rule (how
    # a new size's allocations follow its sizes)
    rules: dict[tuple[object, ...], tuple[list[Recording], SizeRule | None]] = dataclasses.field(
        default_factory=dict
    )


class Mode(NamedTuple):
    """What changes the ops a trace records without changing any tensor (part of a
    signature): the default dtype (factories) and autocast (casts, lower-precision ops)."""

    default_dtype: torch.dtype
    autocast: bool  # on the pool's device
    autocast_dtypes: tuple[object, ...] = ()


class Executor:
    """What both entry points share: checks, the signature cache, planning and the pool."""

    def __init__(self, model: object, pool: BufferPool, plan: object, prefix: object) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"sharedmem: model must be a torch.nn.Module, got {type(model).__name__}"
            )
        if not isinstance(pool, BufferPool):
            raise TypeError(
                f"sharedmem: pool must be a sharedmem.BufferPool, got {type(pool).__name__}"
            )
        if plan not in PLANS:
            raise ValueError(f"sharedmem: plan must be one of {PLANS}, got {plan!r}")
        # A DistributedDataParallel model runs its module; the wrapper drives the all-reduce.
        model, self.ddp = unwrap(model)
        self.model = model
        self.pool = pool
        self.plan = str(plan)
        self.prefix = check_name(prefix)
        device = pool.device
        self.device = torch.device("cpu" if device == "emulated" else device)
        self._device_type = self.device.type
        self._cache: dict[tuple[object, ...], Compiled] = {}
        # Traces made by memory_plan(), kept for planning again (a budget's choice) and for
        # the signature's first call, which then does not trace twice.
        self._traced: dict[tuple[object, ...], Traced] = {}
        self._last: Compiled | None = None
        self._binding: Binding | None = None
        # What the traces read besides tensors, checked on every call (see ``capture``).
        self.capture = Capture(self.model, pool, self._loss_functions)
        self._trains = False  # a train step (its arena grows for it), not a forward
        # Served through the routing allocator where it can be (see ``_routed``); set before
        # the first call to plan with ``out=`` kernels only.
        self.routing = True
        # A step made only to be planned (``sm.estimate``): it plans as the router would
        # serve it but never builds or installs the router (no process-wide effect), and
        # measures kernels (under the router) only where told to.
        self.planning_only = False
        self.measure_kernels = True
        # Signatures up to their data tensors' sizes (``Family``), and the seconds spent
        # tracing and planning graphs so far; why the last family was not traced
        # symbolically ("" where none was refused).
        self._families: dict[tuple[object, ...], Family] = {}
        self.capture_seconds = 0.0
        self.shape_fallback = ""

    def _loss_functions(self) -> list[tuple[str, object]]:
        """The callables a trace runs besides the model (a train step's loss function)."""
        return []

    def _state(self) -> tuple[Binding, State]:
        binding = self._binding
        state = None if binding is None else binding.state()
        if binding is None or state is None:  # first call, or the model's structure changed
            binding = self._binding = Binding(self.model)
            state = binding.state()
            assert state is not None, "a fresh binding matches the model"
        if self.capture.stale(binding):
            # A value a trace read changed (an attribute, a hook, a closure, the structure):
            # every graph traced with the old one is dropped, and the next call of each
            # signature traces again, as eager would see the change.
            self._cache.clear()
            self._traced.clear()
            self._families.clear()
        return binding, state

    def _mode(self) -> Mode:
        kind = self._device_type
        default, autocast = torch.get_default_dtype(), torch.is_autocast_enabled(kind)
        if autocast:
            return Mode(default, True, (torch.get_autocast_dtype(kind),))
        if kind != "cpu" and torch.is_autocast_enabled("cpu"):  # CPU scalars of a GPU model
            return Mode(default, False, ("cpu", torch.get_autocast_dtype("cpu")))
        return Mode(default, False)

    def plan_summary(self) -> PlanSummary:
        """What the graph of the latest call asks of the pool, and what its plan saves."""
        if self._last is None:
            raise ValueError("sharedmem: plan_summary() needs a first call to trace a graph")
        return routed_summary(self._last)

    def plan_summaries(self) -> list[PlanSummary]:
        """The plan of every signature traced so far, in the order they were first seen."""
        return [routed_summary(c) for c in self._cache.values()]

    def _recorded(self, key: tuple[object, ...], returned: int) -> MemoryPlan | None:
        """The memory of signature ``key`` as its recorded call measured it (exact), where
        the router recorded one."""
        compiled = self._cache.get(key)
        if compiled is None or compiled.route is None or compiled.route.plan is None:
            return None
        plan = compiled.route.plan
        return MemoryPlan(
            pooled_bytes=round_up(plan.need, 16),
            unpooled_bytes=plan.beside_bytes,
            slot_bytes={f"{self.prefix}0": round_up(plan.need, 16)} if plan.need else {},
            returned_bytes=returned,
            beside_peak=plan.beside_peak,
            floor=compiled.summary.floor,
            floor_op=compiled.summary.floor_op,
        )

    def source(self) -> str:
        """The generated Python code of the latest call's graph (for reading and debugging)."""
        if self._last is None:
            raise ValueError("sharedmem: source() needs a first call to trace a graph")
        return self._last.source

    def _check_devices(self, state: State, *leaves: Leaves) -> None:
        # Tensor attributes are left out: a model may keep CPU scalars next to GPU weights.
        registered = state.buffers[: state.registered]
        tensors = [*state.params, *registered, *(t for lv in leaves for t in lv.tensors)]
        for t in tensors:
            if t.device != self.device:
                raise ValueError(
                    f"sharedmem: the pool is on {self.pool.device!r} but a tensor of the call is "
                    f"on {t.device}; keep the model and its inputs on {self.device}"
                )

    def _build(
        self,
        traced: Traced,
        *,
        label: str,
        n_data: int,
        autocast: bool,
        outputs_in_pool: bool,
        grad_ready: Callable[[int, torch.Tensor], None] | None = None,
        recompute: Recompute = Recompute.OFF,
    ) -> Compiled:
        """Plan ``traced``'s intermediates into pool slots and generate its runner.

        Args:
            traced: the traced graph.
            label: the signature, for messages and the plan summary.
            n_data: how many of the last placeholders are the call's inputs and targets.
            autocast: traced under autocast (the runner then runs the recorded casts as they
                are, with autocast off).
            outputs_in_pool: the graph's outputs may be pool views (``pooled_forward``).
            grad_ready: for a train graph, called as ``grad_ready(k, grad)`` as soon as the
                ``k``-th gradient is final (a DDP bucket's all-reduce starts there).
            recompute: what the planner may compute again in backward (part of the key the
                caller caches the result under).
        """
        routed = self._routed(outputs_in_pool)
        # A routed call's first run is planned before it runs, by the sequence the graph and
        # its measured kernels predict (``Route.predict``), and records the real one.
        measure = self._measures(routed)
        # Before the arena is grown for this graph: its kernels' zeros in the arena's pages.
        with measured_in(self.pool, f"{self.prefix}0") if routed else nullcontext() as room:
            planned, recomputed = self._recompute(traced, recompute, measure=measure)
            gm = planned.gm
            analysis = analyse(gm, self.device, measure=measure)
            analysis = self._step_floor(analysis, traced, planned, measure=measure)
            traced = planned
        plan = self._plan(analysis, traced, outputs_in_pool, routed=routed)
        for name, nbytes in plan.slot_bytes.items():
            # Grow now, once: views fetched during a call then never see a growth.
            self.pool.tensor(name, (nbytes,), torch.uint8)
        self._mark_planned()
        placeholders = sum(1 for n in gm.graph.nodes if n.op == "placeholder")
        # Inputs (and targets) may be views into these very slots: the runner copies those.
        guarded = range(placeholders - n_data, placeholders)
        n_grads = len(analysis.owned) - 1 - len(traced.stored)  # loss, *grads, *stored
        taps = grad_taps(gm.graph, 1, n_grads) if grad_ready is not None else None
        runner, source = generate(
            gm,
            analysis.steps,
            plan.slots,
            plan.slot_bytes,
            self.device,
            label,
            guarded,
            offsets=plan.offsets,
            eager=plan.eager,
            over=plan.over,
            taps=taps,
            on_ready=grad_ready,
        )
        route = None
        if routed:
            training = grad_ready is not None or self._trains
            route = Route(self.pool, f"{self.prefix}0", training=training)
            if plan.predicted is not None:
                grown_from = None if room is None else room.grown_from
                route.predict(plan.predicted, captured_from=grown_from)
        return Compiled(
            runner,
            source,
            self._summary(gm, analysis, plan, label, recomputed),
            analysis.owned,
            0 if routed else plan.unpooled_bytes,
            traced.stored,
            autocast,
            traced.spec,
            route,
            n_data,
        )

    def shared(
        self,
        family: tuple[object, ...],
        tail: tuple[object, ...],
        data: Sequence[torch.Tensor],
        label: str,
        trace: Callable[[tuple[frozenset[int], ...]], Traced],
        build: Callable[[Traced], Compiled],
    ) -> Compiled | None:
        """The compiled step of a new signature from its family's symbolic graph, traced
        once the family's second signature shows which dimensions change (as Dynamo marks a
        dimension dynamic); ``None`` where the signature needs a graph of its own (its
        family's first, one the symbolic graph's guards refuse, or a family that cannot be
        traced symbolically: the reason is ``shape_fallback`` and ``stats()`` counts
        ``symbolic_fallbacks``).

        A signature served this way shares the family's runner (the graph computes its sizes
        from its inputs) with a route of its own: the arena serves it by a plan recorded on
        its first call, as any signature's. Recomputation is decided once, at the sizes the
        family was traced with, and holds at every size (it recomputes values, never
        changes them).

        Args:
            family: the signature without the data tensors' sizes (``data_family``).
            tail: what else the compiled step depends on (gradients present, recomputation).
            data: the call's data tensors (inputs, then targets).
            label: the signature, for messages and the plan summary.
            trace: traces the step with the given dimensions of each data tensor symbolic.
            build: plans and generates a traced graph's step.
        """
        sizes = tuple(tuple(t.shape) for t in data)
        found = self._families.get(family)
        if found is None:
            self._families[family] = Family(sizes)
            return None
        if found.refused:
            return None
        changed = tuple(
            frozenset(d for d, (a, b) in enumerate(zip(old, new, strict=True)) if a != b)
            for old, new in zip(found.sizes, sizes, strict=True)
        )
        # The batch dimension (the first, shared by the data tensors) is taken as changing
        # with any other: a short last batch then needs no second symbolic trace.
        batch = data[0].shape[0] if data and data[0].dim() else None
        dims = tuple(
            ds | {0} if any(changed) and t.dim() and t.shape[0] == batch and batch > 1 else ds
            for t, ds in zip(data, changed, strict=True)
        )
        if found.dims is None and any(
            found.sizes[k][d] < 2 for k, ds in enumerate(changed) for d in ds
        ):
            # A size of 0 or 1 may take other ops (a squeezed dimension): the family's own
            # graph, whose ops a symbolic graph must run, is this call's instead.
            self._families[family] = Family(sizes)
            return None
        if found.dims is not None:
            dims = tuple(a | b for a, b in zip(found.dims, changed, strict=True))
            if dims == found.dims:
                assert found.traced is not None and found.traced.serves is not None
                if not found.traced.serves(data):
                    return None  # a guard of the symbolic graph fails: a graph of its own
                return self._instance(found, found.traced, tail, label, build, data)
        if not any(dims):
            return None
        if any(t.shape[d] < 2 for t, ds in zip(data, dims, strict=True) for d in ds):
            return None  # a size of 0 or 1 would be traced as fixed: wait for another call
        reason = self._refusal()
        if not reason:
            try:
                traced = trace(dims)
            except SharedMemError as e:
                reason = f"the symbolic trace failed: {str(e).removeprefix('sharedmem: ')}"
            else:
                if found.ops and op_sequence(traced.gm) != found.ops:
                    reason = (
                        "the symbolic trace runs other ops than the step's own graph (a "
                        "decomposition of its own, or a loop over a changing size)"
                    )
        if reason:
            found.refused = self.shape_fallback = reason
            self.pool.count("symbolic_fallbacks", 1)
            return None
        self.pool.count("symbolic_captures", 1)
        found.dims, found.traced, found.built, found.routes = dims, traced, {}, {}
        found.plans, found.rules = {}, {}
        return self._instance(found, traced, tail, label, build, data)

    def first_of(self, family: tuple[object, ...] | None, traced: Traced) -> None:
        """``traced`` is the graph of ``family``'s first signature, traced alone: a symbolic
        graph of the family must run its ops."""
        found = None if family is None else self._families.get(family)
        if found is not None and not found.ops:
            found.ops = op_sequence(traced.gm)

    def _refusal(self) -> str:
        """Why this executor's graphs cannot serve other sizes ("" where they can)."""
        if not self._routed(False):
            return (
                "the slot plan (routing off, or the per-node plan) fixes every pooled "
                "value's size and offset in the generated code"
            )
        return ""

    def _instance(
        self,
        family: Family,
        traced: Traced,
        tail: tuple[object, ...],
        label: str,
        build: Callable[[Traced], Compiled],
        data: Sequence[torch.Tensor],
    ) -> Compiled:
        base = family.built.get(tail)
        fresh = base is None
        if base is None:
            base = family.built[tail] = build(traced)
        summary = dataclasses.replace(base.summary, signature=label)
        route = base.route
        if route is not None:
            # Every size's route plans by the family's envelope (``SharedPlans``): a new
            # size reuses its offsets rather than planning its own.
            shared = family.plans.setdefault(tail, SharedPlans())
            if fresh:
                route.family = shared
            else:
                route = Route(self.pool, f"{self.prefix}0", training=route.training, family=shared)
        compiled = dataclasses.replace(base, summary=summary, route=route)
        if compiled.route is not None and traced.sizes is not None:
            sizes = traced.sizes(data)
            routes = family.routes.setdefault(tail, [])
            recorded = [
                (s, r.recording)
                for s, r in routes
                if r.recording is not None and id(r.recording) not in family.derived
            ]
            # The rule is made again only when the recordings it stands on change.
            made = family.rules.get(tail)
            if (
                made is None
                or len(made[0]) != len(recorded)
                or any(a is not b for a, (_, b) in zip(made[0], recorded, strict=True))
            ):
                made = family.rules[tail] = ([r for _, r in recorded], size_rule(recorded))
            recording = derive(sizes, made[1])
            if recording is not None:
                family.derived.add(id(recording))
                compiled.route.derive(recording)
                self.pool.count("derived_plans", 1)
            routes.append((sizes, compiled.route))
        return compiled

    def _measures(self, routed: bool) -> bool:
        """Whether a graph's kernels are measured (``analyse``) before it is planned: where
        told to, and always for an unrouted call, whose ``out=`` plan places each result at
        its measured size and each kernel's scratch beside it."""
        return self.measure_kernels or not routed

    def _routed(self, outputs_in_pool: bool) -> bool:
        """Whether a call's allocations are served by the routing allocator: with the
        liveness plan, on a CPU (or emulated) pool where the router could be built or a CUDA
        pool once ``install_cuda_router`` ran, unless the outputs are asked for as pool views
        (they outlive the call, so only the slot plan can place them). A pool's limit caps
        the arena (what does not fit runs beside it)."""
        return (
            self.routing
            and self.plan == "liveness"
            and not outputs_in_pool
            and self._device_type in ("cpu", "cuda")
            and routes_on(self.pool, build=not self.planning_only)
        )

    def _memory_plan(
        self, traced: Traced, *, outputs_in_pool: bool, recompute: Recompute = Recompute.OFF
    ) -> MemoryPlan:
        """What running ``traced`` would ask of the pool and beside it, without running it or
        growing anything (the planning layer's estimate stands on this)."""
        routed = self._routed(outputs_in_pool)
        # The search counts the kernels' scratch as the run's does: the same values recomputed.
        measure = self._measures(routed)
        planned, _ = self._recompute(traced, recompute, measure=measure)
        kernels = self.measure_kernels
        analysis = analyse(planned.gm, self.device, measure=kernels)
        analysis = self._step_floor(analysis, traced, planned, measure=kernels)
        traced = planned
        plan = self._plan(analysis, traced, outputs_in_pool, routed=routed)
        # A routed step's arena grows when its signature is recorded, not when it compiles:
        # what it will ask of the pool is the router's planned arena.
        slot_bytes = {n: round_up(b, 16) for n, b in plan.alone.items()} if routed else None
        return MemoryPlan(
            pooled_bytes=sum(round_up(n, 16) for n in plan.alone.values()),
            unpooled_bytes=plan.unpooled_bytes,
            slot_bytes=plan.slot_bytes if slot_bytes is None else slot_bytes,
            returned_bytes=returned_bytes(traced.gm),
            beside_peak=plan.beside_peak,
            recompute_cost=float(traced.gm.meta.get("recompute_cost", 0.0)),
            floor=analysis.floor,
            floor_op=analysis.floor_op,
        )

    def _step_floor(
        self, analysis: Analysis, traced: Traced, planned: Traced, *, measure: bool
    ) -> Analysis:
        """``analysis`` of ``planned`` (``traced`` with values computed again) with the floor
        of ``traced``: the step's, which no plan goes below. A plan's own graph also runs its
        recomputations, some in the backward beside the backward's values, and its floor is
        higher by that much (ViT-tiny's least memory: a GELU computed again, 51.1 MB against
        the step's 40.5 MB), or lower where a value now dies at an op that can write over it."""
        if planned is traced:
            return analysis
        key = f"sharedmem_step_floor_{measure}"
        floor = traced.gm.meta.get(key)
        if floor is None:  # (a graph as traced is planned once per policy: asked once)
            found = analyse(traced.gm, self.device, measure=measure)
            floor = traced.gm.meta[key] = (found.floor, found.floor_op)
        return dataclasses.replace(analysis, floor=floor[0], floor_op=floor[1])

    def _recompute(
        self, traced: Traced, policy: Recompute, *, measure: bool = False
    ) -> tuple[Traced, int]:
        """``traced`` with its cheap long-idle values computed again where read late (and,
        as ``policy`` allows, its costly ones: see ``recompute``), and how many; the
        per-node baseline keeps the graph as traced. Where time is given for memory and
        ``measure``, the search counts the kernels' measured scratch."""
        if self.plan != "liveness":
            return traced, 0
        scratch = measured_scratch if measure and policy.heavy is not False else None
        gm, count = recompute(traced.gm, heavy=policy.heavy, scratch=scratch)
        return (dataclasses.replace(traced, gm=gm), count) if count else (traced, 0)

    def _plan(
        self, analysis: Analysis, traced: Traced, outputs_in_pool: bool, *, routed: bool = False
    ) -> SlotPlan:
        # Results the caller keeps get fresh memory on each call; everything else is planned.
        # Tensors written back to the module are kept by it: never pool views.
        n_outputs = len(analysis.owned)
        first_kept = 0 if not outputs_in_pool else n_outputs - len(traced.stored)
        kept = frozenset().union(*analysis.returned_by[first_kept:])
        planned = [i for i in range(len(analysis.lifetimes)) if i not in kept]
        # Outputs asked for as pool views must be pool views (analysis.returned: read by
        # outputs; here only those not kept, so those of outputs_in_pool=True).
        wanted = analysis.returned - kept
        index = {life: k for k, life in enumerate(planned)}
        share = self.plan == "liveness"
        found = [
            (index[a], index[b], a, node)
            for (a, b), node in zip(analysis.inplace, analysis.over, strict=True)
            if share and a in index and b in index
        ]
        lifetimes = [analysis.lifetimes[i] for i in planned]
        joined, member = merge(lifetimes, [(a, b) for a, b, _, _ in found])
        existing = self._capacities()
        # The scratch of ops without an out= form is counted at its node, so the plan keeps
        # room for it where eager has it too.
        fresh = [*(analysis.lifetimes[i] for i in kept), *analysis.beside, *analysis.scratch]
        horizon = len(traced.gm.graph.nodes)
        offsets: list[int | None] = [0] * len(joined)
        recording: Recording | None = None
        if routed:
            # Every op allocates as eager does and the router serves it from the arena; what
            # the arena serves is known exactly once a call is recorded. Before that (an
            # estimate), the graph's eager allocation sequence stands for the recording,
            # planned by the router's own planner: every intermediate, result of an op
            # without out= and kernel scratch may go into the arena; what the call returns
            # stays beside.
            returned = analysis.beside_returned
            values = (
                [*joined, *(b for b, r in zip(analysis.beside, returned, strict=True) if not r)],
                [
                    *(analysis.lifetimes[i] for i in kept),
                    *(b for b, r in zip(analysis.beside, returned, strict=True) if r),
                ],
                analysis.scratch,
            )
            # The first call's guide: each measured kernel's own allocations in their order.
            recording = as_recording(*values, analysis.sequences)
            routed_plan = choose_plan(
                as_recording(*values),
                capacity=existing.get(f"{self.prefix}0", 0),
                granularity=self.pool.granularity,
                ceiling=self.pool.growth_room(f"{self.prefix}0"),  # a pool limit, as the router
            )
            offsets = [None] * len(joined)
            names: list[str | None] = [None] * len(joined)
            need: dict[str, int] = {}
            alone = {f"{self.prefix}0": routed_plan.need} if routed_plan.need else {}
        elif share:
            # One arena, planned in the pool's own granularity (what it will really hold). Not
            # the routed steps' arena (``prefix`` 0) where the router may serve one: it fences
            # what a routed call leaves there (gradients, a loss, outputs the user holds),
            # which a slot plan's fixed offsets would write over.
            arena = f"{self.prefix}{1 if self._device_type in ('cpu', 'cuda') else 0}"
            granularity = max(16, self.pool.granularity)
            capacity = existing.get(arena, 0)
            must = frozenset(member[index[i]] for i in wanted)
            placed = place(
                joined,
                fresh,
                capacity,
                horizon=horizon,
                granularity=granularity,
                must=must,
                # what does not fit under the pool's limit runs beside the pool rather than fail
                ceiling=self.pool.growth_room(arena),
                establish=self.prefix not in self.pool.arenas.planned,
            )
            offsets = placed.offsets
            names = [arena if o is not None else None for o in offsets]
            need = {arena: placed.need} if placed.need else {}
            if capacity:
                again = place(joined, fresh, 0, horizon=horizon, granularity=granularity, must=must)
                alone = {arena: again.need} if again.need else {}
            else:
                alone = need
        else:  # the one-buffer-per-node baseline pools everything
            every, need = assign_slots(joined, existing, prefix=self.prefix)
            names = list(every)
            alone = assign_slots(joined, {}, prefix=self.prefix)[1]
        slots: list[str | None] = [None] * len(analysis.lifetimes)
        where = [0] * len(analysis.lifetimes)
        eager: set[int] = set()
        for k, i in enumerate(planned):
            slots[i] = names[member[k]]
            where[i] = offsets[member[k]] or 0
            if slots[i] is None:
                eager.add(i)
        over = {a: node for _, _, a, node in found if a in eager}
        left = [] if routed else [joined[j] for j, name in enumerate(names) if name is None]
        beside_peak = routed_plan.beside_peak if routed else timeline_peak([*fresh, *left])
        ops = [
            op_name(step.node.target)
            for step in analysis.steps
            if not routed and any(life in eager for life in step.lifetimes)
        ]
        # Whole multiples of 16 bytes, so a slot's bytes view as any dtype.
        slot_bytes = {name: round_up(n, 16) for name, n in need.items()}
        return SlotPlan(
            slots,
            where,
            slot_bytes,
            lifetimes,
            joined,
            existing,
            frozenset(eager),
            over,
            beside_peak,
            0 if routed else analysis.unpooled_bytes + sum(life.nbytes for life in left),
            () if routed else tuple(dict.fromkeys([*analysis.unpooled_ops, *ops])),
            alone,
            recording,
        )

    def _summary(
        self,
        gm: torch.fx.GraphModule,
        analysis: Analysis,
        plan: SlotPlan,
        label: str,
        recomputed: int,
    ) -> PlanSummary:
        alone = plan.alone
        return PlanSummary(
            plan=self.plan,
            signature=label,
            nodes=sum(1 for n in gm.graph.nodes if n.op == "call_function"),
            pooled_values=sum(slot is not None for slot in plan.slots),
            slots=len(alone),
            pooled_bytes=sum(alone.values()),
            per_node_bytes=sum(life.nbytes for life in plan.lifetimes),
            added_bytes=sum(
                max(0, n - plan.existing.get(name, 0)) for name, n in plan.slot_bytes.items()
            ),
            unpooled_bytes=plan.unpooled_bytes,
            unpooled_ops=plan.unpooled_ops,
            recomputed=recomputed,
            recompute_cost=float(gm.meta.get("recompute_cost", 0.0)),
            floor=analysis.floor,
            floor_op=analysis.floor_op,
            planned_peak=sum(alone.values()) + plan.beside_peak,
        )

    def _mark_planned(self) -> None:
        # Graphs planned after this one on the pool grow its arena only to lower their peak.
        # (the arena prefixes a pool has had a graph planned for, however empty the arena
        # that plan left: later graphs are not the first)
        self.pool.arenas.planned.add(self.prefix)

    def slot_names(self) -> list[str]:
        """The pool buffers this executor's plans use: ``prefix`` and a number."""
        prefix = self.prefix
        return [n for n in self.pool.names() if n.startswith(prefix) and n[len(prefix) :].isdigit()]

    def _capacities(self) -> dict[str, int]:
        return {n: self.pool.blob(n).data_memory.device_capacity for n in self.slot_names()}

    def _run(
        self, compiled: Compiled, binding: Binding, flat: list[torch.Tensor], adds_into: int = 0
    ) -> list[Any]:
        """Run the graph; write back what it stores on the module; return the other outputs.
        ``adds_into``: the bytes of the gradients the call adds into (``Route.scope``)."""
        self._last = compiled
        enabled = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)  # as torch.no_grad(), without its per-call cost
        if compiled.autocast:  # the recorded ops are already cast: run them as they are
            torch.set_autocast_enabled(self._device_type, False)
        route = compiled.route
        if route is not None:
            flat = route.unalias(flat, len(flat) - compiled.n_data)
        try:
            with nullcontext() if route is None else route.scope(adds_into):
                # A call that fails part-way leaves the module as eager's would: the running
                # statistics of the layers that ran are updated. Copies to put them back would
                # be alive across the whole step, above eager's peak on every batch-norm model.
                outputs = compiled.runner(self.pool.tensor, *flat)
        finally:
            torch._C._set_grad_enabled(enabled)
            if compiled.autocast:
                torch.set_autocast_enabled(self._device_type, True)
        if compiled.unpooled_bytes:
            self.pool.count_unpooled(compiled.unpooled_bytes)
        if not compiled.stored:
            return outputs
        n = len(outputs) - len(compiled.stored)
        for where, value, owned in zip(
            compiled.stored, outputs[n:], compiled.owned[n:], strict=True
        ):
            module = binding.modules[where.path]
            value = value if owned else value.clone()
            if where.kind == "_buffers" and where.attr not in module._buffers:
                module.register_buffer(where.attr, value)  # registered during the forward
            else:
                setattr(module, where.attr, value)  # as the forward's assignment did
        return outputs[:n]


def routed_summary(compiled: Compiled) -> PlanSummary:
    """``compiled``'s summary, with its recorded route (what the arena really serves) where
    the router recorded a call."""
    route = compiled.route
    if route is None or route.plan is None:
        return compiled.summary
    return with_route(compiled.summary, route)


def with_route(summary: PlanSummary, route: Route) -> PlanSummary:
    """``summary`` with the figures of ``route``'s plan (what the arena really serves), its
    planned peak the plan's; ``route`` has a plan."""
    plan = route.plan
    assert plan is not None
    return dataclasses.replace(
        summary,
        pooled_values=sum(offset >= 0 for offset in plan.offsets),
        slots=1 if plan.need else 0,
        pooled_bytes=plan.need,
        per_node_bytes=plan.routed_bytes,
        added_bytes=route.added_bytes,
        unpooled_bytes=plan.beside_bytes,
        unpooled_ops=(),
        routed=route.describe(),
        planned_peak=plan.need + plan.beside_peak,
    )


def returned_bytes(gm: torch.fx.GraphModule) -> int:
    """The bytes of the graph's tensor outputs (from the trace's fake values)."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    nodes = [n for n in pytree.tree_leaves(output.args) if isinstance(n, torch.fx.Node)]
    values = (n.meta.get("val") for n in nodes)
    return sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))


def data_family(*trees: Leaves) -> tuple[object, ...] | None:
    """The part of a signature that its data tensors' sizes leave out: their count, ranks,
    dtypes and devices and the trees' constants; ``None`` where a tensor is not contiguous
    (its strides are part of what a trace fixes)."""
    key: list[object] = []
    for tree in trees:
        if not all(t.is_contiguous() for t in tree.tensors):
            return None
        key.append((tree.spec, tuple(c for c in tree.constants if c is not TENSOR)))
        key.append(tuple((t.dim(), t.dtype, t.device) for t in tree.tensors))
    return tuple(key)


class SizeRule(NamedTuple):
    """How each allocation of a symbolic graph's call follows its sizes: per allocation, the
    candidate sizes (``Traced.sizes``) it matched at every recorded size, or none where its
    size is fixed (``fixed``). Made once per set of recordings, applied at every new size."""

    matched: tuple[tuple[int, ...], ...]
    fixed: tuple[int, ...]  # per allocation, its size where no candidate matched (else -1)
    alloc_at: Sequence[int]
    free_at: Sequence[int]
    # the distinct candidate groups of more than one (each must agree at a new size)
    groups: tuple[tuple[int, ...], ...] = ()


def size_rule(recorded: list[tuple[list[int], Recording]]) -> SizeRule | None:
    """The ``SizeRule`` of the recordings of a symbolic graph at other sizes (``recorded``:
    each with the candidate sizes at its size): ``None`` where nothing was recorded, the
    sequences differ between sizes, or an allocation no candidate matches changed size."""
    if not recorded:
        return None
    first = recorded[0][1]
    if any(r.alloc_at != first.alloc_at or r.free_at != first.free_at for _, r in recorded):
        return None
    where: list[dict[int, set[int]]] = []
    for candidates, _ in recorded:
        found: dict[int, set[int]] = {}
        for c, size in enumerate(candidates):
            found.setdefault(size, set()).add(c)
        where.append(found)
    matched: list[tuple[int, ...]] = []
    fixed: list[int] = []
    for i in range(len(first.sizes)):
        common: set[int] | None = None
        for found, (_, r) in zip(where, recorded, strict=True):
            here = found.get(r.sizes[i], set())
            common = here if common is None else common & here
        if common:
            matched.append(tuple(sorted(common)))
            fixed.append(-1)
            continue
        if len({r.sizes[i] for _, r in recorded}) != 1:
            return None
        matched.append(())
        fixed.append(first.sizes[i])
    groups = tuple(dict.fromkeys(m for m in matched if len(m) > 1))
    return SizeRule(tuple(matched), tuple(fixed), first.alloc_at, first.free_at, groups)


def derive(sizes: list[int], rule: SizeRule | None) -> Recording | None:
    """The allocation sequence of a call at another size of a symbolic graph (``sizes``: its
    candidate sizes there), by ``rule``: each allocation's matched candidates evaluated at
    this size. ``None`` where there is no rule or an allocation's size is ambiguous
    (candidates that matched every recording disagree here): that call is recorded.

    Example::

        >>> from sharedmem._executor.executor import derive, size_rule
        >>> from sharedmem._routing.plan import Recording
        >>> # two recordings: the first allocation is 4t bytes (candidate 0), the second fixed
        >>> rule = size_rule([([32, 8], Recording([32, 64], [0, 1], [2, 3])),
        ...                   ([48, 12], Recording([48, 64], [0, 1], [2, 3]))])
        >>> derive([80, 20], rule).sizes
        [80, 64]
    """
    if rule is None:
        return None
    # Every new size of a family derives its sequence: one pass, no per-allocation loop
    # in Python beyond the list itself (fixed sizes are recorded ones, never negative).
    for group in rule.groups:
        size = sizes[group[0]]
        if any(sizes[c] != size for c in group[1:]):
            return None
    out = [sizes[m[0]] if m else size for m, size in zip(rule.matched, rule.fixed, strict=True)]
    if out and min(out) < 0:
        return None
    return Recording(out, rule.alloc_at, rule.free_at)


def describe(what: str, *trees: Leaves) -> str:
    shapes = ", ".join(
        f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
        for lv in trees
        for t in lv.tensors
    )
    return f"{what} [{shapes}]"
