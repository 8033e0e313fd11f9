"""One plan for every size: the routes of a graph traced with symbolic sizes share plans.

A graph traced with a dimension as a symbol (a sequence length) serves every length with one
route per length, and every new length's allocation sequence is derived rather than recorded
(the same allocations in the same order; only their sizes follow the symbols). Planning each
new length offline (``choose_plan``, tens of milliseconds) would make the first call of every
length cost more than its step, and with lengths drawn at random most calls are a first call.

So the routes of one family plan once for the envelope of every size seen: per allocation,
the largest size any length of the family asked for. A plan of the envelope is a plan of
every sequence it covers: allocations that share a tick get disjoint byte ranges in the
envelope, and a smaller allocation at the same offset keeps within its range, so no two
overlap still (and every offset stays on the 64-byte grid: the kernels compute as eager's).
A new length reuses that plan where the envelope covers it (a comparison per allocation);
only a length larger than every one before (a few in a run: the running maxima) widens the
envelope. The widened envelope keeps the previous plan's order: each allocation right above
the new tops of those it sat above (still disjoint), which on a transformer's sequence
meets max-live exactly; only where that is more than ``SCALE_SLACK`` above it (sizes that
grew unevenly) is the envelope planned again. The arena holds the envelope's plan, so it
ends at the size the longest length would have grown it to alone, as without the sharing.

Plans are kept, as a route keeps its own, per set of fences. Unlike a route's own plan, a
family's is not made again when the arena grows (another size's plan grew it): it still fits,
and the arena grows for the family only while the envelope widens, which plans it again.

What outlives a call (the loss) is still held by the user at the next call (the previous
loss): a fence. Placed anywhere, it would sit at another offset in each envelope's plan, and
every length would find other fences, and plan again. So the small outliving allocations
(a loss, a bias's gradient, a norm's running statistics) take one of two fixed banks at the
arena's start (``banks``), and the rest of the sequence is planned around both: a call whose
fence is the previous call's bank takes the other, with the same plan of the rest. (The
large ones, gradients of weights, are freed by ``zero_grad`` before the next call: planned
with the rest.) A route gets both banks' plans of its size at once (``FamilyPlan.other``)
and keeps them by the bank the fences leave free (``key``): a length that comes back finds
the previous loss, its own or another length's, in either bank and replays, planning
nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections import OrderedDict
from collections.abc import Collection
from typing import NamedTuple, Protocol

import numpy as np

from .plan import ALIGN, Fences, Recording, RoutePlan

__all__ = ["FamilyPlan", "Make", "SharedPlans", "banks", "key", "reused"]

PLANS_PER_FAMILY = 16  # envelope plans kept per family (least recent dropped)
# A widened envelope takes its previous plan scaled (``_scaled``) where that needs at most
# this fraction above the envelope's max-live (no plan needs less), instead of planning anew.
SCALE_SLACK = 0.05
# Outliving allocations of at most BANK_ITEM bytes take the banks, unless they come to more
# than BANK_BYTES: each bank holds them all, so the banks cost their bytes again.
BANK_ITEM = 4096
BANK_BYTES = 1 << 20

_Ticks = tuple[tuple[int, ...], tuple[int, ...]]  # alloc_at, free_at of a sequence
# a sequence's ticks as arrays (``_ticks``): alloc_at, free_at, which are freed, tick count
_Arrays = tuple[np.ndarray, np.ndarray, np.ndarray, int]


class _Envelope(NamedTuple):
    plans: tuple[RoutePlan, ...]  # the plan of ``sizes``; with banks, one per bank
    sizes: np.ndarray  # the envelope's sizes it was made for
    grown: bool  # made for a call that may grow the arena (else only within it)
    need: int  # the arena bytes the plans need (the most of theirs)
    bank: int  # the bytes of each bank (0: no banks, one plan)


class FamilyPlan(NamedTuple):
    """A route's plan from its family: the plan of its own sizes, the arena bytes the
    family's plan needs (what to grow the arena to: the envelope's), and whether it was
    reused (the envelope covered the sizes) rather than made.

    Where the plan has banks (``bank``: the bytes of each), ``which`` is the bank it
    places the small outliving allocations in, and ``other`` the same sizes' plan with
    them in the other bank: what the route's next call takes where it finds this call's
    outliving allocations still held (the previous loss), with the same fences beside."""

    plan: RoutePlan
    need: int
    reused: bool
    bank: int = 0
    which: int = -1
    other: RoutePlan | None = None


class SharedPlans:
    """The plans the routes of one family of sizes lend one another (see the module).

    Thread-safe: routes of the family may plan on several threads at once.

    Args:
        slack: how far above the widened envelope's max-live (a fraction) the previous
            envelope's plan, kept in order at the wider sizes, may be and still serve
            (``_scaled``); ``None``: every widened envelope is planned anew.
    """

    def __init__(self, *, slack: float | None = SCALE_SLACK) -> None:
        self._lock = threading.Lock()
        self._slack = slack
        # per allocation sequence (its ticks): the largest size of each allocation seen
        self._envelopes: dict[_Ticks, np.ndarray] = {}
        self._plans: OrderedDict[tuple[object, ...], _Envelope] = OrderedDict()
        self.made = 0  # envelope plans made
        self.scaled = 0  # envelope plans taken from the previous envelope's, scaled
        self._banks = 0  # the bytes of both banks in the latest plan (0: none)

    def plan(
        self,
        recording: Recording,
        *,
        capacity: int,
        fences: Fences,
        grow: bool,
        make: Make,
        outliving: Collection[int] = (),
        ceiling: int | None = None,
    ) -> FamilyPlan:
        """The plan of ``recording`` (as ``make`` plans a sequence, for an arena of
        ``capacity`` bytes that ``fences`` hold parts of, grown where ``grow``).

        Where a plan of an envelope covering ``recording`` was made for the same fences (and
        fits the arena as it is), its offsets serve; otherwise the envelope is widened by
        ``recording`` and planned by ``make``, or, where the previous envelope's plan kept
        in order at the wider sizes is within the slack (``_scaled``) and needs at most
        ``ceiling`` bytes (what ``make`` may use; ``None``: no limit where ``grow``, else
        ``capacity``), by that plan. The allocations of ``outliving`` (indices of
        those that outlive the call, placed by ``placeable``) that are small take one of two
        fixed banks at the arena's start (see ``banks``): a fence there (what the user holds
        of the previous call) then picks the other bank, not another plan."""
        ticks = (tuple(recording.alloc_at), tuple(recording.free_at))
        sizes = np.asarray(recording.sizes, dtype=np.int64)
        arrays = _ticks(ticks)
        with self._lock:
            envelope = self._envelopes.get(ticks)
            widest = sizes if envelope is None else np.maximum(envelope, sizes)
            kept, bank = banks(widest, outliving, capacity)
            which, rest = _bank(fences, bank)
            self._banks = 2 * bank if which >= 0 else 0
            key: tuple[object, ...] = (ticks, tuple(rest), tuple(kept) if which >= 0 else None)
            found = self._plans.get(key)
            if (
                found is not None
                and (found.grown or not grow)
                and found.need <= capacity
                and bool(np.all(sizes <= found.sizes))
            ):
                self._plans.move_to_end(key)
                return _both(sizes, arrays, found, which, True)
            self._envelopes[ticks] = widest
        whole = Recording(widest.tolist(), recording.alloc_at, recording.free_at)
        scaled = None
        if self._slack is not None and found is not None and not rest and (found.grown or not grow):
            scaled = _scaled(found, whole, kept, 2 * bank if which >= 0 else 0, self._slack)
            top = ceiling if ceiling is not None or grow else capacity
            if scaled is not None and top is not None and max(p.need for p in scaled) > top:
                scaled = None  # past what ``make`` may use: plan within it
        if scaled is not None:
            plans: tuple[RoutePlan, ...] = scaled
        elif which < 0:
            plans = (make(whole),)
        else:
            # The rest planned around both banks; the outliving allocations then take either.
            inner = widest.copy()
            inner[kept] = 0
            around = make(
                Recording(inner.tolist(), recording.alloc_at, recording.free_at),
                tuple(sorted([*rest, (0, 2 * bank)])),
            )
            plans = tuple(
                reused(whole, _in_bank(around, kept, widest, start)) for start in (0, bank)
            )
        need = max(p.need for p in plans)
        made = _Envelope(plans, widest, grow, need, bank if len(plans) == 2 else 0)
        with self._lock:
            if scaled is None:
                self.made += 1
            else:
                self.scaled += 1
            self._plans[key] = made
            self._plans.move_to_end(key)
            while len(self._plans) > PLANS_PER_FAMILY:
                self._plans.popitem(last=False)
        return _both(sizes, arrays, made, which, False)

    def banked(self, fences: Fences) -> bool:
        """Whether every range of ``fences`` lies in the banks of the latest plan: what the
        user holds there is the previous call's outliving allocations, the family's steady
        state (its plans are made around both banks), so a plan may grow the arena past them
        as over an arena no tensor holds."""
        return bool(self._banks) and all(high <= self._banks for _, high in fences)


class Make(Protocol):
    """Plans a sequence for the route's arena (around ``fences`` where given, else the
    call's own)."""

    def __call__(self, sequence: Recording, fences: Fences = ..., /) -> RoutePlan: ...


def banks(sizes: np.ndarray, outliving: Collection[int], capacity: int) -> tuple[list[int], int]:
    """The allocations of ``outliving`` that take the banks (those of at most ``BANK_ITEM``
    bytes at ``sizes``), and the bytes of each of the two banks (at offsets ``0`` and this
    many); ``0`` bytes where there are none: none outlive the call small, they come to more
    than ``BANK_BYTES`` (two copies would cost the arena more than the plans they save), or
    the arena is not yet as large as both banks.

    Example::

        >>> import numpy as np
        >>> from sharedmem._routing.family import banks
        >>> banks(np.array([4, 1 << 20, 100, 8]), [0, 1, 2], capacity=1 << 22)
        ([0, 2], 192)
    """
    if not outliving:
        return [], 0
    # A few dozen indices: plain Python, not numpy's per-call cost (each call of a family).
    at = sorted(i for i in outliving if 0 < int(sizes[i]) <= BANK_ITEM)
    total = sum(-(-int(sizes[i]) // ALIGN) * ALIGN for i in at)
    if not total or total > BANK_BYTES or 2 * total > capacity:
        return [], 0
    return at, total


def _both(
    sizes: np.ndarray, arrays: _Arrays, envelope: _Envelope, which: int, reused: bool
) -> FamilyPlan:
    # The plan of ``sizes`` from ``envelope``, in bank ``which``, with the other bank's.
    plan = _reused(sizes, arrays, envelope.plans[max(which, 0)])
    if which < 0 or not envelope.bank:
        return FamilyPlan(plan, envelope.need, reused)
    # The other bank's plan differs only in where the bank allocations sit (below both banks'
    # end): its figures are this plan's, its need too where the rest reaches past the banks.
    offsets = envelope.plans[1 - which].offsets
    other = (
        dataclasses.replace(plan, offsets=offsets)
        if plan.need > 2 * envelope.bank
        else _reused(sizes, arrays, envelope.plans[1 - which])
    )
    return FamilyPlan(plan, envelope.need, reused, envelope.bank, which, other)


def key(fences: Fences, bank: int) -> tuple[int, Fences]:
    """What a plan of a family with banks of ``bank`` bytes each depends on in ``fences``:
    the bank they leave free (the first where both are) and the fences beside the banks;
    ``-1`` and ``fences`` themselves where neither bank is free (or there are no banks).

    Example::

        >>> from sharedmem._routing.family import key
        >>> key(((0, 4),), 192), key(((192, 196),), 192), key(((0, 4), (200, 264)), 192)
        ((1, ()), (0, ()), (-1, ((0, 4), (200, 264))))
    """
    which, rest = _bank(fences, bank)
    return which, tuple(rest)


def _bank(fences: Fences, bank: int) -> tuple[int, list[tuple[int, int]]]:
    # The bank the outliving allocations take (-1: neither is free, or no banks), and the
    # fences beside the banks (what the rest is planned around besides them).
    if not bank:
        return -1, list(fences)
    free = [
        not any(low < (k + 1) * bank and k * bank < high for low, high in fences) for k in (0, 1)
    ]
    if not any(free):
        return -1, list(fences)
    rest = [(low, high) for low, high in fences if high > 2 * bank]
    return free.index(True), rest


def _aligned(sizes: np.ndarray) -> np.ndarray:
    return -(-sizes // ALIGN) * ALIGN


def _in_bank(plan: RoutePlan, kept: list[int], sizes: np.ndarray, start: int) -> RoutePlan:
    # ``plan`` with the allocations of ``kept`` one after another from ``start``.
    offsets = list(plan.offsets)
    at = start
    for i in kept:
        offsets[i] = at
        at += int(_aligned(sizes[i]))
    return dataclasses.replace(plan, offsets=tuple(offsets))


def _scaled(
    found: _Envelope, whole: Recording, kept: list[int], base: int, slack: float
) -> tuple[RoutePlan, ...] | None:
    """``found``'s plans for the wider sizes of ``whole`` (the same ticks), each keeping the
    order its offsets had: every allocation (above the banks, ``base`` bytes; the bank
    allocations ``kept`` stay where they are) goes right above the tops, at their new
    sizes, of those it sat above in the old plan and shares a tick with. What was disjoint
    stays disjoint (one of any two that share a tick was below the other, and still is);
    checked pair by pair all the same. ``None`` where that needs more than ``slack`` above
    the envelope's max-live (the least any plan needs: sizes that grew unevenly along the
    old plan's stacks), or the plan left an allocation beside the arena: the envelope is
    then planned anew.

    A widening (the running maximum of drawn lengths) then costs a pass over the pairs,
    where planning it costs as much as several steps."""
    new = _aligned(np.asarray(whole.sizes, dtype=np.int64))
    old = _aligned(found.sizes)
    starts = np.asarray(whole.alloc_at, dtype=np.int64)
    ends = np.asarray(whole.free_at, dtype=np.int64)
    bank = np.zeros(len(new), dtype=bool)
    bank[kept] = True
    if bool(np.any(new[bank] > old[bank])):
        return None
    shared = (starts[:, None] < ends[None, :]) & (starts[None, :] < ends[:, None])
    plans = []
    for plan in found.plans:
        at = np.asarray(plan.offsets, dtype=np.int64)
        placed = at >= 0
        moved = placed & ~bank & (new > 0)
        if bool(np.any(~placed & (ends >= 0) & (new > 0))) or bool(np.any(old[moved] == 0)):
            return None  # one left beside (the ceiling) or one that was empty: plan anew
        if not moved.any():
            return None
        # below[i, j]: j sat under i in the old plan and shares a tick with it
        below = shared & moved[None, :] & ((at + old)[None, :] <= at[:, None])
        offsets = np.where(placed, at, -1)
        for i in np.flatnonzero(moved)[np.argsort(at[moved], kind="stable")]:
            under = below[i]
            offsets[i] = (
                max(base, int((offsets[under] + new[under]).max())) if under.any() else base
            )
        low, high = offsets[placed], offsets[placed] + new[placed]
        clash = shared[np.ix_(placed, placed)]
        clash &= (low[:, None] < high[None, :]) & (low[None, :] < high[:, None])
        np.fill_diagonal(clash, False)
        if clash.any():
            return None
        live = np.zeros(int(ends[moved].max()) + 2, dtype=np.int64)
        np.add.at(live, starts[moved], new[moved])
        np.subtract.at(live, ends[moved], new[moved])
        if int(high.max()) > (1 + slack) * (base + int(np.cumsum(live).max())):
            return None
        plans.append(reused(whole, dataclasses.replace(plan, offsets=tuple(offsets.tolist()))))
    return tuple(plans)


def reused(recording: Recording, plan: RoutePlan) -> RoutePlan:
    """``plan``'s offsets for ``recording``, a sequence of the same ticks with each
    allocation at most as large: ``plan.reuse_offsets``, its figures computed on arrays
    (a family serves each call's plan this way: a tenth of the time, in every call).

    Example::

        >>> from sharedmem._routing.family import reused
        >>> from sharedmem._routing.plan import Recording, plan_offsets
        >>> big = plan_offsets(Recording([256, 128, 128], [0, 2, 3], [1, 4, 5]))
        >>> small = reused(Recording([64, 100, 32], [0, 2, 3], [1, 4, 5]), big)
        >>> small.offsets, small.need
        ((0, 0, 128), 192)
    """
    sizes = np.asarray(recording.sizes, dtype=np.int64)
    return _reused(sizes, _ticks((tuple(recording.alloc_at), tuple(recording.free_at))), plan)


def _reused(sizes: np.ndarray, arrays: _Arrays, plan: RoutePlan) -> RoutePlan:
    # ``reused`` of the sequence of ``sizes`` at the ticks of ``arrays`` (``_ticks``).
    assert len(plan.offsets) == len(sizes), "a plan of another sequence"
    starts, ends, freed, ticks = arrays
    at = np.asarray(plan.offsets, dtype=np.int64)
    routed = at >= 0
    # The most bytes live at one tick, of the routed allocations (row 0) and of those beside
    # the arena (row 1), from one pair of counts per tick (exact: sums of byte sizes are far
    # below 2**53).
    row = np.where(routed, 0, ticks)
    weights = sizes.astype(np.float64)
    delta = np.bincount(starts + row, weights, minlength=2 * ticks)
    delta -= np.bincount((ends + row)[freed], weights[freed], minlength=2 * ticks)
    most = np.cumsum(delta.reshape(2, ticks), axis=1).max(axis=1)
    return RoutePlan(
        offsets=tuple(plan.offsets),
        need=int((at[routed] + _aligned(sizes[routed])).max()) if routed.any() else 0,
        lower_bound=int(most[0]),
        routed_bytes=int(sizes[routed].sum()),
        beside_bytes=int(sizes[~routed & freed].sum()),
        beside_peak=int(most[1]),
    )


@functools.lru_cache(maxsize=64)
def _ticks(ticks: _Ticks) -> _Arrays:
    # A sequence's ticks as arrays (every size of a family shares them): the allocation
    # and free ticks, which allocations are freed, and the ticks' count with one to spare.
    starts = np.asarray(ticks[0], dtype=np.int64)
    ends = np.asarray(ticks[1], dtype=np.int64)
    count = int(max(starts.max(), ends.max())) + 2 if len(starts) else 2
    for a in (starts, ends):
        a.flags.writeable = False
    freed = ends >= 0
    freed.flags.writeable = False
    return starts, ends, freed, count
