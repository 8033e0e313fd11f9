"""Offsets for a recorded allocation sequence: a static memory planner over one arena.

A step's allocations, recorded once per signature, are intervals in time (from the tick of
their allocation to the tick of their free) with a size. Those freed inside the step are
given byte offsets in one arena such that no two live at the same time overlap; those that
outlive it (the loss, gradients, what a hook keeps) stay with PyTorch's allocator.

The heuristic packs allocations one at a time, each at the smallest gap, among the
allocations already placed that are live at some tick of its own interval, that holds it
(best fit) or at the lowest (first fit), else above them; it packs in several orders and
keeps the smallest arena: those live at the busiest tick first, longest-lived first (the
busiest tick's allocations stack up without gaps); TFLite's greedy by size (largest first);
longest-lived first; and, where some allocations live to the step's end (gradients, the
loss), those first, in the order they are made, then the rest largest first: the gradients
stack into one range at the arena's bottom that grows as backward makes them, into the room
the activations leave, and the room above them stays one range (ResNet-18's default loop:
0.35% above max-live, where the other orders left 2.9%). Where the arena is still above
max-live and the step is small, orders drawn at random (a fixed seed) are tried too; where
it is above max-live still, an exact search (``pack.py``: branch and bound over canonical
packings, after MiniMalloc) looks for a lower one, from max-live up, within a bounded number
of placements (ResNet-18's default loop: at max-live, where the orders above left 0.35%).
Its arena is reported against the lower bound no packing can beat, the most bytes live at one
tick (max-live).

The arena is shared: ``fences`` are byte ranges of it that other allocations hold for the
whole step (a gradient the user still holds, a tensor an earlier step kept), packed around.
What outlives the step may be placed too (``outliving``: the indices the route learned are
freed before its next call, as gradients set to ``None`` by ``zero_grad()`` and the loss are):
such an allocation is live from its tick to the step's end, and a later step finds it as a
fence while the user holds it. Where a packing of the same arena has them together at its
bottom (the exact search, asked once more), the chosen plan is that one: the room they leave
free while held is then one range up to the arena's top, which a call made meanwhile (an
evaluation before ``zero_grad()``) packs into and grows from whole.

The arena is reserved for the whole step, while what outlives the step and is left out
is PyTorch's and grows during backward, often while the arena is full of activations: the
step's peak is the arena plus the most bytes live beside it, where the allocator alone
(eager) holds the most bytes live at once. ``choose_plan`` therefore compares the full
packing with arenas grown one allocation at a time (what does not fit is left to PyTorch)
and keeps the lowest peak: a step needs no more than it would without the pool, to the
byte, unless one page more serves more of it (an arena in whole pages at max-live is up to
a page above the allocator alone: the default loop is then served whole), or unless that
would leave most of the step to PyTorch for the arena's rounding.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .pack import lifted, lowest_packing, merged, pack_under

__all__ = [
    "Fences",
    "Recording",
    "RoutePlan",
    "best_gap",
    "choose_plan",
    "placeable",
    "plan_offsets",
    "reuse_offsets",
]

ALIGN = 64  # every planned address is a multiple of this: any dtype and vector load fits
_ALWAYS = 1 << 62  # a fence's end tick: after every tick of any step
_TRIES = 64  # the most random orders a packing tries (``plan_offsets``)
_WORK = 2048  # ... and at most this many placements in all
_EXACT_STEPS = 8000  # the most placements the exact search tries (``plan_offsets``) ...
_EXACT_EACH = 4  # ... and at most this many per allocation, and 256
_EXACT_MOST = 4000  # ... on steps of at most this many allocations (it holds n^2 bits)
_TRIMS = 2  # the most arenas a granule lower each that ``_trimmed`` packs the step under
_REGROW = 16  # the most rounds ``_best`` grows a plan again one arena granule lower, then bisects
_FEW = 16  # ``best_gap`` loops over at most this many busy ranges, else works on arrays


class Recording(NamedTuple):
    """A step's allocation sequence, in order: the size of each allocation, the tick of its
    allocation and the tick of its free (``-1``: alive when the step ended, it outlives it),
    and where the recorded call served it (``served_at``: an arena offset, ``-1`` PyTorch's
    allocator; empty where not known)."""

    sizes: Sequence[int]
    alloc_at: Sequence[int]
    free_at: Sequence[int]
    served_at: Sequence[int] = ()

    def live_peak(self) -> int:
        """The most bytes of the step's own allocations live at one tick: what the
        allocator alone (eager) holds at the step's peak, relative to its start."""
        return _max_live(self.sizes, self.alloc_at, self.free_at)

    def beside_arena(self) -> Recording:
        """The allocations the recorded call got from PyTorch's allocator, not the arena
        (every one where ``served_at`` is not known)."""
        if not self.served_at:
            return self
        keep = [i for i, at in enumerate(self.served_at) if at < 0]
        return Recording(
            [self.sizes[i] for i in keep],
            [self.alloc_at[i] for i in keep],
            [self.free_at[i] for i in keep],
            [-1] * len(keep),
        )

    def floor(self) -> int:
        """A peak no placement of this sequence goes below: when an allocation is made, every
        allocation made before it that outlives the step (gradients only grow) is live
        beside it. Where it is most of ``live_peak()``, the step's peak is its gradients."""
        kept = best = 0
        for i in sorted(range(len(self.sizes)), key=self.alloc_at.__getitem__):
            if self.free_at[i] < 0:
                kept += self.sizes[i]
                best = max(best, kept)
            else:
                best = max(best, kept + self.sizes[i])
        return best

    @property
    def total_bytes(self) -> int:
        """The bytes of every allocation of the step."""
        return sum(self.sizes)

    @property
    def outliving_bytes(self) -> int:
        """The bytes of the allocations still alive when the step ended."""
        return sum(s for s, f in zip(self.sizes, self.free_at, strict=True) if f < 0)


@dataclass(frozen=True)
class RoutePlan:
    """Where each recorded allocation is served: its arena offset, or ``-1`` (PyTorch's
    allocator: it outlives the step, or the arena's ceiling left no room).

    Attributes:
        offsets: per allocation, in recorded order.
        need: the arena bytes the plan uses (the top of its highest allocation).
        lower_bound: the most bytes of the routed allocations live at one tick (max-live):
            no packing needs fewer; ``need / lower_bound`` is the packing's overhead.
        routed_bytes: bytes per call the plan serves from the arena.
        beside_bytes: bytes per call served by PyTorch's allocator although they die inside
            the step (the ceiling left them no room).
        beside_peak: the most bytes served by PyTorch's allocator live at one tick (what
            the step holds beside the arena at its busiest).
    """

    offsets: tuple[int, ...]
    need: int
    lower_bound: int
    routed_bytes: int
    beside_bytes: int
    beside_peak: int


Fences = Sequence[tuple[int, int]]  # byte ranges [low, high) of the arena held all step long


def placeable(recording: Recording, outliving: Collection[int] = ()) -> Recording:
    """``recording`` as the packers see it: the allocations of ``outliving`` (indices of
    allocations that outlive the step) live from their tick to one past the step's last."""
    if not outliving:
        return recording
    end = max([*recording.alloc_at, *recording.free_at], default=0) + 1
    free_at = list(recording.free_at)
    for i in outliving:
        if free_at[i] < 0:
            free_at[i] = end
    return Recording(recording.sizes, recording.alloc_at, free_at)


def plan_offsets(
    recording: Recording, *, ceiling: int | None = None, fences: Fences = ()
) -> RoutePlan:
    """Place every allocation that dies inside the step at an arena offset.

    Args:
        recording: the step's sequence (``placeable`` for one with outliving allocations).
        ceiling: the most arena bytes allowed (a pool limit): allocations that would reach
            past it are served by PyTorch's allocator instead.
        fences: byte ranges of the arena held for the whole step: packed around.

    Returns:
        The plan.

    Example::

        >>> from sharedmem._routing.plan import Recording, plan_offsets
        >>> # 256 bytes freed before two 128-byte allocations that then share its bytes;
        >>> # the last allocation outlives the step
        >>> rec = Recording([256, 128, 128, 8], [0, 2, 3, 6], [1, 4, 5, -1])
        >>> got = plan_offsets(rec)
        >>> got.offsets, got.need, got.lower_bound
        ((0, 0, 128, -1), 256, 256)
    """
    sizes, starts, ends = recording.sizes, recording.alloc_at, recording.free_at
    candidates = [i for i in range(len(sizes)) if ends[i] >= 0 and sizes[i] > 0]
    live = np.zeros(max([*starts, *ends], default=0) + 2, dtype=np.int64)
    for i in candidates:
        live[starts[i] : ends[i]] += sizes[i]
    busiest = int(live.argmax())
    last = max(ends, default=0)
    # Live to the step's end (``placeable``'s outliving allocations, the gradients): placed
    # first, in the order they are made, they stack into one range at the arena's bottom
    # that grows as backward makes them, and the room above it stays one range.
    kept = [i for i in candidates if ends[i] == last]
    stacked = sorted(kept, key=starts.__getitem__)
    rest = [i for i in candidates if ends[i] != last]
    # Orders to pack in, each with best fit (the smallest gap that holds it) or first fit
    # (the lowest); the smallest arena wins (the one packed first is kept on a tie).
    orders = [
        # live at the busiest tick first (they are the lower bound), longest-lived first
        (lambda i: (not starts[i] <= busiest < ends[i], starts[i] - ends[i], -sizes[i]), False),
        ((lambda i: (-sizes[i], starts[i])), False),  # TFLite's greedy by size
        ((lambda i: (starts[i] - ends[i], -sizes[i])), False),  # longest-lived first
    ]
    best: list[int] | None = None
    best_need = 0

    def cost(offsets: list[int], need: int) -> int:
        # Under a ceiling an order may leave allocations to PyTorch: judged by the step's
        # peak, the arena and the most left beside it at once (a packing that drops a large
        # allocation to keep a lower top is not the better one).
        if ceiling is None:
            return need
        beside = [i for i in candidates if offsets[i] < 0]
        return need + _max_live(
            [sizes[i] for i in beside], [starts[i] for i in beside], [ends[i] for i in beside]
        )

    for key, first in orders:
        offsets, need = _pack(recording, sorted(candidates, key=key), ceiling, fences, first)
        need = cost(offsets, need)
        if best is None or need < best_need:
            best, best_need = offsets, need
    if kept:
        # The kept allocations stacked, then the rest largest first (the tightest on most
        # training steps: within a fraction of a percent of max-live on ResNet-18).
        for first in (True, False):
            order = stacked + sorted(rest, key=lambda i: (-sizes[i], starts[i]))
            offsets, need = _pack(recording, order, ceiling, fences, first)
            need = cost(offsets, need)
            if need < best_need:
                best, best_need = offsets, need
    # Iterative improvement, where the packing is above max-live and a step is small enough
    # to pack again cheaply (a few thousand placements in all): orders drawn at random, from
    # a seed fixed by the sequence (the same plan every time), the rest shuffled below the
    # stacked gradients or everything shuffled. A small step's few long-lived allocations
    # decide its arena, and few orders place them well.
    aligned = [-(-n // ALIGN) * ALIGN for n in sizes]
    bound = _max_live(
        [aligned[i] for i in candidates],
        [starts[i] for i in candidates],
        [ends[i] for i in candidates],
    )
    bound = lifted(bound, _aligned(fences))  # nor below the fences in its way
    draw = random.Random(len(candidates))
    for attempt in range(min(_TRIES, _WORK // max(1, len(candidates)))):
        if best_need <= bound:
            break
        shuffled = list(rest if attempt % 2 == 0 else candidates)
        draw.shuffle(shuffled)
        order = stacked + shuffled if attempt % 2 == 0 else shuffled
        offsets, need = _pack(recording, order, ceiling, fences, attempt % 4 < 2)
        need = cost(offsets, need)
        if need < best_need:
            best, best_need = offsets, need
    assert best is not None
    # Still above max-live: the exact search (``pack.lowest_packing``), bounded. At the same
    # peak, a packing of everything serves more than one that leaves some out.
    if best_need > bound and 0 < len(candidates) <= _EXACT_MOST:
        upper = best_need + any(best[i] < 0 for i in candidates)
        upper = upper if ceiling is None else min(upper, ceiling + 1)
        exact = _exact(recording, candidates, aligned, fences, upper)
        if exact is not None:
            best, best_need = exact
    return _described(recording, best)


def _exact(
    recording: Recording,
    candidates: list[int],
    aligned: list[int],
    fences: Fences,
    upper: int,
) -> tuple[list[int], int] | None:
    # Every candidate packed by the exact search below ``upper`` bytes, around the fences
    # (allocations fixed at their offsets, live at every tick), and the arena it needs.
    starts, ends = recording.alloc_at, recording.free_at
    first = min(starts[i] for i in candidates) - 1
    last = max(ends[i] for i in candidates) + 1
    held = merged(_aligned(fences))  # in whole ``ALIGN`` units, merged where they meet
    found, _ = lowest_packing(
        [aligned[i] for i in candidates] + [high - low for low, high in held],
        [starts[i] for i in candidates] + [first] * len(held),
        [ends[i] for i in candidates] + [last] * len(held),
        upper=upper,
        unit=ALIGN,
        fixed=[-1] * len(candidates) + [low for low, _ in held],
        steps=min(_EXACT_STEPS, _EXACT_EACH * len(candidates) + 256),
    )
    if found is None:
        return None
    offsets = [-1] * len(recording.sizes)
    for i, offset in zip(candidates, found, strict=False):
        offsets[i] = offset
    return offsets, max(offsets[i] + aligned[i] for i in candidates)


def reuse_offsets(recording: Recording, plan: RoutePlan) -> RoutePlan:
    """``plan``'s offsets for ``recording``: a sequence of the same ticks as the one ``plan``
    was made for, each allocation at most as large (another size of a symbolic graph). No
    two allocations that share a tick overlap still: each keeps within its planned range.

    Example::

        >>> from sharedmem._routing.plan import Recording, plan_offsets, reuse_offsets
        >>> big = plan_offsets(Recording([256, 128, 128], [0, 2, 3], [1, 4, 5]))
        >>> small = reuse_offsets(Recording([64, 100, 32], [0, 2, 3], [1, 4, 5]), big)
        >>> small.offsets, small.need
        ((0, 0, 128), 192)
    """
    planned = plan.offsets
    assert len(planned) == len(recording.sizes), "a plan of another sequence"
    return _described(recording, list(planned))


def _pack(
    recording: Recording,
    order: Sequence[int],
    ceiling: int | None,
    fences: Fences,
    first: bool = False,
) -> tuple[list[int], int]:
    # Each allocation of ``order`` at its best gap (``first``: its lowest) among those placed
    # that share a tick.
    sizes, starts, ends = recording.sizes, recording.alloc_at, recording.free_at
    offsets = [-1] * len(sizes)
    # The placed allocations, as arrays grown in place: start tick, end tick, offset, top;
    # the fences first, live at every tick.
    placed = np.zeros((4, len(fences) + max(1, len(order))), dtype=np.int64)
    for k, (low, high) in enumerate(_aligned(fences)):
        placed[:, k] = (-1, _ALWAYS, low, high)
    count = len(fences)
    need = 0
    for i in order:
        size = -(-sizes[i] // ALIGN) * ALIGN
        start, end = starts[i], ends[i]
        live = placed[:, :count]
        overlapping = live[:, (live[0] < end) & (start < live[1])]
        offset = best_gap(overlapping[2], overlapping[3], size, first=first)
        if ceiling is not None and offset + size > ceiling:
            continue
        placed[:, count] = (start, end, offset, offset + size)
        count += 1
        offsets[i] = offset
        need = max(need, offset + size)
    return offsets, need


def choose_plan(
    recording: Recording,
    *,
    capacity: int = 0,
    granularity: int = 16,
    ceiling: int | None = None,
    tolerance: int | None = None,
    fences: Fences = (),
) -> RoutePlan:
    """The plan with the lowest step peak that serves the most bytes from the arena at it.

    Candidates: the full packing; and allocations taken one at a time (those live at the
    step's busiest tick first: the arena must be full there for the peak to fall; then
    largest first), each at its best gap, refusing any that would grow the arena past the
    peak it lowers, with the arena's growth judged in whole granules and, separately, in
    bytes; passes repeat while some are taken, and where the arena's rounding puts such a
    plan over the allocator alone, it is taken again under its arena rounded down. Of those
    whose peak is at most the allocator's alone, the lowest peak wins; of those at most one
    granule (a page) above it, the one that serves the most where it serves more (the arena
    of a packing at max-live, rounded to whole pages, is up to a page above the allocator).

    Else at the allocator's alone to the byte, unless that serves less than half of what
    ``tolerance`` above it would: at the step's busiest tick an arena holding any
    of it needs its bytes rounded to whole granules and each allocation to 64 bytes, so a
    step whose peak no plan lowers (gradients present, nothing outlives it) could serve
    next to nothing from the arena to save a few hundred bytes; there the whole step is
    served, at most that tolerance above.

    Args:
        recording: the step's sequence.
        capacity: the arena's bytes already there (other steps made it): free to use.
        granularity: the arena grows in whole multiples of this many bytes.
        ceiling: the most arena bytes allowed (a pool limit).
        tolerance: the bytes above the allocator alone that buy serving the whole step
            (default: one granule and 0.1% of the step's peak; 0: never above it).
        fences: byte ranges of the arena held for the whole step (within ``capacity``).

    Returns:
        The plan chosen; ``max(capacity, arena) + beside_peak`` is its step peak.
    """
    alone = capacity + recording.live_peak()
    # Grown once, judged in whole granules and in bytes; each limit below trims its own copy.
    # Every growth is kept by its unit and ceiling: the three limits below share them.
    grown: dict[tuple[int, int | None], RoutePlan] = {}
    for unit in dict.fromkeys((granularity, 1)):
        grown[unit, ceiling] = _grow_greedily(recording, capacity, ceiling, unit, fences)
    full = plan_offsets(recording, ceiling=ceiling, fences=fences)
    packed = [full, *_trimmed(recording, full, capacity, granularity, ceiling, fences, alone)]
    candidates = (recording, capacity, granularity, ceiling, packed, grown, fences)
    strict = _best(*candidates, alone, 0)
    if tolerance is None:
        tolerance = granularity + alone // 1000
    if tolerance <= 0:
        return strict
    # One page of slack: a plan at most one page above the lowest peak (and the allocator
    # alone) that serves more (the whole step, where its packing meets max-live). Never more
    # than a page above the lowest: where fences fill the arena, the allocator alone is far
    # above what a plan needs.
    paged = _best(*candidates, alone + min(granularity, tolerance), granularity)
    if paged.routed_bytes > strict.routed_bytes:
        strict = paged
    tolerant = _best(*candidates, alone + tolerance, tolerance)
    chosen = strict if 2 * strict.routed_bytes >= tolerant.routed_bytes else tolerant
    return _kept_below(recording, chosen, granularity=granularity, ceiling=ceiling, fences=fences)


def _kept_below(
    recording: Recording,
    plan: RoutePlan,
    *,
    granularity: int,
    ceiling: int | None,
    fences: Fences,
) -> RoutePlan:
    # ``plan``, or a plan of the same arena (its need in whole granules) in which the
    # allocations live at the step's last tick (``placeable``'s outliving ones: gradients,
    # the loss) lie together at the arena's bottom, so that the room they leave free while
    # the user holds them is one range up to the arena's top, which a call made then (an
    # evaluation before ``zero_grad()``) packs into and grows from as one. Placed between
    # activations, they split it: GPT-2's gradients sat mid-arena with 512 KB free on either
    # side, and an evaluation at twice the batch needed 1.17x eager's peak. Found by the
    # exact search with one more allocation at that tick, fixed above them, filling the
    # arena: only where every allocation is placed, on an arena no fence holds.
    sizes, starts, ends = recording.sizes, recording.alloc_at, recording.free_at
    candidates = [i for i in range(len(sizes)) if ends[i] >= 0 and sizes[i] > 0]
    if fences or not candidates or any(plan.offsets[i] < 0 for i in candidates):
        return plan
    last = max(ends[i] for i in candidates)
    aligned = [-(-sizes[i] // ALIGN) * ALIGN for i in candidates]
    kept = [k for k, i in enumerate(candidates) if ends[i] == last]
    spans = merged([(plan.offsets[candidates[k]], plan.offsets[candidates[k]] + aligned[k])
                    for k in kept])  # fmt: skip
    if len(spans) == 1 and spans[0][0] == 0:
        return plan  # together at the bottom already
    height = -(-plan.need // granularity) * granularity
    if ceiling is not None:
        height = min(height, ceiling)
    height = max(plan.need, height // ALIGN * ALIGN)
    held = sum(aligned[k] for k in kept)
    if height <= held:
        return plan
    n = len(candidates)
    found = pack_under(
        [*aligned, height - held],
        [*(starts[i] for i in candidates), last - 1],
        [*(ends[i] for i in candidates), last],
        height,
        fixed=[-1] * n + [held],
        steps=min(_EXACT_STEPS, _EXACT_EACH * n + 256),
    )
    if found is None:
        return plan
    offsets = [-1] * len(sizes)
    for i, offset in zip(candidates, found, strict=False):
        offsets[i] = offset
    return _described(recording, offsets)


def _trimmed(
    recording: Recording,
    full: RoutePlan,
    capacity: int,
    granularity: int,
    ceiling: int | None,
    fences: Fences,
    alone: int,
) -> list[RoutePlan]:
    # Where the full packing's arena, in whole granules, is more than a granule above the
    # allocator alone (each allocation's 64-byte alignment at the busiest tick, and the
    # rounding: Swin-T's step with gradients present packs at its aligned max-live, 3,648
    # bytes over the allocator's, 4,480 in pages), the packings of the same step under an
    # arena a granule lower, then two: what no longer fits (a few small allocations) is
    # left to PyTorch, at its own bytes, and the step is served all but those at most a
    # granule above the allocator alone (Swin-T: 928 bytes over, all but 544 bytes served),
    # where the packings taken one allocation at a time served 65% of it.
    plans: list[RoutePlan] = []
    top = -(-full.need // granularity) * granularity
    if ceiling is not None:
        top = min(top, ceiling // granularity * granularity)
    for k in range(1, _TRIMS + 1):
        if _peak(plans[-1] if plans else full, capacity, granularity) <= alone + granularity:
            break
        height = top - k * granularity
        if height <= capacity:
            break
        plans.append(plan_offsets(recording, ceiling=height, fences=fences))
    return plans


def _best(
    recording: Recording,
    capacity: int,
    granularity: int,
    ceiling: int | None,
    packed: list[RoutePlan],
    grown: dict[tuple[int, int | None], RoutePlan],
    fences: Fences,
    allowed: int,
    tolerance: int,
) -> RoutePlan:
    # The lowest peak at most ``allowed``, and of the plans within ``tolerance`` of it, the
    # one that serves the most. A grown plan over ``allowed`` grows again under its arena
    # rounded down to whole granules, until it fits (``grown`` keeps every growth made); past
    # ``_REGROW`` such rounds (a step whose peak stays a few bytes above ``allowed`` as its
    # arena shrinks by one granule: ResNet-50's, hundreds of rounds of a second each), the
    # highest arena below that fits is bisected for, in whole granules: at most
    # ``_REGROW + log2(arena / granularity) + 1`` growths per unit, and every fitting plan
    # the bisection met is a candidate.
    plans = list(packed)

    def grow(unit: int, limit: int) -> RoutePlan:
        if (unit, limit) not in grown:
            grown[unit, limit] = _grow_greedily(recording, capacity, limit, unit, fences)
        return grown[unit, limit]

    def fits(plan: RoutePlan) -> bool:
        return _peak(plan, capacity, granularity) <= allowed

    for unit in dict.fromkeys((granularity, 1)):
        plan = grown[unit, ceiling]
        rounds = 0
        while not fits(plan) and plan.need > 0:
            lower = (plan.need - 1) // granularity * granularity
            rounds += 1
            if rounds <= _REGROW:
                plan = grow(unit, lower)
                continue
            # Bisected over whole granules of [0, lower]: ``low`` fits (an empty arena is
            # the allocator alone) or is 0, ``high`` is past what was found to fit.
            low, high = 0, lower // granularity + 1
            while high - low > 1:
                middle = (low + high) // 2
                if fits(tried := grow(unit, middle * granularity)):
                    low = middle
                    plans.append(tried)
                else:
                    high = middle
            plan = grow(unit, low * granularity)
            break
        plans.append(plan)
    # The greedy plans always fit: each growth keeps the peak in bytes, and at an empty
    # arena the plan is the allocator alone. Every growth an earlier limit made is a
    # candidate too: a looser limit stops regrowing sooner, and judged only by its own
    # plans, its "lowest" peak could sit more than ``tolerance`` above the step's lowest.
    plans.extend(grown.values())
    fitting = [p for p in plans if _peak(p, capacity, granularity) <= allowed]
    lowest = min(_peak(p, capacity, granularity) for p in fitting)
    near = [p for p in fitting if _peak(p, capacity, granularity) <= lowest + tolerance]
    return max(near, key=lambda p: p.routed_bytes)


def _peak(plan: RoutePlan, capacity: int, granularity: int) -> int:
    return max(capacity, -(-plan.need // granularity) * granularity) + plan.beside_peak


def _grow_greedily(
    recording: Recording, capacity: int, ceiling: int | None, unit: int, fences: Fences
) -> RoutePlan:
    # ``unit``: the arena's growth is judged rounded up to whole multiples of it.
    sizes, starts, ends = recording.sizes, recording.alloc_at, recording.free_at
    n = len(sizes)
    horizon = max([*starts, *ends], default=0) + 2
    beside = np.zeros(horizon + 1, dtype=np.int64)  # bytes live beside the arena per tick
    for i in range(n):
        beside[starts[i] : (ends[i] if ends[i] >= 0 else horizon)] += sizes[i]
    busiest = int(beside.argmax())
    pending = sorted(
        (i for i in range(n) if ends[i] >= 0 and sizes[i] > 0),
        key=lambda i: (not starts[i] <= busiest < ends[i], -sizes[i], starts[i]),
    )
    arena = capacity
    offsets = [-1] * n
    # The placed allocations, as arrays grown in place (start tick, end tick, offset, top),
    # the fences first, live at every tick: one vectorized overlap test per allocation.
    held_fences = _aligned(fences)
    placed = np.zeros((4, len(held_fences) + max(1, len(pending))), dtype=np.int64)
    for k, (low, high) in enumerate(held_fences):
        placed[:, k] = (-1, _ALWAYS, low, high)
    count = len(held_fences)
    while pending:
        refused: list[int] = []
        for i in pending:
            start, end = starts[i], ends[i]
            size = -(-sizes[i] // ALIGN) * ALIGN
            live = placed[:, :count]
            busy = live[:, (live[0] < end) & (start < live[1])]
            offset = best_gap(busy[2], busy[3], size)
            grown = max(arena, offset + size)
            if ceiling is not None and grown > ceiling:
                refused.append(i)
                continue
            held, holds = -(-arena // unit) * unit, -(-grown // unit) * unit
            if holds > held:
                peak = held + int(beside.max())
                outside = max(_top(beside[:start]), _top(beside[end:]))
                inside = int(beside[start:end].max()) - sizes[i]
                if holds + max(outside, inside) > peak:
                    refused.append(i)
                    continue
            arena = grown
            beside[start:end] -= sizes[i]
            placed[:, count] = (start, end, offset, offset + size)
            count += 1
            offsets[i] = offset
        if len(refused) == len(pending):
            break
        pending = refused
    return _described(recording, offsets)


def _aligned(fences: Fences) -> Fences:
    # A fence is a tensor's exact bytes (a 4-byte loss ends off the grid): widened to whole
    # ``ALIGN`` units, so that what is packed after it starts on the grid too. An allocation
    # at an unaligned address computes otherwise (a matrix product's kernel takes another
    # path, its sums another order): the step would not equal eager's to the bit.
    return tuple((low // ALIGN * ALIGN, -(-high // ALIGN) * ALIGN) for low, high in fences)


def _top(values: np.ndarray) -> int:
    return int(values.max()) if values.size else 0


def _described(recording: Recording, offsets: list[int]) -> RoutePlan:
    sizes, ends = recording.sizes, recording.free_at
    n = len(sizes)
    routed = [i for i in range(n) if offsets[i] >= 0]
    beside = [i for i in range(n) if offsets[i] < 0]
    need = max((offsets[i] + -(-sizes[i] // ALIGN) * ALIGN for i in routed), default=0)
    return RoutePlan(
        offsets=tuple(offsets),
        need=need,
        lower_bound=_max_live(*_pick(recording, routed)),
        routed_bytes=sum(sizes[i] for i in routed),
        beside_bytes=sum(sizes[i] for i in beside if ends[i] >= 0),
        beside_peak=_max_live(*_pick(recording, beside)),
    )


def best_gap(lows: np.ndarray, highs: np.ndarray, size: int, *, first: bool = False) -> int:
    """The offset of the smallest gap between the busy ranges ``[low, high)`` that holds
    ``size`` bytes (``first``: the lowest gap that holds it; of equal gaps the lowest), else
    the top of the highest range: best fit, or first fit, over one allocation's neighbours."""
    if lows.size == 0:
        return 0
    order = np.argsort(lows, kind="stable")
    if lows.size <= _FEW:  # a few ranges: a loop costs less than the arrays below
        best, smallest, offset = -1, 0, 0
        for low, high in zip(lows[order].tolist(), highs[order].tolist(), strict=True):
            gap = low - offset
            if gap >= size and (best < 0 or gap < smallest):
                best, smallest = offset, gap
                if first:
                    return best
            offset = max(offset, high)
        return best if best >= 0 else offset
    # Each range's gap starts at the highest top below it (0 for the first) and ends at it.
    tops = np.maximum.accumulate(highs[order])
    below = np.empty_like(tops)
    below[0] = 0
    below[1:] = np.maximum(tops[:-1], 0)
    gaps = lows[order] - below
    fits = np.flatnonzero(gaps >= size)
    if fits.size == 0:
        return max(int(tops[-1]), 0)
    at = fits[0] if first else fits[int(np.argmin(gaps[fits]))]
    return int(below[at])


def _pick(recording: Recording, chosen: list[int]) -> tuple[list[int], list[int], list[int]]:
    return (
        [recording.sizes[i] for i in chosen],
        [recording.alloc_at[i] for i in chosen],
        [recording.free_at[i] for i in chosen],
    )


def _max_live(sizes: Sequence[int], starts: Sequence[int], ends: Sequence[int]) -> int:
    live = _live(sizes, starts, ends)
    return int(live.max()) if live.size else 0


def _live(sizes: Sequence[int], starts: Sequence[int], ends: Sequence[int]) -> np.ndarray:
    """The bytes live after each tick (an empty array for no allocations)."""
    if not sizes:
        return np.zeros(0, dtype=np.int64)
    horizon = max(max(starts), max(ends)) + 2
    delta = np.zeros(horizon, dtype=np.int64)
    np.add.at(delta, np.asarray(starts, dtype=np.int64), np.asarray(sizes, dtype=np.int64))
    freed = [(e, s) for s, e in zip(sizes, ends, strict=True) if e >= 0]
    if freed:
        at, nbytes = zip(*freed, strict=True)
        np.subtract.at(delta, np.asarray(at, dtype=np.int64), np.asarray(nbytes, dtype=np.int64))
    return np.cumsum(delta)
