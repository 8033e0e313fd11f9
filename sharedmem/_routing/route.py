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

Threads: a route may be entered by several threads at once. Each call holds the arena buffer
it serves from for as long as it runs; a call that finds it held serves from a lane of its
own (``Arenas.lease``: another buffer of the host, grown to the plan's need), so no two calls
ever hand out the same bytes, and none waits for another. The route's plan changes under a
lock; each call serves and accounts by the plan it began with.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch

from .._backends import cuda_torch_ops
from .._errors import OutOfMemoryError
from .cuda_native import cuda_router
from .host import ArenaHost
from .native import loaded, native, would_load
from .plan import Recording, RoutePlan, choose_plan, plan_offsets

__all__ = ["COUNTERS", "CallPeak", "Route", "arena_live_bytes", "routes_on"]

# The pool counters the router adds to (``pool.stats()``), defined here once.
COUNTERS = (
    "arena_served_bytes",  # allocations served from the arena
    "arena_fallback_bytes",  # allocations dying inside a step that PyTorch served
    "arena_escaped_bytes",  # arena allocations still alive when their step ended
    "recorded_calls",  # calls that recorded their sequence (served by PyTorch)
    "replayed_calls",  # calls served by a plan
    "diverged_calls",  # replays that left their plan part way
)


class CallPeak(NamedTuple):
    """The peak of one routed call as the router saw it: the bytes of the arena it was
    served from (held during the call), and the most bytes PyTorch's allocator held for it
    at once. A recorded call's allocations are all watched, each from its allocation to its
    free. A replay's are each checked against the recorded sequence (size and order): while
    it keeps to its plan, what it holds beside the arena is the recorded sequence's; after
    it leaves it (``on_plan`` false), everything served from there on is added whole (an
    upper bound)."""

    arena_bytes: int
    beside_peak: int
    recorded: bool
    on_plan: bool

    @property
    def total(self) -> int:
        return self.arena_bytes + self.beside_peak


class Route:
    """One signature's allocation sequence over the arena ``arena`` of ``host``.

    Args:
        host: what holds the arena (a ``BufferPool``): a CPU or emulated pool (the CPU router
            serves its steps), or a CUDA pool once ``install_cuda_router`` ran (the CUDA
            router, by the step's stream).
        arena: the arena's buffer name; routes of one host that share it share its bytes
            (train and eval, every batch size), each planned from offset 0.
        training: a training step's route (its arena grows to the step's plan); an inference
            route grows the arena only while no training route has been planned on it.
    """

    def __init__(self, host: ArenaHost, arena: str, *, training: bool) -> None:
        self._host = host
        self._arena = arena
        self.training = training
        self.plan: RoutePlan | None = None
        self.recording: Recording | None = None
        self._native_plan: Any = None
        self.last: dict[str, int] = {}  # the counts of the latest replay
        self.added_bytes = 0  # what planning this route grew the arena by
        self._planned_for = 0  # the arena's capacity the plan was made for
        self._rerecorded = 0  # times a stale plan (outliving allocations that died) was redone
        self._lock = threading.Lock()  # guards the plan: threads may run one route at once
        self.last_peak: CallPeak | None = None  # the latest call's, as the router saw it

    @contextmanager
    def scope(self) -> Iterator[None]:
        """Serve the block's allocations on this thread: recorded on the first call (and after
        a divergence), replayed from the arena after."""
        router = _scopes(self._host)
        self.last_peak = None
        if router is None or router.active():  # no router, or a step inside a step
            yield
            return
        arenas = self._host.arenas
        lane = arenas.lease(self._arena)
        try:
            with self._lock:
                if (
                    self.plan is not None
                    and self.recording is not None
                    and self._capacity() != self._planned_for
                ):
                    # Other routes grew the arena (or it was trimmed) since this plan was
                    # made: plan the recorded sequence again for the arena as it is now,
                    # without growing it (the arena grows only when a signature is recorded,
                    # so steady state is steady).
                    self._adopt(self.recording, lane, grow=False)
                plan, native_plan = self.plan, self._native_plan
            place = None if plan is None else self._place(lane, plan)
            if plan is None or place is None:
                before = self._host.device_capacity(lane)
                router.begin_record()
                completed = False
                try:
                    yield
                    completed = True
                finally:
                    recording = Recording(*router.end_record())
                if completed:  # a failed call's sequence is not the signature's
                    self._recorded(recording, lane, beside=plan is not None)
                # The arena held through the call, then grown (after it) beside what outlives it.
                after = self._host.device_capacity(lane)
                peak = max(before + recording.live_peak(), after + recording.outliving_bytes)
                self.last_peak = CallPeak(after, peak - after, True, True)
                return
            base, size = place
            held = router.live_bytes(base) if base else 0
            router.begin_replay(native_plan, base, size)
            try:
                yield
            finally:
                counts = router.end_replay()
                on_plan = counts["diverged_at"] < 0
                beside = plan.beside_peak + (0 if on_plan else counts["fell_back_bytes"])
                self.last_peak = CallPeak(size, beside, False, on_plan)
                with self._lock:
                    self._account(counts, held, plan)
        finally:
            arenas.give_back(lane)

    def _place(self, lane: str, plan: RoutePlan) -> tuple[int, int] | None:
        """The address and size of ``lane`` for a replay of ``plan`` (grown to its need where
        it is smaller: a lane's first use, a trimmed arena), or ``None`` where it cannot be
        (the pool's limit, or a moving buffer that holds kept tensors): the call then runs
        beside the arena."""
        if not plan.need:
            return 0, 0
        host = self._host
        if (
            host.device_capacity(lane) < plan.need
            and not host.stable_address
            and arena_live_bytes(host, lane)
        ):
            return None  # growing would move the bytes kept tensors live in
        try:
            view = host.tensor(lane, (plan.need,), torch.uint8)
        except OutOfMemoryError:
            return None
        host.arenas.served_from(lane, view.data_ptr())
        return view.data_ptr(), view.numel()

    def _recorded(self, recording: Recording, lane: str, *, beside: bool) -> None:
        """A recorded call ended: its sequence planned (unless another thread planned the
        signature meanwhile), or where a plan existed but the call ran beside the arena
        (``beside``), its dying bytes counted as served by PyTorch."""
        host = self._host
        if beside:
            dying = recording.total_bytes - recording.outliving_bytes
            host.count("arena_fallback_bytes", dying)
            host.count_unpooled(dying)
            return
        host.count("recorded_calls", 1)
        with self._lock:
            if self.plan is None:
                self._adopt(recording, lane)

    def derive(self, recording: Recording) -> None:
        """Plan ``recording``, a sequence derived rather than recorded (another size of a
        graph traced with symbolic sizes), before this route's first call: that call then
        replays it, and where it leaves it, it is recorded anew as any divergence is."""
        with self._lock:
            if self.plan is None:
                self._adopt(recording, self._arena)

    def unalias(self, tensors: list[torch.Tensor], first: int) -> list[torch.Tensor]:
        """``tensors`` with those from ``first`` on that view the arena's bytes (a pool view an
        earlier step returned, fed back in) copied out first: the step's own allocations may
        be placed over them."""
        spans = [
            (base, base + self._host.device_capacity(name))
            for name, base in self._host.arenas.lanes(self._arena)
            if name in self._host
        ]
        if not spans:
            return tensors
        out = tensors
        for i in range(first, len(tensors)):
            t = tensors[i]
            start = t.untyped_storage().data_ptr()
            end = start + t.untyped_storage().nbytes()
            if any(base <= start < top or start <= base < end for base, top in spans):
                if out is tensors:
                    out = list(tensors)
                out[i] = t.clone()
        return out

    def _adopt(self, recording: Recording, lane: str, *, grow: bool = True) -> None:
        # Outside any scope: growing the arena is the pool's own allocation. Only the call
        # that holds the arena grows it; one on another lane grows that lane as it replays.
        host = self._host
        before = self._capacity()
        ceiling = self._ceiling() if grow else before
        plan = choose_plan(
            recording, capacity=before, granularity=host.granularity, ceiling=ceiling
        )
        if plan.need and lane == self._arena:  # its base too: inputs are unaliased against it
            try:
                view = host.tensor(self._arena, (plan.need,), torch.uint8)
                host.arenas.served_from(self._arena, view.data_ptr())
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
        module = _module(host)
        assert module is not None, "a route is planned only where a router runs"
        self._native_plan = module.Plan(list(recording.sizes), offsets)

    def _capacity(self) -> int:
        return self._host.device_capacity(self._arena)

    def _ceiling(self) -> int | None:
        host = self._host
        capacity = self._capacity()
        room = host.growth_room(self._arena)
        trained = host.arenas.trained
        if self.training:
            trained.add(self._arena)
        elif self._arena in trained:
            return capacity  # evaluation after training: what the training steps made
        if capacity and not host.stable_address and arena_live_bytes(host, self._arena):
            return capacity  # escaped tensors live in it: a moving growth would strand them
        return room

    def _account(self, counts: dict[str, int], held: int, plan: RoutePlan) -> None:
        """A replay of ``plan`` ended with the router's ``counts`` (the caller holds the
        lock); ``held``: the arena's live bytes when it began."""
        self.last = counts
        host = self._host
        host.count("replayed_calls", 1)
        host.count("arena_served_bytes", counts["served_bytes"])
        beside = counts["fell_back_bytes"] + plan.beside_bytes
        host.count("arena_fallback_bytes", beside)
        host.count_unpooled(beside)
        escaped = counts["live_bytes"] - held
        if counts["diverged_at"] >= 0:
            host.count("diverged_calls", 1)
        if escaped > 0:
            host.count("arena_escaped_bytes", escaped)
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
        if (counts["diverged_at"] >= 0 or escaped > 0 or stale) and self.plan is plan:
            self.plan = None  # recorded anew on the next call (unless another call replanned)

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


def arena_live_bytes(host: ArenaHost, name: str) -> int:
    """Bytes of routed allocations alive now in the buffer ``name`` of ``host`` (0 where the
    router never served from it): a buffer holding any must not move or be freed."""
    router = _module(host, build=False)
    base = host.arenas.base(name)
    if router is None or base is None:
        return 0
    return int(router.live_bytes(base))


def routes_on(pool: ArenaHost, *, build: bool = True) -> bool:
    """Whether a router serves steps on ``pool``: the CPU router on a CPU or emulated pool
    (built at first use), the CUDA router on a CUDA pool once it was installed.
    ``build=False``: whether one would, without building or installing anything (planning
    only: the process's allocator stays as it is)."""
    if not build and not _on_cuda(pool):
        return would_load()
    return _module(pool) is not None


def _module(pool: ArenaHost, *, build: bool = True) -> Any | None:
    """The router module of ``pool``'s device (``build=False``: only if loaded already)."""
    if _on_cuda(pool):
        return cuda_router()
    return native() if build else loaded()


def _on_cuda(pool: ArenaHost) -> bool:
    return pool.device.startswith("cuda")


def _scopes(pool: ArenaHost) -> Any | None:
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
