"""The public faces of the pooled executor and of fitting to a budget:
``sm.pooled_train_step``, ``sm.pooled_forward`` and ``sm.fit_eager_step`` (``sm.fit_step``,
its old name, is deprecated).

The pooled factories return one class each, whatever the arguments: a budget or a chunk count
is a policy the step owns (``step.budget_policy``); without one a step pays nothing for it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._executor import PooledForward, PooledTrainStep
from .._executor.fsdp import fsdp_modules
from .._executor.fsdp_step import ShardedTrainStep
from .._executor.policy import Recompute
from .._pool import BufferPool
from .._validate import check_loss_fn
from .arguments import policy_of
from .chunking import Chunks
from .fit import EagerFitStep, ForwardBudget, TrainBudget
from .fsdp_budget import sharded_train_step

__all__ = ["fit_eager_step", "fit_step", "pooled_forward", "pooled_train_step"]


def pooled_train_step(
    model: nn.Module,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    *,
    pool: BufferPool,
    plan: str = "liveness",
    prefix: str = "act.",
    budget: int | str | None = None,
    chunks: int | Chunks | None = None,
    recompute: Recompute | None = None,
    **deprecated: Any,
) -> PooledTrainStep | ShardedTrainStep:
    """Make a train step that runs ``model`` as an ATen graph with activations in ``pool``.

    ``loss = step(inputs, targets)`` does what
    ``loss = loss_fn(model(inputs), targets); loss.backward()`` does: it runs the forward and
    the backward, adds each parameter's gradient into ``p.grad`` (creating it where it is
    ``None``), so ``optimizer.zero_grad()`` and ``optimizer.step()`` work as usual, updates
    batch-norm running statistics, draws random numbers (dropout) from the global generator
    in eager order, and returns the loss. Results equal eager PyTorch's.

    ``inputs`` are given to the model as the ecosystem gives them: a ``tuple`` is unpacked
    into positional arguments (``model(*inputs)``, as ``torch.jit.trace`` takes example
    inputs), a ``dict`` (or any mapping, a tokenizer's ``BatchEncoding``) into keyword
    arguments (``model(**inputs)``, as transformers' ``Trainer`` calls a model), anything
    else is the one argument (a model that takes one tuple or dict is given ``(batch,)``).
    Without ``loss_fn`` the loss is the model's own, ``out.loss``, ``out["loss"]`` or the
    output itself when it is a scalar, and ``targets`` are left out: a transformers model
    given ``labels`` among its inputs trains as it is, ``step({"input_ids": ids, "labels":
    ids})``.

    The model is traced once per signature (the inputs' shapes, strides, dtypes and devices,
    training flags, the model's structure, autocast and the default dtype) into a joint
    forward+backward graph of ATen ops, which is planned and compiled to a straight-line
    function; later calls of that signature only run it. The plan puts every intermediate
    on one timeline with what runs beside the pool: an intermediate an op can write through
    a native ``out=`` form (or a factory, a copy) goes into a named pool buffer where that
    does not raise the step's peak, and is otherwise allocated as in eager; views and
    in-place ops stay what they are; ops without a native ``out=`` form (convolution, layer
    norm, attention on CPU) allocate as in eager, counted in
    ``pool.stats()["unpooled_bytes_total"]``. The plan's peak is at most what the same graph
    needs on the allocator alone; it can still differ from eager's by the graph's own
    order and kernels (``sm.estimate`` gives both before running).

    The model may change between calls: a replaced, added or removed submodule, parameter or
    buffer, weights untied, or a parameter cast to another dtype or moved to another device
    (``model.double()``), is noticed on the next call, which traces anew. Lazy modules
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
    written back after every call, as in eager. A step is never stale: each call checks
    (in microseconds) the Python values the trace read besides tensors, as
    ``torch.compile``'s guards do: every submodule's attributes and flags (a Dropout's ``p``,
    a batch norm's ``momentum``), the module hooks (global ones too), the closure cells and
    globals of ``loss_fn``, of the forwards and of the hooks; after a change the next call
    captures again and equals eager's. Captures caused by changes are counted in
    ``pool.stats()["recaptures"]``; past 8 for one step (``RECAPTURE_LIMIT``) one warning
    names the value that keeps changing (a value changed every step is better passed in
    as a tensor). Plain values the forward sets on a module (a counter) stay set, as in
    eager, and so capture again on the next call. Module hooks run while tracing: what
    they compute is part of the graph; a hook that would store a traced tensor (or a forward
    that appends one to a list) is refused, as is a hook that returns nothing and computes
    nothing the step uses (storing, printing, counting), since a replayed graph cannot
    repeat it. Gradient hooks on parameters (``register_hook``,
    ``register_post_accumulate_grad_hook``) run on every call with the real gradients, as
    autograd runs them. Under ``torch.no_grad()`` the step raises ``RuntimeError``, as
    ``loss.backward()`` would. Traces in different threads take turns; one executor, or
    one model, must not be called from two threads at once.

    A ``DistributedDataParallel`` model (one pool per rank) gets its gradients averaged as
    DDP averages them, by its process group and buckets, skipped under ``ddp.no_sync()``;
    each bucket's all-reduce starts as soon as its gradients are final. A model sharded with
    ``fully_shard`` (FSDP2; per layer and at the root) is not traced: the step (a
    ``ShardedTrainStep``) prepares it once (``sm.prepare_fsdp``) and runs each call as eager
    FSDP2 runs it, inside ``pool.step()``, so FSDP2's hooks fire and its all-gather and
    reduce-scatter buffers are served from the arena: losses and ``p.grad.full_tensor()``
    equal eager FSDP2's bit for bit (a ``set_requires_gradient_sync(False)`` the user set is
    kept). Its budget runs chunks under ``set_requires_gradient_sync(False)`` but the last
    (one reduce-scatter per step), and where chunks alone do not reach the budget,
    checkpoints every leaf FSDP unit's forward (``torch.utils.checkpoint`` inside the unit),
    chosen from the sharded estimate; its results equal eager FSDP2 run in the same chunks.
    ``recompute=`` and ``plan=`` are refused there. Wrappers whose communication the step
    would skip (FSDP1, ``DataParallel``) raise ``TypeError``.

    **Three questions, three arguments.** A call reads as its job: ``budget=`` (how much
    memory the step may hold), ``chunks=`` (how a batch is cut into micro-batches: a count,
    or an ``sm.Chunks`` record with the count, the loss's ``reduction``, the ``batch_dim``,
    a custom ``split`` and ``exact``) and ``recompute=`` (an ``sm.Recompute``: the most
    modelled time recomputation may add, one meaning wherever it is given)::

        sm.pooled_train_step(model, loss_fn, pool=pool)                      # as traced
        sm.pooled_train_step(..., recompute=sm.Recompute.within(1.3))        # least memory
        sm.pooled_train_step(..., budget="2G")                               # fit a budget
        sm.pooled_train_step(..., budget="2G", recompute=sm.Recompute.within(1.2),
                             chunks=sm.Chunks(batch_dim=1, exact=False))
        sm.pooled_train_step(..., chunks=sm.Chunks(4, reduction="sum"))      # fixed chunks

    (The keywords these records hold, ``reduction=``, ``batch_dim=``, ``split=``,
    ``exact=`` and ``max_slowdown=``, are still taken, with one ``DeprecationWarning``
    naming the new spelling.)

    **The least memory at a stated cost.** ``recompute=sm.Recompute.within(1.3)`` (without a
    budget) recomputes all that lowers the peak within that modelled slowdown (at most 30%
    more time), in one chunk, bit for bit the default step (``sm.Recompute.MOST``: as much
    as lowers the peak): the same solver a budget uses, with the time given instead of the
    memory.

    **Fitting a memory budget.** With ``budget=`` (bytes, a size such as ``"2G"``, or
    ``"free"``) each batch runs as the fewest micro-batches ("chunks", split along the
    record's ``batch_dim``) whose planned peak fits, chosen from the executor's plan before
    anything runs (no trial runs) and kept per input signature, so the same budget and
    shapes always give the same chunks; ``chunks=N`` fixes the count instead. Before
    chunks, a batch that does not fit as planned is tried in one chunk with convolutions
    and matrix products computed again where backward reads them (the same ops on the same
    inputs: bit for bit the unbudgeted step, at the cost of that time). What is recomputed
    is chosen by a cost model (``sharedmem/_executor/cost.py``: a convolution's or matrix
    product's time is its flops, any other op's the bytes it moves): the values that cost
    the least time per byte they free go first, and the least recomputation that fits is
    taken, within ``recompute=`` where it is given (``Recompute.OFF``: nothing costly,
    chunks meet the budget; by default as much as lowers the peak). ``step.recompute`` says
    what the latest choice recomputes (``step.recomputing``: whether it recomputes costly
    ops), ``step.report()`` and ``plan_summary()`` how much and at what modelled cost.
    ``chunks=sm.Chunks(exact=False)`` accepts chunks' different computation where they are
    faster: where both recomputation and chunks fit, the same cost model picks the one that
    adds less time (chunks add a fixed cost per op call and per pass over the weights,
    recomputation its ops), and ``step.report()`` gives both figures. The gradients of
    chunks are accumulated into ``p.grad`` exactly: a mean-reduced loss is weighted by each
    chunk's share of the batch, a sum-reduced one is summed, and the loss returned is the
    whole batch's. A budget covers what the step holds beyond what was there before it: the
    pool's buffers, what runs beside the pool and the gradients. ``"free"`` is what the
    device can give at the start of each batch (on CUDA its free memory, plus the pool's
    buffers; on ``cpu``/``emulated`` the machine's available memory, plus the pool's); a
    pool's ``limit`` also caps the pool's buffers. If one example does not fit,
    ``sm.OutOfMemoryError`` is raised before running, naming the shortfall and the biggest
    consumers. Batch norm in training mode reads the batch as a whole, so its statistics
    (and results) differ between chunked and unchunked steps: the first chunked call warns.
    ``step.chunks_for(inputs, targets)`` and ``step.report()`` say what was chosen. Under
    DDP the chunks before the last run under ``no_sync()``: one all-reduce per step. A call
    that fails part way (an error in its third chunk) leaves the gradients of the chunks
    already run added into ``p.grad``, as eager gradient accumulation over micro-batches
    would: zero them (``optimizer.zero_grad()``) before running the batch again.

    **Figures a user can check.** ``step.last_call`` holds the latest call's peak, planned
    and measured (the arena it was served from and the most PyTorch's allocator held for it
    at once, as the routing allocator saw every allocation), and with a budget whether the
    call held it (``step.last_call.held_budget``); ``step.report()`` and
    ``step.plan_summary()`` print them.

    Args:
        model: the module; on the pool's device (``"emulated"`` pools take CPU modules).
        loss_fn: ``loss_fn(output, targets)`` returns the scalar loss; ``None``: the
            model's own loss (no targets).
        pool: the ``BufferPool`` the activations live in.
        plan: ``"liveness"`` (intermediates whose lifetimes do not overlap share a buffer) or
            ``"per_node"`` (one buffer per intermediate; for comparison).
        prefix: the pool buffer names' prefix.
        budget: bytes, a size (``"2G"``) or ``"free"``: run each batch in the fewest
            chunks that fit.
        chunks: a number of chunks to run each batch in (a batch with fewer examples runs
            in one chunk per example, with a warning once per batch shape), or an
            ``sm.Chunks`` record: that count (``None``: the budget's), how the loss reduces,
            the batch dimension, a custom split, and whether a budget may prefer chunks to
            recomputation (``exact=False``).
        recompute: an ``sm.Recompute``, the most modelled time recomputation may add.
            Without ``budget``: what the step recomputes (``Recompute.OFF``, the default;
            ``Recompute.within(1.3)``; ``Recompute.MOST``). With ``budget``: the cap on what
            the budget may choose (default: no cap). Not with a fixed chunk count.

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
    policy = policy_of("pooled_train_step", budget, chunks, recompute, deprecated)
    if isinstance(model, nn.Module) and fsdp_modules(model):
        # FSDP2: not traced; its eager step runs in pool.step(), so its hooks fire
        return sharded_train_step(
            model, loss_fn, pool=pool, plan=plan, prefix=prefix, policy=policy
        )
    fixed = Recompute.OFF if policy.budgeted or policy.recompute is None else policy.recompute
    step = PooledTrainStep(model, loss_fn, pool, plan, prefix, recompute=fixed)
    if policy.budgeted:
        chunking = policy.chunking
        step.budget_policy = TrainBudget(
            step,
            budget=policy.budget,
            chunks=policy.fixed,
            reduction=chunking.reduction,
            splitter=chunking.splitter,
            max_slowdown=None if policy.recompute is None else policy.recompute.max_slowdown,
            exact=chunking.exact,
        )
    return step


def pooled_forward(
    model: nn.Module,
    *,
    pool: BufferPool,
    plan: str = "liveness",
    prefix: str = "act.",
    outputs_in_pool: bool = False,
    budget: int | str | None = None,
    chunks: int | Chunks | None = None,
    **deprecated: Any,
) -> PooledForward:
    """Make a forward that runs ``model`` without autograd, with activations in ``pool``.

    ``out = fwd(inputs)`` returns what ``with torch.no_grad(): model(inputs)`` returns (a
    tuple of inputs unpacked into positional arguments, a dict into keyword arguments, as in
    ``pooled_train_step``), in the module's current mode (``model.eval()`` for evaluation;
    in training mode dropout is drawn and batch-norm statistics are updated, as in eager).
    Tracing, planning and unpooled ops work as in ``pooled_train_step``; with the same
    ``pool`` and ``prefix`` an eval forward fits into the train step's buffers and adds
    (almost) nothing to the pool.

    By default the outputs are fresh tensors, written directly (no copy) into new memory on
    each call, so they stay valid after later calls. With ``outputs_in_pool=True`` they are
    views into pool buffers instead: nothing is allocated, but the next call of any executor
    on the pool overwrites them; copy what you keep. Passing such a view to an executor on
    the pool (``fwd(fwd(x))``, features for a pooled head) is safe: the call copies it first.
    Outputs are tensors and plain constants in any pytree (a transformers ``ModelOutput``);
    an object a graph cannot return is refused before running with what to pass instead (a
    key/value cache: ``use_cache=False``).

    Args:
        model: the module; on the pool's device (``"emulated"`` pools take CPU modules).
        pool: the ``BufferPool`` the activations live in.
        plan: ``"liveness"`` or ``"per_node"``, as in ``pooled_train_step``.
        prefix: the pool buffer names' prefix.
        outputs_in_pool: return views into the pool instead of fresh tensors (a chunked
            call returns its joined outputs, fresh).
        budget: bytes, a size (``"2G"``) or ``"free"``: run each batch in the fewest chunks
            that fit (as in ``pooled_train_step``); the chunks' outputs are joined along the
            batch dimension.
        chunks: a number of chunks to run each batch in (one per example at most, as in
            ``pooled_train_step``), or ``sm.Chunks(count, batch_dim=...)`` where the batch
            dimension of the inputs and outputs is not 0 (``batch_dim=``, the old keyword,
            is deprecated).

    Example::

        >>> import torch, sharedmem as sm
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU()).eval()
        >>> fwd = sm.pooled_forward(model, pool=sm.BufferPool("cpu"))
        >>> x = torch.randn(2, 4)
        >>> torch.equal(fwd(x), model(x))
        True
    """
    policy = policy_of("pooled_forward", budget, chunks, None, deprecated)
    forward = PooledForward(model, pool, plan, prefix, outputs_in_pool)
    if policy.budgeted:
        forward.budget_policy = ForwardBudget(
            forward, budget=policy.budget, chunks=policy.fixed, splitter=policy.chunking.splitter
        )
    return forward


def fit_eager_step(
    model: nn.Module,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    *,
    budget: int | str | None = None,
    chunks: int | Chunks | None = None,
    **deprecated: Any,
) -> EagerFitStep:
    """Make an eager train step, without a pool, that runs each batch in as many chunks as
    fit a budget.

    ``loss = step(inputs, targets)`` does what
    ``loss = loss_fn(model(inputs), targets); loss.backward()`` does (inputs and the
    model's own loss without ``loss_fn`` as in ``sm.pooled_train_step``), for a plain model
    without a pool: gradients are added into ``p.grad`` as ``backward()`` adds them, and the
    loss returned is the whole batch's (detached). The batch runs as the fewest chunks whose
    peak, estimated on fake tensors before running (``sm.estimate``'s eager model), fits
    ``budget``; choices, weighting, batch norm and errors are as in
    ``sm.pooled_train_step(..., budget=...)``. ``"free"`` is the device's free memory at the
    start of each batch (on CUDA, plus what PyTorch's caching allocator holds unused).

    Args:
        model: the module, in the mode it trains in.
        loss_fn: ``loss_fn(output, targets)`` returns the scalar loss; ``None``: the
            model's own loss (no targets).
        budget: bytes, a size (``"2G"``) or ``"free"``.
        chunks: a fixed number of chunks instead of a budget (for reproducible runs; a
            batch with fewer examples runs in one chunk per example, with a warning), or an
            ``sm.Chunks`` record: that count (``None``: the budget's), ``reduction`` where
            ``loss_fn`` does not say, ``batch_dim`` and a custom ``split``, as in
            ``sm.pooled_train_step`` (the old keywords for these are deprecated).

    Example::

        >>> import torch, sharedmem as sm
        >>> model = torch.nn.Linear(16, 4)
        >>> step = sm.fit_eager_step(model, torch.nn.functional.mse_loss, chunks=4)
        >>> x, y = torch.randn(32, 16), torch.randn(32, 4)
        >>> loss = step(x, y)
        >>> step.chunks_for(x, y), loss.shape
        (4, torch.Size([]))
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"sharedmem: model must be a torch.nn.Module, got {type(model).__name__}")
    check_loss_fn(loss_fn)
    policy = policy_of("fit_eager_step", budget, chunks, None, deprecated)
    if not policy.budgeted:
        raise ValueError(
            "sharedmem: fit_eager_step needs budget=... (bytes, a size such as '8G', or "
            "'free') or chunks=N"
        )
    chunking = policy.chunking
    return EagerFitStep(
        model,
        loss_fn,
        budget=policy.budget,
        chunks=policy.fixed,
        reduction=chunking.reduction,
        splitter=chunking.splitter,
    )


_SAID_FIT_STEP: list[bool] = []


def fit_step(
    model: nn.Module,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    **kwargs: Any,
) -> EagerFitStep:
    """Deprecated: ``sm.fit_eager_step`` (the same eager, poolless step, named for what it is).
    Warns once per process."""
    if not _SAID_FIT_STEP:
        _SAID_FIT_STEP.append(True)
        warnings.warn(
            "sharedmem: fit_step is deprecated: it is the eager step without a pool, now "
            "sm.fit_eager_step (same arguments); for a pooled step that fits a budget use "
            "sm.pooled_train_step(..., budget=...)",
            DeprecationWarning,
            stacklevel=2,
        )
    return fit_eager_step(model, loss_fn, **kwargs)
