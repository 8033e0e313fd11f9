"""The two entry points: a pooled train step and a pooled forward, with a graph per signature.

A signature is everything a trace fixes: the shapes, strides, dtypes and devices of the
inputs (and targets), their non-tensor values, the training flag of every submodule, and the
parameters' and buffers' shapes, dtypes, devices and ``requires_grad``. The first call of a
signature traces, plans and generates code; later calls only look the signature up and run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from .._pool import BufferPool
from .._validate import check_name
from .codegen import Runner, generate
from .graph import analyse
from .plan import PLANS, PlanSummary, assign_slots, merge
from .trace import Binding, Leaves, State, flatten, trace_forward, trace_train

__all__ = ["PooledForward", "PooledTrainStep", "pooled_forward", "pooled_train_step"]


@dataclass(frozen=True)
class _Compiled:
    runner: Runner
    source: str
    summary: PlanSummary
    owned: tuple[bool, ...]
    unpooled_bytes: int
    out_spec: pytree.TreeSpec | None = None


class _Executor:
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
        self.model = model
        self.pool = pool
        self.plan = str(plan)
        self.prefix = check_name(prefix)
        device = pool.device
        self.device = torch.device("cpu" if device == "emulated" else device)
        self._cache: dict[tuple[object, ...], _Compiled] = {}
        self._last: _Compiled | None = None
        self._binding: Binding | None = None

    def _state(self) -> State:
        if self._binding is None:
            self._binding = Binding(self.model)
        return self._binding.state()

    def plan_summary(self) -> PlanSummary:
        """What the graph of the latest call asks of the pool, and what its plan saves."""
        if self._last is None:
            raise ValueError("sharedmem: plan_summary() needs a first call to trace a graph")
        return self._last.summary

    def plan_summaries(self) -> list[PlanSummary]:
        """The plan of every signature traced so far, in the order they were first seen."""
        return [c.summary for c in self._cache.values()]

    def source(self) -> str:
        """The generated Python code of the latest call's graph (for reading and debugging)."""
        if self._last is None:
            raise ValueError("sharedmem: source() needs a first call to trace a graph")
        return self._last.source

    def _check_devices(self, state: State, *leaves: Leaves) -> None:
        tensors = [*state.params, *state.buffers, *(t for lv in leaves for t in lv.tensors)]
        for t in tensors:
            if t.device != self.device:
                raise ValueError(
                    f"sharedmem: the pool is on {self.pool.device!r} but a tensor of the call is "
                    f"on {t.device}; keep the model and its inputs on {self.device}"
                )

    def _build(self, gm: torch.fx.GraphModule, outputs_in_pool: bool, label: str) -> _Compiled:
        analysis = analyse(gm, self.device)
        # Results the caller keeps get fresh memory on each call; everything else is planned.
        planned = [
            i
            for i in range(len(analysis.lifetimes))
            if outputs_in_pool or i not in analysis.returned
        ]
        index = {life: k for k, life in enumerate(planned)}
        pairs = [
            (index[a], index[b])
            for a, b in analysis.inplace
            if self.plan == "liveness" and a in index and b in index
        ]
        lifetimes = [analysis.lifetimes[i] for i in planned]
        joined, member = merge(lifetimes, pairs)
        share = self.plan == "liveness"
        existing = self._capacities()
        names, need = assign_slots(joined, existing, share=share, prefix=self.prefix)
        slots: list[str | None] = [None] * len(analysis.lifetimes)
        for k, i in enumerate(planned):
            slots[i] = names[member[k]]
        # Whole multiples of 16 bytes, so a slot's bytes view as any dtype.
        slot_bytes = {name: -(-n // 16) * 16 for name, n in need.items()}
        for name, nbytes in slot_bytes.items():
            # Grow now, once: views fetched during a call then never see a growth.
            self.pool.tensor(name, (nbytes,), torch.uint8)
        runner, source = generate(gm, analysis.steps, slots, slot_bytes, self.device, label)
        alone = assign_slots(joined, {}, share=share, prefix=self.prefix)[1]
        summary = PlanSummary(
            plan=self.plan,
            signature=label,
            nodes=sum(1 for n in gm.graph.nodes if n.op == "call_function"),
            pooled_values=len(planned),
            slots=len(alone),
            pooled_bytes=sum(alone.values()),
            per_node_bytes=sum(life.nbytes for life in lifetimes),
            added_bytes=sum(max(0, n - existing.get(name, 0)) for name, n in slot_bytes.items()),
            unpooled_bytes=analysis.unpooled_bytes,
            unpooled_ops=analysis.unpooled_ops,
        )
        return _Compiled(runner, source, summary, analysis.owned, analysis.unpooled_bytes)

    def _capacities(self) -> dict[str, int]:
        slots = {}
        for name in self.pool.names():
            if name.startswith(self.prefix) and name[len(self.prefix) :].isdigit():
                slots[name] = self.pool.blob(name).data_memory.device_capacity
        return slots

    def _run(self, compiled: _Compiled, flat: list[torch.Tensor]) -> list[Any]:
        self._last = compiled
        enabled = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)  # as torch.no_grad(), without its per-call cost
        try:
            outputs = compiled.runner(self.pool.tensor, *flat)
        finally:
            torch._C._set_grad_enabled(enabled)
        if compiled.unpooled_bytes:
            self.pool.count_unpooled(compiled.unpooled_bytes)
        return outputs


def _describe(what: str, *trees: Leaves) -> str:
    shapes = ", ".join(
        f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
        for lv in trees
        for t in lv.tensors
    )
    return f"{what} [{shapes}]"


class PooledTrainStep(_Executor):
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
    ) -> None:
        super().__init__(model, pool, plan, prefix)
        if not callable(loss_fn):
            raise TypeError(f"sharedmem: loss_fn must be callable, got {type(loss_fn).__name__}")
        self.loss_fn: Callable[[Any, Any], torch.Tensor] = loss_fn

    def __call__(self, inputs: object, targets: object) -> torch.Tensor:
        """Run forward and backward, add the gradients into ``p.grad``, return the loss."""
        state = self._state()
        x = flatten(inputs, "inputs")
        y = flatten(targets, "targets")
        key = (state.key, x.key, y.key)
        compiled = self._cache.get(key)
        if compiled is None:
            self._check_devices(state, x, y)
            gm = trace_train(self.model, self.loss_fn, state, x, y)
            label = _describe("train step", x, y)
            compiled = self._build(gm, False, label)
            self._cache[key] = compiled
        loss, *grads = self._run(compiled, [*state.params, *state.buffers, *x.tensors, *y.tensors])
        for p, g, owned in zip(state.params, grads, compiled.owned[1:], strict=True):
            if g is None:
                continue
            if p.grad is None:
                # As autograd's AccumulateGrad: keep a fresh gradient that has the parameter's
                # layout as it is, copy anything else into the parameter's layout.
                keep = owned and g.stride() == p.stride()
                p.grad = g if keep else torch.empty_like(p).copy_(g)
            else:
                p.grad.add_(g)
        result: torch.Tensor = loss if compiled.owned[0] else loss.clone()
        return result


class PooledForward(_Executor):
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

    def __call__(self, inputs: object) -> Any:
        """Run the forward without autograd and return the model's output."""
        state = self._state()
        x = flatten(inputs, "inputs")
        key = (state.key, x.key)
        compiled = self._cache.get(key)
        if compiled is None:
            self._check_devices(state, x)
            gm, spec = trace_forward(self.model, state, x)
            label = _describe("train-mode forward" if self.model.training else "forward", x)
            compiled = self._build(gm, self.outputs_in_pool, label)
            compiled = dataclasses.replace(compiled, out_spec=spec)
            self._cache[key] = compiled
        outputs = self._run(compiled, [*state.params, *state.buffers, *x.tensors])
        assert compiled.out_spec is not None
        return pytree.tree_unflatten(outputs, compiled.out_spec)


def pooled_train_step(
    model: nn.Module,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    *,
    pool: BufferPool,
    plan: str = "liveness",
    prefix: str = "act.",
) -> PooledTrainStep:
    """Make a train step that runs ``model`` as an ATen graph with activations in ``pool``.

    ``loss = step(inputs, targets)`` does what
    ``loss = loss_fn(model(inputs), targets); loss.backward()`` does: it runs the forward and
    the backward, adds each parameter's gradient into ``p.grad`` (creating it where it is
    ``None``), so ``optimizer.zero_grad()`` and ``optimizer.step()`` work as usual, updates
    batch-norm running statistics, draws random numbers (dropout) from the global generator
    in eager order, and returns the loss. Results equal eager PyTorch's.

    The model is traced once per input signature (shapes, strides, dtypes, devices, training
    flags) into a joint forward+backward graph of ATen ops, which is planned and compiled to a
    straight-line function; later calls of that signature only run it. Every intermediate an
    op allocates is written into a named pool buffer through the op's ``out=`` form; views
    and in-place ops stay what they are; ops without a native ``out=`` form allocate as in
    eager and are counted in ``pool.stats()["unpooled_bytes"]``.

    Returned tensors are never views into the pool: the loss and new gradients are fresh
    tensors (as in eager), so nothing the caller holds is overwritten by the next call. The
    loss is detached (it does not require grad).

    Buffers are named ``prefix`` + a number and shared by every executor using that prefix on
    the pool, so a ``pooled_forward`` (eval) reuses the train step's buffers. Calls are not
    thread-safe. The module's Python code runs only while tracing: Python-side state it keeps
    (counters, data-dependent branches) is fixed at trace time, and hooks registered on
    parameter tensors are not run.

    Args:
        model: the module; on the pool's device (``"emulated"`` pools take CPU modules).
        loss_fn: ``loss_fn(model(inputs), targets)`` returns the scalar loss.
        pool: the ``BufferPool`` the activations live in.
        plan: ``"liveness"`` (intermediates whose lifetimes do not overlap share a buffer) or
            ``"per_node"`` (one buffer per intermediate; for comparison).
        prefix: the pool buffer names' prefix.

    Example::

        >>> import torch, sharedmem as sm
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
        ...                             torch.nn.Linear(8, 1))
        >>> pool = sm.BufferPool("cpu")
        >>> step = sm.pooled_train_step(model, torch.nn.functional.mse_loss, pool=pool)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> x, y = torch.randn(16, 4), torch.randn(16, 1)
        >>> for _ in range(3):
        ...     opt.zero_grad()
        ...     loss = step(x, y)
        ...     opt.step()
        >>> loss.shape, model[0].weight.grad.shape
        (torch.Size([]), torch.Size([8, 4]))
    """
    return PooledTrainStep(model, loss_fn, pool, plan, prefix)


def pooled_forward(
    model: nn.Module,
    *,
    pool: BufferPool,
    plan: str = "liveness",
    prefix: str = "act.",
    outputs_in_pool: bool = False,
) -> PooledForward:
    """Make a forward that runs ``model`` without autograd, with activations in ``pool``.

    ``out = fwd(inputs)`` returns what ``with torch.no_grad(): model(inputs)`` returns, in
    the module's current mode (``model.eval()`` for evaluation; in training mode dropout is
    drawn and batch-norm statistics are updated, as in eager). Tracing, planning and unpooled
    ops work as in ``pooled_train_step``; with the same ``pool`` and ``prefix`` an eval
    forward fits into the train step's buffers and adds (almost) nothing to the pool.

    By default the outputs are fresh tensors, written directly (no copy) into new memory on
    each call, so they stay valid after later calls. With ``outputs_in_pool=True`` they are
    views into pool buffers instead: nothing is allocated, but the next call of any executor
    on the pool overwrites them; copy what you keep.

    Args:
        model: the module; on the pool's device (``"emulated"`` pools take CPU modules).
        pool: the ``BufferPool`` the activations live in.
        plan: ``"liveness"`` or ``"per_node"``, as in ``pooled_train_step``.
        prefix: the pool buffer names' prefix.
        outputs_in_pool: return views into the pool instead of fresh tensors.

    Example::

        >>> import torch, sharedmem as sm
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU()).eval()
        >>> fwd = sm.pooled_forward(model, pool=sm.BufferPool("cpu"))
        >>> x = torch.randn(2, 4)
        >>> torch.equal(fwd(x), model(x))
        True
    """
    return PooledForward(model, pool, plan, prefix, outputs_in_pool)
