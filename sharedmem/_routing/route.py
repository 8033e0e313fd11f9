"""Record, plan, replay: one signature's allocations served from one arena of a pool.

The first call of a signature runs with the router recording (every allocation is
PyTorch's, as without a pool); its sequence is planned (``plan_offsets``) and the arena, a
named buffer of the pool, grown once to hold it. Later calls replay: the n-th allocation
gets its planned address. A call that leaves its plan (another size, another count, or an
allocation whose bytes are still held) is served by PyTorch from there on, counted, and the
signature is recorded anew on its next call; no byte of a live tensor is ever handed out
twice, since the router checks every planned address against the arena's live allocations.

An arena allocation still alive when the call ends has escaped (a hook or a list kept it):
it is neither moved nor an error. Its bytes stay fenced off, exactly as long as the tensor
lives (the router refuses any later allocation that would overlap them), the pool keeps the
arena while any such tensor lives (``trim`` and ``release`` leave it alone), and the
signature is recorded anew so that its next plan knows the value outlives the call.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from .._backends import cuda_torch_ops
from .cuda_native import cuda_router
from .native import loaded, native
from .plan import Recording, RoutePlan, choose_plan, plan_offsets

if TYPE_CHECKING:
    from .._pool import BufferPool

__all__ = ["COUNTERS", "Route", "arena_live_bytes", "routes_on"]

# The pool counters the router adds to (``pool.stats()``), defined here once.
COUNTERS = (
    "arena_served_bytes",  # allocations served from the arena
    "arena_fallback_bytes",  # allocations dying inside a step that PyTorch served
    "arena_escaped_bytes",  # arena allocations still alive when their step ended
    "recorded_calls",  # calls that recorded their sequence (served by PyTorch)
    "replayed_calls",  # calls served by a plan
    "diverged_calls",  # replays that left their plan part way
)


# The arenas a training step (autograd on) has been planned on: an inference step planned on
# one of those fits in what it has, so that evaluation after training adds nothing.
_TRAINED: weakref.WeakKeyDictionary[BufferPool, set[str]] = weakref.WeakKeyDictionary()
# Where each arena was when a replay last served from it: the router's live allocations are
# keyed by address.
_BASES: weakref.WeakKeyDictionary[BufferPool, dict[str, int]] = weakref.WeakKeyDictionary()


class Route:
    """One signature's allocation sequence over the arena ``arena`` of ``pool``.

    Args:
        pool: the pool that holds the arena: a CPU or emulated pool (the CPU router serves
            its steps), or a CUDA pool once ``install_cuda_router`` ran (the CUDA router, by
            the step's stream).
        arena: the arena's buffer name; routes of one pool that share it share its bytes
            (train and eval, every batch size), each planned from offset 0.
        training: a training step's route (its arena grows to the step's plan); an inference
            route grows the arena only while no training route has been planned on it.
    """

    def __init__(self, pool: BufferPool, arena: str, *, training: bool) -> None:
        self._pool = pool
        self._arena = arena
        self.training = training
        self.plan: RoutePlan | None = None
        self.recording: Recording | None = None
        self._native_plan: Any = None
        self.last: dict[str, int] = {}  # the counts of the latest replay
        self.added_bytes = 0  # what planning this route grew the arena by
        self._planned_for = 0  # the arena's capacity the plan was made for
        self._rerecorded = 0  # times a stale plan (outliving allocations that died) was redone

    @contextmanager
    def scope(self) -> Iterator[None]:
        """Serve the block's allocations on this thread: recorded on the first call (and after
        a divergence), replayed from the arena after."""
        router = _scopes(self._pool)
        if router is None or router.active():  # no router, or a step inside a step
            yield
            return
        if self.plan is None:
            router.begin_record()
            completed = False
            try:
                yield
                completed = True
            finally:
                recording = Recording(*router.end_record())
            self._pool.count("recorded_calls", 1)
            if completed:  # a failed call's sequence is not the signature's
                self._adopt(recording)
            return
        if self.recording is not None and self._capacity() != self._planned_for:
            # Other routes grew the arena (or it was trimmed) since this plan was made: plan
            # the recorded sequence again for the arena as it is now, without growing it
            # (the arena grows only when a signature is recorded, so steady state is steady).
            self._adopt(self.recording, grow=False)
        plan = self.plan
        assert plan is not None
        base = size = 0
        if plan.need:
            arena = self._pool.tensor(self._arena, (plan.need,), torch.uint8)
            base, size = arena.data_ptr(), arena.numel()
            _BASES.setdefault(self._pool, {})[self._arena] = base
        held = router.live_bytes(base) if base else 0
        router.begin_replay(self._native_plan, base, size)
        try:
            yield
        finally:
            self._account(router.end_replay(), held)

    def unalias(self, tensors: list[torch.Tensor], first: int) -> list[torch.Tensor]:
        """``tensors`` with those from ``first`` on that view the arena's bytes (a pool view an
        earlier step returned, fed back in) copied out first: the step's own allocations may
        be placed over them."""
        base = _BASES.get(self._pool, {}).get(self._arena)
        if base is None or self._arena not in self._pool:
            return tensors
        top = base + self._pool.blob(self._arena).data_memory.device_capacity
        out = tensors
        for i in range(first, len(tensors)):
            t = tensors[i]
            start = t.untyped_storage().data_ptr()
            if base <= start < top or start <= base < start + t.untyped_storage().nbytes():
                if out is tensors:
                    out = list(tensors)
                out[i] = t.clone()
        return out

    def _adopt(self, recording: Recording, *, grow: bool = True) -> None:
        # Outside any scope: growing the arena is the pool's own allocation.
        from .._errors import OutOfMemoryError

        before = self._capacity()
        ceiling = self._ceiling() if grow else before
        plan = choose_plan(
            recording, capacity=before, granularity=self._pool.granularity, ceiling=ceiling
        )
        if plan.need:
            try:
                view = self._pool.tensor(self._arena, (plan.need,), torch.uint8)
                _BASES.setdefault(self._pool, {})[self._arena] = view.data_ptr()
            except OutOfMemoryError:  # the limit's arithmetic was off: keep to what is there
                plan = plan_offsets(recording, ceiling=self._capacity())
        self.recording = recording
        self.plan = plan
        self._planned_for = self._capacity()
        self.added_bytes = max(self.added_bytes, self._planned_for - before)
        # To the router: -1 for what outlived the recorded call, -2 for what the plan left out.
        offsets = [
            o if o >= 0 else (-1 if f < 0 else -2)
            for o, f in zip(plan.offsets, recording.free_at, strict=True)
        ]
        module = _module(self._pool)
        assert module is not None, "a route is planned only where a router runs"
        self._native_plan = module.Plan(list(recording.sizes), offsets)

    def _capacity(self) -> int:
        if self._arena not in self._pool:
            return 0
        return self._pool.blob(self._arena).data_memory.device_capacity

    def _ceiling(self) -> int | None:
        capacity = self._capacity()
        room = self._pool.growth_room(self._arena)
        trained = _TRAINED.setdefault(self._pool, set())
        if self.training:
            trained.add(self._arena)
        elif self._arena in trained:
            return capacity  # evaluation after training: what the training steps made
        if capacity and not self._pool.stable_address and arena_live_bytes(self._pool, self._arena):
            return capacity  # escaped tensors live in it: a moving growth would strand them
        return room

    def _account(self, counts: dict[str, int], held: int) -> None:
        self.last = counts
        pool = self._pool
        pool.count("replayed_calls", 1)
        pool.count("arena_served_bytes", counts["served_bytes"])
        assert self.plan is not None
        beside = counts["fell_back_bytes"] + self.plan.beside_bytes
        pool.count("arena_fallback_bytes", beside)
        pool.count_unpooled(beside)
        escaped = counts["live_bytes"] - held
        if counts["diverged_at"] >= 0:
            pool.count("diverged_calls", 1)
        if escaped > 0:
            pool.count("arena_escaped_bytes", escaped)
            warnings.warn(
                f"sharedmem: {escaped:,} bytes of a step's arena were still referenced when the "
                "step ended (a hook or a list kept a tensor of the step): they stay fenced off "
                "until that tensor is freed, and the step is recorded anew so that its next "
                "plan leaves them to PyTorch's allocator",
                RuntimeWarning,
                stacklevel=4,
            )
        # Allocations the plan left to PyTorch as outliving the call died inside it after all
        # (the recording ran in another state: gradients absent then, present now): record
        # anew, a few times at most, so that a block alternating between two states does not
        # spend every other call recording.
        stale = counts["planned_out_freed_bytes"] > 0 and self._rerecorded < 3
        if stale:
            self._rerecorded += 1
        if counts["diverged_at"] >= 0 or escaped > 0 or stale:
            self.plan = None  # recorded anew on the next call

    def describe(self) -> str:
        """One line on the plan: what is served from the arena, against max-live."""
        plan, recording = self.plan, self.recording
        if plan is None or recording is None:
            return "not recorded yet"
        over = plan.need / plan.lower_bound - 1 if plan.lower_bound else 0.0
        return (
            f"{len(recording.sizes):,} allocations per call; {plan.routed_bytes:,} bytes served "
            f"from an arena of {plan.need:,} bytes (max-live {plan.lower_bound:,}, "
            f"{over:+.1%}); {recording.outliving_bytes:,} bytes outlive the call{_kept(recording)}"
        )


def _kept(recording: Recording) -> str:
    """Where most of the call's peak is its floor, say so: no placement goes below it."""
    peak, floor = recording.live_peak(), recording.floor()
    if not peak or floor < peak / 2:
        return ""
    return (
        f"; its floor, {floor / peak:.0%} of the call's peak, is what outlives it (gradients, "
        "returned values) beside the largest allocation made with it: no placement lowers it"
    )


def arena_live_bytes(pool: BufferPool, name: str) -> int:
    """Bytes of routed allocations alive now in the buffer ``name`` of ``pool`` (0 where the
    router never served from it): a buffer holding any must not move or be freed."""
    router = _module(pool, build=False)
    base = _BASES.get(pool, {}).get(name)
    if router is None or base is None:
        return 0
    return int(router.live_bytes(base))


def routes_on(pool: BufferPool) -> bool:
    """Whether a router serves steps on ``pool``: the CPU router on a CPU or emulated pool
    (built at first use), the CUDA router on a CUDA pool once it was installed."""
    return _module(pool) is not None


def _module(pool: BufferPool, *, build: bool = True) -> Any | None:
    """The router module of ``pool``'s device (``build=False``: only if loaded already)."""
    if _on_cuda(pool):
        return cuda_router()
    return native() if build else loaded()


def _on_cuda(pool: BufferPool) -> bool:
    return pool.device.startswith("cuda")


def _scopes(pool: BufferPool) -> Any | None:
    """The scopes a step of ``pool`` opens: the CPU router's, one per thread; the CUDA
    router's, one per stream (the device's current stream when the step begins)."""
    module = _module(pool)
    if module is None or not _on_cuda(pool):
        return module
    index = torch.device(pool.device).index
    if index is None:
        index = cuda_torch_ops.ops().current_device()
    return _StreamScopes(module, index)


class _StreamScopes:
    """The CUDA router's calls in the CPU router's shape, for one (device, stream)."""

    def __init__(self, module: Any, index: int) -> None:
        self._module = module
        self._key = (index, int(cuda_torch_ops.ops().current_stream(index).cuda_stream))

    def active(self) -> bool:
        return bool(self._module.active(*self._key))

    def begin_record(self) -> None:
        self._module.begin_record(*self._key)

    def end_record(self) -> list[list[int]]:
        return list(self._module.end_record(*self._key))

    def begin_replay(self, plan: Any, base: int, size: int) -> None:
        self._module.begin_replay(plan, base, size, *self._key)

    def end_replay(self) -> dict[str, int]:
        return dict(self._module.end_replay(*self._key))

    def live_bytes(self, base: int) -> int:
        return int(self._module.live_bytes(base))
