"""FSDP2 (``fully_shard``) on gloo ranks spawned here: the sharded estimate against what runs,
and the pooled step against eager FSDP2 on 4 ranks (2 and 3: tests/test_distributed.py).

Each world size is spawned once, for this file and tests/test_distributed.py together
(tests/worlds.py), and runs every case; each rank records per case ``None`` or the traceback.
A rank that does not end in time is killed and the test fails naming it: a distributed test
never hangs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import worlds
from torch import nn
from worlds import Ranks

import sharedmem as sm
from sharedmem.testing import raw_allocator_peak as allocator_peak

pytestmark = pytest.mark.xdist_group("distributed")

# Every world size the cases run on (2 and 4 ranks) is spawned once, with test_distributed's
# cases of that size (tests/worlds.py).
FSDP_WORLDS = (2, 4)


def case(*sizes: int) -> Callable[[worlds.Case], worlds.Case]:
    """A case, run on the world sizes ``sizes`` (both of ``FSDP_WORLDS`` where none is given)."""
    return worlds.case(*(sizes or FSDP_WORLDS))


def _uneven() -> nn.Module:
    model = nn.Sequential(
        nn.Linear(33, 301), nn.ReLU(), nn.Linear(301, 7), nn.LayerNorm(7), nn.Linear(7, 5)
    )
    model[3].requires_grad_(False)  # a frozen unit: gathered, never reduced
    model[2].bias.requires_grad_(False)  # a frozen parameter beside a trainable one
    return model


def _models() -> dict[str, tuple[Callable[[], nn.Module], Callable[[], tuple[torch.Tensor, ...]]]]:
    # An MLP whose middle layer dominates (the all-gather and reduce-scatter buffers set the
    # peak), one whose first dimensions the world size does not divide (padded shards and
    # padded gradient copies) with frozen parameters, a conv net with batch-norm buffers (not
    # sharded) whose activations set the peak.
    return {
        "mlp": (
            lambda: nn.Sequential(
                nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 512), nn.Tanh(), nn.Linear(512, 10)
            ),
            lambda: (torch.randn(32, 64), torch.randn(32, 10)),
        ),
        "uneven": (_uneven, lambda: (torch.randn(16, 33), torch.randn(16, 5))),
        "conv": (
            lambda: nn.Sequential(
                nn.Conv2d(3, 16, 3, padding=1),
                nn.BatchNorm2d(16),
                nn.ReLU(),
                nn.Conv2d(16, 32, 3, padding=1),
                nn.ReLU(),
                nn.AdaptiveAvgPool2d(1),
                nn.Flatten(),
                nn.Linear(32, 4),
            ),
            lambda: (torch.randn(8, 3, 16, 16), torch.randn(8, 4)),
        ),
    }


def _storages(tensors: list[torch.Tensor]) -> int:
    seen = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors}
    return sum(seen.values())


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t  # type: ignore[no-any-return]


@case()
def sharded_estimate_bounds_the_measured_peak(rank: int, world: int) -> None:
    # sm.estimate(world_size=N) before sharding, then the same model sharded as it assumes
    # (each child with parameters, then the root) and trained with Adam: the step's own peak
    # (forward, backward and the optimizer's step from no .grad, its state made) measured by
    # the allocator's events is within the documented bounds (1% under, 3% over), and the
    # bytes held across steps are what it says on rank 0 (the largest shards) and at most that
    # elsewhere. The least of nine steps: a buffer whose last reference is gloo's (a copy it
    # made, the work it holds) dies when gloo's worker thread drops it, at a time of its own,
    # so about two steps in five measure more, by one unit's bytes or so (seen: up to 36%).
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    problems: list[str] = []
    for name, (make, data) in _models().items():
        torch.manual_seed(0)
        model = make()
        torch.manual_seed(rank)  # every rank its own batch
        x, y = data()
        est = sm.estimate(
            model, x, y, loss_fn=nn.functional.mse_loss,
            optimizer=torch.optim.Adam(model.parameters()), world_size=world,
            measure_kernels=True,
        )  # fmt: skip
        sharded = est.sharded
        assert sharded is not None
        for unit in sharded.units[:-1]:
            fully_shard(model.get_submodule(unit), mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.Adam(model.parameters())

        def step(
            model: nn.Module = model,
            x: torch.Tensor = x,
            y: torch.Tensor = y,
            opt: torch.optim.Optimizer = opt,
        ) -> None:
            out = model(x)  # held through backward, as the estimate assumes
            nn.functional.mse_loss(out, y).backward()
            del out
            opt.step()

        for _ in range(2):  # FSDP2's lazy init, the optimizer's state
            opt.zero_grad()
            step()
        peaks = []
        for _ in range(9):
            opt.zero_grad()
            peaks.append(allocator_peak(step))
        measured = min(peaks)
        held = {
            "parameters": _storages([_local(p) for p in model.parameters()])
            + _storages(list(model.buffers())),
            "gradients": _storages(
                [_local(p.grad) for p in model.parameters() if p.grad is not None]
            ),
            "optimizer_state": _storages(
                [_local(v) for state in opt.state.values() for v in state.values()]
            ),
        }
        said = f"{name}, rank {rank} of {world}: estimated {sharded.step_peak:,}, measured {peaks}"
        if not 0.99 * measured <= sharded.step_peak <= 1.03 * measured:
            problems.append(f"{said}: outside the documented bounds")
        for key, nbytes in held.items():
            if nbytes > sharded.train_bytes[key] or (
                rank == 0 and nbytes != sharded.train_bytes[key]
            ):
                problems.append(f"{said}: {key} {nbytes:,} held, {sharded.train_bytes[key]:,} said")
    assert not problems, "\n".join(problems)


@case(4)
def pooled_fsdp2_equals_eager_on_four_ranks(rank: int, world: int) -> None:
    # The case tests/test_distributed.py runs on 2 and 3 ranks: the eager FSDP2 step inside
    # pool.step(), the model prepared by sm.prepare_fsdp, gives eager FSDP2's losses and full
    # gradients bit for bit over several steps (reshard_after_forward True and False,
    # accumulation), and every call after a block's first follows its plan.
    import test_distributed

    test_distributed.FSDP_STEPS = 4  # four ranks on two cores: fewer steps than there
    test_distributed.pool_step_around_eager_fsdp2_matches_it(rank, world)


class _Block(nn.Sequential):
    def __init__(self, width: int, inner: int) -> None:
        super().__init__(nn.Linear(width, inner), nn.Tanh(), nn.Linear(inner, width))


def _blocks(
    mesh: object,
    reshard: bool = True,
    *,
    blocks: int = 2,
    inner: int = 256,
    bf16: bool = False,
) -> nn.Module:
    # Blocks whose inner activations a checkpoint drops, a head; each block and the head a
    # unit, then the root. ``bf16``: FSDP2's mixed precision (bf16 compute, fp32 reduction).
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*(_Block(32, inner) for _ in range(blocks)), nn.Linear(32, 4))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    shard: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard}
    if bf16:
        shard["mp_policy"] = policy
    for layer in model:
        fully_shard(layer, **shard)
    fully_shard(model, **shard)
    return model


def _eager_chunks(model: nn.Module, x: torch.Tensor, y: torch.Tensor, chunks: int) -> torch.Tensor:
    """Eager FSDP2 in ``chunks`` micro-batches: each loss weighted by its share of the batch,
    gradient sync on the last only; the batch's loss."""
    total = torch.zeros(())
    n = x.shape[0]
    for k, (xs, ys) in enumerate(zip(x.tensor_split(chunks), y.tensor_split(chunks), strict=True)):
        model.set_requires_gradient_sync(k == chunks - 1)  # type: ignore[operator]
        loss = nn.functional.mse_loss(model(xs), ys)
        if chunks > 1:
            loss = loss * (xs.shape[0] / n)
        loss.backward()
        total = loss.detach() if k == 0 else total + loss.detach()
    return total


def _grads_differ(eager: nn.Module, pooled: nn.Module, when: str) -> list[str]:
    return [
        f"{when}: {name}.grad differs from eager FSDP2's"
        for (name, a), b in zip(eager.named_parameters(), pooled.parameters(), strict=True)
        if not torch.equal(a.grad.full_tensor(), b.grad.full_tensor())  # a collective
    ]


STEP_CALLS = 3


@case()
def pooled_train_step_on_fsdp2_equals_eager(rank: int, world: int) -> None:
    # sm.pooled_train_step on a model sharded per layer and at the root: eager FSDP2's loss and
    # full gradients bit for bit over several steps, reshard_after_forward True and False,
    # gradient accumulation by the user (set_requires_gradient_sync(False) on the first of two
    # micro-batches), a fixed chunk count (against eager FSDP2 in the same chunks: one
    # reduce-scatter per step), and FSDP2's mixed precision (bf16 compute, fp32 reduction).
    # Every call after the first of a signature follows its plan.
    # Problems are collected: a rank stopping early would leave the others in a collective.
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    problems: list[str] = []
    cases = ((True, 1, 1, False), (False, 2, 1, False), (True, 1, 2, False), (True, 1, 1, True))
    for reshard, micro, chunks, bf16 in cases:
        eager, pooled = _blocks(mesh, reshard, bf16=bf16), _blocks(mesh, reshard, bf16=bf16)
        pool = sm.BufferPool("cpu")
        kwargs = {"chunks": chunks} if chunks > 1 else {}
        step = sm.pooled_train_step(pooled, nn.functional.mse_loss, pool=pool, **kwargs)
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, pooled)]
        for i in range(STEP_CALLS):
            when = f"reshard={reshard} micro-batches={micro} chunks={chunks} bf16={bf16} step {i}"
            for opt in opts:
                opt.zero_grad()
            for k in range(micro):
                torch.manual_seed(1000 * rank + 10 * i + k)  # every rank its own batch
                x, y = torch.randn(16, 32), torch.randn(16, 4)
                expected = _eager_chunks(eager, x, y, chunks) if micro == 1 else None
                if expected is None:  # the user's own accumulation, on both sides
                    for m in (eager, pooled):
                        m.set_requires_gradient_sync(k == micro - 1)  # type: ignore[operator]
                    expected = nn.functional.mse_loss(eager(x), y)
                    expected.backward()
                    expected = expected.detach()
                loss = step(x, y)
                if not torch.equal(loss, expected):
                    problems.append(f"{when}: the loss of micro-batch {k} differs")
            problems += _grads_differ(eager, pooled, when)
            for opt in opts:
                opt.step()
        stats, last = pool.stats(), step.last_call
        if stats.get("diverged_calls", 0) or not stats.get("arena_served_bytes"):
            problems.append(f"reshard={reshard} chunks={chunks}: {stats}")
        if last is None or last.chunks != chunks or "checked against its plan" not in last.measured:
            problems.append(f"chunks={chunks}: the latest call's figures: {last}")
    assert not problems, "\n".join(problems)


@case(2)
def pooled_fsdp2_step_peaks_at_eager_fsdp2s(rank: int, world: int) -> None:
    # sm.pooled_train_step on an FSDP2 model: from its third call on, every step replays its
    # plan and its per-rank peak (allocator events of every thread plus the pool's bytes,
    # DESIGN section 8) is at most eager FSDP2's lowest plus the arena's page rounding. Gloo's
    # own all-gather and reduce-scatter copy their buffers on its worker thread at times of
    # its own (eager's steps read up to 1.5x its lowest); sm.prepare_fsdp's collectives make
    # no copy, so the pooled figure is the same every step (it read 1.23x-1.46x with them).
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    eager, pooled = _blocks(mesh), _blocks(mesh)
    pool = sm.BufferPool("cpu")
    step = sm.pooled_train_step(pooled, nn.functional.mse_loss, pool=pool)
    eager_peaks, pooled_peaks = [], []
    for i in range(STEP_CALLS + 3):
        torch.manual_seed(1000 * rank + 10 * i)
        x, y = torch.randn(16, 32), torch.randn(16, 4)
        eager.zero_grad()
        pooled.zero_grad()

        def eager_step(x: torch.Tensor = x, y: torch.Tensor = y) -> None:
            nn.functional.mse_loss(eager(x), y).backward()

        eager_peaks.append(allocator_peak(eager_step))
        peak = allocator_peak(lambda x=x, y=y: step(x, y))
        if i >= 2:  # recorded, then planned
            pooled_peaks.append(peak + pool.stats()["reserved_bytes"])
    stats = pool.stats()
    assert not stats.get("diverged_calls") and stats["recorded_calls"] == 1, stats
    assert max(pooled_peaks) <= min(eager_peaks) + pool.granularity, (pooled_peaks, eager_peaks)


@case(2, 4)
def compile_backend_on_fsdp2_equals_eager(rank: int, world: int) -> None:
    # torch.compile with the pool's backend on an FSDP2 model, compiled the way torchtitan
    # compiles one: each block its own torch.compile, then fully_shard on each and at the root
    # (FSDP2's hooks run eagerly between the compiled blocks), then sm.prepare_fsdp and the
    # backend's steps_from(model). Eager FSDP2's loss and full gradients bit for bit over
    # several steps; the first call (compiling) is not the steady sequence, the second records
    # it and every later one replays its plan (none recorded again, none leaving it: what
    # compiling allocates inside the step's span is set aside, PyTorch's; recorded with the
    # step, the second call left the plan at twice eager's peak, the third recorded again, and
    # only the fourth replayed); and every
    # step's per-rank peak, the first included (allocator events of every thread plus the
    # pool's bytes, DESIGN section 8), at most eager FSDP2's plus the arena's page rounding.
    # Without steps_from the first block's all-gather output sits beside the
    # arena: 1.53x. Eager's figure is its lowest over the run: gloo's worker thread gathers
    # into a copy of its own at times of its own (eager's steps read up to 1.53x of it); the
    # pooled step's collectives make none (sm.prepare_fsdp), so its figure is the same every
    # step.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from sharedmem._compile import compile_backend

    mesh = init_device_mesh("cpu", (world,))
    pool = sm.BufferPool("cpu")
    backend = compile_backend(pool)
    eager = _blocks(mesh)
    torch.manual_seed(0)
    pooled = nn.Sequential(*(_Block(32, 256) for _ in range(2)), nn.Linear(32, 4))
    for i in range(len(pooled)):
        pooled[i] = torch.compile(pooled[i], backend=backend)
        fully_shard(pooled[i], mesh=mesh)
    fully_shard(pooled, mesh=mesh)
    sm.prepare_fsdp(pooled)
    backend.steps_from(pooled)  # the span opens before FSDP2 gathers the first block
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, pooled)]
    problems: list[str] = []
    eager_peaks, pooled_peaks = [], []
    steady = 2  # the first call (compiling) and the second recorded, the third replays
    for i in range(STEP_CALLS + 5):
        torch.manual_seed(1000 * rank + 10 * i)
        x, y = torch.randn(16, 32), torch.randn(16, 4)
        losses, peaks = [], []
        if i == steady:
            counts = {k: pool.stats().get(k, 0) for k in ("recorded_calls", "diverged_calls")}
            if counts != {"recorded_calls": 2, "diverged_calls": 0}:
                problems.append(f"the first two calls were not recorded once each: {counts}")
        for m, opt in zip((eager, pooled), opts, strict=True):
            opt.zero_grad()

            def step(
                m: nn.Module = m, x: torch.Tensor = x, y: torch.Tensor = y, out: list = losses
            ) -> None:
                loss = nn.functional.mse_loss(m(x), y)
                loss.backward()
                out.append(loss.detach())

            peaks.append(allocator_peak(step))
        eager_peaks.append(peaks[0])
        pooled_peaks.append(peaks[1] + pool.stats()["reserved_bytes"])
        if not torch.equal(*losses):
            problems.append(f"step {i}: the loss differs")
        problems += _grads_differ(eager, pooled, f"step {i}")
        for opt in opts:
            opt.step()
    stats = pool.stats()
    if not stats.get("arena_served_bytes"):
        problems.append(f"nothing served from the arena: {stats}")
    if any(stats.get(k, 0) != n for k, n in counts.items()):
        problems.append(f"a step after the first was recorded again or left its plan: {stats}")
    if max(pooled_peaks) > min(eager_peaks) + pool.granularity:
        problems.append(
            f"per-rank peaks {pooled_peaks} above eager FSDP2's {min(eager_peaks)} "
            f"(its steps: {eager_peaks})"
        )
    assert not problems, "\n".join(problems)


@case(2)
def fsdp2_budget_checkpoints_units_and_holds(rank: int, world: int) -> None:
    # A budget between the sharded estimates of the step with its blocks' forwards
    # checkpointed and of the least chunk count: no chunk count reaches it, so the step
    # checkpoints the leaf units, in one chunk; its results equal eager FSDP2's
    # (without checkpointing: the same ops on the same values) and its measured per-rank peak
    # holds the budget. A budget below every choice is refused before running.
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    # Four blocks: chunks keep every unit's unsharded gradient (as big as the parameters)
    # between them, more than checkpointing keeps of one block's activations.
    eager, pooled = _blocks(mesh, blocks=4, inner=512), _blocks(mesh, blocks=4, inner=512)
    torch.manual_seed(rank)
    x, y = torch.randn(64, 32), torch.randn(64, 4)
    pool = sm.BufferPool("cpu")
    probe = sm.pooled_train_step(pooled, nn.functional.mse_loss, pool=pool, budget=1)
    policy = probe.budget_policy
    assert policy is not None
    leaves = ("0", "1", "2", "3", "4")
    checkpointed = policy.estimate(x, y, 1, leaves)
    chunked = min(policy.estimate(x, y, n, ()) for n in (1, 2, 4, 8, 16, 32, 64))
    assert checkpointed < chunked, (checkpointed, chunked)
    with pytest.raises(sm.OutOfMemoryError, match=r"^sharedmem: out of memory .* FSDP2"):
        probe(x, y)  # refused before running: no collective started
    assert all(p.grad is None for p in pooled.parameters())
    budget = (checkpointed + chunked) // 2
    step = sm.pooled_train_step(pooled, nn.functional.mse_loss, pool=pool, budget=budget)
    problems: list[str] = []
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, pooled)]
    for i in range(STEP_CALLS):
        for opt in opts:
            opt.zero_grad()
        expected = _eager_chunks(eager, x, y, 1)
        loss = step(x, y)
        if not torch.equal(loss, expected):
            problems.append(f"step {i}: the loss differs")
        problems += _grads_differ(eager, pooled, f"step {i}")
        last = step.last_call
        if step.checkpointed != leaves or last is None or last.chunks != 1:
            problems.append(f"step {i}: chose {step.last_choice}")
        elif i and not last.held_budget:
            problems.append(f"step {i}: {last.describe()}")
        for opt in opts:
            opt.step()
    report = step.report()
    if "checkpointed FSDP units" not in report or "held its budget" not in report:
        problems.append(report)
    assert not problems, "\n".join(problems)


@case(2)
def fsdp2_step_refuses_what_it_cannot_honour(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    layers = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    fully_shard(layers[0], mesh=mesh)  # the root left unsharded
    refused: list[tuple[nn.Module, dict[str, object], str]] = [
        (layers, {}, "fully_shard applied to the model itself"),
        (_blocks(mesh), {"recompute": sm.Recompute.MOST}, "give budget="),
        (_blocks(mesh), {"plan": "per_node"}, "leave plan= out"),
    ]
    for model, kwargs, alternative in refused:
        with pytest.raises((TypeError, ValueError), match=r"^sharedmem: ") as error:
            sm.pooled_train_step(model, nn.functional.mse_loss, pool=sm.BufferPool(), **kwargs)
        assert alternative in str(error.value), str(error.value)


@case()
def estimate_refuses_a_sharded_model(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = fully_shard(nn.Linear(4, 4), mesh=init_device_mesh("cpu", (world,)))
    with pytest.raises(TypeError, match=r"^sharedmem: estimate a model before fully_shard"):
        sm.estimate(model, torch.randn(2, 4), world_size=world)


@pytest.fixture(scope="module")
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Ranks:
    return worlds.ranks(request.param, tmp_path_factory, request.session)


_check = worlds.check


FOUR = pytest.param(4, marks=pytest.mark.slow, id="4-ranks")


@pytest.mark.timeout(worlds.TIMEOUT_S)  # the worlds' ranks on 2 shared cores: minutes
@pytest.mark.parametrize("ranks", [pytest.param(2, id="2-ranks"), FOUR], indirect=True)
def test_sharded_estimate_bounds_the_measured_per_rank_peak(ranks: Ranks) -> None:
    _check(ranks, "sharded_estimate_bounds_the_measured_peak")


@pytest.mark.timeout(worlds.TIMEOUT_S)
@pytest.mark.parametrize("ranks", [FOUR], indirect=True)
def test_pooled_fsdp2_step_equals_eager_fsdp2_on_four_ranks(ranks: Ranks) -> None:
    _check(ranks, "pooled_fsdp2_equals_eager_on_four_ranks")


@pytest.mark.timeout(worlds.TIMEOUT_S)
@pytest.mark.parametrize("ranks", [pytest.param(2, id="2-ranks"), FOUR], indirect=True)
def test_pooled_train_step_on_fsdp2_equals_eager_fsdp2(ranks: Ranks) -> None:
    _check(ranks, "pooled_train_step_on_fsdp2_equals_eager")


@pytest.mark.timeout(worlds.TIMEOUT_S)
@pytest.mark.parametrize("ranks", [pytest.param(2, id="2-ranks")], indirect=True)
def test_a_pooled_fsdp2_step_peaks_at_eager_fsdp2s(ranks: Ranks) -> None:
    _check(ranks, "pooled_fsdp2_step_peaks_at_eager_fsdp2s")


@pytest.mark.timeout(worlds.TIMEOUT_S)
@pytest.mark.parametrize("ranks", [pytest.param(2, id="2-ranks"), FOUR], indirect=True)
def test_the_compile_backend_on_an_fsdp2_model_equals_eager_fsdp2(ranks: Ranks) -> None:
    _check(ranks, "compile_backend_on_fsdp2_equals_eager")


@pytest.mark.timeout(worlds.TIMEOUT_S)
@pytest.mark.parametrize("ranks", [pytest.param(2, id="2-ranks")], indirect=True)
def test_a_budget_on_an_fsdp2_step_checkpoints_units_and_holds(ranks: Ranks) -> None:
    _check(ranks, "fsdp2_budget_checkpoints_units_and_holds")


@pytest.mark.timeout(worlds.TIMEOUT_S)
@pytest.mark.parametrize("ranks", [pytest.param(2, id="2-ranks")], indirect=True)
def test_an_fsdp2_step_refuses_what_it_cannot_honour_naming_the_way(ranks: Ranks) -> None:
    _check(ranks, "fsdp2_step_refuses_what_it_cannot_honour")


@pytest.mark.timeout(worlds.TIMEOUT_S)
@pytest.mark.parametrize("ranks", [pytest.param(2, id="2-ranks")], indirect=True)
def test_the_estimate_refuses_a_model_already_sharded(ranks: Ranks) -> None:
    _check(ranks, "estimate_refuses_a_sharded_model")


class _Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([nn.Linear(16, 16) for _ in range(3)])
        self.head = nn.Linear(16, 2)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = self.act(block(x))
        return self.head(x)  # type: ignore[no-any-return]


def test_units_default_to_children_and_blocks_and_are_the_users_to_choose() -> None:
    model, x = _Blocks(), torch.randn(4, 8)
    est = sm.estimate(model, x, world_size=2)
    assert est.sharded is not None
    assert est.sharded.units == ("embed", "blocks.0", "blocks.1", "blocks.2", "head", "")
    assert est.sharded.largest_unit == "blocks.0"  # the first of the largest
    # The blocks and the head left to the root: gathered from its forward to its backward's end.
    whole = sm.estimate(model, x, world_size=2, fsdp_units=["embed"])
    assert whole.sharded is not None and whole.sharded.units == ("embed", "")
    assert whole.sharded.largest_unit == ""
    assert whole.sharded.gathered_bytes > est.sharded.gathered_bytes
    assert sm.estimate(model, x).sharded is None
    report = est.report()
    assert "sharded with fully_shard over 2 ranks" in report and "'blocks.0' unsharded" in report


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"world_size": 0}, ValueError, "world_size must be a positive int"),
        ({"world_size": True}, ValueError, "world_size must be a positive int"),
        ({"fsdp_units": ["blocks"]}, ValueError, "fsdp_units needs world_size="),
        ({"world_size": 2, "fsdp_units": ["nope"]}, ValueError, "names no module"),
        ({"world_size": 2, "fsdp_units": "blocks"}, TypeError, "list of module paths"),
        ({"world_size": 2, "fsdp_units": ["blocks"]}, ValueError, "name its items"),
    ],
)
def test_bad_sharding_arguments_are_refused_naming_the_fix(
    kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match="^sharedmem: .*" + match):
        sm.estimate(_Blocks(), torch.randn(4, 8), **kwargs)  # type: ignore[arg-type]


def test_the_estimate_command_gives_one_ranks_figures_under_fsdp2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from sharedmem._cli import main

    args = ["estimate", "torch.nn:Linear", "--arg", "16", "--arg", "4", "--input", "8x16"]
    assert main([*args, "--world-size", "2"]) == 0
    assert "sharded with fully_shard over 2 ranks" in capsys.readouterr().out
    assert main([*args, "--world-size", "0"]) == 2
    assert "world_size must be a positive int" in capsys.readouterr().err
