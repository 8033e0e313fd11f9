"""Eager blocks served from a pool: ``with pool.step("train", x, y): ...`` around any code
(a user's forward and backward, no tracing) records the block's allocation sequence on its
first run per signature and serves every later run's allocations from one arena of the pool
(see ``_routing``). A pool owns one ``StepBlocks`` and delegates ``step()`` to it."""

from __future__ import annotations

import weakref
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

import torch
import torch.utils._pytree as pytree

from .._routing import Route, routes_on
from .._validate import check_name

if TYPE_CHECKING:
    from .pool import BufferPool

__all__ = ["StepBlocks", "signature_of"]


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


class StepBlocks:
    """The routes of a pool's eager blocks, one per (block name, arena, signature)."""

    def __init__(self, pool: BufferPool) -> None:
        self._pool = weakref.ref(pool)
        self._routes: dict[tuple[object, ...], Route] = {}

    def block(
        self, name: str, inputs: tuple[object, ...], arena: str
    ) -> AbstractContextManager[None]:
        check_name(name, "step name")
        check_name(arena, "arena name")
        pool = self._pool()
        assert pool is not None, "the pool is gone"
        if not routes_on(pool):
            # No router serves this pool's device (or none could be built): as it is.
            return nullcontext()
        key = (name, arena, signature_of(inputs))
        route = self._routes.get(key)
        if route is None:
            route = self._routes[key] = Route(pool, arena, training=torch.is_grad_enabled())
        return route.scope()

    def routes(self) -> dict[tuple[object, ...], Route]:
        """Every block's route so far (for reports and tests)."""
        return dict(self._routes)
