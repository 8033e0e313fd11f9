"""Arena placement: no two live values overlap in memory, and the step's peak never rises.

``place`` decides which intermediates of a step live in the pool's arena (and where) and
which run as eager runs them, allocating; these tests hold it to its contract on random
lifetimes against a reference timeline computed here, independently.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sharedmem._executor.placement import intervals, place, timeline_peak
from sharedmem._executor.plan import Lifetime
from sharedmem._routing.plan import plan_offsets

HORIZON = 60


def lifetimes(max_size: int = 30) -> st.SearchStrategy[list[Lifetime]]:
    one = st.tuples(st.integers(1, 20_000), st.integers(0, 45), st.integers(0, 14)).map(
        lambda t: Lifetime(t[0], t[1], t[1] + t[2])
    )
    return st.lists(one, max_size=max_size)


def overlap(a: Lifetime, b: Lifetime) -> bool:
    return a.start <= b.end and b.start <= a.end


def reference_peak(arena: int, beside: list[Lifetime]) -> int:
    """The step's peak as a person would count it: the arena at every node, plus the bytes
    of every value that is not in it while it lives."""
    live = [0] * HORIZON
    for life in beside:
        for t in range(life.start, life.end + 1):
            live[t] += life.nbytes
    return arena + max(live, default=0)


@settings(max_examples=150)
@given(
    lifetimes(),
    lifetimes(10),
    st.sampled_from([0, 4096, 65536]),
    st.sampled_from([16, 4096]),
)
def test_values_live_at_once_never_share_bytes_and_the_peak_never_rises(
    candidates: list[Lifetime], fresh: list[Lifetime], capacity: int, granularity: int
) -> None:
    got = place(candidates, fresh, capacity, horizon=HORIZON, granularity=granularity)
    assert len(got.offsets) == len(candidates)
    placed = [(c, o) for c, o in zip(candidates, got.offsets, strict=True) if o is not None]
    for i, (a, at) in enumerate(placed):
        assert at % 64 == 0, "every dtype views an offset"
        assert at + a.nbytes <= got.need <= got.arena
        for b, bt in placed[:i]:
            if overlap(a, b):
                assert at + a.nbytes <= bt or bt + b.nbytes <= at, (a, at, b, bt)
    assert got.arena % granularity == 0 and got.arena >= capacity
    beside = [*fresh, *(c for c, o in zip(candidates, got.offsets, strict=True) if o is None)]
    assert got.beside_peak == timeline_peak(beside)
    assert got.peak == reference_peak(got.arena, beside)
    # Nothing pooled is always a choice: the plan is never worse than eager's allocations.
    assert got.peak <= reference_peak(capacity, [*fresh, *candidates])


@given(lifetimes(), st.integers(0, 30_000))
def test_the_ceiling_caps_the_arena_and_required_values_are_always_placed(
    candidates: list[Lifetime], ceiling: int
) -> None:
    must = frozenset(range(0, len(candidates), 3))
    got = place(candidates, [], 0, horizon=HORIZON, ceiling=ceiling, must=must)
    assert all(got.offsets[i] is not None for i in must)
    if not must:
        assert got.arena <= max(ceiling, 0) or got.arena == 0


@given(lifetimes(), lifetimes(10), st.sampled_from([0, 4096]))
def test_values_that_must_be_pooled_pack_as_low_as_the_router_packs_them(
    candidates: list[Lifetime], fresh: list[Lifetime], capacity: int
) -> None:
    # Outputs asked for as pool views: every one in the arena, so the packing is the peak.
    every = frozenset(range(len(candidates)))
    got = place(candidates, fresh, capacity, horizon=HORIZON, must=every)
    assert all(offset is not None for offset in got.offsets)
    routed = plan_offsets(intervals(candidates)).need
    assert got.peak <= reference_peak(max(capacity, -(-routed // 16) * 16), fresh)


def test_a_long_lived_value_and_two_later_ones_share_the_arena() -> None:
    got = place([Lifetime(256, 0, 2), Lifetime(128, 3, 4), Lifetime(128, 3, 3)], [], 0, horizon=5)
    assert got.offsets == [0, 0, 128] and got.peak == 256


def test_a_value_that_would_raise_the_peak_runs_beside_the_arena() -> None:
    # A small value live early, when little else is: an arena kept for it all step long
    # would sit beside the big fresh result at node 5.
    fresh = [Lifetime(10_000, 5, 5)]
    got = place([Lifetime(4096, 0, 1)], fresh, 0, horizon=6, granularity=16)
    assert got.offsets == [None] and got.peak == 10_000


def test_a_later_graph_uses_the_arena_and_grows_it_only_to_lower_its_peak() -> None:
    # An evaluation after training: its values fit the arena the train step made.
    got = place([Lifetime(1000, 0, 1), Lifetime(1000, 2, 3)], [], 8192, horizon=4)
    assert got.offsets == [0, 0] and got.arena == 8192 and got.peak == 8192
    # A value bigger than the arena, live at the graph's busiest node: growing lowers the peak.
    bigger = place([Lifetime(20_000, 0, 3)], [Lifetime(500, 1, 1)], 8192, horizon=4)
    assert bigger.offsets == [0] and bigger.peak < 8192 + 20_500


def test_values_that_must_be_pooled_pack_at_the_most_bytes_live_at_once() -> None:
    # First fit, those live at the busiest node first and then largest first, stacks them
    # 1024 bytes high; the router's packing meets the 704 bytes live at nodes 2 and 5 to 7.
    values = [Lifetime(320, 0, 2), Lifetime(128, 0, 4), Lifetime(448, 5, 7), Lifetime(256, 2, 7)]
    got = place(values, [], 0, horizon=8, must=frozenset(range(4)))
    assert got.peak == timeline_peak(values) == 704
