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
envelope and plans it again. The arena holds the envelope's plan, so it ends at the size the
longest length would have grown it to alone, as without the sharing.

Plans are kept, as a route keeps its own, per set of fences. Unlike a route's own plan, a
family's is not made again when the arena grows (another size's plan grew it): it still fits,
and the arena grows for the family only while the envelope widens, which plans it again.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from .plan import Fences, Recording, RoutePlan, reuse_offsets

__all__ = ["FamilyPlan", "SharedPlans"]

PLANS_PER_FAMILY = 16  # envelope plans kept per family (least recent dropped)

_Ticks = tuple[tuple[int, ...], tuple[int, ...]]  # alloc_at, free_at of a sequence


class _Envelope(NamedTuple):
    plan: RoutePlan  # the plan of ``sizes``
    sizes: np.ndarray  # the envelope's sizes it was made for


class FamilyPlan(NamedTuple):
    """A route's plan from its family: the plan of its own sizes, the arena bytes the
    family's plan needs (what to grow the arena to: the envelope's), and whether it was
    reused (the envelope covered the sizes) rather than made."""

    plan: RoutePlan
    need: int
    reused: bool


class SharedPlans:
    """The plans the routes of one family of sizes lend one another (see the module).

    Thread-safe: routes of the family may plan on several threads at once.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # per allocation sequence (its ticks): the largest size of each allocation seen
        self._envelopes: dict[_Ticks, np.ndarray] = {}
        self._plans: OrderedDict[tuple[_Ticks, Fences, bool], _Envelope] = OrderedDict()
        self.made = 0  # envelope plans made

    def plan(
        self,
        recording: Recording,
        *,
        capacity: int,
        fences: Fences,
        grow: bool,
        make: Callable[[Recording], RoutePlan],
    ) -> FamilyPlan:
        """The plan of ``recording`` (as ``make`` plans a sequence, for an arena of
        ``capacity`` bytes that ``fences`` hold parts of, grown where ``grow``).

        Where a plan of an envelope covering ``recording`` was made for the same fences (and
        fits the arena as it is), its offsets serve; otherwise the envelope is widened by
        ``recording`` and planned by ``make``."""
        ticks = (tuple(recording.alloc_at), tuple(recording.free_at))
        sizes = np.asarray(recording.sizes, dtype=np.int64)
        key = (ticks, tuple(fences), grow)
        with self._lock:
            found = self._plans.get(key)
            if (
                found is not None
                and found.plan.need <= capacity
                and bool(np.all(sizes <= found.sizes))
            ):
                self._plans.move_to_end(key)
                return FamilyPlan(reuse_offsets(recording, found.plan), found.plan.need, True)
            envelope = self._envelopes.get(ticks)
            envelope = sizes if envelope is None else np.maximum(envelope, sizes)
            self._envelopes[ticks] = envelope
        widest = Recording(envelope.tolist(), recording.alloc_at, recording.free_at)
        made = make(widest)
        with self._lock:
            self.made += 1
            self._plans[key] = _Envelope(made, envelope)
            self._plans.move_to_end(key)
            while len(self._plans) > PLANS_PER_FAMILY:
                self._plans.popitem(last=False)
        return FamilyPlan(reuse_offsets(recording, made), made.need, False)
