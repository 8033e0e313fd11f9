"""The two executors users run: a pooled train step and a pooled forward, with a graph per
signature (see ``executor`` for what a signature holds). Their public factories,
``sm.pooled_train_step`` and ``sm.pooled_forward``, live in ``_planning.steps``, which adds
budgets and chunks on top."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

from .._errors import SharedMemError
from .._pool import BufferPool
from .._validate import check_loss_fn
from .accumulate import accumulating, obeys_layout, relayout
from .binding import State
from .calling import OwnLoss, check_targets
from .cost import call_cost, graph_cost
from .distributed import GradientSync, after_forward, sync_buffers
from .executor import Compiled, Executor, MemoryPlan, data_family, describe, returned_bytes
from .trace import Traced, flatten, trace_forward, trace_train

__all__ = ["PooledForward", "PooledTrainStep"]


class PooledTrainStep(Executor):
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
        self._trains = True
        loss_fn = check_loss_fn(loss_fn)  # callable as loss_fn(output, targets), before tracing
        self.own_loss = loss_fn is None
        self.loss_fn: Callable[[Any, Any], torch.Tensor] = OwnLoss() if loss_fn is None else loss_fn
        self._sync = None if self.ddp is None else GradientSync(self.ddp, pool, self.prefix)

    def __call__(self, inputs: object, targets: object = None) -> torch.Tensor:
        """Run forward and backward, add the gradients into ``p.grad``, return the loss."""
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
        key = (*traced_key, present, self._recompute_key())
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
        loss, *grads = self._run(compiled, binding, flat)
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
        result: torch.Tensor = loss if compiled.owned[0] else loss.clone()
        return result

    def memory_plan(
        self, inputs: object, targets: object = None, *, with_grads: bool | None = None
    ) -> MemoryPlan:
        """The memory a call with ``inputs`` and ``targets`` would plan, traced but not run
        (nothing is allocated in the pool). ``with_grads``: planned as if every parameter
        had a ``.grad`` to add into (``True``: a chunk after the first), or none had
        (``False``); by default, as the parameters' ``.grad`` stand now."""
        traced, key, state = self._trace_for(inputs, targets)
        present: tuple[bool, ...] = ()
        if self._sync is None:
            present = tuple(
                p.grad is not None if with_grads is None else with_grads for p in state.params
            )
        recorded = self._recorded((*key, present, self._recompute_key()), returned_bytes(traced.gm))
        traced = self._with_grads(traced, state, present)
        return recorded or self._memory_plan(traced, outputs_in_pool=False)

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
        gm = relayout(traced.gm, state.params, fresh)
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


class PooledForward(Executor):
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
