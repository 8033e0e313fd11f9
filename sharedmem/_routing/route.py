"""Record, plan, replay: one signature's allocations served from one arena of a pool.

The first call of a signature runs inside the arena as it is: the router serves each
allocation at the smallest free range of the arena's bytes that holds it (best fit), and
PyTorch only what does not fit (on an empty arena, all of it, as without a pool), so the
first call of a new state costs no more than the arena's free room lacks. An evaluation's
first call while gradients are held in the arena may also be served past the arena's bytes,
in the pages its address range reserved (``_reach``), the arena grown over what it served:
eager's peak in that state, given back when another route's call begins. A traced step's
first call is planned before it runs (``predict``): its graph and measured kernels predict
its sequence, the arena grows to that sequence's plan first, and the router serves each
allocation at its predicted place where the call keeps to the prediction (best fit where not),
so that call is served from the arena at the plan's peak. Its real sequence is then planned
offline (``choose_plan``) into the arena as it is: its bytes are reserved
already, the ranges other tensors hold in it at the call's start are fences packed around,
and it grows only where the plan lowers the step's peak by growing, when the next call
begins (the recording call's values, its gradients, are still held when it ends: an arena
grown then would add to that call's peak what no call holds at once). Later calls replay: the
n-th allocation gets its planned address. A call that leaves its plan (another size, another
count, or an allocation whose bytes are still held) is served by PyTorch from there on,
counted, and the signature is recorded anew on its next call (inside the arena again); no
byte of a live tensor is ever handed out twice, since the router checks every planned
address against the arena's live allocations.

What outlives a call (new gradients when ``p.grad`` is ``None``, the loss) is planned into
the arena too, in the room activations leave during backward. Such a tensor stays fenced
while the user holds it (the router's live map; a plan made while it is held packs around
it) and is free again when its storage is freed (``zero_grad()``): the route learns which
outliving allocations the user frees before its next call. One still held when the next
call of the same signature begins (a gradient kept by ``zero_grad(set_to_none=False)``, a
loss appended to a list) is left to PyTorch in the plans after that.

An optimizer's state is neither: the step that makes it runs with the scope set aside
(``optimizer``), and the call after it records the steady sequence.

Plans are kept per set of fences (a few): a loop whose evaluation runs while the gradients
of its training step are held plans the evaluation once around them (growing the arena, where
that lowers the evaluation's peak, up to the held bytes and its own peak: eager's in that
state, in whole pages; a traced evaluation's first call there is planned before it runs by
the same rule). Where the arena is larger than that (the training steps made it), nothing
is given back: the pool frees nothing unless asked, and the next training call needs it
again. One that evaluates after ``zero_grad()`` plans it once over the whole arena. A
training step's passing state (accumulation) never grows it. A training call whose
gradients are present but not in the arena (the user's own tensors: ``scope(adds_into=)``)
gives back what it does not need: the room the default loop's gradients took would sit
beside the user's through the call. When another route grows the arena
a plan is made again for the arena as it is, without growing it; the recording is never
redone for that.

An arena allocation the plan said dies inside the call but still alive when the call ends
has escaped (a hook or a list kept it): it is neither moved nor an error. Its bytes stay
fenced off, exactly as long as the tensor lives, the pool keeps the arena while any such
tensor lives (``trim`` and ``release`` leave it alone), and the signature is recorded anew.

Threads: a route may be entered by several threads at once. Each call holds the arena buffer
it serves from for as long as it runs; a call that finds it held serves from a lane of its
own (``Arenas.lease``: another buffer of the host, grown to the plan's need), so no two calls
ever hand out the same bytes, and none waits for another. The route's plans change under a
lock; each call serves and accounts by the plan it began with.
"""

from __future__ import annotations

import threading
import warnings
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch

from .._backends import cuda_torch_ops, round_up
from .._errors import OutOfMemoryError
from . import optimizer
from .cuda_native import cuda_router
from .family import FamilyPlan, SharedPlans, key
from .host import ArenaHost
from .native import loaded, native, would_load
from .plan import Fences, Recording, RoutePlan, choose_plan, placeable, plan_offsets

__all__ = ["COUNTERS", "CallPeak", "Route", "arena_live_bytes", "routes_on"]

# The pool counters the router adds to (``pool.stats()``), defined here once.
COUNTERS = (
    "arena_served_bytes",  # allocations served from the arena
    "arena_fallback_bytes",  # allocations dying inside a step that PyTorch served
    "arena_kept_bytes",  # arena allocations planned to outlive their step (gradients, loss)
    "arena_escaped_bytes",  # arena allocations still alive when their step ended, unplanned
    "recorded_calls",  # calls that recorded their sequence (inside the arena, best fit)
    "replayed_calls",  # calls served by a plan
    "replanned_calls",  # calls that planned a recording again (fences or capacity changed)
    # (a derived sequence's first plan, a new length's, is not one: ``shared_plans`` counts
    # it where the family's plan served it)
    "shared_plans",  # plans of one size taken from another's (a symbolic graph's family)
    "diverged_calls",  # replays that left their plan part way
)

PAGE = 4096  # a CPU page: the slack the peak targets allow
PLANS_PER_ROUTE = 4  # plans kept per signature, one per set of fences (least recent dropped)


class _Planned(NamedTuple):
    plan: RoutePlan
    native: Any
    capacity: int  # the arena's capacity it was made for
    # a plan of a passing state that grows the arena: the arena's bytes before (what it
    # gives back to when a call of another route begins); else None
    passing_from: int | None = None


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

    @property
    def how(self) -> str:
        """How the router measured this peak, in words (``CallFigures.measured``)."""
        if self.recorded:
            return "routing allocator, every allocation of the recorded call"
        if self.on_plan:
            return "routing allocator, every allocation checked against its plan"
        return "routing allocator, the call left its plan: an upper bound"


class Route:
    """One signature's allocation sequence over the arena ``arena`` of ``host``.

    Args:
        host: what holds the arena (a ``BufferPool``): a CPU or emulated pool (the CPU router
            serves its steps), or a CUDA pool once ``install_cuda_router`` ran (the CUDA
            router, by the step's stream).
        arena: the arena's buffer name; routes of one host that share it share its bytes
            (train and eval, every batch size), each planned into it as it is.
        training: a training step's route (its arena grows to the step's plan); an inference
            route grows the arena only while no training route has been planned on it.
    """

    def __init__(
        self,
        host: ArenaHost,
        arena: str,
        *,
        training: bool,
        expected: int = 0,
        family: SharedPlans | None = None,
    ) -> None:
        self._host = host
        self._arena = arena
        self.training = training
        # The plans this route shares with the other sizes of its graph (``family``), where
        # its graph was traced with symbolic sizes.
        self.family = family
        self.plan: RoutePlan | None = None  # the plan the latest call served by
        self.recording: Recording | None = None
        # The call's allocation sequence as its traced graph predicts it (``predict``): the
        # first call is planned by it before it runs; ``guided``: the latest recorded call
        # was served by such a plan.
        self.predicted: Recording | None = None
        self._predicted_recorded = False  # ``predict``'s ``recorded``
        self.guided = False
        # Per set of fences (a family's: per bank left free and the fences beside, ``_key``).
        self._plans: OrderedDict[tuple[int, Fences], _Planned] = OrderedDict()
        self._bank = 0  # the bytes of each bank of this route's family plans (0: none)
        self._redo = False  # the next call records anew
        self.last: dict[str, int] = {}  # the counts of the latest replay
        self.added_bytes = 0  # what planning this route grew the arena by
        self._rerecorded = 0  # times a stale plan (outliving allocations that died) was redone
        self._held: set[int] = set()  # outliving allocations the user still held next call
        self._kept: dict[tuple[int, int], int] = {}  # the latest call's outliving arena ranges
        self._lock = threading.Lock()  # guards the plans: threads may run one route at once
        self.last_peak: CallPeak | None = None  # the latest call's, as the router saw it
        # An optimizer steps in the block: the gradients it finds held are its steady state
        # (every call reads them), not a passing one, so its plans may grow the arena.
        self.optimizer = False
        # The arena's bytes before this route's first call grew it for a passing state
        # (``_guide``): its plan gives the growth back as a plan of that state does.
        self._grown_from: int | None = None
        # The arena's bytes before measuring this route's kernels grew it (``predict``).
        self._captured_from: int | None = None

    @contextmanager
    def scope(self, adds_into: int = 0) -> Iterator[None]:
        """Serve the block's allocations on this thread: recorded inside the arena on the
        first call (and after a divergence), replayed from the arena after. ``adds_into``:
        the bytes of the gradients the call adds into (present before it); where the arena
        holds fewer than half of them, the user's own tensors hold them beside it, and the
        arena gives back what this call does not need first (``_give_back_idle``)."""
        router = _scopes(self._host)
        self.last_peak = None
        if router is None or router.active():  # no router, or a step inside a step
            yield
            return
        arenas = self._host.arenas
        lane = arenas.lease(self._arena)
        try:
            fences = self._fences(router, lane)  # giving back leaves them where they are
            if lane == self._arena:
                self._give_back_passing(fences)
                if self._beside_gradients(fences, adds_into):
                    self._give_back_idle(fences)
            with self._lock:
                planned = self._planned(lane, fences)
            place = None if planned is None else self._place(lane, planned.plan)
            if planned is None or place is None:
                # A first call with a predicted sequence: the arena grown to that sequence's
                # plan before it runs, and the call served by the plan where it keeps to it.
                with self._lock:
                    self._grown_from = None
                    guide = self._guide(lane, fences) if planned is None else None
                    grown_from = self._grown_from
                self.guided = guide is not None
                if grown_from is not None and lane == self._arena:
                    arenas.mark_passing(
                        self._arena, id(self), grown_from, self._accumulating(fences)
                    )
                before = self._host.device_capacity(lane)
                room = self._room(lane)
                reach = self._reach(lane, fences) if guide is None and room is not None else 0
                if room is None:
                    router.begin_record(0, 0, None)
                elif guide is not None and not _on_cuda(self._host):
                    router.begin_record(room.data_ptr(), room.numel(), room, guide)
                elif reach > room.numel():  # the pages past the buffer, mapped already
                    router.begin_record(room.data_ptr(), reach, room)
                else:  # the router keeps the view's memory while a tensor lives in it
                    router.begin_record(room.data_ptr(), room.numel(), room)
                completed = False
                frame = optimizer.enter(router)
                try:
                    yield
                    completed = True
                finally:
                    optimizer.leave(frame)
                    recording = Recording(*router.end_record())
                    if reach:
                        self._cover(lane, recording, fences, before)
                self.optimizer |= frame.stepped
                # A call in which an optimizer made its state (set aside: PyTorch's) is not
                # the block's steady sequence: the next call records it.
                adopt = completed and planned is None and not frame.suspended
                self._recorded(recording, lane, fences, adopt=adopt)
                if frame.suspended:
                    with self._lock:
                        self._redo = self.recording is not None
                # The arena held through the call (what it served of the call inside it),
                # then grown after it, beside what PyTorch served and still holds.
                after = self._host.device_capacity(lane)
                others = recording.beside_arena()
                during = after if reach else before  # what it served past the buffer, too
                peak = max(during + others.live_peak(), after + others.outliving_bytes)
                self.last_peak = CallPeak(after, peak - after, True, True)
                return
            if planned.passing_from is not None and lane == self._arena:
                arenas.mark_passing(
                    self._arena, id(self), planned.passing_from, self._accumulating(fences)
                )
                self._trim_passing(fences, planned.plan.need)
            if self._captured_from is not None and lane == self._arena:
                # The measurements' growth (zeros of parameters the step does not copy):
                # given back above what the plan and the other routes' use need.
                self._trim_passing(fences, max(planned.plan.need, self._captured_from))
                self._captured_from = None
            router.begin_replay(planned.native, *place)
            frame = optimizer.enter(router)
            try:
                yield
            finally:
                optimizer.leave(frame)
                counts = router.end_replay()
                on_plan = counts["diverged_at"] < 0
                beside = planned.plan.beside_peak + (0 if on_plan else counts["fell_back_bytes"])
                # The arena as reserved (what the process holds for it), not the plan's part.
                arena = self._host.device_capacity(lane)
                self.last_peak = CallPeak(arena, beside, False, on_plan)
                with self._lock:
                    self._account(counts, planned.plan, lane)
                    if frame.suspended:
                        self._redo = True
        finally:
            arenas.give_back(lane)

    def _reach(self, lane: str, fences: Fences) -> int:
        """How far past ``lane``'s bytes a recording call in a passing state (an evaluation
        while gradients are held; no plan predicted it) may serve by best fit: to the end of
        the address range the buffer reserved, within the pool's limit (the pages are mapped
        and committed only as they are touched). An evaluation at twice the batch whose
        largest temporary (a 9 MB weight reorder on ResNet-18) misses the room above the
        held gradients by a few hundred KB is then served above them, not beside the arena
        at nearly twice eager's peak; the buffer is grown over what the call served
        (``_cover``), and given back when a call of another route begins, as the plan of
        that state grows and gives back. 0: the call records in the buffer as it is (no
        fences, a training or optimizer block, another lane, a moving buffer, CUDA)."""
        host = self._host
        if not fences or self.training or self.optimizer or lane != self._arena:
            return 0
        if _on_cuda(host) or not host.stable_address:
            return 0
        return host.in_place_room(lane)

    def _cover(self, lane: str, recording: Recording, fences: Fences, before: int) -> None:
        """A recording served past ``lane``'s ``before`` bytes (``_reach``): the buffer
        grown, in place, over the highest byte the call served (its pages are those the
        call touched), and the growth marked as a passing state's."""
        served = zip(recording.served_at, recording.sizes, strict=True)
        tops = [at + size for at, size in served if at >= 0] if recording.served_at else []
        top = max([0, *tops, *(high for _, high in fences)])
        if top <= before:
            return
        host = self._host
        try:
            view = host.tensor(lane, (top,), torch.uint8)  # within the reserved range: no move
        except OutOfMemoryError:  # the limit changed during the call: the router fences them
            return
        host.arenas.served_from(lane, view.data_ptr())
        host.arenas.mark_passing(self._arena, id(self), before, self._accumulating(fences))
        with self._lock:
            self._grown_from = before

    def _trim_passing(self, fences: Fences, need: int) -> None:
        """A replay of a passing state's plan begins: where the arena is larger than the plan
        needs (a recording served past it by best fit, ``_cover``), the bytes above the plan's
        need and what tensors hold (``fences``) are given back."""
        self._give_back_above(need, fences)

    def _give_back_above(self, need: int, fences: Fences) -> None:
        """Give back the arena's bytes above ``need`` and above what tensors hold
        (``fences``); nothing where it is no larger (``give_back_above``)."""
        self._host.give_back_above(self._arena, max([need, *(high for _, high in fences)]))

    def _give_back_passing(self, fences: Fences) -> None:
        """A call of this route begins on the arena: where another route's plan of a passing
        state (an evaluation while gradients are held, or an accumulation call whose
        gradients are gone now: ``Arenas.take_passing``) grew the arena, the bytes it grew by
        are given back, down to what tensors hold (the arena as the other states planned it:
        their calls stay at their own peaks; the passing state grows it again when it next
        runs, from fresh pages). ``fences``: the ranges tensors hold in it."""
        held = sum(high - low for low, high in fences)
        before = self._host.arenas.take_passing(self._arena, id(self), held)
        if before is not None:
            self._give_back_above(before, fences)

    def _beside_gradients(self, fences: Fences, adds_into: int) -> bool:
        """Whether a training call that adds into ``adds_into`` bytes of gradients finds
        fewer than half of them held in the arena (``fences``): the user replaced them with
        tensors of its own (``p.grad = torch.zeros_like(p)``), or PyTorch made them. An
        optimizer's block is left alone: the gradients it finds are its steady state."""
        if not self.training or self.optimizer or adds_into <= 0:
            return False
        return 2 * sum(high - low for low, high in fences) < adds_into

    def _give_back_idle(self, fences: Fences) -> None:
        """A call whose gradients sit beside the arena begins: the arena's bytes above what
        tensors hold and what this route's plan for ``fences`` needs are given back. They
        held the gradients of another state (the default loop's first call made them in the
        arena), and kept through this call they would add to its peak what eager's never
        holds: the user's gradients and the room of the ones they replaced. With no plan
        yet, the call's plan is made over the arena as the fences leave it, and grows it to
        its own need; the other state grows it again when it next runs. Calls of other
        sizes in this state keep what the largest of them needs (``Arenas.beside_need``)."""
        with self._lock:
            planned = self._plans.get(self._key(fences))
            need = 0 if planned is None else planned.plan.need
        need = self._host.arenas.beside_need(self._arena, need)  # every size's in that state
        self._give_back_above(need, fences)

    def _accumulating(self, fences: Fences) -> int | None:
        """For a passing state's growth (``Arenas.mark_passing``): the bytes a training
        call found held (its gradients: an accumulation call), or ``None`` (an evaluation)."""
        return sum(high - low for low, high in fences) if self.training else None

    def _fences(self, router: Any, lane: str) -> Fences:
        """The ranges of ``lane`` that tensors hold now (sorted ``(low, high)`` offsets)."""
        base = self._host.arenas.base(lane)
        if base is None:
            return ()
        return tuple(sorted((int(low), int(high)) for low, high in router.live_ranges(base)))

    def _planned(self, lane: str, fences: Fences) -> _Planned | None:
        """The plan for a call that finds ``fences`` held in ``lane`` (made now where none
        fits them), or ``None``: the call records (the caller holds the lock)."""
        if self.recording is None or self._redo:
            return None
        # This route's own outliving tensors of its latest call, still held: only where no
        # other call left one at the same range since (another size's loss in the same bank).
        arenas = self._host.arenas
        held = {
            i
            for span, i in self._kept.items()
            if span in fences and arenas.keeper(lane, span) == id(self)
        }
        self._kept = {}
        if not held <= self._held:  # kept by the user past this call's start: left out now
            self._held |= held
            self._plans.clear()
        capacity = self._capacity()
        at = self._key(fences)
        planned = self._plans.get(at)
        # A family's plan still fits an arena another size grew (its need is the envelope's):
        # made again only where it left allocations beside the arena that the room now holds.
        grown = planned is not None and capacity > planned.capacity
        if grown and self.family is not None and planned is not None:
            grown = planned.plan.beside_bytes > 0 or planned.plan.beside_peak > 0
        if planned is None or grown:
            # Only a plan over an arena no tensor holds may grow it (where that lowers the
            # step's peak): bytes the user holds there (gradients during accumulation or an
            # evaluation) are a passing state, and an arena grown for it would stay above
            # what the other states need. Another route's growth only makes the plan again
            # for the arena as it is, so steady state is steady. An optimizer's block grows
            # it around the gradients: they are held at every call of it, and its peak is
            # theirs plus its temporaries, as without the pool.
            # A family's banks are its steady state too (``SharedPlans.banked``).
            grow = planned is None and (
                not fences
                or self.optimizer
                or (self.family is not None and self.family.banked(fences))
            )
            again = self.plan is not None  # else a derived sequence's first plan
            planned = self._adopt(self.recording, lane, fences, grow=grow)
            if again:
                self._host.count("replanned_calls", 1)
        else:
            self._plans.move_to_end(at)
        self.plan = planned.plan
        return planned

    def _key(self, fences: Fences) -> tuple[int, Fences]:
        """What this route's plans are kept by: ``-1`` and ``fences``; for a family's plans
        with banks, the bank they leave free and the fences beside the banks (``key``): a call
        that finds the previous call's loss in either bank takes that bank's plan, made
        with the other's when this route was first planned."""
        return key(fences, self._bank)

    def predict(
        self, recording: Recording, *, captured_from: int | None = None, recorded: bool = False
    ) -> None:
        """``recording``: the call's allocation sequence as its traced graph predicts it (its
        measured kernels' scratch included). The route's first call is planned by it before
        it runs (``_guide``): the arena grown to that plan's need, within the pool's limit,
        and the call served at the plan's places where it keeps to the
        prediction, best fit in the arena where it does not. ``captured_from``: the arena's
        bytes before measuring the kernels grew it (``kernels.measured_in``); the first
        replay gives back what its plan does not use, down to those bytes. ``recorded``: the
        sequence is a recording of the same code in another state (an accumulation call's,
        from the call that made the gradients), its small allocations foreseen as exactly as
        its large ones: the first call matches them to the plan too."""
        with self._lock:
            self.predicted = recording
            self._captured_from = captured_from
            self._predicted_recorded = recorded

    def _guide(self, lane: str, fences: Fences) -> Any | None:
        """The router's plan of the predicted sequence for a recording call on ``lane``
        that finds ``fences`` held, with ``lane`` grown to its need; ``None`` where there is
        none (nothing predicted, the route recorded already, or no router): the call records
        by best fit in the lane as it is (the caller holds the lock)."""
        predicted = self.predicted
        if predicted is None or self.recording is not None or _on_cuda(self._host):
            return None
        module = _module(self._host)
        if module is None:
            return None
        host = self._host
        capacity = host.device_capacity(lane)
        order = sorted(range(len(predicted.sizes)), key=predicted.alloc_at.__getitem__)
        predicted = Recording(
            [predicted.sizes[i] for i in order],
            [predicted.alloc_at[i] for i in order],
            [predicted.free_at[i] for i in order],
        )  # in allocation order, as the router meets them
        # The router matches no allocation under ``GUIDE_SMALL`` bytes in a guided call,
        # foreseen or not: the plan places the others, and those take the arena's bytes above
        # the plan (its rounding to whole granules: BERT's first accumulation call 4,568 B
        # over eager's peak with them beside it, 1,744 B inside), else PyTorch's; those of
        # a size predicted to outlive the call, PyTorch's. A prediction that is a recording
        # (``recorded``) foresees the small ones too: all are matched.
        small = 1 if self._predicted_recorded else int(module.GUIDE_SMALL)
        large = [i for i, size in enumerate(predicted.sizes) if size >= small]
        sequence = Recording(
            [predicted.sizes[i] for i in large],
            [predicted.alloc_at[i] for i in large],
            [predicted.free_at[i] for i in large],
        )
        outliving = [i for i, free in enumerate(sequence.free_at) if free < 0]
        grow = not fences or self.optimizer
        # A passing state (an evaluation while gradients are held): the steady evaluation's
        # rule, up to eager's peak in that state where growing lowers the call's peak.
        ceiling = self._ceiling() if grow else self._passing_ceiling(capacity, predicted, fences)
        plan = choose_plan(
            placeable(sequence, outliving),
            capacity=capacity,
            granularity=host.granularity,
            ceiling=ceiling,
            fences=fences,
        )
        if plan.need > capacity and self._place(lane, plan) is None:
            return None  # the lane cannot grow now: best fit in it as it is
        if not grow and plan.need > capacity:
            self._grown_from = capacity  # a passing state's growth, given back as a plan's
        # -1 for a small one predicted to outlive the call (a loss): the router leaves every
        # small one of its size to PyTorch, so that no such tensor is held in the arena
        # where no plan put it (a family's loss keeps to its banks).
        offsets = [-1 if free < 0 else -2 for free in predicted.free_at]
        for i, offset in zip(large, plan.offsets, strict=True):
            offsets[i] = offset if offset >= 0 else -2
        return module.Plan(list(predicted.sizes), offsets, [0] * len(offsets), small)

    def _room(self, lane: str) -> torch.Tensor | None:
        """``lane`` as it is, for a recording served inside it by best fit (``None``: no
        arena yet, PyTorch serves the call)."""
        host = self._host
        capacity = host.device_capacity(lane)
        if not capacity:
            return None
        view = host.tensor(lane, (capacity,), torch.uint8)  # no growth: the size it has
        host.arenas.served_from(lane, view.data_ptr())
        return view

    def _place(self, lane: str, plan: RoutePlan) -> tuple[int, int, torch.Tensor | None] | None:
        """The address, size and a view of ``lane`` for a replay of ``plan`` (grown to its
        need where it is smaller: a lane's first use, a trimmed arena), or ``None`` where it
        cannot be (the pool's limit, or a moving buffer that holds kept tensors): the call
        then records inside the lane as it is."""
        if not plan.need:
            return 0, 0, None
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
        return view.data_ptr(), view.numel(), view

    def _recorded(self, recording: Recording, lane: str, fences: Fences, *, adopt: bool) -> None:
        """A recording call ended: what it served inside the arena and beside it counted, and
        where it was the signature's recording (``adopt``: it completed, and no plan served
        it), its sequence planned (unless another thread planned it meanwhile)."""
        host = self._host
        served = dying = 0
        kept: dict[tuple[int, int], int] = {}
        for i, (size, free, at) in enumerate(
            zip(recording.sizes, recording.free_at, recording.served_at, strict=True)
        ):
            if at >= 0:
                served += size
                if free < 0:
                    kept[(at, at + size)] = i
            elif free >= 0:
                dying += size
        host.arenas.keep(lane, kept, id(self))
        host.count("recorded_calls", 1)
        host.count("arena_served_bytes", served)
        host.count("arena_fallback_bytes", dying)
        host.count_unpooled(dying)
        with self._lock:
            if adopt and (self.recording is None or self._redo):
                self._kept = kept
                self.recording = recording
                self._redo = False
                self._held = set()
                self._plans.clear()
                grow = not fences or self.optimizer
                # The arena grows for this plan when the next call begins (``_place``), not
                # now: this call's values (gradients) are still held, and an arena grown
                # beside them would add to its peak what no call needs at once.
                self.plan = self._adopt(recording, lane, fences, grow=grow, now=False).plan
            self._grown_from = None

    def derive(self, recording: Recording) -> None:
        """Plan ``recording``, a sequence derived rather than recorded (another size of a
        graph traced with symbolic sizes), before this route's first call: that call then
        replays it, and where it leaves it, it is recorded anew as any divergence is. It is
        planned, as a recording is, when that call finds which bytes of the arena are held."""
        with self._lock:
            if self.recording is None:
                self.recording = recording
                self._plans.clear()

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

    def _adopt(
        self, recording: Recording, lane: str, fences: Fences, *, grow: bool, now: bool = True
    ) -> _Planned:
        # Outside any scope: growing the arena is the pool's own allocation. Only the call
        # that holds the arena grows it; one on another lane grows that lane as it replays.
        # ``now=False``: the plan is made for the arena it may grow to, and the arena grows
        # when the next call begins (``_place``). The caller holds the lock.
        host = self._host
        before = self._capacity()
        if not grow and self._grown_from is not None:
            # A recording served past the arena (``_reach``): planned into the arena as it
            # was, its best-fit growth given back down to the plan's need (``_trim_passing``).
            before = min(before, self._grown_from)
        ceiling = self._ceiling() if grow else self._passing_ceiling(before, recording, fences)
        outliving = [
            i
            for i, free in enumerate(recording.free_at)
            if free < 0 and recording.sizes[i] > 0 and i not in self._held
        ]
        spread = placeable(recording, outliving)

        def make(sequence: Recording, around: Fences = fences, /) -> RoutePlan:
            return choose_plan(
                sequence,
                capacity=before,
                granularity=host.granularity,
                ceiling=ceiling,
                fences=around,
            )

        shared: FamilyPlan | None = None
        if self.family is None:
            plan = make(spread)
            need = plan.need
        else:  # the family's plan, grown to what its widest sizes need
            shared = self.family.plan(
                spread,
                capacity=before,
                fences=fences,
                grow=grow,
                make=make,
                outliving=outliving,
                ceiling=ceiling,
            )
            plan, need = shared.plan, shared.need
            self._bank = shared.bank
            if shared.reused:
                host.count("shared_plans", 1)
        if need and lane == self._arena and now:  # its base too: inputs are unaliased
            try:
                view = host.tensor(self._arena, (need,), torch.uint8)
                host.arenas.served_from(self._arena, view.data_ptr())
            except OutOfMemoryError:  # the limit's arithmetic was off: keep to what is there
                plan = plan_offsets(spread, ceiling=self._capacity(), fences=fences)
        covers = (
            self._capacity() if now else max(self._capacity(), round_up(need, host.granularity))
        )
        self.added_bytes = max(self.added_bytes, covers - before)
        # To the router: -1 for what outlived the recorded call and stays PyTorch's (watched:
        # dying inside a later call, it says the recording is stale), -2 for what the plan
        # left out; and which placed allocations are meant to outlive the call.
        offsets = [
            o if o >= 0 else (-1 if f < 0 else -2)
            for o, f in zip(plan.offsets, recording.free_at, strict=True)
        ]
        outlives = [1 if f < 0 else 0 for f in recording.free_at]
        module = _module(host)
        assert module is not None, "a route is planned only where a router runs"
        base = before if self._grown_from is None else min(before, self._grown_from)
        passing_from = base if not grow and need > base else None
        sizes = list(recording.sizes)
        planned = _Planned(plan, module.Plan(sizes, offsets, outlives), covers, passing_from)
        at = self._key(fences)
        if shared is not None and shared.other is not None and plan is shared.plan:
            # Both banks at once: the next call of this size finds this call's loss held in
            # one bank and takes the plan of the other, without planning.
            which, rest = at
            if which == shared.which:
                other = [
                    o if o >= 0 else (-1 if f < 0 else -2)
                    for o, f in zip(shared.other.offsets, recording.free_at, strict=True)
                ]
                self._plans[(1 - which, rest)] = _Planned(
                    shared.other, module.Plan(sizes, other, outlives), covers, passing_from
                )
        self._plans[at] = planned
        self._plans.move_to_end(at)
        while len(self._plans) > PLANS_PER_ROUTE:
            self._plans.popitem(last=False)
        return planned

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

    def _passing_ceiling(self, capacity: int, recording: Recording, fences: Fences) -> int:
        """The most bytes a plan of a call in a passing state (tensors held in the arena: the
        gradients of a step not yet zeroed) may grow the arena to: the peak eager holds in
        that state (the held bytes and the call's own peak), where the growth lowers this
        call's peak (``choose_plan`` grows only then). An evaluation at twice the batch
        whose largest temporary (a 9 MB weight reorder on ResNet-18) misses the room above
        the gradients by a few hundred KB would otherwise serve it beside the arena, at
        nearly twice eager's peak. So would an accumulation call (a training step that finds
        its gradients held): the room above them is the default loop's activations less its
        gradients, and ConvNeXt's accumulation calls left 18% of their bytes beside it, at
        1.43x eager's peak. The growth is the passing state's (``Arenas.mark_passing``): the
        default loop's next step gives it back, so that step stays at its own peak."""
        host = self._host
        if not fences:
            return capacity
        if not host.stable_address and arena_live_bytes(host, self._arena):
            return capacity  # growing would move the held tensors
        # Eager's peak in this state, rounded down to whole granules: rounded up, the plan's
        # one-granule slack grew the arena for a call whose plan fits the room it has (a
        # distributed demo's evaluation added a 1 MiB granule on every rank). An accumulation
        # call's, where a granule is a page, rounded up: the target's page of slack, which
        # its packing above the held gradients may need (an LSTM's, rounded down, left 67 KB
        # beside the arena, at eager's peak plus 65 KB).
        limit = sum(high - low for low, high in fences) + recording.live_peak()
        grain = host.granularity
        if self.training and grain <= PAGE:
            limit = round_up(limit, grain)
        room = host.growth_room(self._arena)
        limit = limit if room is None else min(limit, room)
        return max(capacity, limit // grain * grain)

    def _account(self, counts: dict[str, int], plan: RoutePlan, lane: str) -> None:
        """A replay of ``plan`` on ``lane`` ended with the router's ``counts`` (the caller
        holds the lock)."""
        self.last = counts
        host = self._host
        host.count("replayed_calls", 1)
        host.count("arena_served_bytes", counts["served_bytes"])
        host.count("arena_kept_bytes", counts["kept_bytes"])
        beside = counts["fell_back_bytes"] + plan.beside_bytes
        host.count("arena_fallback_bytes", beside)
        host.count_unpooled(beside)
        escaped = counts["escaped_bytes"]
        recording = self.recording
        if recording is not None:
            self._kept = {
                (o, o + recording.sizes[i]): i
                for i, (o, f) in enumerate(zip(plan.offsets, recording.free_at, strict=True))
                if o >= 0 and f < 0
            }
            host.arenas.keep(lane, self._kept, id(self))
        if counts["diverged_at"] >= 0:
            host.count("diverged_calls", 1)
        if escaped > 0:
            host.count("arena_escaped_bytes", escaped)
            warnings.warn(
                f"sharedmem: {escaped:,} bytes of a step's arena were still referenced when the "
                "step ended (a hook or a list kept a tensor of the step): they stay fenced off "
                "until that tensor is freed, and the step is recorded anew so that its next "
                "plan knows the value outlives the step",
                RuntimeWarning,
                stacklevel=4,
            )
        # Allocations the plan left to PyTorch as outliving the call died inside it after all
        # (the recording ran in another state: gradients absent then, present now): record
        # anew, a few times at most, so that a block alternating between two states does not
        # spend every other call recording.
        # So did those it placed in the arena to outlive the call, where fewer are kept.
        placed_kept = 0
        if recording is not None:
            for size, at, free in zip(
                recording.sizes, plan.offsets, recording.free_at, strict=True
            ):
                placed_kept += size if at >= 0 and free < 0 else 0
        died = counts["diverged_at"] < 0 and counts["kept_bytes"] < placed_kept
        stale = (counts["planned_out_freed_bytes"] > 0 or died) and self._rerecorded < 3
        if stale:
            self._rerecorded += 1
        if counts["diverged_at"] >= 0 or escaped > 0 or stale:
            self._redo = True  # recorded anew on the next call

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

    def begin_record(self, base: int, size: int, owner: torch.Tensor | None) -> None:
        self._module.begin_record(base, size, *self._key, owner)

    def end_record(self) -> list[list[int]]:
        return list(self._module.end_record(*self._key))

    def begin_replay(self, plan: Any, base: int, size: int, owner: torch.Tensor | None) -> None:
        self._module.begin_replay(plan, base, size, *self._key, owner)

    def end_replay(self) -> dict[str, int]:
        return dict(self._module.end_replay(*self._key))

    def suspend(self) -> int:
        return int(self._module.suspend(*self._key))

    def resume(self, scope: int) -> None:
        self._module.resume(*self._key, scope)

    def live_bytes(self, base: int) -> int:
        return int(self._module.live_bytes(base))

    def live_ranges(self, base: int) -> list[tuple[int, int]]:
        return list(self._module.live_ranges(base))
