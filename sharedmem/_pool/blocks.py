"""Eager blocks served from a pool: ``with pool.step("train", x, y): ...`` around any code
(a user's forward and backward, no tracing) records the block's allocation sequence on its
first run per signature and serves every later run's allocations from one arena of the pool
(see ``_routing``). A pool owns one ``StepBlocks`` and delegates ``step()`` to it.

The routes (a signature's recording and plan) are kept for the ``PLAN_CACHE_SIZE`` signatures
used most recently; the least recently used is dropped when another is added, and recorded
anew if it comes back. A loop that meets a new batch size every call keeps a bounded state.

A block's first call in an accumulation state (``params=`` given; gradients present that were
``None`` when the block last recorded) is planned before it runs, from that recording
(``accumulating``): the same allocations, each gradient it made added into the one held now
and freed where the recorded call stored it (a hook on each parameter notes how many
allocations the call had made then). That call is served from the room the held gradients
leave at its plan's peak, where by best fit alone it met that room split (ResNet-18, batch 8:
22% of it served, 84%).
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING

import torch
import torch.utils._pytree as pytree

from .._routing import Recording, Route, native, routes_on
from .._validate import check_name

if TYPE_CHECKING:
    from .pool import BufferPool

__all__ = ["PLAN_CACHE_SIZE", "StepBlocks", "accumulating", "grad_state", "listed", "signature_of"]

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


def listed(params: torch.nn.Module | Iterable[torch.Tensor] | None) -> tuple[torch.Tensor, ...]:
    """``params=`` as a tuple of its tensors, read once (a block reads them again after its
    signature: a generator would be spent); ``()`` for ``None``."""
    if params is None:
        return ()
    if isinstance(params, torch.Tensor):
        raise TypeError(
            "sharedmem: params= takes a module or an iterable of tensors, not one tensor; "
            "pass [tensor]"
        )
    found = tuple(params.parameters() if isinstance(params, torch.nn.Module) else params)
    for p in found:
        if not isinstance(p, torch.Tensor):
            raise TypeError(
                f"sharedmem: params= must hold tensors, got a {type(p).__name__}; pass a "
                "module or its parameters()"
            )
    return found


def grad_state(params: tuple[torch.Tensor, ...]) -> tuple[bool, ...]:
    """Which of ``params`` (``listed``) have a gradient now (a block's signature holds it: a
    step that makes gradients allocates other bytes than one that adds into them)."""
    return tuple(p.grad is not None for p in params)


def accumulating(
    recording: Recording, made: Counter[int], noted: Sequence[tuple[int, int]] = ()
) -> Recording:
    """``recording``, a block's call that made gradients (each was ``None``), as the same
    block's call with them present predicts it: the same allocations in the same order, each
    that outlived the call with the bytes of a gradient made then (``made``: bytes, count)
    now added into the gradient and freed.

    Where each is freed comes from ``noted``: per gradient the recorded call stored, its
    bytes and how many allocations the call had made then (``StepBlocks`` notes it with a
    hook). The autograd engine adds a gradient into the held one at the point of its
    schedule where it stored it, and frees it at once: the latest allocation of that size
    made before then that outlived the call is predicted freed before the next allocation.
    One not noted is predicted freed before the third allocation after it (ResNet-18's are
    freed within two allocations, but ConvNeXt's and DenseNet's up to five after, at the
    end of the node that made them, which only the note tells).

    Example::

        >>> from collections import Counter
        >>> from sharedmem._pool.blocks import accumulating
        >>> from sharedmem._routing import Recording
        >>> rec = Recording([64, 32, 8, 16, 4], [0, 1, 2, 3, 5], [4, -1, 6, -1, -1])
        >>> accumulating(rec, Counter({32: 1, 16: 1})).free_at
        [4, 5, 6, 7, -1]
        >>> accumulating(rec, Counter({32: 1, 16: 1}), [(32, 2), (16, 5)]).free_at
        [4, 2, 6, 7, -1]
    """
    left = Counter(made)
    order = sorted(range(len(recording.sizes)), key=recording.alloc_at.__getitem__)
    ticks = [recording.alloc_at[i] for i in order]
    end = max([*recording.alloc_at, *recording.free_at], default=0) + 1
    free_at = list(recording.free_at)
    for size, count in sorted(noted, key=lambda note: note[1]):
        for k in range(min(count, len(order)) - 1, -1, -1):
            i = order[k]
            if left[size] > 0 and free_at[i] < 0 and recording.sizes[i] == size:
                left[size] -= 1
                free_at[i] = ticks[count] if count < len(ticks) else end
                break
    for k, i in enumerate(order):
        size = recording.sizes[i]
        if free_at[i] < 0 and size > 0 and left[size] > 0:
            left[size] -= 1
            free_at[i] = ticks[k + 3] if k + 3 < len(ticks) else end
    return Recording(list(recording.sizes), list(recording.alloc_at), free_at)


class StepBlocks:
    """The routes of a pool's eager blocks, one per (block name, arena, signature), the
    ``size`` used most recently kept."""

    def __init__(self, pool: BufferPool, size: int = PLAN_CACHE_SIZE) -> None:
        self._pool = weakref.ref(pool)
        self._size = size
        self._routes: OrderedDict[tuple[object, ...], Route] = OrderedDict()
        # Per route kept, where its recorded call accumulated each gradient it made (bytes,
        # allocations made then): what ``accumulating`` predicts their frees by.
        self._noted: dict[tuple[object, ...], list[tuple[int, int]]] = {}
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
        tensors = listed(params)  # refuses one tensor, or anything but tensors
        grads = grad_state(tensors)
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
                predicted = self._accumulating(key, tensors)
                if predicted is not None:
                    route.predict(predicted, recorded=True)
                while len(self._routes) > self._size:
                    dropped, _ = self._routes.popitem(last=False)  # a call in it keeps its own
                    self._noted.pop(dropped, None)
                    self._evicted += 1
            else:
                self._routes.move_to_end(key)
            noting = route.recording is None and not all(grads)  # (no params: all of none)
        if noting:
            return self._noting(key, route, tensors)
        # The bytes of the gradients the call adds into: where the arena does not hold
        # them (the user replaced them), the route gives back what the call does not need.
        return route.scope(sum(t.grad.nbytes for t in tensors if t.grad is not None))

    @contextmanager
    def _noting(
        self,
        key: tuple[object, ...],
        route: Route,
        params: tuple[torch.Tensor, ...],
    ) -> Iterator[None]:
        """``route``'s call, which records and makes gradients, with a hook on each
        parameter whose gradient is ``None`` noting how many allocations the call had made
        when the engine stored it there (``accumulating``: where a call of this block in the
        accumulation state frees the gradient it makes). The hooks are gone when it ends."""
        router = native()
        noted: list[tuple[int, int]] = []

        def note(param: torch.Tensor) -> None:
            made = -1 if router is None else int(router.allocations())
            if made >= 0 and param.grad is not None:
                noted.append((param.grad.untyped_storage().nbytes(), made))

        handles = [
            p.register_post_accumulate_grad_hook(note)  # type: ignore[no-untyped-call]
            for p in params
            if p.grad is None and p.requires_grad and p.is_leaf
        ]
        try:
            with route.scope():
                yield
        finally:
            for handle in handles:
                handle.remove()
        with self._lock:
            if route.recording is not None and key in self._routes:
                self._noted[key] = noted

    def _accumulating(
        self,
        key: tuple[object, ...],
        params: tuple[torch.Tensor, ...],
    ) -> Recording | None:
        """The sequence a block's first call in an accumulation state (gradients present
        that were ``None``) is predicted to allocate, from the same block's recording in the
        state where they were ``None`` (``None``: there is none; the call records by best fit
        in the room the held gradients leave). Planned before it runs (``Route.predict``), the
        call is served at the plan's peak (ResNet-18, batch 8: 22% of it served by best fit,
        where its plan serves 84%). The caller holds the lock."""
        grads = key[3]
        assert isinstance(grads, tuple)
        if not any(grads):
            return None
        for other, route in reversed(self._routes.items()):
            was = other[3]
            assert isinstance(was, tuple)
            if other[:3] != key[:3] or len(was) != len(grads) or route.recording is None:
                continue
            if any(a and not b for a, b in zip(was, grads, strict=True)) or was == grads:
                continue  # a gradient that was there is gone: not an accumulation
            made = Counter(
                p.numel() * p.element_size()
                for p, a, b in zip(params, was, grads, strict=True)
                if b and not a
            )
            return accumulating(route.recording, made, self._noted.get(other, ()))
        return None

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
            self._noted.clear()
        return dropped

    def stats(self) -> dict[str, int]:
        """``cached_plans``: the signatures kept now; ``evicted_plans``: those dropped as
        least recently used so far."""
        with self._lock:
            return {"cached_plans": len(self._routes), "evicted_plans": self._evicted}
