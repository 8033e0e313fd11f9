"""What routing needs of the object that owns its arenas (a ``BufferPool``), and the routing
state that object keeps for it.

Routing imports nothing of the pool: ``ArenaHost`` says what a route calls on its host, and
``Arenas`` is the state routing keeps per host, created and owned by the host (one per pool),
so that no table keyed by pool lives in a module.
"""

from __future__ import annotations

import threading
from collections.abc import Collection
from typing import Protocol

import torch

__all__ = ["ArenaHost", "Arenas", "lane_name"]


class Arenas:
    """One host's routing state: which arenas a training step was planned on, where each
    arena buffer was when a call last served from it, the arena prefixes a traced graph was
    planned for, and which arena buffers an open step holds.

    A step holds its arena buffer for as long as it runs. A second step that wants the same
    arena while the first runs (another thread) gets a lane of its own: a buffer named
    ``lane_name(arena, k)``, grown to what the plan needs, so that two steps never hand out
    the same bytes and neither waits for the other (as two eager threads would each allocate
    their own activations).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.trained: set[str] = set()  # arenas a training route was planned on
        # arena -> (the route whose plan of a passing state grew it, its bytes before, the
        # bytes held then where it trains): given back when a call of another route begins
        self.passing: dict[str, tuple[int, int, int | None]] = {}
        self.planned: set[str] = set()  # arena prefixes a traced graph was planned for
        # arena -> the most a plan of a call whose gradients sit beside it needed: such calls
        # give the arena back down to it, not below (``beside_need``)
        self._beside: dict[str, int] = {}
        self._bases: dict[str, int] = {}  # arena buffer -> its address when last served
        self._held: set[str] = set()  # arena buffers an open step serves from
        # per arena buffer: the ranges calls left outliving tensors in, each with the route
        # (its ``id``) whose call was the latest to leave one there
        self._keepers: dict[str, dict[tuple[int, int], int]] = {}

    def lease(self, arena: str) -> str:
        """The buffer a step opening now serves from: ``arena`` itself, or where another
        step holds it, the first lane no step holds. Give it back with ``give_back``."""
        with self._lock:
            lane, k = arena, 0
            while lane in self._held:
                k += 1
                lane = lane_name(arena, k)
            self._held.add(lane)
            return lane

    def mark_passing(self, arena: str, owner: int, before: int, held: int | None = None) -> None:
        """The route ``owner`` (its ``id``) grew ``arena`` from ``before`` bytes for a
        passing state: an evaluation while gradients are held, or a training step's
        accumulation call, which found ``held`` bytes of the arena held (its gradients)."""
        with self._lock:
            self.passing.setdefault(arena, (owner, before, held))

    def take_passing(self, arena: str, caller: int, held: int) -> int | None:
        """For a call of the route ``caller`` beginning on ``arena``, which finds ``held``
        bytes of it held: the bytes ``arena`` had before a route (another, or the caller in
        an accumulation call) grew it for a passing state, which the caller gives it back
        to. ``None``: none did, or ``caller`` did for an evaluation, or an accumulation call
        did and its gradients are held still (half its held bytes or more). An evaluation
        between accumulation calls, or an accumulation call of another batch size, keeps the
        growth (the next accumulation call would grow the arena again, page by page, in a
        loop that alternates); the default loop's next step (gradients ``None``) gives it
        back, and so does the accumulating step's own next call where its gradients are gone
        (replaced by tensors the user made: the growth held room for nothing then)."""
        with self._lock:
            marker = self.passing.get(arena)
            if marker is None or (marker[0] == caller and marker[2] is None):
                return None
            if marker[2] is not None and 2 * held >= marker[2]:
                return None  # most of what was held is held still (a loss may have gone)
            del self.passing[arena]
            return marker[1]

    def beside_need(self, arena: str, need: int) -> int:
        """A call whose gradients sit beside ``arena`` (the user's own tensors) has a plan
        that needs ``need`` bytes: the most any such call's plan needed, which they give the
        arena back down to. Calls of several sizes in that state then keep the arena at the
        largest's need, as the default loop's calls of several sizes do, instead of each
        giving back what the next one grows again."""
        with self._lock:
            most = self._beside[arena] = max(need, self._beside.get(arena, 0))
            return most

    def give_back(self, lane: str) -> None:
        """The step that leased ``lane`` has ended."""
        with self._lock:
            self._held.discard(lane)

    def served_from(self, name: str, base: int) -> None:
        """A call serves from the buffer ``name``, now at ``base`` (the router's live
        allocations are keyed by address)."""
        with self._lock:
            self._bases[name] = base

    def keep(self, name: str, spans: Collection[tuple[int, int]], owner: int) -> None:
        """A call of the route ``owner`` (its ``id``) ended leaving outliving tensors at
        ``spans`` (offsets) of the buffer ``name``: any range of another call's they overlap
        was free by then."""
        with self._lock:
            keepers = self._keepers.setdefault(name, {})
            for span in spans:
                # The ranges kept are disjoint (each one inserted drops those it overlaps):
                # one kept at the very same range overlaps no other.
                if span not in keepers:
                    low, high = span
                    for gone in [k for k in keepers if k[0] < high and low < k[1]]:
                        del keepers[gone]
                keepers[span] = owner

    def keeper(self, name: str, span: tuple[int, int]) -> int | None:
        """The route whose call was the latest to leave an outliving tensor at ``span`` of
        the buffer ``name`` (``None``: none did)."""
        return self._keepers.get(name, {}).get(span)

    def base(self, name: str) -> int | None:
        """Where the buffer ``name`` was when a call last served from it (``None``: never)."""
        return self._bases.get(name)

    def lanes(self, arena: str) -> list[tuple[str, int]]:
        """``(buffer, base)`` of ``arena`` and each of its lanes that a call served from."""
        prefix = lane_name(arena, 0)[:-1]
        with self._lock:
            return [
                (name, base)
                for name, base in self._bases.items()
                if name == arena or (name.startswith(prefix) and name[len(prefix) :].isdigit())
            ]


def lane_name(arena: str, k: int) -> str:
    """The buffer of ``arena``'s ``k``-th lane (``k >= 1``): what a step running while
    another holds ``arena`` serves from."""
    return f"{arena}.lane{k}"


class ArenaHost(Protocol):
    """What a route needs of the object that owns its arenas (``BufferPool`` is one)."""

    @property
    def device(self) -> str:
        """The device string (``"cpu"``, ``"cuda:0"``...)."""
        ...

    @property
    def granularity(self) -> int:
        """Buffer capacities are whole multiples of this many bytes."""
        ...

    @property
    def stable_address(self) -> bool:
        """Whether a buffer keeps its address when it grows."""
        ...

    @property
    def arenas(self) -> Arenas:
        """The routing state this host keeps for its arenas (one ``Arenas``, its own)."""
        ...

    def __contains__(self, name: object) -> bool:
        """Whether a buffer ``name`` exists."""
        ...

    def tensor(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The buffer ``name``'s device-side view, grown to ``shape`` if it is smaller."""
        ...

    def device_capacity(self, name: str) -> int:
        """The device bytes the buffer ``name`` holds (0 for a name it does not have)."""
        ...

    def growth_room(self, name: str) -> int | None:
        """The most device bytes ``name`` may grow to (``None``: no limit)."""
        ...

    def in_place_room(self, name: str) -> int:
        """The most device bytes ``name`` may grow to without moving, within the limit (its
        capacity where any growth would move it)."""
        ...

    def give_back_above(self, name: str, nbytes: int) -> int:
        """Give back the device bytes of the buffer ``name`` above ``nbytes``, those below
        staying where they are (0 where they cannot: a moving buffer)."""
        ...

    def count(self, key: str, nbytes: int) -> None:
        """Add to the counter ``key`` of the host's figures."""
        ...

    def count_unpooled(self, nbytes: int) -> None:
        """Record bytes one call allocated beside the host's buffers."""
        ...
