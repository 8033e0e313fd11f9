"""Fitting a batch to a memory budget: chunks chosen before running, exact gradients.

Grouped by behaviour: the accumulated gradients and loss are the whole batch's; the chosen
count is the fewest that fits and never breaks a limit; a batch that cannot fit is refused
before anything runs; what chunking changes is said once; evaluation is chunked too; bad
arguments are refused.
"""

from __future__ import annotations

import functools
import math
import re
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import sharedmem as sm
from sharedmem._executor import cost
from sharedmem._planning.fit import REFINE_STEPS, planned_peak, recompute_levels
from sharedmem.testing import allocator_peak

F = nn.functional


def mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(12, 48), nn.Tanh(), nn.Linear(48, 48), nn.GELU(), nn.Linear(48, 5)
    )


def cnn(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.GroupNorm(2, 8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, 5),
    )


class Tagger(nn.Module):
    """A GRU over (batch, time, features) with a per-step head: a sequence model."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.rnn = nn.GRU(6, 16, batch_first=True)
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0]).mean(dim=1)


MODELS: dict[str, Callable[[int], nn.Module]] = {"mlp": mlp, "cnn": cnn, "gru": Tagger}


def data(kind: str, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    shape = {"mlp": (n, 12), "cnn": (n, 3, 8, 8), "gru": (n, 7, 6)}[kind]
    return torch.randn(shape, generator=gen), torch.randn(n, 5, generator=gen)


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def eager_grads(
    model: nn.Module, loss_fn: Callable[..., torch.Tensor], x: object, y: object
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    loss = loss_fn(model(x), y)
    loss.backward()
    return loss.detach(), grads(model)


def assert_close(got: list[torch.Tensor], want: list[torch.Tensor], rel: float, what: str) -> None:
    assert len(got) == len(want), what
    for g, w in zip(got, want, strict=True):
        scale = w.abs().max().item() or 1.0
        assert (g - w).abs().max().item() <= rel * scale, what


# ---- the accumulated gradients and loss are the whole batch's ----------------------------------


@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_chunked_gradients_equal_the_whole_batchs_in_float64(
    kind: str, reduction: str, seed: int, rng: np.random.Generator
) -> None:
    torch.set_default_dtype(torch.float64)
    try:
        gen = torch.Generator().manual_seed(seed)
        loss_fn = nn.MSELoss(reduction=reduction)
        for trial in range(3):
            n = int(rng.integers(2, 23))
            chunks = int(rng.integers(2, n + 1))
            x, y = data(kind, n, gen)
            want_loss, want = eager_grads(MODELS[kind](seed), loss_fn, x, y)
            what = f"seed {seed} trial {trial}: {kind} batch {n} in {chunks} chunks ({reduction})"
            pooled_model = MODELS[kind](seed)
            pool = sm.BufferPool("cpu")
            step = sm.pooled_train_step(pooled_model, loss_fn, pool=pool, chunks=chunks)
            loss = step(x, y)
            assert step.chunks_for(x, y) == chunks
            assert loss.item() == pytest.approx(want_loss.item(), rel=1e-12), what
            assert_close(grads(pooled_model), want, 1e-6, what)
            eager_model = MODELS[kind](seed)
            loss = sm.fit_eager_step(eager_model, loss_fn, chunks=chunks)(x, y)
            assert loss.item() == pytest.approx(want_loss.item(), rel=1e-12), what
            assert_close(grads(eager_model), want, 1e-6, what)
    finally:
        torch.set_default_dtype(torch.float32)


def test_gradients_add_into_existing_grads_as_backward_does() -> None:
    torch.set_default_dtype(torch.float64)
    try:
        gen = torch.Generator().manual_seed(3)
        batches = [data("mlp", 10, gen) for _ in range(3)]
        ref = mlp(0)
        for x, y in batches:  # gradient accumulation over three batches, eager
            F.mse_loss(ref(x), y).backward()
        for make_step in (
            lambda m: sm.pooled_train_step(m, F.mse_loss, pool=sm.BufferPool("cpu"), chunks=3),
            lambda m: sm.fit_eager_step(m, F.mse_loss, chunks=4),
        ):
            model = mlp(0)
            step = make_step(model)
            for x, y in batches:
                step(x, y)
            assert_close(grads(model), grads(ref), 1e-6, "accumulated over three batches")
    finally:
        torch.set_default_dtype(torch.float32)


def test_a_users_split_weights_padded_sequences_by_their_tokens() -> None:
    # A token-level mean over padded sequences: chunks must weigh their real tokens, not
    # their sequences. The user's split says so.
    torch.set_default_dtype(torch.float64)
    try:
        gen = torch.Generator().manual_seed(5)
        lengths = torch.tensor([7, 2, 5, 1, 6, 3])
        x = torch.randn(6, 7, 6, generator=gen)
        mask = (torch.arange(7)[None, :] < lengths[:, None]).to(torch.float64)
        y = torch.randn(6, 7, 5, generator=gen)

        class PerStep(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                torch.manual_seed(1)
                self.head = nn.Linear(6, 5)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.head(x)

        def token_mean(
            out: torch.Tensor, target: tuple[torch.Tensor, torch.Tensor]
        ) -> torch.Tensor:
            y, m = target
            return (((out - y) ** 2).sum(-1) * m).sum() / m.sum()

        def split(
            inputs: torch.Tensor, targets: tuple[torch.Tensor, torch.Tensor], n: int
        ) -> list[tuple[object, ...]]:
            y, m = targets
            total = m.sum()
            return [
                (xs, (ys, ms), (ms.sum() / total).item())
                for xs, ys, ms in zip(inputs.chunk(n), y.chunk(n), m.chunk(n), strict=True)
            ]

        want_loss, want = eager_grads(PerStep(), token_mean, x, (y, mask))
        for make_step in (
            lambda m: sm.pooled_train_step(
                m, token_mean, pool=sm.BufferPool("cpu"), chunks=sm.Chunks(3, split=split)
            ),
            lambda m: sm.fit_eager_step(m, token_mean, chunks=sm.Chunks(3, split=split)),
        ):
            model = PerStep()
            loss = make_step(model)(x, (y, mask))
            assert loss.item() == pytest.approx(want_loss.item(), rel=1e-12)
            assert_close(grads(model), want, 1e-6, "token-weighted chunks")
    finally:
        torch.set_default_dtype(torch.float32)


def test_the_loss_functions_own_reduction_is_read() -> None:
    gen = torch.Generator().manual_seed(2)
    x, y = data("mlp", 12, gen)
    labels = torch.randint(0, 5, (12,), generator=gen)
    cases: list[tuple[Callable[..., torch.Tensor], object]] = [
        (nn.MSELoss(reduction="sum"), y),
        (functools.partial(F.mse_loss, reduction="sum"), y),
        (F.cross_entropy, labels),
        (nn.CrossEntropyLoss(label_smoothing=0.1), labels),
    ]
    for loss_fn, targets in cases:
        want_loss, want = eager_grads(mlp(0), loss_fn, x, targets)
        model = mlp(0)
        loss = sm.fit_eager_step(model, loss_fn, chunks=4)(x, targets)
        assert loss.item() == pytest.approx(want_loss.item(), rel=1e-5), loss_fn
        assert_close(grads(model), want, 1e-5, repr(loss_fn))


# ---- the count chosen is the fewest that fits, and never breaks a limit -------------------------


def planned_pool_bytes(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """What the unchunked step's plan would reserve on an empty pool, pages included."""
    pool = sm.BufferPool("cpu")
    plan = sm.pooled_train_step(model, F.mse_loss, pool=pool).memory_plan(x, y)
    return pool.reserved_after(plan.slot_bytes)


def test_under_half_the_unchunked_plan_no_limit_is_broken_over_varying_shapes(
    seed: int, rng: np.random.Generator
) -> None:
    torch.manual_seed(seed)
    model = nn.Sequential(  # over (batch, features, time): sequences of any length
        nn.Conv1d(6, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv1d(32, 32, 3, padding=1),
        nn.Tanh(),
        nn.AdaptiveAvgPool1d(1),
        nn.Flatten(),
        nn.Linear(32, 5),
    )
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(64, 6, 40), torch.randn(64, 5)  # the run's biggest batch
    unchunked = planned_pool_bytes(model, x, y)
    pool = sm.BufferPool("cpu", limit=unchunked // 2)
    step = sm.pooled_train_step(model, F.mse_loss, pool=pool, budget="free")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for trial in range(12):
        n, t = int(rng.integers(8, 65)), int(rng.integers(5, 41))
        if trial < 2:  # the biggest batch, recorded then replayed: it cannot all fit
            n, t = 64, 40
        x, y = torch.randn(n, 6, t, generator=gen), torch.randn(n, 5, generator=gen)
        opt.zero_grad()
        step(x, y)  # an OutOfMemoryError here fails the test: that is the point
        opt.step()
        reserved = pool.stats()["peak_reserved_bytes"]
        assert reserved <= unchunked // 2, f"seed {seed} trial {trial}: {reserved:,} bytes"
    # The limit caps the pool's arena; what does not fit in it runs beside it (chunks only
    # where that does not fit the budget either).
    assert pool.stats()["unpooled_bytes_total"] > 0


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_the_chosen_count_is_the_fewest_the_budget_allows(kind: str) -> None:
    gen = torch.Generator().manual_seed(0)
    x, y = data(kind, 96, gen)
    whole = sm.pooled_train_step(MODELS[kind](0), F.mse_loss, pool=sm.BufferPool("cpu"))
    plan = whole.memory_plan(x, y)
    unchunked = whole.pool.reserved_after(plan.slot_bytes) + plan.beside_peak
    for share in (0.75, 0.5):
        budget = int(unchunked * share)
        pool = sm.BufferPool("cpu")
        step = sm.pooled_train_step(  # chunks only: recomputation meets some of these
            MODELS[kind](0), F.mse_loss, pool=pool, budget=budget, recompute=sm.Recompute.OFF
        )
        chosen = step.chunks_for(x, y)
        assert pool.stats()["reserved_bytes"] == 0, "choosing allocates nothing"
        assert chosen > 1
        # Judged as the choice was made: on the pool as it stood then.
        fewer = step.budget_policy._need(x, y, chosen - 1, False)  # type: ignore[union-attr]
        assert fewer is None or fewer.total > budget, "the choice was the fewest"
        step(x, y)
        assert pool.stats()["peak_reserved_bytes"] <= budget
        # What the step holds, the pool and beside it, as the allocator's events count it;
        # the step says the same of itself.
        step.model.zero_grad(set_to_none=True)
        held = allocator_peak(functools.partial(step, x, y)) + pool.stats()["reserved_bytes"]
        assert held <= budget, (held, budget)
        assert step.last_call is not None and step.last_call.held_budget, step.report()


def test_the_same_budget_and_shapes_give_the_same_chunks() -> None:
    gen = torch.Generator().manual_seed(0)
    x, y = data("cnn", 40, gen)
    # Before a first call (planned) and after it (recorded, gradients there to add into):
    # each the same on every step made alike.
    before, after = set(), set()
    for _ in range(2):
        step = sm.pooled_train_step(cnn(0), F.mse_loss, pool=sm.BufferPool("cpu"), budget=200_000)
        before.add(step.chunks_for(x, y))
        step(x, y)
        after.add(step.chunks_for(x, y))
    assert len(before) == len(after) == 1


def test_a_budget_is_bytes_or_a_size_as_the_command_line_writes_it() -> None:
    gen = torch.Generator().manual_seed(0)
    x, y = data("cnn", 40, gen)
    pool = sm.BufferPool("cpu")
    for written, nbytes in (("8G", 8 << 30), ("200K", 200 << 10), ("512_000", 512_000)):
        by_size = sm.pooled_train_step(cnn(0), F.mse_loss, pool=pool, budget=written)
        by_bytes = sm.pooled_train_step(cnn(0), F.mse_loss, pool=pool, budget=nbytes)
        assert by_size.budget == nbytes and by_size.chunks_for(x, y) == by_bytes.chunks_for(x, y)
        assert sm.fit_eager_step(cnn(0), F.mse_loss, budget=written).budget == nbytes
    est = sm.estimate(cnn(0), x, y, loss_fn=F.mse_loss)
    assert est.fits("8G") and not est.fits("1K")


def test_an_eager_budget_bounds_the_allocators_peak() -> None:
    gen = torch.Generator().manual_seed(0)
    x, y = data("mlp", 256, gen)
    whole = allocator_peak(lambda: F.mse_loss(mlp(0)(x), y).backward())
    for share in (0.5, 0.25):
        budget = int(whole * share)
        model = mlp(0)
        step = sm.fit_eager_step(model, F.mse_loss, budget=budget)
        assert step.chunks_for(x, y) > 1
        assert allocator_peak(functools.partial(step, x, y)) <= budget


def test_a_larger_budget_never_takes_more_chunks() -> None:
    gen = torch.Generator().manual_seed(0)
    x, y = data("mlp", 64, gen)
    step = sm.fit_eager_step(mlp(0), F.mse_loss, budget=10**9)
    counts = []
    for budget in (30_000, 40_000, 80_000, 160_000, 10**9):
        step.budget = budget
        counts.append(step.chunks_for(x, y))
    assert counts == sorted(counts, reverse=True) and counts[-1] == 1, counts


# ---- a batch that cannot fit is refused before anything runs -----------------------------------


def test_one_example_too_big_is_refused_before_running_naming_the_shortfall() -> None:
    model = nn.Sequential(nn.Linear(12, 48), nn.LayerNorm(48), nn.Linear(48, 5))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pool = sm.BufferPool("cpu")
    step = sm.pooled_train_step(model, F.mse_loss, pool=pool, budget=1024)
    gen = torch.Generator().manual_seed(0)
    x, y = data("mlp", 16, gen)
    with pytest.raises(sm.OutOfMemoryError) as failure:
        step(x, y)
    message = str(failure.value)
    assert "before running" in message and "more than the budget" in message
    assert "beside the pool" in message and "gradients" in message
    assert pool.stats()["reserved_bytes"] == 0
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with pytest.raises(sm.OutOfMemoryError, match="budget"):
        sm.fit_eager_step(model, F.mse_loss, budget=64)(x, y)


# ---- what chunking changes is said once ---------------------------------------------------------


def test_batch_norm_in_training_mode_is_named_once() -> None:
    model = nn.Sequential(nn.Linear(12, 8), nn.BatchNorm1d(8), nn.Linear(8, 5))
    step = sm.pooled_train_step(model, F.mse_loss, pool=sm.BufferPool("cpu"), chunks=2)
    gen = torch.Generator().manual_seed(0)
    x, y = data("mlp", 8, gen)
    with pytest.warns(UserWarning, match="batch norm"):
        step(x, y)
    with __import__("warnings").catch_warnings():
        __import__("warnings").simplefilter("error")
        step(x, y)  # said once


def test_more_chunks_than_examples_run_one_example_a_chunk_and_say_so() -> None:
    # Clamped, not refused: a loader's last batch may hold fewer examples than chunks=.
    gen = torch.Generator().manual_seed(0)
    x, y = data("mlp", 4, gen)
    said = r"^sharedmem: chunks=100 but the batch holds 4 examples, the most chunks it can run in"
    pool = sm.BufferPool("cpu")
    for step, args in (
        (sm.pooled_train_step(mlp(0), F.mse_loss, pool=pool, chunks=100), (x, y)),
        (sm.fit_eager_step(mlp(0), F.mse_loss, chunks=100), (x, y)),
        (sm.pooled_forward(mlp(0), pool=pool, chunks=100), (x,)),
    ):
        with pytest.warns(UserWarning, match=said + r": it runs in 4 chunks of one example"):
            step(*args)
        assert step.chunks_for(*args) == 4
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            step(*args)  # said once a batch shape


def test_an_unknown_reduction_is_assumed_a_mean_and_said_and_none_is_refused() -> None:
    gen = torch.Generator().manual_seed(0)
    x, y = data("mlp", 8, gen)

    def my_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ((out - target) ** 2).mean()

    step = sm.pooled_train_step(mlp(0), my_loss, pool=sm.BufferPool("cpu"), chunks=2)
    with pytest.warns(UserWarning, match="reduction='sum'"):
        step(x, y)
    with pytest.raises(ValueError, match="reduction='none'"):
        sm.fit_eager_step(mlp(0), nn.MSELoss(reduction="none"), chunks=2)


# ---- evaluation is chunked too ------------------------------------------------------------------


def test_a_chunked_forward_joins_the_outputs_along_the_batch() -> None:
    gen = torch.Generator().manual_seed(0)
    x, _ = data("cnn", 30, gen)
    model = cnn(0).eval()
    with torch.no_grad():
        want = model(x)
    fwd = sm.pooled_forward(model, pool=sm.BufferPool("cpu"), chunks=4)
    torch.testing.assert_close(fwd(x), want)
    budgeted = sm.pooled_forward(model, pool=sm.BufferPool("cpu"), budget=40_000)
    torch.testing.assert_close(budgeted(x), want)
    assert budgeted.chunks_for(x) > 1, budgeted.report()


# ---- bad arguments ------------------------------------------------------------------------------


def test_bad_arguments_say_what_is_wrong() -> None:
    pool = sm.BufferPool("cpu")
    for kwargs, error, text in [
        ({"budget": -1}, ValueError, "budget"),
        ({"budget": True}, ValueError, "budget"),
        ({"budget": "all"}, ValueError, "budget"),
        ({"budget": "8Q"}, ValueError, "budget"),
        ({"chunks": 0}, ValueError, "chunks"),
        ({"budget": 10, "chunks": 2}, ValueError, "not both"),
        ({"chunks": "4"}, TypeError, r"chunks must be a number of chunks or a sharedmem\.Chunks"),
        ({"chunks": sm.Chunks(exact=False)}, ValueError, "exact=False"),
        ({"chunks": sm.Chunks(2, exact=False)}, ValueError, "exact=False"),
        ({"chunks": sm.Chunks(batch_dim=1)}, ValueError, r"gives no count: give one"),
        ({"budget": 10, "chunks": sm.Chunks(2)}, ValueError, "not both"),
    ]:
        with pytest.raises(error, match=f"^sharedmem: .*{text}"):
            sm.pooled_train_step(mlp(0), F.mse_loss, pool=pool, **kwargs)  # type: ignore[arg-type]
    for fields, error, text in [
        ({"count": 0}, ValueError, "chunks must be an int >= 1"),
        ({"count": 2.0}, TypeError, "chunks must be an int >= 1"),
        ({"batch_dim": -1}, ValueError, "batch_dim"),
        ({"split": 3}, TypeError, "split"),
        ({"reduction": "max"}, ValueError, "reduction"),
        ({"exact": "no"}, TypeError, "exact"),
    ]:
        with pytest.raises(error, match=f"^sharedmem: .*{text}"):
            sm.Chunks(**fields)  # type: ignore[arg-type]
    for kwargs, text in [  # what a forward or an eager step has no use for
        ({"chunks": sm.Chunks(2, reduction="sum")}, "a forward has no loss to weigh"),
        ({"budget": 10, "chunks": sm.Chunks(exact=False)}, "only sm.pooled_train_step has"),
    ]:
        with pytest.raises(ValueError, match=f"^sharedmem: .*{text}"):
            sm.pooled_forward(mlp(0), pool=pool, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^sharedmem: exact=False .* fit_eager_step meets"):
        sm.fit_eager_step(mlp(0), F.mse_loss, budget=10, chunks=sm.Chunks(exact=False))
    with pytest.raises(ValueError, match=r"^sharedmem: fit_eager_step needs"):
        sm.fit_eager_step(mlp(0), F.mse_loss)
    with pytest.raises(TypeError, match=r"^sharedmem: model"):
        sm.fit_eager_step(object(), F.mse_loss, chunks=2)  # type: ignore[arg-type]
    step = sm.fit_eager_step(mlp(0), F.mse_loss, chunks=2)
    with pytest.raises(ValueError, match=r"^sharedmem: the inputs hold 8 examples .* targets 6"):
        step(torch.randn(8, 12), torch.randn(6, 5))
    with pytest.raises(ValueError, match=r"^sharedmem: to split a batch"):
        step(torch.randn(8, 12), torch.tensor(1.0))


# Recomputation before chunks (issue 24): where computing convolutions and matrix products
# again in backward fits the whole batch, the step computes exactly the unbudgeted step.


# The tests of deep_cnn's batch share its plans (cached below): on one xdist worker, so that
# each is made once in a run rather than once on each worker.
SHARES_THE_CNN_PLAN = pytest.mark.xdist_group("test_fit_deep_cnn")


def deep_cnn(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Conv2d(3, 16, 3, padding=1)]
    for _ in range(6):
        layers += [nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1)]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 5))


@SHARES_THE_CNN_PLAN
def test_a_budget_recomputation_meets_runs_the_whole_batch_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 3, 32, 32, generator=gen), torch.randn(32, 5, generator=gen)
    plain = sm.pooled_train_step(deep_cnn(0), F.mse_loss, pool=sm.BufferPool("cpu"))
    planned = plain.memory_plan(x, y)
    unchunked = planned.pooled_bytes + planned.beside_peak
    budget = int(unchunked * 0.8)
    pool = sm.BufferPool("cpu")
    fitted = sm.pooled_train_step(deep_cnn(0), F.mse_loss, pool=pool, budget=budget)
    assert fitted.chunks_for(x, y) == 1 and fitted.recomputing
    assert "computing convolutions and matrix products again" in fitted.report()
    expected, loss = plain(x, y), fitted(x, y)
    assert torch.equal(loss, expected)  # the same computation: batch norm saw the whole batch
    pairs = zip(plain.model.parameters(), fitted.model.parameters(), strict=True)
    assert all(torch.equal(a.grad, b.grad) for a, b in pairs)  # type: ignore[arg-type]
    fitted.model.zero_grad(set_to_none=True)
    held = allocator_peak(functools.partial(fitted, x, y)) + pool.stats()["reserved_bytes"]
    assert held <= budget, (held, budget)
    # Below what recomputation reaches, chunks as before.
    low = _cnn_low()
    assert low.budget == int(unchunked * 0.3)
    assert low.chunks_for(x, y) > 1 and not low.recomputing


def _cnn_batch() -> tuple[torch.Tensor, torch.Tensor, int]:
    """deep_cnn's batch of 32 (fresh tensors each call) and its unchunked plan's bytes."""
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 3, 32, 32, generator=gen), torch.randn(32, 5, generator=gen)
    return x, y, _cnn_unchunked()


@functools.cache
def _cnn_unchunked() -> int:
    # Planned once for the tests that share this batch (a trace and a plan each otherwise);
    # the default plan reads no cost constant a test patches (OP_CALL_FLOPS).
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 3, 32, 32, generator=gen), torch.randn(32, 5, generator=gen)
    planned = sm.pooled_train_step(deep_cnn(0), F.mse_loss, pool=sm.BufferPool("cpu"))
    plan = planned.memory_plan(x, y)
    return plan.pooled_bytes + plan.beside_peak


@functools.cache
def _cnn_low() -> Any:
    # The step under 30% of the unchunked plan, which recomputation cannot meet: chosen (a
    # search over recomputation and chunks) once for the two tests that read it, never run.
    return sm.pooled_train_step(
        deep_cnn(0), F.mse_loss, pool=sm.BufferPool("cpu"), budget=int(_cnn_unchunked() * 0.3)
    )


@SHARES_THE_CNN_PLAN
def test_where_recomputation_cannot_meet_a_budget_the_report_says_what_bounds_it() -> None:
    x, y, unchunked = _cnn_batch()
    budget = int(unchunked * 0.3)
    low = _cnn_low()
    assert low.budget == budget
    assert low.chunks_for(x, y) > 1 and not low.recomputing
    ((least, floor, op),) = low.unreached.values()
    assert budget < least and 0 < floor <= least
    # One figure for what recomputation reaches: the plan's own peak, as the estimate gives it.
    estimated = sm.estimate(deep_cnn(0), x, y, loss_fn=F.mse_loss).time_for_memory
    assert least == estimated[-1][1], (least, estimated)
    pool = sm.BufferPool("cpu")
    most = sm.pooled_train_step(deep_cnn(0), F.mse_loss, pool=pool, recompute=sm.Recompute.MOST)
    most_plan = most.memory_plan(x, y)  # planned before it runs: its trace serves the run
    assert least == planned_peak(most_plan) == most_plan.pooled_bytes + most_plan.beside_peak
    report = low.report()
    assert f"{least:,}" in report and f"{floor:,}" in report and op in report
    # The floor bounds what runs: the step recomputing as much as lowers its peak, measured.
    most(x, y)  # captured and planned outside the profiler (with it, 25 s of tracing recorded)
    most.model.zero_grad(set_to_none=True)
    held = allocator_peak(functools.partial(most, x, y)) + pool.stats()["reserved_bytes"]
    assert held >= floor, (held, floor)


@SHARES_THE_CNN_PLAN
def test_a_budget_takes_the_least_recomputation_that_fits() -> None:
    x, y, unchunked = _cnn_batch()
    budget = int(unchunked * 0.9)
    fitted = sm.pooled_train_step(deep_cnn(0), F.mse_loss, pool=sm.BufferPool("cpu"), budget=budget)
    assert fitted.chunks_for(x, y) == 1 and fitted.recomputing
    chosen = fitted.recompute.max_slowdown
    assert 1.0 < chosen < math.inf
    # Bisected over the levels, then between the two around it: a setting less by the last
    # step of that search (less recomputed) does not fit; the chosen one's cost is reported.
    levels = [v.max_slowdown for v in recompute_levels(None) if v != sm.Recompute.MOST]
    upper = min(v for v in levels if v >= chosen)
    below = max((v for v in levels if v < upper), default=1.0)
    assert below < chosen <= upper
    less = sm.Recompute(max(1.0, chosen - (upper - below) / 2**REFINE_STEPS))
    policy = fitted.budget_policy
    assert policy is not None and not policy._need(x, y, 1, False, less).fits(budget, None)  # type: ignore[attr-defined]
    fitted(x, y)
    summary = fitted.plan_summary()
    assert 0 < summary.recompute_cost <= chosen - 1
    assert "modelled" in str(summary) and "modelled" in fitted.report()


@SHARES_THE_CNN_PLAN
@pytest.mark.parametrize("per_call", [0.0, 1e12])
def test_exact_false_takes_whichever_of_chunks_and_recomputation_is_modelled_faster(
    per_call: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What a chunk adds is mostly the fixed cost of calling every op again: free, chunks
    # add only the weights read again; dear, they cost more than any recomputation.
    monkeypatch.setattr(cost, "OP_CALL_FLOPS", per_call)
    x, y, unchunked = _cnn_batch()
    budget = int(unchunked * 0.8)
    exact = sm.pooled_train_step(deep_cnn(0), F.mse_loss, pool=sm.BufferPool("cpu"), budget=budget)
    assert exact.chunks_for(x, y) == 1 and exact.recomputing and not exact.compared
    either = sm.pooled_train_step(
        deep_cnn(0),
        F.mse_loss,
        pool=sm.BufferPool("cpu"),
        budget=budget,
        chunks=sm.Chunks(exact=False),
    )
    chosen = either.chunks_for(x, y)
    ((label, (chunks, by_chunks, by_recomputing)),) = either.compared.items()
    assert chunks > 1 and by_recomputing > 0 and label in either.report()
    if per_call:
        assert by_chunks > by_recomputing and chosen == 1 and either.recomputing
    else:
        assert 0 <= by_chunks < by_recomputing and chosen == chunks and not either.recomputing
    loss = either(x, y)
    assert torch.isfinite(loss) and all(p.grad is not None for p in either.model.parameters())


@SHARES_THE_CNN_PLAN
def test_recompute_with_a_budget_caps_what_the_budget_may_choose() -> None:
    # One meaning: the most time recomputation may add. With a budget, the budget takes
    # the least recomputation that fits within it; Recompute.OFF gives no time: chunks.
    x, y, unchunked = _cnn_batch()
    budget = int(unchunked * 0.7)
    pool = sm.BufferPool("cpu")
    free = sm.pooled_train_step(deep_cnn(0), F.mse_loss, pool=pool, budget=budget)
    assert free.chunks_for(x, y) == 1 and free.recomputing
    chosen = free.recompute.max_slowdown
    capped = sm.pooled_train_step(
        deep_cnn(0),
        F.mse_loss,
        pool=sm.BufferPool("cpu"),
        budget=budget,
        recompute=sm.Recompute.OFF,
    )
    assert capped.chunks_for(x, y) > 1 and not capped.recomputing
    roomy = sm.pooled_train_step(
        deep_cnn(0),
        F.mse_loss,
        pool=sm.BufferPool("cpu"),
        budget=budget,
        recompute=sm.Recompute.within(chosen + 1.0),
    )
    assert roomy.chunks_for(x, y) == 1 and roomy.recompute == free.recompute


@SHARES_THE_CNN_PLAN
def test_recompute_within_gives_the_least_memory_within_it_bit_for_bit() -> None:
    x, y, unchunked = _cnn_batch()
    plain = sm.pooled_train_step(deep_cnn(0), F.mse_loss, pool=sm.BufferPool("cpu"))
    loss = plain(x, y)  # every step below starts from the same weights: one reference
    peaks = {}
    for slowdown in (1.05, 1.2, 1.5):
        step = sm.pooled_train_step(
            deep_cnn(0),
            F.mse_loss,
            pool=sm.BufferPool("cpu"),
            recompute=sm.Recompute.within(slowdown),
        )
        plan = step.memory_plan(x, y)
        peaks[slowdown] = plan.pooled_bytes + plan.beside_peak
        assert torch.equal(step(x, y), loss)
        pairs = zip(plain.model.parameters(), step.model.parameters(), strict=True)
        assert all(torch.equal(a.grad, b.grad) for a, b in pairs)  # type: ignore[arg-type]
        assert step.plan_summary().recompute_cost <= slowdown - 1
    assert unchunked > peaks[1.05] >= peaks[1.2] >= peaks[1.5], (unchunked, peaks)


@SHARES_THE_CNN_PLAN
def test_the_old_keywords_warn_once_with_the_new_spelling_and_do_the_same() -> None:
    # reduction=, batch_dim=, split=, exact= are sm.Chunks(...) now, max_slowdown= is
    # sm.Recompute.within(...): one DeprecationWarning per call names the call to write.
    x, y, _ = _cnn_batch()
    old_and_new: list[tuple[dict[str, Any], dict[str, Any], str]] = [
        (
            {"max_slowdown": 1.2},
            {"recompute": sm.Recompute.within(1.2)},
            r"pooled_train_step\(max_slowdown=1\.2\) is deprecated: pass "
            r"recompute=sm\.Recompute\.within\(1\.2\)$",
        ),
        (
            {"budget": 10**9, "max_slowdown": 1.0, "exact": False, "batch_dim": 0},
            {"budget": 10**9, "recompute": sm.Recompute.OFF, "chunks": sm.Chunks(exact=False)},
            r"pass chunks=sm\.Chunks\(exact=False, batch_dim=0\), "
            r"recompute=sm\.Recompute\.within\(1\.0\)$",
        ),
        (
            {"chunks": 2, "reduction": "sum"},
            {"chunks": sm.Chunks(2, reduction="sum")},
            r"pass chunks=sm\.Chunks\(2, reduction='sum'\)$",
        ),
        (  # as before, chunking settings without a budget or a count do nothing
            {"batch_dim": 1},
            {},
            r"with budget= or a count \(without either it does nothing: leave it out\)$",
        ),
    ]
    for old_kwargs, new_kwargs, said in old_and_new:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            old = sm.pooled_train_step(
                deep_cnn(0), F.mse_loss, pool=sm.BufferPool("cpu"), **old_kwargs
            )
        assert [w.category for w in caught] == [DeprecationWarning], caught
        message = str(caught[0].message)
        assert message.startswith("sharedmem: pooled_train_step(") and re.search(said, message)
        new = sm.pooled_train_step(deep_cnn(0), F.mse_loss, pool=sm.BufferPool("cpu"), **new_kwargs)
        assert old.recompute == new.recompute, old_kwargs
        assert old.chunks_for(x, y) == new.chunks_for(x, y), old_kwargs
        if old.budget_policy is None:
            assert new.budget_policy is None
            assert old.memory_plan(x, y) == new.memory_plan(x, y)
        else:
            assert new.budget_policy is not None
            for field in ("max_slowdown", "exact", "reduction", "fixed", "budget"):
                assert getattr(old.budget_policy, field) == getattr(new.budget_policy, field)
    with pytest.warns(DeprecationWarning, match=r"pass chunks=sm\.Chunks\(2, batch_dim=0\)$"):
        fwd = sm.pooled_forward(deep_cnn(0), pool=sm.BufferPool("cpu"), chunks=2, batch_dim=0)
    assert fwd.chunks_for(x) == 2
    with pytest.warns(DeprecationWarning, match=r"pass chunks=sm\.Chunks\(3, reduction='sum'\)$"):
        eager = sm.fit_eager_step(deep_cnn(0), F.mse_loss, chunks=3, reduction="sum")
    assert eager.chunks_for(x, y) == 3 and eager.reduction == "sum"
    # A bad old value is refused as its record refuses it; old and new together, and a
    # keyword that never was, are refused too.
    bad: list[tuple[dict[str, Any], type[Exception], str]] = [
        ({"max_slowdown": 0.9}, ValueError, "Recompute's max_slowdown must be at least 1.0"),
        ({"max_slowdown": "1.2"}, TypeError, "Recompute's max_slowdown must be a number"),
        ({"chunks": 2, "batch_dim": -1}, ValueError, "batch_dim must be an int"),
        ({"max_slowdown": 1.2, "recompute": sm.Recompute.MOST}, TypeError, "give one or"),
        ({"chunks": sm.Chunks(2, batch_dim=1), "reduction": "sum"}, TypeError, "inside"),
        ({"max_slowdwn": 1.2}, TypeError, "unexpected keyword argument 'max_slowdwn'"),
    ]
    for kwargs, error, text in bad:
        with pytest.raises(error, match=f"^sharedmem: .*{text}"), warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            sm.pooled_train_step(deep_cnn(0), F.mse_loss, pool=sm.BufferPool("cpu"), **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"recompute": 1.3}, TypeError, r"recompute must be a sharedmem\.Recompute"),
        ({"recompute": sm.Recompute.within(1.2), "chunks": 2}, ValueError, "nothing is chosen"),
        (
            {"recompute": sm.Recompute.MOST, "chunks": sm.Chunks(2, batch_dim=0)},
            ValueError,
            "give budget= instead of a count",
        ),
    ],
)
def test_a_bad_recompute_is_refused(kwargs: dict[str, object], error: type, match: str) -> None:
    with pytest.raises(error, match=f"^sharedmem: .*{match}"):
        sm.pooled_train_step(deep_cnn(0), F.mse_loss, pool=sm.BufferPool("cpu"), **kwargs)  # type: ignore[arg-type]


def test_recompute_is_a_record_that_says_one_thing() -> None:
    assert sm.Recompute() == sm.Recompute.OFF and not sm.Recompute.OFF.costly
    assert sm.Recompute.within(1.3) == sm.Recompute(1.3) != sm.Recompute.MOST
    # Up to the step's own time again (2.0) and as much as lowers the peak are two keys.
    assert len({sm.Recompute(2.0), sm.Recompute.MOST, sm.Recompute.adding(True)}) == 2
    for bad, error in (("1.3", TypeError), (True, TypeError), (0.9, ValueError)):
        with pytest.raises(error, match=r"^sharedmem: Recompute's max_slowdown"):
            sm.Recompute(bad)  # type: ignore[arg-type]


@SHARES_THE_CNN_PLAN
def test_recomputing_up_to_the_whole_step_and_as_much_as_lowers_the_peak_are_two_plans() -> None:
    # Up to +100% (max_slowdown 2.0) and as much as lowers the peak: two graphs, not one.
    x, y, _ = _cnn_batch()
    step = sm.pooled_train_step(deep_cnn(0), F.mse_loss, pool=sm.BufferPool("cpu"))
    for setting in (sm.Recompute(2.0), sm.Recompute.MOST):
        step.model.zero_grad(set_to_none=True)  # the same signature, gradients and all
        step._call(x, y, setting)
    assert len(step.plan_summaries()) == 2
