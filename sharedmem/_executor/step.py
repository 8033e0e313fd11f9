"""The two entry points: a pooled train step and a pooled forward, with a graph per signature
(see ``executor`` for what a signature holds)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from .._pool import BufferPool
from .distributed import GradientSync, after_forward, sync_buffers
from .executor import Executor, MemoryPlan, describe
from .trace import flatten, trace_forward, trace_train

__all__ = ["PooledForward", "PooledTrainStep", "pooled_forward", "pooled_train_step"]


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
        if not callable(loss_fn):
            raise TypeError(f"sharedmem: loss_fn must be callable, got {type(loss_fn).__name__}")
        self.loss_fn: Callable[[Any, Any], torch.Tensor] = loss_fn
        self._sync = None if self.ddp is None else GradientSync(self.ddp, pool, self.prefix)

    def __call__(self, inputs: object, targets: object) -> torch.Tensor:
        """Run forward and backward, add the gradients into ``p.grad``, return the loss."""
        binding, state = self._state()
        x = flatten(inputs, "inputs")
        y = flatten(targets, "targets")
        mode = self._mode()
        key = (state.key, x.key, y.key, mode)
        compiled = self._cache.get(key)
        if compiled is None:
            self._check_devices(state, x, y)
            traced = trace_train(self.model, self.loss_fn, binding, state, x, y)
            label = describe("train step", x, y)
            n_data = len(x.tensors) + len(y.tensors)
            compiled = self._build(
                traced,
                label=label,
                n_data=n_data,
                autocast=mode.autocast,
                outputs_in_pool=False,
                grad_ready=None if self._sync is None else self._sync.ready,
            )
            self._cache[key] = compiled
        if self._sync is not None:
            self._sync.begin(state.params)
        flat = [*state.params, *state.buffers, *x.tensors, *y.tensors]
        loss, *grads = self._run(compiled, binding, flat)
        owned_grads = compiled.owned[1 : 1 + len(grads)]
        for p, g, owned in zip(state.params, grads, owned_grads, strict=True):
            if g is None:
                continue
            if p.grad is None:
                # As autograd's AccumulateGrad: keep a fresh gradient that has the parameter's
                # layout as it is, copy anything else into the parameter's layout.
                keep = owned and g.stride() == p.stride()
                p.grad = g if keep else torch.empty_like(p).copy_(g)
            else:
                p.grad.add_(g)
        if self._sync is not None:
            self._sync.finish()
        result: torch.Tensor = loss if compiled.owned[0] else loss.clone()
        return result

    def memory_plan(self, inputs: object, targets: object) -> MemoryPlan:
        """The memory a call with ``inputs`` and ``targets`` would plan, traced but not run
        (nothing is allocated in the pool)."""
        binding, state = self._state()
        x, y = flatten(inputs, "inputs"), flatten(targets, "targets")
        self._check_devices(state, x, y)
        traced = trace_train(self.model, self.loss_fn, binding, state, x, y)
        return self._memory_plan(traced, outputs_in_pool=False)


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
            traced = trace_forward(self.model, binding, state, x)
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
        self._check_devices(state, x)
        traced = trace_forward(self.model, binding, state, x)
        return self._memory_plan(traced, outputs_in_pool=self.outputs_in_pool)


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

    The model is traced once per signature (the inputs' shapes, strides, dtypes and devices,
    training flags, the model's structure, autocast and the default dtype) into a joint
    forward+backward graph of ATen ops, which is planned and compiled to a straight-line
    function; later calls of that signature only run it. Every intermediate an op allocates
    is written into a named pool buffer through the op's ``out=`` form; views and in-place
    ops stay what they are; ops without a native ``out=`` form allocate as in eager and are
    counted in ``pool.stats()["unpooled_bytes_total"]``.

    The model may change between calls: a replaced, added or removed submodule, parameter or
    buffer, or weights untied, is noticed on the next call, which traces anew. Lazy modules
    (``nn.LazyLinear``) must be initialized by one eager forward first.

    Returned tensors are never views into the pool: the loss and new gradients are fresh
    tensors (as in eager), so nothing the caller holds is overwritten by the next call. The
    loss is detached (it does not require grad).

    Buffers are named ``prefix`` + a number and shared by every executor using that prefix on
    the pool, so a ``pooled_forward`` (eval) reuses the train step's buffers. An input that
    is itself a view into those buffers (an ``outputs_in_pool=True`` output of another call)
    is copied before the call overwrites them.

    The module's Python code runs only while tracing. Tensors it stores on the module (a
    buffer it rebinds, ``self.avg = 0.9 * self.avg + ...``; a tensor attribute it sets) are
    written back after every call, as in eager; other Python-side state (counters, tensors
    put in lists, data-dependent branches) is fixed at trace time, and tracing puts every
    attribute of every submodule back as it was. Hooks registered on parameter tensors, and
    module hooks added after a signature was traced, are not run. Traces in different
    threads take turns; one executor, or one model, must not be called from two threads at
    once.

    A ``DistributedDataParallel`` model (one pool per rank) gets its gradients averaged as
    DDP averages them, by its process group and buckets, skipped under ``ddp.no_sync()``;
    each bucket's all-reduce starts as soon as its gradients are final. Wrappers whose
    communication the step would skip (FSDP, ``DataParallel``) raise ``TypeError``.

    Args:
        model: the module, or a ``DistributedDataParallel`` around it; on the pool's device
            (``"emulated"`` pools take CPU modules).
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
    on the pool overwrites them; copy what you keep. Passing such a view to an executor on
    the pool (``fwd(fwd(x))``, features for a pooled head) is safe: the call copies it first.

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
