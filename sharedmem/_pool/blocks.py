"""Eager blocks served from a pool: ``with pool.step("train", x, y): ...`` around any code
(a user's forward and backward, no tracing) records the block's allocation sequence on its
first run per signature and serves every later run's allocations from one arena of the pool
(see ``_routing``). A pool owns one ``StepBlocks`` and delegates ``step()`` to it.

The routes (a signature's recording and plan) are kept for the ``PLAN_CACHE_SIZE`` signatures
used most recently; the least recently used is dropped when another is added, and recorded
anew if it comes back. A loop that meets a new batch size every call keeps a bounded state.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

import torch
import torch.utils._pytree as pytree

from .._routing import Route, routes_on
from .._validate import check_name

if TYPE_CHECKING:
    from .pool import BufferPool

__all__ = ["PLAN_CACHE_SIZE", "StepBlocks", "grad_state", "signature_of"]

# The most block signatures whose plans and recordings a pool keeps (least recently used
# dropped): a signature costs about 100 bytes per allocation of its call, so 64 of a step
# with a thousand allocations keep about 6 MB.
PLAN_CACHE_SIZE = 64


def signature_of(values: tuple[object, ...]) -> tuple[object, ...]:
    """What fixes a block's allocation sequence, as far as its arguments show it: every
    tensor's shape, strides, dtype, device and ``requires_grad``, every other leaf's type and
    (when hashable) value, and whether autograd is on."""
    leaves, spec = pytree.tree_flatten(values)
    key: list[object] = [str(spec), torch.is_grad_enabled()]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            key.append(
                (tuple(leaf.shape), leaf.stride(), leaf.dtype, leaf.device, leaf.requires_grad)
            )
        else:
            try:
                hash(leaf)
                key.append((type(leaf).__name__, leaf))
            except TypeError:
                key.append(type(leaf).__name__)
    return tuple(key)


def grad_state(params: torch.nn.Module | Iterable[torch.Tensor] | None) -> tuple[bool, ...]:
    """Which of ``params`` have a gradient now (a block's signature holds it: a step that
    makes gradients allocates other bytes than one that adds into them)."""
    if params is None:
        return ()
    if isinstance(params, torch.nn.Module):
        params = params.parameters()
    elif isinstance(params, torch.Tensor):
        raise TypeError(
            "sharedmem: params= takes a module or an iterable of tensors, not one tensor; "
            "pass [tensor]"
        )
    state = []
    for p in params:
        if not isinstance(p, torch.Tensor):
            raise TypeError(
                f"sharedmem: params= must hold tensors, got a {type(p).__name__}; pass a "
                "module or its parameters()"
            )
        state.append(p.grad is not None)
    return tuple(state)


class StepBlocks:
    """The routes of a pool's eager blocks, one per (block name, arena, signature), the
    ``size`` used most recently kept."""

    def __init__(self, pool: BufferPool, size: int = PLAN_CACHE_SIZE) -> None:
        self._pool = weakref.ref(pool)
        self._size = size
        self._routes: OrderedDict[tuple[object, ...], Route] = OrderedDict()
        self._lock = threading.Lock()  # threads may open blocks of one pool at once
        self._evicted = 0

    def block(
        self,
        name: str,
        inputs: tuple[object, ...],
        arena: str,
        params: torch.nn.Module | Iterable[torch.Tensor] | None = None,
    ) -> AbstractContextManager[None]:
        check_name(name, "step name")
        check_name(arena, "arena name")
        grads = grad_state(params)
        pool = self._pool()
        assert pool is not None, "the pool is gone"
        if not routes_on(pool):
            # No router serves this pool's device (or none could be built): as it is.
            return nullcontext()
        key = (name, arena, signature_of(inputs), grads)
        with self._lock:
            route = self._routes.get(key)
            if route is None:
                route = self._routes[key] = Route(pool, arena, training=torch.is_grad_enabled())
                while len(self._routes) > self._size:
                    self._routes.popitem(last=False)  # a call still in it keeps its own
                    self._evicted += 1
            else:
                self._routes.move_to_end(key)
        return route.scope()

    def routes(self) -> dict[tuple[object, ...], Route]:
        """The blocks' routes kept now, least recently used first (for reports and tests)."""
        with self._lock:
            return dict(self._routes)

    def clear(self) -> int:
        """Drop every kept route (each signature is recorded anew on its next call); returns
        how many were kept."""
        with self._lock:
            dropped = len(self._routes)
            self._routes.clear()
        return dropped

    def stats(self) -> dict[str, int]:
        """``cached_plans``: the signatures kept now; ``evicted_plans``: those dropped as
        least recently used so far."""
        with self._lock:
            return {"cached_plans": len(self._routes), "evicted_plans": self._evicted}
