"""Pooled steps under ``torch.distributed``: what a ``DistributedDataParallel`` wrapper adds.

A pooled step runs the wrapped module's graph, never ``DDP.forward``, so DDP's autograd
hooks never fire and its reducer never sees a gradient. This module does the reducer's work
the same way, driven by the DDP object itself: its process group, its parameter list, its
bucketing (its initial buckets, then rebuilt once, in the order the first synchronised step
made its gradients final, the second with ``static_graph``, as the reducer's
``rebuild_buckets`` does; never with ``find_unused_parameters``), its
``no_sync()`` flag, its buffer broadcast before the forward. Each gradient is multiplied by
``1 / world_size`` while it is copied into its bucket and the buckets are summed with one
all-reduce each, as the reducer does, so the results equal eager DDP's bit for bit.

The generated code calls ``GradientSync.ready`` right after the op that makes a gradient
final; a bucket's all-reduce starts (asynchronously) as soon as its last gradient is in, so
it runs while the rest of the backward is computed. ``finish`` waits for every bucket and
copies the averaged values back into ``p.grad``.

A wrapper whose semantics the pooled step cannot reproduce (FSDP, ``DataParallel``,
``replicate``, a DDP with communication hooks or mixed precision, a DDP subclass with its own
``forward``) is refused: running the inner module would give silently wrong gradients. An
FSDP2 (``fully_shard``) model never reaches this module: ``sm.pooled_train_step`` runs its eager
step inside ``pool.step()`` (``fsdp_step``); a pooled forward refuses it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch.fx import Graph, Node

from .._backends import round_up
from .._pool import BufferPool
from .codegen import mutates
from .graph import graph_outputs

__all__ = ["GradientSync", "after_forward", "bucket_bytes", "grad_taps", "sync_buffers", "unwrap"]

DDP = nn.parallel.DistributedDataParallel


def unwrap(model: nn.Module) -> tuple[nn.Module, Any]:
    """The module a pooled step runs, and the DDP wrapper around it (``None`` if none).

    Raises ``TypeError`` (``sharedmem:``) for a wrapper the pooled step cannot honour.
    """
    ddp = model if isinstance(model, DDP) else None
    if ddp is not None:
        _check_ddp(ddp)
        model = ddp.module
    refused = _refused_kinds()
    for name, module in model.named_modules():
        where = f"the submodule {name!r}" if name else "the model"
        what = refused(module)
        if what is not None:
            eager = "run this model eagerly (save_on_pool works there)"
            if what.startswith("fully_shard"):
                # Tested bit for bit against eager FSDP2 (tests/test_distributed.py).
                eager = (
                    "sm.pooled_train_step, which takes an FSDP2 model (sharded at the root) and "
                    "runs its eager step served from the pool; elsewhere call "
                    "sm.prepare_fsdp(model) once, then run it eagerly inside "
                    '`with pool.step("eval", *inputs):`'
                )
            raise TypeError(
                f"sharedmem: {where} is wrapped by {what}, which a pooled step cannot honour "
                "(its forward and backward do communication the pooled graph would skip, "
                "giving silently wrong gradients); use pooled steps with "
                f"DistributedDataParallel, or {eager}"
            )
    return model, ddp


def _refused_kinds() -> Callable[[nn.Module], str | None]:
    """What names the wrapper of a module that a pooled step cannot honour (``None``: none).

    Imported here, not with the package: a PyTorch build without ``torch.distributed`` has
    only ``DataParallel`` to refuse.
    """
    if not dist.is_available():
        return lambda m: "DataParallel" if isinstance(m, nn.DataParallel) else None
    from torch.distributed._composable_state import _get_module_state
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    def refused(module: nn.Module) -> str | None:
        if isinstance(module, DDP):
            return "DistributedDataParallel (nested: wrap the whole model once)"
        if isinstance(module, nn.DataParallel):
            return "DataParallel"
        if isinstance(module, FullyShardedDataParallel):
            return "FullyShardedDataParallel"
        if isinstance(module, FSDPModule):
            return "fully_shard (FSDP2)"
        if _get_module_state(module) is not None:
            return "a torch.distributed composable API (replicate, fully_shard)"
        return None

    return refused


def _check_ddp(ddp: Any) -> None:
    reasons = []
    if type(ddp).forward is not DDP.forward:
        reasons.append(f"{type(ddp).__name__} overrides forward")
    if ddp._comm_hooks or ddp._get_ddp_logging_data().get("comm_hook"):
        reasons.append("it has a communication hook")
    if ddp.mixed_precision is not None:
        reasons.append("it has mixed_precision")
    if ddp._delay_all_reduce_params or ddp._use_python_reducer:
        reasons.append("it delays or hand-codes its all-reduce")
    if any(ddp._build_params_for_reducer()[1]):
        reasons.append("it expects sparse gradients")
    if reasons:
        raise TypeError(
            "sharedmem: this DistributedDataParallel cannot run as a pooled step: "
            f"{'; '.join(reasons)}. Wrap the model in a plain DistributedDataParallel, or run "
            "it eagerly"
        )


def sync_buffers(ddp: Any) -> None:
    """Before a forward, broadcast the module's buffers from rank 0 as ``DDP.forward`` would
    (when the previous forward was a synchronised training one and ``broadcast_buffers``)."""
    if ddp._check_sync_bufs_pre_fwd():
        ddp._sync_buffers()


def after_forward(ddp: Any, *, synced_backward: bool) -> None:
    """What ``DDP.forward`` records for the next forward's buffer broadcast."""
    ddp.require_forward_param_sync = synced_backward


def grad_taps(graph: Graph, first: int, count: int) -> dict[Node, list[tuple[int, int]]]:
    """Where in ``graph`` each of the outputs ``first .. first + count - 1`` becomes final.

    Returns, for each node, the gradients whose value is final once that node has run (the
    node that produces the output, or the last op writing into it in place), as pairs of the
    gradient's number (from 0) and its position among the outputs.

    Args:
        graph: a traced train graph.
        first: the position of the first gradient among the graph's outputs.
        count: how many gradients follow it.
    """
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    outputs = graph_outputs(nodes[-1])
    taps: dict[Node, list[tuple[int, int]]] = {}
    for k in range(count):
        value = outputs[first + k]
        if not isinstance(value, Node):
            continue
        writers = [u for u in value.users if u.op == "call_function" and mutates(u)]
        final = max([value, *writers], key=position.__getitem__)
        taps.setdefault(final, []).append((k, first + k))
    return taps


class GradientSync:
    """The gradient all-reduce of one DDP model's pooled steps, bucket by bucket.

    Args:
        ddp: the ``DistributedDataParallel`` wrapper.
        pool: where the buckets live (one buffer, named ``prefix`` + ``ddp.buckets``).
        prefix: the step's buffer prefix.
    """

    def __init__(self, ddp: Any, pool: BufferPool, prefix: str) -> None:
        self.ddp = ddp
        self.pool = pool
        self.prefix = prefix
        self.group = ddp.process_group
        self.scale = 1.0 / self.group.size()
        # The reducer's parameters, in its order (what it buckets by index).
        self.params: list[torch.Tensor] = ddp._build_params_for_reducer()[0]
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.buckets = _initial_buckets(ddp, self.params)
        self.nbytes = sum(round_up(p.numel() * p.element_size(), 16) for p in self.params)
        self._views_key: tuple[int, list[list[int]]] | None = None
        # The bucket layout is rebuilt once, in the order a synchronised step made gradients
        # final (unless unused parameters are searched for, as DDP).
        self.rebuild = ddp.static_graph or not ddp.find_unused_parameters
        self.order: list[int] = []
        self.synced_steps = 0
        self.active = False
        self.step_params: Sequence[torch.Tensor] = ()
        self.where: list[int] = []  # step parameter k -> reducer index (-1: not reduced)
        self._where_key: tuple[int, ...] = ()
        self.views: list[torch.Tensor | None] = []
        self.flats: list[torch.Tensor] = []
        self.pending: list[int] = []
        self.works: list[Any] = []
        self.done: list[bool] = []
        self.bucket_of: dict[int, int] = {}

    def begin(self, params: Sequence[torch.Tensor]) -> None:
        """Before a step's graph runs: note whether this step synchronises (``no_sync()``),
        fetch the buckets and map the step's parameters to the reducer's."""
        sync_buffers(self.ddp)
        self.active = bool(self.ddp.require_backward_grad_sync)
        if not self.active:
            return
        key = tuple(id(p) for p in params)
        if key != self._where_key:
            self.where = [self.index.get(id(p), -1) for p in params]
            self._where_key = key
        self.step_params = params
        # All buckets share one pool buffer, so rebuilding them reuses its bytes. A view per
        # step: on a moving backend the buffer may have moved since the last one.
        raw = self.pool.tensor(f"{self.prefix}ddp.buckets", (self.nbytes,), torch.uint8)
        if (raw.data_ptr(), self.buckets) != self._views_key:
            self._views_key = (raw.data_ptr(), self.buckets)
            self.views = [None] * len(self.params)
            self.flats = []
            start = 0
            for bucket in self.buckets:
                numel = sum(self.params[i].numel() for i in bucket)
                dtype = self.params[bucket[0]].dtype  # a bucket holds one dtype
                flat = raw[start : start + numel * dtype.itemsize].view(dtype)
                start += round_up(numel * dtype.itemsize, 16)
                offset = 0
                for i in bucket:
                    p = self.params[i]
                    self.views[i] = _bucket_view(flat, offset, p)
                    offset += p.numel()
                self.flats.append(flat)
        self.bucket_of = {i: b for b, bucket in enumerate(self.buckets) for i in bucket}
        self.pending = [len(bucket) for bucket in self.buckets]
        self.done = [False] * len(self.buckets)
        self.works = [None] * len(self.buckets)
        self.order = []

    def ready(self, k: int, grad: torch.Tensor) -> None:
        """Gradient ``k`` of the step is final: scale it into its bucket (after adding the
        gradient already in ``p.grad``, as AccumulateGrad would) and start the bucket's
        all-reduce if it was the bucket's last."""
        if not self.active:
            return
        i = self.where[k]
        if i < 0:
            return
        view = self.views[i]
        assert view is not None
        held = self.step_params[k].grad
        if held is None:
            torch.mul(grad, self.scale, out=view)
        else:
            torch.add(held, grad, out=view)
            view.mul_(self.scale)
        self.order.append(i)
        b = self.bucket_of[i]
        self.pending[b] -= 1
        if self.pending[b] == 0:
            self._launch(b)

    def finish(self) -> None:
        """After the step has put its gradients into ``p.grad``: reduce the buckets not yet
        started (parameters that got no gradient count their ``p.grad``, or zeros), wait
        for every bucket and copy the averages back into ``p.grad``."""
        if not self.active:
            after_forward(self.ddp, synced_backward=False)
            return
        self.active = False
        done = set(self.order)
        for b, bucket in enumerate(self.buckets):
            if self.done[b]:
                continue
            for i in bucket:
                if i in done:
                    continue
                view, grad = self.views[i], self.params[i].grad
                assert view is not None
                if grad is None:
                    view.zero_()
                else:
                    torch.mul(grad, self.scale, out=view)
            self._launch(b)
        for b, bucket in enumerate(self.buckets):
            self.works[b].wait()
            for i in bucket:
                p, view = self.params[i], self.views[i]
                assert view is not None
                if p.grad is None:
                    p.grad = view.clone(memory_format=torch.preserve_format)
                else:
                    p.grad.copy_(view)
        self.synced_steps += 1
        # A static graph's first step all-reduces everything at its end and records nothing:
        # DDP rebuilds after its second step instead.
        if self.rebuild and self.synced_steps == (2 if self.ddp.static_graph else 1):
            self.rebuild = False
            order = self.order + [i for i in range(len(self.params)) if i not in done]
            self.buckets = _rebuilt_buckets(self.ddp, self.params, order)
        self.works = []
        after_forward(self.ddp, synced_backward=torch.is_grad_enabled())

    def _launch(self, b: int) -> None:
        self.done[b] = True
        self.works[b] = dist.all_reduce(self.flats[b], group=self.group, async_op=True)


def _bucket_view(flat: torch.Tensor, offset: int, p: torch.Tensor) -> torch.Tensor:
    # The reducer lays a dense parameter's gradient out with the parameter's strides (its
    # gradient layout contract), anything else contiguously; the layout decides where each
    # element sits in the bucket, and so the order the ranks' values are summed in.
    if is_non_overlapping_and_dense_or_false(p):
        return flat.as_strided(p.shape, p.stride(), flat.storage_offset() + offset)
    return flat[offset : offset + p.numel()].view(p.shape)


def _limits(ddp: Any) -> tuple[list[int], list[int]]:
    """DDP's bucket size limits: for its first buckets, and for rebuilding them."""
    config = getattr(ddp, "_bucket_config", None)
    if config is not None:  # torch 2.12 and later keep them in one object
        initial, rebuilding = config.compute_bucket_size_limits(
            static_graph=ddp.static_graph, find_unused_parameters=ddp.find_unused_parameters
        )
        return initial, rebuilding or [config.first_bucket_bytes_cap, config.bucket_bytes_cap]
    # Older torch computes the same in DDP's _ddp_init_helper, from its attributes.
    cap, custom = ddp.bucket_bytes_cap, list(getattr(ddp, "bucket_bytes_cap_list", None) or [])
    default_first: int = getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", 1 << 20)
    first = default_first if ddp.bucket_bytes_cap_default else cap
    if custom:
        return custom, custom
    if ddp.static_graph or not ddp.find_unused_parameters:
        return [sys.maxsize], [first, cap]
    return ([first, cap] if first < cap else [cap]), [first, cap]


def _initial_buckets(ddp: Any, params: list[torch.Tensor]) -> list[list[int]]:
    # As DDP's constructor: assigned in parameter order, then reversed (the order in which
    # gradients are expected to be produced).
    from torch._C._distributed_c10d import _compute_bucket_assignment_by_size

    indices, _ = _compute_bucket_assignment_by_size(params, _limits(ddp)[0])
    return [list(bucket) for bucket in reversed(indices)]


def _rebuilt_buckets(ddp: Any, params: list[torch.Tensor], order: list[int]) -> list[list[int]]:
    # As the reducer's rebuild_buckets: the parameters in the order their gradients became
    # final, a small first bucket, then the usual cap.
    from torch._C._distributed_c10d import _compute_bucket_assignment_by_size

    ordered = [params[i] for i in order]
    limits = _limits(ddp)[1]
    indices, _ = _compute_bucket_assignment_by_size(ordered, limits, [], order)
    return [list(bucket) for bucket in indices]


def bucket_bytes(ddp: Any) -> int:
    """The bytes of ``ddp``'s gradient buckets: every parameter it reduces, once."""
    return sum(p.numel() * p.element_size() for p in ddp._build_params_for_reducer()[0])
