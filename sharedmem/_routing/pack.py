"""An exact search for a packing under a given height: branch and bound over canonical
placements, in the manner of MiniMalloc (Moffitt, "MiniMalloc: A Lightweight Memory Allocator
for Hardware-Accelerated Machine Learning", ASPLOS 2023).

Each allocation is an interval of ticks ``[start, end)`` with a size; a packing gives each an
offset such that no two that share a tick overlap in bytes. Any packing can be let fall (each
allocation moved down until it rests on another that shares a tick, or on the arena's bottom)
without growing, and the fallen packing, its allocations taken by offset, places each one at
the top of those placed before it that share a tick. The search builds only such canonical
packings: each step places one unplaced allocation at its lowest feasible offset (the highest
top among placed allocations that share a tick), in non-decreasing order of offsets. It prunes:

- *section inference*: time cut into sections (between consecutive start or end ticks), no
  section may hold more than the height: its floor (the highest top placed in it, no less than
  the offset of the last placement, since offsets only grow, nor than the lowest offset any
  allocation still to place in it can take) plus the bytes still to place in it;
- *dominance*: an allocation whose lowest offset is at or above the top some other unplaced
  allocation could reach is not placed next (that one fits in the gap below it first);
- *hatless pruning*: where the allocation placed shares a tick with no unplaced allocation, no
  alternative to it is tried (nothing above it depends on its choice);
- *decomposition*: where no unplaced allocation crosses a section boundary, the two sides are
  solved on their own (a failure on one side never undoes the other's choices).

Fixed allocations (``fixed[i] >= 0``: a fence, bytes another tensor holds all step) land at
exactly their offset. The search is bounded by a number of placements tried ("steps"): it
returns a packing, or ``None`` where it proved there is none or ran out of steps. Each search
follows a static preorder (the tie-break among allocations of the same lowest offset); the
preorders take turns, each with a node limit that doubles every round: live to the step's end
first, then earliest made, then largest area (``KLA``: gradients in the order backward makes
them, the activations in the order forward does; ResNet-18's default loop packs at max-live
in 541 placements), then MiniMalloc's ``WAT``, ``TAW``, ``TWA`` (widest lifetime, largest area,
largest section total first, in turn).
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Sequence

import numpy as np

__all__ = ["PREORDERS", "lifted", "lowest_packing", "merged", "pack_under"]


_CELLS = 1 << 18  # the most (allocation, section) pairs one placement's inference reads
_NESTING = 100  # the most parts solved one inside another (each a Python frame)


class _OutOfSteps(Exception):
    pass


PREORDERS = ("KLA", "WAT", "TAW", "TWA")  # the static preorders tried, in turn


def pack_under(
    sizes: Sequence[int],
    starts: Sequence[int],
    ends: Sequence[int],
    height: int,
    *,
    fixed: Sequence[int] = (),
    steps: int = 20_000,
) -> list[int] | None:
    """Offsets that pack every allocation (``sizes[i]`` bytes live over ticks
    ``[starts[i], ends[i])``) under ``height`` bytes, each allocation of ``fixed`` that is not
    ``-1`` at exactly that offset; ``None`` where none was found within ``steps`` placements
    tried in all (or none exists).

    Sizes are taken as they are (the caller rounds them to its alignment: an offset is a sum
    of sizes, or a fixed offset).

    Example::

        >>> from sharedmem._routing.pack import pack_under
        >>> # two 2-byte allocations at ticks 0-2, one 4-byte at 2-4: max-live 4
        >>> pack_under([2, 2, 4], [0, 0, 2], [2, 2, 4], 4)
        [0, 2, 0]
        >>> pack_under([2, 2, 4], [0, 0, 2], [2, 2, 4], 3) is None
        True
    """
    return _pack_under(sizes, starts, ends, height, fixed, steps)[0]


def lowest_packing(
    sizes: Sequence[int],
    starts: Sequence[int],
    ends: Sequence[int],
    *,
    upper: int,
    unit: int = 64,
    fixed: Sequence[int] = (),
    steps: int = 20_000,
) -> tuple[list[int] | None, int]:
    """The packing of the lowest height found below ``upper``, and its height; ``(None,
    upper)`` where none was found. Heights are tried from the most bytes live at one tick (no
    packing is lower: found there, the packing is optimal), then halfway to the lowest found
    (or to ``upper``), in multiples of ``unit``, ``steps`` placements in all.

    Example::

        >>> from sharedmem._routing.pack import lowest_packing
        >>> lowest_packing([2, 2, 4], [0, 0, 2], [2, 2, 4], upper=8)
        ([0, 2, 0], 4)
    """
    free = [i for i in range(len(sizes)) if not fixed or fixed[i] < 0]
    if not free:
        return list(fixed), 0
    size = np.asarray([sizes[i] for i in free], dtype=np.int64)
    start = np.asarray([starts[i] for i in free], dtype=np.int64)
    end = np.asarray([ends[i] for i in free], dtype=np.int64)
    first, last = int(start.min()), int(end.max())
    events = np.zeros(last - first + 2, dtype=np.int64)
    np.add.at(events, start - first, size)
    np.subtract.at(events, end - first, size)
    low = int(np.cumsum(events).max())  # max-live: no packing is lower
    # ... nor below the fixed allocations live at every tick: only the room between them.
    spans = sorted(
        (fixed[i], fixed[i] + sizes[i])
        for i in range(len(sizes))
        if fixed and fixed[i] >= 0 and starts[i] <= first and last <= ends[i]
    )
    low = lifted(low, spans)
    high = upper - 1  # the heights left to try: [low, high]
    best: list[int] | None = None
    best_height = upper
    spent = 0
    height = low
    while low <= high and spent < steps:
        # Three quarters of the steps for max-live (a packing there is the one that matters:
        # the step is then served whole at the allocator's peak), half of the rest then.
        left = steps - spent
        share = left if height == high else max(1, left * 3 // 4 if not spent else left // 2)
        found, used = _pack_under(sizes, starts, ends, height, fixed, share)
        spent += used
        if found is not None:
            best = found
            best_height = max(found[i] + sizes[i] for i in free)
            high = best_height - 1
        else:
            low = height + 1
        height = min(high, low + (high - low) // 2 // unit * unit)
    return best, best_height


def lifted(height: int, spans: Sequence[tuple[int, int]]) -> int:
    """The lowest top at which ``height`` bytes of room are free below it, around the byte
    ranges ``spans`` (held; they may overlap).

    Example::

        >>> from sharedmem._routing.pack import lifted
        >>> lifted(100, [(50, 200), (180, 260), (400, 500)])
        310
    """
    for low, high in merged(spans):
        if low >= height:
            break
        height += high - low
    return height


def merged(spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The byte ranges ``spans`` sorted, those that overlap or meet made one."""
    merged: list[list[int]] = []
    for low, high in sorted(spans):
        if merged and low <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], high)
        elif high > low:
            merged.append([low, high])
    return [(low, high) for low, high in merged]


def _pack_under(
    sizes: Sequence[int],
    starts: Sequence[int],
    ends: Sequence[int],
    height: int,
    fixed: Sequence[int],
    steps: int,
) -> tuple[list[int] | None, int]:
    # ``pack_under``, and the placements it tried. The preorders take turns, each with a
    # node limit that doubles every round (a preorder that suits the instance finds a
    # packing in about one placement per allocation); a search that ends within its limit
    # is complete: it found a packing, or proved there is none.
    # Fixed allocations at or above ``height`` are out of the way; those that reach past it
    # are cut at it.
    keep = [i for i in range(len(sizes)) if not fixed or fixed[i] < height]
    if not keep:
        return list(fixed), 0
    sub_fixed = [fixed[i] for i in keep] if fixed else []
    sub_sizes = [
        sizes[i] if not fixed or fixed[i] < 0 else min(sizes[i], height - fixed[i]) for i in keep
    ]
    sub_starts, sub_ends = [starts[i] for i in keep], [ends[i] for i in keep]
    spent = 0
    limit = max(2 * len(keep), 64)
    first = _Search(sub_sizes, sub_starts, sub_ends, height, sub_fixed, PREORDERS[0])
    searches = [first] + [first.reordered(order) for order in PREORDERS[1:]]
    while True:
        for search in searches:
            cap = min(limit, steps - spent)
            if cap <= 0:
                return None, spent
            search.nodes = 0
            try:
                found = search.run(cap)
            except _OutOfSteps:
                spent += cap
                continue
            spent += search.nodes
            if found is None:
                return None, spent
            offsets = list(fixed) if fixed else [-1] * len(sizes)
            for i, offset in zip(keep, found, strict=True):
                offsets[i] = offset
            return offsets, spent
        limit *= 2


class _Search:
    """One depth-first search under a height, in one static preorder."""

    def __init__(
        self,
        sizes: Sequence[int],
        starts: Sequence[int],
        ends: Sequence[int],
        height: int,
        fixed: Sequence[int],
        heuristic: str,
    ) -> None:
        n = len(sizes)
        self.size = np.asarray(sizes, dtype=np.int64)
        start = np.asarray(starts, dtype=np.int64)
        end = np.asarray(ends, dtype=np.int64)
        points = np.unique(np.concatenate([start, end]))
        self.lo = np.searchsorted(points, start)
        self.hi = np.searchsorted(points, end)
        sections = max(1, len(points) - 1)
        self.height = height
        self.fixed = (
            np.asarray(fixed, dtype=np.int64) if len(fixed) else np.full(n, -1, dtype=np.int64)
        )
        total = np.zeros(sections + 1, dtype=np.int64)
        np.add.at(total, self.lo, self.size)
        np.subtract.at(total, self.hi, self.size)
        self.total = np.cumsum(total)[:sections]
        self.floor = np.zeros(sections, dtype=np.int64)
        self.min_off = np.where(self.fixed >= 0, self.fixed, 0)
        self.placed = np.zeros(n, dtype=bool)
        self.offsets = np.full(n, -1, dtype=np.int64)
        # Which allocations share a tick with each.
        share = (start[:, None] < end[None, :]) & (start[None, :] < end[:, None])
        np.fill_diagonal(share, False)
        self.overlaps = [np.flatnonzero(row) for row in share]
        sect = np.arange(sections)
        self.member = (self.lo[:, None] <= sect[None, :]) & (sect[None, :] < self.hi[:, None])
        self.width, self.start, self.end, self.most = end - start, start, end, np.zeros(0)
        self.nodes = 0
        self.limit = 0
        self.solution = np.full(n, -1, dtype=np.int64)
        # Per section boundary (below section k + 1), the unplaced allocations across it.
        crossing = np.zeros(sections + 1, dtype=np.int64)
        np.add.at(crossing, self.lo, 1)
        np.subtract.at(crossing, np.maximum(self.hi - 1, self.lo), 1)
        self.crossing = np.cumsum(crossing)[:sections]
        self._rank(heuristic)

    def reordered(self, heuristic: str) -> _Search:
        """This search (in its initial state) in another static preorder."""
        other = copy.copy(self)
        other.solution = self.solution.copy()
        other._rank(heuristic)
        return other

    def _rank(self, heuristic: str) -> None:
        # The static preorder: a rank per allocation.
        start, end, width = self.start, self.end, self.width
        area = width * self.size
        if self.most.size != len(start):
            self.most = np.array(
                [
                    self.total[a:b].max() if b > a else 0
                    for a, b in zip(self.lo, self.hi, strict=True)
                ],
                dtype=np.int64,
            )
        most = self.most
        last = end[self.fixed < 0].max(initial=0)
        keys = {
            "W": -width,
            "A": -area,
            "T": -most,
            "K": (end != last).astype(np.int64),  # live to the step's end first
            "L": start,  # earliest made first
        }
        order = np.lexsort([keys[c] for c in reversed(heuristic)])
        self.rank = np.empty(len(order), dtype=np.int64)
        self.rank[order] = np.arange(len(order))

    def run(self, limit: int) -> list[int] | None:
        if (self.total > self.height).any() or (
            (self.fixed >= 0) & (self.fixed + self.size > self.height)
        ).any():
            return None
        self.limit = limit
        everything = np.arange(len(self.size))
        cuts = (np.flatnonzero(self.crossing == 0) + 1).tolist()
        if not self._split(everything, 0, len(self.floor), cuts, -1):
            return None
        return self.solution.tolist()

    def _solve(self, members: np.ndarray, low: int, high: int, depth: int) -> bool:
        # A depth-first search over the unplaced allocations ``members``, which lie within
        # sections ``[low, high)``: True where it packed them (their offsets in
        # ``self.solution``), the state as it was on return. Where the placements made leave
        # no unplaced allocation across some section boundary, each side is an independent
        # part, solved on its own (a part that fails fails the placement that split them).
        stack: list[tuple[list[int], int, int]] = []  # candidates, last offset, last rank
        undo: list[tuple[int, np.ndarray, np.ndarray, np.ndarray, bool]] = []
        candidates = self._candidates(members, -1, -1)
        if candidates is None:
            return True
        stack.append((candidates, -1, -1))
        found = False
        try:
            while stack and not found:
                candidates, _, _ = stack[-1]
                # Back from the child placed here; hatless: nothing above it depends on it.
                if undo and len(undo) == len(stack) and self._undo(undo.pop()):
                    candidates.clear()
                if not candidates:
                    stack.pop()
                    continue
                i = candidates.pop(0)
                self.nodes += 1
                if self.nodes > self.limit:
                    raise _OutOfSteps
                record, ok = self._place(i, members, low, high)
                undo.append(record)
                if not ok:
                    continue
                offset, rank = int(self.offsets[i]), int(self.rank[i])
                self.solution[i] = offset
                cuts = self._cuts(i)
                if cuts and depth < _NESTING:
                    found = self._split(members, low, high, cuts, depth)
                    continue
                below = self._candidates(members, offset, rank)
                if below is None:
                    found = True
                else:
                    stack.append((below, offset, rank))
        finally:  # the state as it was, found or not, out of steps or not
            for record in reversed(undo):
                self._undo(record)
        return found

    def _split(self, members: np.ndarray, low: int, high: int, cuts: list[int], depth: int) -> bool:
        # The unplaced allocations of ``members``, in the parts between ``cuts`` (section
        # boundaries no unplaced allocation crosses), each solved on its own.
        unplaced = members[~self.placed[members]]
        bounds = [low, *[c for c in cuts if low < c < high], high]
        for a, b in itertools.pairwise(bounds):
            part = unplaced[(self.lo[unplaced] < b) & (a < self.hi[unplaced])]
            if part.size and not self._solve(part, a, b, depth + 1):
                return False
        return True

    def _cuts(self, i: int) -> list[int]:
        # Boundaries (a section index: the boundary below it) that placing ``i`` left no
        # unplaced allocation across.
        lo, hi = int(self.lo[i]), int(self.hi[i])
        return (np.flatnonzero(self.crossing[lo : hi - 1] == 0) + lo + 1).tolist()

    def _candidates(self, members: np.ndarray, last: int, last_rank: int) -> list[int] | None:
        # The unplaced allocations of ``members`` in dynamic order (lowest offset, then rank)
        # that may go next; ``None`` where none is left (a packing).
        unplaced = members[~self.placed[members]]
        if unplaced.size == 0:
            return None
        low = self.min_off[unplaced]
        rank = self.rank[unplaced]
        order = np.lexsort((rank, low))
        unplaced, low, rank = unplaced[order], low[order], rank[order]
        reach = int((low + self.size[unplaced]).min())
        keep = ((low > last) | ((low == last) & (rank > last_rank))) & (low < reach)
        fixed = self.fixed[unplaced]
        keep &= (fixed < 0) | (low == fixed)
        chosen: list[int] = unplaced[keep].tolist()
        return chosen

    def _place(
        self, i: int, members: np.ndarray, low: int, high: int
    ) -> tuple[tuple[int, np.ndarray, np.ndarray, np.ndarray, bool], bool]:
        offset = int(self.min_off[i])
        top = offset + int(self.size[i])
        self.placed[i] = True
        self.offsets[i] = offset
        others = self.overlaps[i]
        others = others[~self.placed[others]]
        bumped = others[self.min_off[others] < top]
        old = self.min_off[bumped].copy()
        self.min_off[bumped] = top
        lo, hi = int(self.lo[i]), int(self.hi[i])
        floors = self.floor[lo:hi].copy()
        self.floor[lo:hi] = top
        self.total[lo:hi] -= self.size[i]
        self.crossing[lo : hi - 1] -= 1
        record = (i, bumped, old, floors, others.size == 0)
        if top > self.height or (self.fixed[bumped] >= 0).any():
            return record, False
        floor, total = self.floor[low:high], self.total[low:high]
        if not (np.maximum(floor, offset) + total <= self.height).all():
            return record, False
        if bumped.size:  # no section's floor below the lowest offset left to place in it
            # Only the sections of the allocations bumped, and of ``i``, may change; skipped
            # where they are too many to check cheaply (a weaker bound, never a wrong one).
            a = max(low, min(lo, int(self.lo[bumped].min())))
            b = min(high, max(hi, int(self.hi[bumped].max())))
            unplaced = members[~self.placed[members]]
            unplaced = unplaced[(self.lo[unplaced] < b) & (a < self.hi[unplaced])]
            if unplaced.size * (b - a) <= _CELLS:
                lows = np.where(
                    self.member[unplaced, a:b], self.min_off[unplaced][:, None], self.height
                ).min(0, initial=self.height)
                if not (np.maximum(self.floor[a:b], lows) + self.total[a:b] <= self.height).all():
                    return record, False
        return record, True

    def _undo(self, record: tuple[int, np.ndarray, np.ndarray, np.ndarray, bool]) -> bool:
        i, bumped, old, floors, hatless = record
        self.min_off[bumped] = old
        lo, hi = int(self.lo[i]), int(self.hi[i])
        self.floor[lo:hi] = floors
        self.total[lo:hi] += self.size[i]
        self.crossing[lo : hi - 1] += 1
        self.placed[i] = False
        self.offsets[i] = -1
        return hatless
