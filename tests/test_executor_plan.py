"""Slot planning (the per-node baseline): one buffer per intermediate, the pool's reused."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from sharedmem._executor.plan import Lifetime, PlanSummary, assign_slots, merge


def lifetimes_strategy() -> st.SearchStrategy[list[Lifetime]]:
    one = st.tuples(st.integers(1, 10_000), st.integers(0, 40), st.integers(0, 10)).map(
        lambda t: Lifetime(t[0], t[1], t[1] + t[2])
    )
    return st.lists(one, max_size=40)


@given(
    lifetimes_strategy(), st.dictionaries(st.sampled_from(["act.0", "act.3"]), st.integers(0, 9999))
)
def test_per_node_gives_every_intermediate_its_own_buffer_big_enough(
    lifetimes: list[Lifetime], existing: dict[str, int]
) -> None:
    names, need = assign_slots(lifetimes, existing, prefix="act.")
    assert len(set(names)) == len(names) == len(lifetimes)
    assert [need[name] for name in names] == [life.nbytes for life in lifetimes]
    # The pool's slots are used before any new one is made.
    if len(lifetimes) >= len(existing):
        assert set(existing) <= set(names)
    else:
        assert set(names) <= set(existing)


def test_a_later_graph_fits_into_the_buffers_an_earlier_one_left() -> None:
    train = [Lifetime(1000, 0, 9), Lifetime(800, 1, 8), Lifetime(50, 2, 3)]
    names, need = assign_slots(train, {}, prefix="act.")
    existing = {name: nbytes for name, nbytes in need.items()}
    evaluation = [Lifetime(900, 0, 1), Lifetime(700, 1, 2), Lifetime(40, 2, 3)]
    names, need = assign_slots(evaluation, existing, prefix="act.")
    assert set(names) <= set(existing)  # no new buffer
    assert all(need[n] <= existing[n] for n in need)  # and none grows


def test_when_nothing_fits_the_largest_free_buffer_grows() -> None:
    names, need = assign_slots([Lifetime(500, 0, 0)], {"act.0": 100, "act.1": 300}, prefix="act.")
    assert names == ["act.1"] and need == {"act.1": 500}


def test_new_buffers_take_the_smallest_free_number() -> None:
    names, _ = assign_slots([Lifetime(10, 0, 5), Lifetime(10, 1, 5)], {"act.1": 0}, prefix="act.")
    assert sorted(names) == ["act.0", "act.1"]


def test_merge_joins_chains_of_in_place_results() -> None:
    joined, member = merge(
        [Lifetime(8, 0, 2), Lifetime(8, 2, 4), Lifetime(8, 4, 6), Lifetime(4, 1, 3)],
        [(1, 0), (2, 1)],
    )
    assert joined[member[0]] == Lifetime(8, 0, 6)
    assert member[0] == member[1] == member[2] != member[3]


def test_summary_reports_the_saving() -> None:
    summary = PlanSummary("liveness", "train step", 10, 4, 2, 600, 1000, 600, 64, ("aten.x",))
    assert summary.saved_bytes == 400 and summary.saving == 0.4
    text = str(summary)
    assert "saved 400, 40%" in text and "aten.x" in text
