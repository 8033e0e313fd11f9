"""Which intermediates of a graph go into the pool's arena, and where, for the step's peak.

The arena (one pool buffer) is reserved for the whole step and kept after it, while a result
that an op allocates itself lives only from its op to its last read. Pooling every
intermediate would therefore cost more than eager wherever ops without a native ``out=``
kernel (convolution and its backward, layer norm, attention) allocate beside the pool: the
peak would be the arena plus the most bytes ever live beside it, where eager's is the most
bytes live at once. So every byte of the step is put on one timeline: at node ``t`` the step
holds ``A + U(t)``, the arena's bytes ``A`` and the bytes ``U(t)`` of fresh results live then,
and an intermediate is pooled only where that does not raise ``max_t A + U(t)``.

A pooled intermediate gets a byte offset from the router's packers (``_routing.plan``; the
values are its rows, ``intervals``): the lowest one where no value live at the same time sits
(its first fit, largest values first, those live at the busiest node before the rest).
Several packings are compared and the lowest peak wins: everything; one value at a time,
refusing any growth of the arena that raises the peak (passes repeat, since a value refused
early may fit beside values taken after it); arenas capped at fractions of the full packing's;
everything as the router packs a step (``plan_offsets``: more orders, then its bounded exact
search); and nothing at all. The first graph on an arena takes ties (a pooled result costs no
allocation on later calls); a graph planned on an arena other graphs made grows it only where
that lowers its own peak, so that, say, an evaluation after training adds nothing. What is
not pooled runs as eager runs it, allocating.

Since pooling nothing is one of the choices, a planned step needs at most what the same graph
needs on the allocator alone: eager's schedule, freed at each value's last read, with
pointwise results written over dying operands.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .._routing.plan import ALIGN, Recording, best_gap, plan_offsets
from .plan import Lifetime

__all__ = ["Placed", "as_recording", "intervals", "place", "timeline_peak"]

# The share of the step's peak kept free, beside a value the arena grows for, at the nodes
# where that value is not live.
_MARGIN = 0.03


@dataclass(frozen=True)
class Placed:
    """Where each candidate lives in the arena (its byte offset; ``None``: it runs as eager,
    allocating), and the step's planned memory.

    Attributes:
        offsets: per candidate, its offset in the arena or ``None``.
        need: the bytes of the arena this graph uses (the top of its highest value).
        arena: the arena's bytes once planned, in the pool's granularity (what is reserved
            while the step runs, whether this graph or another made it so big).
        beside_peak: the most bytes of fresh results live at once during a call.
    """

    offsets: list[int | None]
    need: int
    arena: int
    beside_peak: int

    @property
    def peak(self) -> int:
        """The arena plus the most bytes ever live beside it: the step's planned peak."""
        return self.arena + self.beside_peak


def place(
    candidates: Sequence[Lifetime],
    fresh: Sequence[Lifetime],
    capacity: int,
    *,
    horizon: int,
    granularity: int = 16,
    must: frozenset[int] = frozenset(),
    ceiling: int | None = None,
    establish: bool | None = None,
) -> Placed:
    """Choose the arena offset of each candidate, or none, for the lowest peak.

    Every offset is a multiple of the router's ``ALIGN`` (64 bytes: any dtype views there),
    found by the router's packers (``_routing.plan``): its first fit, and its own search for
    the lowest packing of everything.

    Args:
        candidates: intermediates that may be pooled (each a whole value, in-place pairs
            already joined).
        fresh: results that always allocate (ops without a native ``out=`` form, and what
            the call returns), which count beside the arena.
        capacity: the arena's bytes before this plan (other graphs' plans made it); ``0``
            for the first graph, which establishes the arena and so takes ties.
        horizon: the number of nodes; every ``end`` is below it.
        granularity: the arena's capacity is a whole multiple of this many bytes.
        must: candidates that go into the arena whatever they cost (outputs the caller asked
            to get as pool views); they are placed first.
        ceiling: the most bytes the arena may grow to (the pool's limit): values that would
            take it further run beside it (``must`` ones excepted: their growth fails).
        establish: whether this is the first graph planned on the arena (default: when
            ``capacity`` is 0), which takes ties; a later one grows the arena only to lower
            its own peak, even where the first left it empty.

    Example::

        >>> from sharedmem._executor.placement import place
        >>> from sharedmem._executor.plan import Lifetime
        >>> # a long-lived activation, then two short-lived results that can reuse its bytes
        >>> got = place([Lifetime(256, 0, 2), Lifetime(128, 3, 4), Lifetime(128, 3, 3)], [], 0,
        ...             horizon=5)
        >>> got.offsets, got.peak
        ([0, 0, 128], 256)
    """
    rows, beside = intervals(candidates), intervals(fresh)
    # Values live at the step's busiest node first (the arena must hold them for the peak to
    # fall), then by size, largest first.
    busiest = int(_timeline([rows, beside], horizon).argmax())
    order = sorted(
        range(len(candidates)),
        key=lambda i: (
            i not in must,
            not candidates[i].start <= busiest <= candidates[i].end,
            -candidates[i].nbytes,
            candidates[i].start,
        ),
    )
    # Packing everything is best where the arena's bytes are all in use at the peak; where
    # they are not, taking values one by one (and refusing those that raise the peak) is.
    # The first graph on an arena takes the lower peak, ties going to the fuller arena; a
    # later graph takes the lower peak, ties going to the smaller arena.
    first = capacity == 0 if establish is None else establish
    step = _Step(rows, beside, horizon, granularity, order, must)
    plans = [step.grow(capacity, greedy, ceiling, first) for greedy in (False, True)]
    # Arenas of a fixed fraction of the full packing's, filled largest first with what fits:
    # forward activations and backward temporaries share addresses where one at a time
    # could not see that it would (taking values one by one refuses the first of them).
    full = plans[0].arena
    for eighth in range(1, 8):
        cap = max(capacity, _rounded(full * eighth // 8, granularity))
        limit = cap if ceiling is None else min(cap, ceiling)
        plans.append(step.grow(capacity, False, limit, first))
    # The router's packing of everything: more orders than the one above, then its exact
    # search (bounded) where they stay above the most bytes live at once.
    routed = step.routed(capacity, ceiling)
    if routed is not None:
        plans.append(routed)
    # Pooling nothing is always a choice: with the arena's rounding to whole granules, a
    # small step may need less that way.
    if not must:
        beside_all = timeline_peak([*fresh, *candidates]) if horizon else 0
        plans.append(Placed([None] * len(candidates), 0, capacity, beside_all))
    if not first:
        # A plan made as if the arena were new may use the arena other graphs made better
        # than one fitted around it: its offsets are as valid in a bigger arena.
        for greedy in (False, True):
            alone = step.grow(0, greedy, ceiling, False)
            plans.append(dataclasses.replace(alone, arena=max(alone.arena, capacity)))
        return min(plans, key=lambda p: (p.peak, p.arena))
    return min(plans, key=lambda p: (p.peak, -p.need))


def intervals(values: Sequence[Lifetime]) -> Recording:
    """``values`` as the router's packers take them: each live over ticks ``[start, end + 1)``
    (a node's index is its tick)."""
    return Recording(
        [life.nbytes for life in values],
        [life.start for life in values],
        [life.end + 1 for life in values],
    )


@dataclass(frozen=True)
class _Step:
    """One graph's values as ``place`` packs them: the candidates (``rows``), what always
    allocates beside the arena, the order candidates are taken in, those that must go in."""

    rows: Recording
    beside: Recording
    horizon: int
    granularity: int
    order: Sequence[int]
    must: frozenset[int]

    def grow(self, capacity: int, greedy: bool, ceiling: int | None, establish: bool) -> Placed:
        """The candidates in ``order``, each at the router's first fit (``best_gap``);
        ``greedy``: refusing those that would grow the arena past the peak they lower."""
        sizes, starts, ends = self.rows.sizes, self.rows.alloc_at, self.rows.free_at
        beside = _timeline([self.beside, self.rows], self.horizon)[: self.horizon]
        arena = capacity
        margin = int(_MARGIN * (arena + int(beside.max()) if self.horizon else 0))
        offsets: list[int | None] = [None] * len(sizes)
        # The values taken, as arrays grown in place (start tick, end tick, offset, top).
        placed = np.zeros((4, max(1, len(sizes))), dtype=np.int64)
        count = 0
        pending = list(self.order)
        while pending:
            refused: list[int] = []
            for i in pending:
                start, end, nbytes = starts[i], ends[i], sizes[i]
                size = _rounded(nbytes, ALIGN)
                live = placed[:, :count]
                busy = live[:, (live[0] < end) & (start < live[1])]
                offset = best_gap(busy[2], busy[3], size, first=True)
                grown = max(arena, offset + size)
                if (
                    ceiling is not None
                    and _rounded(grown, self.granularity) > ceiling
                    and i not in self.must
                ):
                    refused.append(i)
                    continue
                if greedy and grown > arena and i not in self.must:
                    # More arena is reserved at every node: take it only where the peak holds.
                    # (Judged in bytes: the granularity's rounding costs less than one granule
                    # in all, where judging each value by it would refuse every first one.)
                    peak = arena + int(beside.max())
                    outside = max(_max(beside[:start]), _max(beside[end:]))
                    inside = int(beside[start:end].max()) - nbytes
                    # Where the value is not live the arena's new bytes sit beside the rest:
                    # keep a margin there, since kernels' scratch is only modelled.
                    if grown + outside > peak - margin or grown + inside > peak:
                        refused.append(i)
                        continue
                    if grown + max(outside, inside) == peak and not establish:
                        refused.append(i)
                        continue
                arena = grown
                beside[start:end] -= nbytes
                placed[:, count] = (start, end, offset, offset + size)
                count += 1
                offsets[i] = offset
            if len(refused) == len(pending):
                break
            pending = refused
        need = int(placed[3, :count].max()) if count else 0
        reserved = _rounded(arena, self.granularity) if arena else 0
        return Placed(offsets, need, reserved, int(beside.max()) if self.horizon else 0)

    def routed(self, capacity: int, ceiling: int | None) -> Placed | None:
        """The router's packing of the candidates (``plan_offsets``), or ``None`` where it
        leaves out one that must go in, or where the arena is past ``ceiling`` already."""
        if ceiling is not None:
            # ``grow``'s test, a rounded arena over the ceiling, on bytes: the ceiling in
            # whole granules, and nothing taken where the arena is over it already.
            ceiling = ceiling // self.granularity * self.granularity
            if _rounded(capacity, self.granularity) > ceiling:
                return None
        plan = plan_offsets(self.rows, ceiling=ceiling)
        # Empty values are no candidates there: they take no bytes anywhere.
        offsets = [o if o >= 0 else 0 if not n else None
                   for o, n in zip(plan.offsets, self.rows.sizes, strict=True)]  # fmt: skip
        if any(offsets[i] is None for i in self.must):
            return None
        left = [n if o is None else 0 for o, n in zip(offsets, self.rows.sizes, strict=True)]
        beside = _timeline([self.beside, self.rows._replace(sizes=left)], self.horizon)
        arena = max(capacity, plan.need)
        reserved = _rounded(arena, self.granularity) if arena else 0
        return Placed(offsets, plan.need, reserved, _max(beside[: self.horizon]))


def timeline_peak(values: Sequence[Lifetime]) -> int:
    """The most bytes of ``values`` live at one node (each live from ``start`` to ``end``)."""
    return intervals(values).live_peak()


def _timeline(recordings: Sequence[Recording], horizon: int) -> np.ndarray:
    # The bytes live at each node (and one past the last), summed over ``recordings``.
    delta = np.zeros(horizon + 2, dtype=np.int64)
    for rows in recordings:
        if len(rows.sizes):
            sizes = np.asarray(rows.sizes, dtype=np.int64)
            for ticks, sign in ((rows.alloc_at, sizes), (rows.free_at, -sizes)):
                # a graph's outputs live past its last node: counted to one past it
                at = np.minimum(np.asarray(ticks, dtype=np.int64), horizon + 1)
                np.add.at(delta, at, sign)
    return np.cumsum(delta)[: horizon + 1]


def _rounded(nbytes: int, align: int) -> int:
    return -(-nbytes // align) * align


def _max(values: np.ndarray) -> int:
    return int(values.max()) if values.size else 0


# Within one node of a graph's eager run: its results are allocated, then its kernel's
# scratch, which is freed before the values the node read for the last time are (where the
# kernel's own sequence was measured, ``as_recording`` follows it instead).
_RESULT, _SCRATCH, _SCRATCH_FREED, _LAST_READ = range(4)


def as_recording(
    dying: Sequence[Lifetime],
    outliving: Sequence[Lifetime],
    scratch: Sequence[Lifetime],
    sequences: Mapping[int, Sequence[tuple[int, int, int]]] | None = None,
) -> Recording:
    """The allocation sequence a graph's eager run makes, as the router would record it:
    ``dying`` values are freed after their last read, ``outliving`` ones never (they outlive
    the call), ``scratch`` is allocated and freed at its node. Planned with the router's own
    ``choose_plan``, it stands for a routed step's plan before the step has run once.

    ``sequences``: per node, its kernel's own allocations in order as measured
    (``KernelMemory.sequence``): where each of the node's results is one of them, the node
    allocates as its kernel does (each piece of scratch, in its order among the results)
    instead of one lump of scratch after its results: the sequence a guided first call meets.

    Example::

        >>> from sharedmem._executor.plan import Lifetime
        >>> # a value read last at node 1; a gradient made there; that node's scratch
        >>> rec = as_recording([Lifetime(64, 0, 1)], [Lifetime(8, 1, 1)], [Lifetime(32, 1, 1)])
        >>> list(rec.sizes), list(rec.alloc_at), list(rec.free_at)
        ([64, 8, 32], [0, 1, 2], [4, -1, 3])
        >>> # its kernel: 16 bytes of scratch, the result, 24 more, both freed before it ends
        >>> rec = as_recording([Lifetime(64, 0, 1)], [Lifetime(8, 1, 1)], [Lifetime(40, 1, 1)],
        ...                    {1: [(16, 0, 3), (8, 1, -1), (24, 2, 4)]})
        >>> list(rec.sizes), list(rec.alloc_at), list(rec.free_at)
        ([64, 8, 16, 24], [0, 2, 1, 3], [6, -1, 4, 5])
    """
    sizes: list[int] = []
    # (node, phase, order within the node and phase, allocation, allocates)
    events: list[tuple[int, int, int, int, bool]] = []
    kernels = _kernel_orders(dying, outliving, sequences or {})
    for life, kind in (
        *((life, "dies") for life in dying),
        *((life, "outlives") for life in outliving),
        *((life, "scratch") for life in scratch),
    ):
        if not life.nbytes:
            continue
        if kind == "scratch" and life.start in kernels:
            continue  # its kernel's own pieces below
        i = len(sizes)
        sizes.append(life.nbytes)
        if kind == "scratch":
            events += [
                (life.start, _SCRATCH, i, i, True),
                (life.start, _SCRATCH_FREED, i, i, False),
            ]
            continue
        found = kernels.get(life.start)
        tick = found[0].pop(id(life), i) if found is not None else i
        events.append((life.start, _RESULT, tick, i, True))
        if kind == "dies":
            events.append((life.end, _LAST_READ, i, i, False))
    for node, (_, pieces) in sorted(kernels.items()):
        for size, allocated, freed in pieces:
            i = len(sizes)
            sizes.append(size)
            events += [(node, _RESULT, allocated, i, True), (node, _RESULT, freed, i, False)]
    alloc_at = [0] * len(sizes)
    free_at = [-1] * len(sizes)
    for tick, (*_, i, allocates) in enumerate(sorted(events)):
        (alloc_at if allocates else free_at)[i] = tick
    return Recording(sizes, alloc_at, free_at)


def _kernel_orders(
    dying: Sequence[Lifetime],
    outliving: Sequence[Lifetime],
    sequences: Mapping[int, Sequence[tuple[int, int, int]]],
) -> dict[int, tuple[dict[int, int], list[tuple[int, int, int]]]]:
    """Per node whose kernel sequence accounts for each of its results: each result's tick
    in the kernel (by ``id`` of its lifetime) and the kernel's other allocations, its scratch
    (``(size, allocated, freed)``)."""
    results: dict[int, list[Lifetime]] = {}
    for life in (*dying, *outliving):
        if life.nbytes and life.start in sequences:
            results.setdefault(life.start, []).append(life)
    found: dict[int, tuple[dict[int, int], list[tuple[int, int, int]]]] = {}
    for node, lives in results.items():
        ticks: dict[int, int] = {}
        pieces: list[tuple[int, int, int]] = []
        waiting = list(lives)
        for size, allocated, freed in sequences[node]:
            match = next((life for life in waiting if life.nbytes == size), None)
            if freed < 0 and match is not None:
                waiting.remove(match)
                ticks[id(match)] = allocated
            elif freed >= 0 and size:
                pieces.append((size, allocated, freed))
        if not waiting:
            found[node] = (ticks, pieces)
    return found
