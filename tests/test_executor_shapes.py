"""One capture for every length: a train step whose data sizes change is traced once with the
changing dimensions symbolic, and every later size is served by that graph, bit for bit
eager's (issue 34, item 4)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import recordings
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import sharedmem as sm
from sharedmem._executor.executor import derive, size_rule
from sharedmem._routing.family import (
    SCALE_SLACK,
    FamilyPlan,
    SharedPlans,
    banks,
    key,
    reused,
)
from sharedmem._routing.plan import (
    Fences,
    Recording,
    RoutePlan,
    choose_plan,
    placeable,
    plan_offsets,
    reuse_offsets,
)


class TinyLM(nn.Module):
    """Embedding, learned positions, one causal attention block with dropout, a tied head."""

    def __init__(self, vocab: int = 31, width: int = 16, heads: int = 2, p: float = 0.1) -> None:
        super().__init__()
        self.heads = heads
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(64, width)
        self.ln = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)
        )
        self.drop = nn.Dropout(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        x = self.tok(idx) + self.pos(torch.arange(t))
        c = x.shape[-1]
        q, k, v = self.qkv(self.ln(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (c // self.heads) ** -0.5
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        att = self.drop(att.masked_fill(mask, float("-inf")).softmax(-1))
        x = x + (att @ v).transpose(1, 2).reshape(b, t, c)
        x = x + self.drop(self.mlp(x))
        return x @ self.tok.weight.t()


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def batch(b: int, t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.randint(0, 31, (b, t + 1), generator=torch.Generator().manual_seed(seed))
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def run_both(
    model: nn.Module,
    shapes: list[tuple[int, int]],
    *,
    routing: bool = True,
    heavy: bool | float = False,
) -> sm.BufferPool:
    """Eager and the pooled step on copies of ``model`` over batches of ``shapes``: every
    loss and gradient equal bit for bit, step after step (with AdamW between)."""
    eager, pooled = model, copy.deepcopy(model)
    pool = sm.BufferPool("cpu")
    step = sm.pooled_train_step(pooled, lm_loss, pool=pool, recompute=sm.Recompute.adding(heavy))
    step.routing = routing
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, pooled)]
    for i, (b, t) in enumerate(shapes):
        x, y = batch(b, t, i)
        for opt in opts:
            opt.zero_grad()
        torch.manual_seed(100 + i)
        expected = lm_loss(eager(x), y)
        expected.backward()
        torch.manual_seed(100 + i)
        got = step(x, y)
        assert torch.equal(got, expected.detach()), f"loss of step {i} ({b}x{t})"
        for (name, p), q in zip(eager.named_parameters(), pooled.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), f"{name}.grad of step {i} ({b}x{t})"
        for opt in opts:
            opt.step()
    return pool


def captures(pool: sm.BufferPool) -> tuple[int, int]:
    stats = pool.stats()
    return stats.get("captures", 0), stats.get("symbolic_captures", 0)


def test_one_symbolic_capture_serves_every_length() -> None:
    torch.manual_seed(0)
    lengths = [5, 9, 13, 7, 21, 9, 30, 2]
    pool = run_both(TinyLM(), [(4, t) for t in lengths])
    # the first length's own graph, then one symbolic graph for every other length
    assert captures(pool) == (2, 1)
    stats = pool.stats()
    assert stats.get("symbolic_fallbacks", 0) == 0
    # recorded: the first length and the symbolic graph's first; every other length's plan
    # is derived from those recordings and replayed from its first call, never diverging
    assert stats["recorded_calls"] == 2
    assert stats["derived_plans"] == 5
    assert stats.get("diverged_calls", 0) == 0


def test_a_new_length_reuses_the_plan_of_the_longest_so_far() -> None:
    torch.manual_seed(4)
    # the symbolic graph is traced at 40 (the longest); every later length is shorter: its
    # plan is the family's, reused, made again only for new fences or a grown arena
    lengths = [5, 40, 9, 13, 7, 21, 30, 11, 17, 25, 33, 19, 6, 28]
    pool = run_both(TinyLM(), [(3, t) for t in lengths])
    assert captures(pool) == (2, 1)
    stats = pool.stats()
    assert stats.get("diverged_calls", 0) == 0
    new_lengths = len(lengths) - 2  # not the first graph's, nor the symbolic graph's first
    assert stats["derived_plans"] == new_lengths
    assert stats["shared_plans"] >= new_lengths - 3


def test_a_repeated_length_replays_its_plan_whichever_bank_the_held_loss_is_in() -> None:
    torch.manual_seed(6)
    # Lengths that come back, never twice in a row: each call holds the previous call's loss
    # (``got = step(x, y)``) in one of the family's two banks. A length's first call plans
    # both banks' plans; a later call of it finds the held loss in either bank (its own
    # bank's loss is another length's by then) and replays, with nothing planned again.
    lengths = [5, 9, 13, 9, 13, 7, 9, 21, 7, 13, 9, 7, 13, 21, 9]
    pool = run_both(TinyLM(), [(4, t) for t in lengths])
    stats = pool.stats()
    assert captures(pool) == (2, 1)
    assert stats.get("diverged_calls", 0) == 0
    assert stats.get("replanned_calls", 0) == 0
    # every call served from the arena: the loss too (its first call's plan kept it there)
    assert stats["recorded_calls"] + stats["replayed_calls"] == len(lengths)


def test_a_changing_batch_size_joins_the_symbols_once() -> None:
    torch.manual_seed(1)
    shapes = [(4, 8), (4, 12), (2, 12), (3, 5), (4, 17), (2, 8), (5, 3)]
    pool = run_both(TinyLM(), shapes)
    # 4x8 alone, then one graph with the length and the batch symbolic: never again
    assert captures(pool) == (2, 1)


def test_train_length_and_a_short_last_batch() -> None:
    torch.manual_seed(2)
    shapes = [(4, 16)] * 3 + [(4, 6)] + [(4, 16)] * 2 + [(4, 6)]
    pool = run_both(TinyLM(), shapes)
    assert captures(pool) == (2, 1)


def test_heavy_recomputation_holds_at_every_length() -> None:
    torch.manual_seed(3)
    pool = run_both(TinyLM(), [(3, t) for t in (6, 11, 4, 15)], heavy=True)
    assert captures(pool) == (2, 1)


class LengthBranch(nn.Module):
    """A forward that takes another path past a length: the symbolic graph guards on it."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(31, 8)
        self.head = nn.Linear(8, 31)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        if idx.shape[1] > 10:
            x = x * 2.0
        return self.head(torch.relu(x))


def test_a_guard_on_a_length_gives_that_length_its_own_graph() -> None:
    torch.manual_seed(4)
    lengths = [4, 6, 8, 12, 14, 5]
    pool = run_both(LengthBranch(), [(2, t) for t in lengths])
    captured, symbolic = captures(pool)
    assert symbolic == 1
    # 4 alone, 6 symbolic (guarding t <= 10): 12 and 14 fail the guard and are traced each
    assert captured == 4


def test_without_routing_every_size_is_traced_and_the_reason_recorded() -> None:
    torch.manual_seed(5)
    model = TinyLM(p=0.0)
    pool = run_both(model, [(2, t) for t in (4, 6, 8)], routing=False)
    assert captures(pool) == (3, 0)
    assert pool.stats()["symbolic_fallbacks"] == 1


def test_the_fallback_reason_is_on_the_step() -> None:
    pool = sm.BufferPool("cpu")
    step = sm.pooled_train_step(TinyLM(p=0.0), lm_loss, pool=pool)
    step.routing = False
    for t in (4, 6):
        step(*batch(2, t, t))
    assert "slot plan" in step.shape_fallback
    assert step.capture_seconds > 0


@pytest.mark.parametrize("t", [1, 3])
def test_a_length_of_one_is_never_traced_as_a_symbol(t: int) -> None:
    # a size of 1 would be specialised by the symbolic trace: such a call is traced alone
    torch.manual_seed(6)
    shapes = [(2, t), (2, 1), (2, 4), (2, 1), (2, 7)]
    pool = run_both(TinyLM(), shapes)
    assert captures(pool)[1] == 1


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(31, 8)
        self.rnn = nn.LSTM(8, 8, batch_first=True)
        self.head = nn.Linear(8, 31)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.tok(idx))[0])


def test_a_symbolic_trace_running_other_ops_falls_back() -> None:
    # PyTorch's symbolic trace runs the LSTM through its Python decomposition, unrolled over
    # the length: other ops than eager's kernel, so every length keeps a graph of its own
    torch.manual_seed(7)
    pool = run_both(Recurrent(), [(2, 7), (2, 5), (2, 6)])
    assert captures(pool) == (4, 0)
    assert pool.stats()["symbolic_fallbacks"] == 1


def _with_a_held_loss(rec: Recording) -> tuple[Recording, list[int]]:
    """``rec`` with a 4-byte loss that outlives every call (the last allocation), spread as
    a route plans it (``placeable``), and which of its allocations outlive the call."""
    rec = Recording([*rec.sizes, 4], [*rec.alloc_at, 0], [*rec.free_at, -1])
    outliving = [i for i, f in enumerate(rec.free_at) if f < 0 and rec.sizes[i] > 0]
    return placeable(rec, outliving), outliving


def _scaled(spread: Recording, scale: float) -> Recording:
    """``spread``'s sequence at another size: every allocation scaled, the loss (its last,
    4 bytes) as it is."""
    last = len(spread.sizes) - 1
    sizes = [n if i == last else int(n * scale) for i, n in enumerate(spread.sizes)]
    return Recording(sizes, spread.alloc_at, spread.free_at)


def _make_in_1_mib(sequence: Recording, fences: Fences = ()) -> RoutePlan:
    return choose_plan(sequence, capacity=1 << 20, granularity=4096, fences=fences)


def _plan_in_1_mib(
    family: SharedPlans, sized: Recording, held: list[tuple[int, int]], outliving: list[int]
) -> FamilyPlan:
    """``family``'s plan of ``sized`` in a 1 MiB arena around the ``held`` loss (growing it
    only while nothing is held)."""
    return family.plan(
        sized,
        capacity=1 << 20,
        fences=held,
        grow=not held,
        make=_make_in_1_mib,
        outliving=outliving,
    )


def _disjoint(rec: Recording, plan: RoutePlan, fences: list[tuple[int, int]]) -> None:
    """No two allocations of ``rec`` live at one tick share a byte of ``plan`` (every placed
    one on the 64-byte grid, within ``plan.need``), nor any byte of ``fences``."""
    placed = [
        (rec.alloc_at[i], rec.free_at[i], off, off + rec.sizes[i])
        for i, off in enumerate(plan.offsets)
        if off >= 0 and rec.sizes[i] > 0
    ]
    assert all(off % 64 == 0 and top <= plan.need for _, _, off, top in placed)
    for k, (s1, e1, lo1, hi1) in enumerate(placed):
        assert all(hi1 <= low or high <= lo1 for low, high in fences), (lo1, hi1, fences)
        for s2, e2, lo2, hi2 in placed[k + 1 :]:
            if s1 < e2 and s2 < e1:
                assert hi1 <= lo2 or hi2 <= lo1


@given(recordings(), st.lists(st.floats(0.0, 1.0), min_size=2, max_size=6))
def test_the_loss_held_from_the_last_call_takes_the_other_bank_not_another_plan(
    rec: Recording, scales: list[float]
) -> None:
    # The family's sequence with a 4-byte loss outliving every call: the user holds the
    # previous loss (a fence) while the next runs. Every size the envelope covers is served
    # by the envelope's one plan, the loss alternating between the two banks, and no
    # allocation touches the held loss.
    spread, outliving = _with_a_held_loss(rec)
    family = SharedPlans()

    held: list[tuple[int, int]] = []
    loss_at = []
    for k, scale in enumerate([1.0, *scales]):
        sized = _scaled(spread, scale if k else 1.0)
        got = _plan_in_1_mib(family, sized, held, outliving)
        _disjoint(sized, got.plan, held)
        loss = got.plan.offsets[-1]
        loss_at.append(loss)
        held = [(loss, loss + 4)]
    kept, bank = banks(np.asarray(spread.sizes), outliving, 1 << 20)
    assert bank > 0 and len(spread.sizes) - 1 in kept
    # one plan, made at the first call: the later ones (each around the last one's loss)
    # reuse it, the loss in the first bank, then the second, then the first ...
    assert family.made == 1
    assert loss_at[0] < bank
    assert loss_at == [loss_at[0] + (bank if k % 2 else 0) for k in range(len(loss_at))]
    # a loss held in a bank is the family's steady state (its route may grow the arena)
    assert family.banked(held) and not family.banked([(2 * bank, 2 * bank + 4)])


@given(recordings(), st.lists(st.floats(0.0, 1.0), min_size=1, max_size=4))
def test_a_familys_plan_comes_with_the_other_banks_plan(
    rec: Recording, scales: list[float]
) -> None:
    # A size's plan comes with ``other``: the very plan the family gives that size when the
    # loss of this plan is held (the size's next call, its last loss held in this bank).
    spread, outliving = _with_a_held_loss(rec)
    family = SharedPlans()
    held: list[tuple[int, int]] = []
    for k, scale in enumerate([1.0, *scales]):
        sized = _scaled(spread, scale if k else 1.0)
        got = _plan_in_1_mib(family, sized, held, outliving)
        assert got.bank > 0 and got.other is not None
        assert key(held, got.bank) == (got.which, ())
        loss = got.plan.offsets[-1]
        held = [(loss, loss + 4)]
        assert key(held, got.bank) == (1 - got.which, ())
        made = family.made
        again = _plan_in_1_mib(family, sized, held, outliving)
        assert family.made == made and again.reused
        assert again.plan == got.other and again.which == 1 - got.which
        _disjoint(sized, got.other, held)


@given(
    recordings(),
    st.lists(st.floats(1.0, 1.5), min_size=1, max_size=5),
    st.lists(st.floats(0.0, 1.0), min_size=1, max_size=5),
    st.booleans(),
)
def test_a_widened_envelope_keeps_its_plan_in_order_or_plans_anew(
    rec: Recording, growth: list[float], unevenness: list[float], hold: bool
) -> None:
    # Every call longer than the last (the running maximum of drawn lengths): each widens
    # the envelope. Its plan is the last one's, each allocation stacked where it sat, or (too
    # far above max-live) planned anew; either way no two live allocations share a byte,
    # nor any byte of the held loss, and a kept plan is within SCALE_SLACK of max-live.
    spread, outliving = _with_a_held_loss(rec)
    family = SharedPlans()

    held: list[tuple[int, int]] = []
    scale = 1.0
    widest = np.zeros(len(spread.sizes), dtype=np.int64)
    for k, grow in enumerate([1.0, *growth]):
        scale *= grow
        uneven = unevenness[k % len(unevenness)]
        sizes = [  # each allocation grown by the scale, some by up to its square
            n if i == len(spread.sizes) - 1 else int(n * scale ** (1 + uneven * (i % 2)))
            for i, n in enumerate(spread.sizes)
        ]
        sized = Recording(sizes, spread.alloc_at, spread.free_at)
        before = family.scaled
        got = _plan_in_1_mib(family, sized, held, outliving)
        _disjoint(sized, got.plan, held)
        assert got.plan.need <= got.need
        widest = np.maximum(widest, sizes)  # the envelope: each allocation's largest size
        if family.scaled > before:  # the banks at the bottom, then the rest's max-live
            aligned = Recording((-(-widest // 64) * 64).tolist(), sized.alloc_at, sized.free_at)
            bank = banks(widest, outliving, 1 << 20)[1]
            assert got.plan.need <= (1 + SCALE_SLACK) * (aligned.live_peak() + 2 * bank)
        if hold:
            loss = got.plan.offsets[-1]
            held = [(loss, loss + 4)] if loss >= 0 else []
    assert family.made >= 1


def test_a_longer_length_stacks_the_plan_of_the_last_longest() -> None:
    # Two layers' step (see test_routing): planned once at its first size, a plan at max-live;
    # sizes grown evenly (as more tokens grow them) keep that plan's order at max-live, with
    # no planning.
    rec = Recording(
        [684, 140, 3471, 3107, 4, 4, 1068, 1573, 2191, 3642],
        [0, 1, 3, 4, 6, 7, 8, 9, 12, 13],
        [2, 14, 5, 10, -1, 11, -1, 15, -1, 16],
    )
    spread = placeable(rec, [4, 6, 8])
    family = SharedPlans()

    def make(sequence: Recording, fences: Fences = ()) -> RoutePlan:
        return choose_plan(sequence, granularity=4096, fences=fences)

    for k, scale in enumerate([1.0, 1.1, 1.25]):
        sized = Recording([int(n * scale) for n in spread.sizes], spread.alloc_at, spread.free_at)
        got = family.plan(sized, capacity=0, fences=(), grow=True, make=make)
        _disjoint(sized, got.plan, [])
        aligned = Recording([-(-n // 64) * 64 for n in sized.sizes], sized.alloc_at, sized.free_at)
        assert got.need == aligned.live_peak()
        assert (family.made, family.scaled) == (1, k)
    # past what the route may grow the arena to (a pool's limit), it is planned within that
    wider = Recording([int(n * 1.5) for n in spread.sizes], spread.alloc_at, spread.free_at)
    family.plan(wider, capacity=got.need, fences=(), grow=True, make=make, ceiling=got.need)
    assert (family.made, family.scaled) == (2, 2)


@given(recordings(), st.floats(0.0, 1.0), st.integers(0, 1 << 14))
def test_a_family_describes_a_reused_plan_as_the_router_does(
    rec: Recording, scale: float, ceiling: int
) -> None:
    # ``reused`` (arrays) gives the very plan ``reuse_offsets`` does, at any smaller size,
    # with allocations left beside by a ceiling too.
    plan = plan_offsets(rec, ceiling=ceiling)
    smaller = Recording([int(n * scale) for n in rec.sizes], rec.alloc_at, rec.free_at)
    assert reused(smaller, plan) == reuse_offsets(smaller, plan)
    assert reused(rec, plan) == reuse_offsets(rec, plan)


def test_a_new_size_follows_the_rule_of_the_recorded_sizes() -> None:
    ticks = ([0, 1, 2], [3, 4, 5])

    def at(t: int, sizes: list[int]) -> tuple[list[int], Recording]:
        # candidates at length t: 32t, 8t, and t*t (equal to 8t at t = 8)
        return [32 * t, 8 * t, t * t], Recording(sizes, *ticks)

    # allocations: 32t bytes, 64 fixed, 8t; recorded at 5 and 7
    rule = size_rule([at(5, [160, 64, 40]), at(7, [224, 64, 56])])
    assert rule is not None
    assert derive([32 * 11, 8 * 11, 121], rule) == Recording([352, 64, 88], *ticks)
    # recorded at 8 alone, the third allocation is 8t or t*t: ambiguous at any other length
    alone = size_rule([at(8, [256, 64, 64])])
    assert derive([32 * 8, 64, 64], alone) is not None
    assert derive([32 * 9, 72, 81], alone) is None
    # an allocation no candidate explains that changed size, or another sequence: no rule
    assert size_rule([at(5, [160, 64, 40]), at(7, [224, 65, 56])]) is None
    other = Recording([224, 64, 56], [0, 2, 1], [3, 4, 5])
    assert size_rule([at(5, [160, 64, 40]), ([224, 56, 49], other)]) is None


def test_a_size_read_is_size_arithmetic_not_an_op_the_step_runs() -> None:
    # torch 2.11 records ``aten.size`` in a symbolic trace where later ones record ``sym_size``:
    # counted as an op, every symbolic trace "ran other ops" and each length was captured anew.
    from torch.fx import Graph, GraphModule

    from sharedmem._executor.graph import op_sequence

    aten = torch.ops.aten
    graph = Graph()
    x = graph.placeholder("x")
    sizes = graph.call_function(aten.size.default, (x,))
    y = graph.call_function(aten.relu.default, (x,))
    graph.output((y, sizes))
    assert op_sequence(GraphModule(nn.Module(), graph)) == (aten.relu.default,)
