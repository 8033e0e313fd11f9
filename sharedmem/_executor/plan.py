"""The executor's interval type (``Lifetime``), and the one-buffer-per-node baseline's slots.

An intermediate lives from the node that writes it to the last node that reads it. Planned
with the liveness plan, intermediates share one arena, placed by ``placement.place`` with the
router's packers (``placement.intervals`` gives them these lifetimes as the router's rows).
The ``per_node`` baseline gives each intermediate a pool buffer ("slot") of its own: slots
are named pool buffers shared by every graph run on one pool, so it starts from the slots the
pool already holds, one intermediate each, and adds a slot only where none is left.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["PLANS", "Lifetime", "PlanSummary", "assign_slots", "merge"]

PLANS = ("liveness", "per_node")


@dataclass(frozen=True)
class Lifetime:
    """One intermediate: its bytes, the node that writes it and the last node that reads it.

    Both ends are inclusive node indices; ``end`` counts every read through any view or
    in-place alias of the intermediate, and is past the last node for graph outputs.
    """

    nbytes: int
    start: int
    end: int


def merge(
    lifetimes: Sequence[Lifetime], pairs: Sequence[tuple[int, int]]
) -> tuple[list[Lifetime], list[int]]:
    """Join lifetimes that must share a buffer (a result written over its operand).

    Returns the joined lifetimes (each spanning its members, as big as the biggest) and, for
    each input lifetime, the index of the joined one it belongs to.

    Example::

        >>> from sharedmem._executor.plan import Lifetime, merge
        >>> merge([Lifetime(8, 0, 2), Lifetime(8, 2, 5), Lifetime(4, 1, 3)], [(1, 0)])
        ([Lifetime(nbytes=8, start=0, end=5), Lifetime(nbytes=4, start=1, end=3)], [0, 0, 1])
    """
    parent = list(range(len(lifetimes)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for a, b in pairs:
        parent[root(a)] = root(b)
    groups: dict[int, list[int]] = {}
    for i in range(len(lifetimes)):
        groups.setdefault(root(i), []).append(i)
    joined: list[Lifetime] = []
    member = [0] * len(lifetimes)
    for members in groups.values():
        for i in members:
            member[i] = len(joined)
        joined.append(
            Lifetime(
                max(lifetimes[i].nbytes for i in members),
                min(lifetimes[i].start for i in members),
                max(lifetimes[i].end for i in members),
            )
        )
    return joined, member


def assign_slots(
    lifetimes: Sequence[Lifetime], existing: Mapping[str, int], *, prefix: str
) -> tuple[list[str], dict[str, int]]:
    """Give every intermediate a slot of its own (the ``per_node`` baseline).

    Intermediates are taken largest first, each into the smallest free slot already big
    enough; failing that, the largest free slot grows (fewer new bytes than a new slot);
    failing that, a new slot is made.

    Args:
        lifetimes: the intermediates of one graph.
        existing: slots the pool already holds, by name, with their capacities in bytes.
        prefix: names of new slots are ``prefix`` followed by a number.

    Returns:
        The slot name of each intermediate, and the bytes this graph needs of each slot it
        uses (the intermediate placed there).

    Example::

        >>> from sharedmem._executor.plan import Lifetime, assign_slots
        >>> names, need = assign_slots(
        ...     [Lifetime(100, 0, 1), Lifetime(80, 2, 3), Lifetime(50, 1, 2)], {"act.1": 90},
        ...     prefix="act.")
        >>> names, need
        (['act.1', 'act.0', 'act.2'], {'act.0': 80, 'act.1': 100, 'act.2': 50})
    """
    free = dict(sorted(existing.items()))
    taken = set(existing)
    names: list[str] = [""] * len(lifetimes)
    need: dict[str, int] = {}
    order = sorted(range(len(lifetimes)), key=lambda i: (-lifetimes[i].nbytes, lifetimes[i].start))
    for i in order:
        nbytes = lifetimes[i].nbytes
        fitting = [name for name, capacity in free.items() if capacity >= nbytes]
        if fitting:
            name = min(fitting, key=free.__getitem__)
        elif free:
            name = max(free, key=free.__getitem__)
        else:
            name = _new_name(prefix, taken)
            taken.add(name)
        free.pop(name, None)
        names[i] = name
        need[name] = nbytes
    return names, dict(sorted(need.items(), key=lambda kv: _slot_order(kv[0], prefix)))


def _new_name(prefix: str, taken: set[str]) -> str:
    # The smallest free number, so names stay small and the same across runs.
    k = 0
    while f"{prefix}{k}" in taken:
        k += 1
    return f"{prefix}{k}"


def _slot_order(name: str, prefix: str) -> tuple[int, str]:
    tail = name[len(prefix) :]
    return (int(tail), "") if tail.isdigit() else (-1, name)


@dataclass(frozen=True)
class PlanSummary:
    """What one traced graph asks of the pool, and what its plan saves.

    Attributes:
        plan: ``"liveness"`` or ``"per_node"``.
        signature: the input signature the graph was traced for, in words.
        nodes: ATen ops in the graph.
        pooled_values: intermediates written into pool buffers.
        slots: pool buffers the plan needs for them, on a pool of its own.
        pooled_bytes: bytes of those buffers (each as big as the largest intermediate placed
            in it), on a pool of its own.
        per_node_bytes: bytes one buffer per intermediate would need.
        added_bytes: bytes the graph actually added to the shared pool when it was planned;
            with buffers of earlier graphs (a train step before an eval forward) it is much
            less than ``pooled_bytes_total``.
        unpooled_bytes: bytes each call allocates outside the pool (ops with no native
            ``out=`` form); these are counted in the pool's ``unpooled_bytes_total``.
        unpooled_ops: those ops, by name.
        recomputed: values computed again where backward reads them instead of kept from
            the forward (``recompute``).
        recompute_cost: the time that recomputation adds, modelled (``cost``), as a fraction
            of the step's own modelled time (0.0 for the cheap values alone, whose time is
            hidden in memory traffic the step saves).
        routed: where the routing allocator serves the call from the arena, its recorded
            plan in words ("" without the router, or before the first call ran).
        floor: the most bytes one op of the step needs live at once (its operands, results
            and measured scratch, beside the gradients and other returned values made before
            it; a pointwise result counted once with an operand it can be written over), on
            the graph as traced: no placement and no recomputation goes below it, and every
            plan of the step has the same.
        floor_op: that op, and where in the model it comes from.
        planned_peak: the plan's peak: the pool bytes it uses (on a pool of its own) and the
            most bytes beside the pool live at once in a call (gradients and loss included).
        measured_peak: the latest call's peak as it ran (``None`` before a call, or on a
            summary of a graph that is not the latest); see ``measured``.
        measured: how ``measured_peak`` was measured, in words.
    """

    plan: str
    signature: str
    nodes: int
    pooled_values: int
    slots: int
    pooled_bytes: int
    per_node_bytes: int
    added_bytes: int
    unpooled_bytes: int
    unpooled_ops: tuple[str, ...]
    recomputed: int = 0
    routed: str = ""
    recompute_cost: float = 0.0
    floor: int = 0
    floor_op: str = ""
    planned_peak: int = 0
    measured_peak: int | None = None
    measured: str = ""

    @property
    def saved_bytes(self) -> int:
        """Bytes the plan saves against one buffer per intermediate."""
        return self.per_node_bytes - self.pooled_bytes

    @property
    def saving(self) -> float:
        """``saved_bytes`` as a fraction of ``per_node_bytes`` (0.0 for an empty graph)."""
        return self.saved_bytes / self.per_node_bytes if self.per_node_bytes else 0.0

    def __str__(self) -> str:
        ops = ", ".join(self.unpooled_ops) or "none"
        return (
            f"{self.plan} plan for {self.signature}: {self.nodes} ops, "
            f"{self.pooled_values} pooled intermediates in {self.slots} buffers, "
            f"{self.pooled_bytes:,} bytes (one buffer per node: {self.per_node_bytes:,}; "
            f"saved {self.saved_bytes:,}, {self.saving:.0%}); added to the pool: "
            f"{self.added_bytes:,} bytes; "
            f"allocated beside the pool per call: {self.unpooled_bytes:,} bytes in all, a sum "
            f"of allocations, not a peak ({ops}); peak: planned {self.planned_peak:,} bytes"
            + (
                f", measured {self.measured_peak:,} bytes in the latest call ({self.measured})"
                if self.measured_peak is not None
                else ""
            )
            + (f"; {self.recomputed} values recomputed in backward" if self.recomputed else "")
            + (
                f" (modelled +{self.recompute_cost:.0%} time)"
                if self.recompute_cost >= 0.005
                else ""
            )
            + (f"; routed: {self.routed}" if self.routed else "")
            + (f"; floor: {self.floor:,} bytes at {self.floor_op}" if self.floor else "")
        )
