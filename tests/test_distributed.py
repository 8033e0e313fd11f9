"""Pooled steps under torch.distributed: gloo ranks on CPU, spawned here, against eager DDP.

Spawning ranks costs seconds, so the ranks are spawned once, for every world size of this
file and tests/test_fsdp.py together (tests/worlds.py), and run every case; each rank records
per case ``None`` or the traceback, and each test below reads its case's record from every
rank. The ranks see different data, so a gradient that was not averaged, or averaged in
another order, differs from eager DDP's.
"""

from __future__ import annotations

import copy
import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import worlds
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from worlds import Ranks

import sharedmem as sm
from sharedmem._executor.fsdp import param_groups

# The ranks are spawned once for every world size (tests/worlds.py): every test of this file
# and of test_fsdp in one pytest-xdist worker, so that they are not spawned again in the other.
# The first test waits for every world (test_fsdp's cases too): as test_fsdp's, a timeout past
# the worlds' (worlds.RANK_SECONDS each), after which the ranks are killed and the test fails.
pytestmark = [pytest.mark.xdist_group("distributed"), pytest.mark.timeout(worlds.TIMEOUT_S)]

# Every case runs on 2 and 3 ranks, in the worlds test_fsdp's cases share (tests/worlds.py).
case = worlds.case(2, 3)


def _mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(24, 64), nn.Tanh(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 4)
    )


def _conv_bn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )


def _batch(model: nn.Module, rank: int, step: int, batch: int = 8) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1000 * rank + step)  # different data on every rank
    conv = any(isinstance(m, nn.Conv2d) for m in model.modules())
    shape = (batch, 3, 8, 8) if conv else (batch, 24)
    return torch.randn(*shape, generator=g), torch.randn(batch, 4, generator=g)


def _pair(
    make: Callable[[], nn.Module], **ddp_kwargs: object
) -> tuple[DDP, DDP, sm.BufferPool, sm._executor.PooledTrainStep]:
    torch.manual_seed(0)
    model = make()
    eager = DDP(copy.deepcopy(model), **ddp_kwargs)  # type: ignore[arg-type]
    pooled = DDP(model, **ddp_kwargs)  # type: ignore[arg-type]
    pool = sm.BufferPool("cpu")
    step = sm.pooled_train_step(pooled, nn.functional.mse_loss, pool=pool)
    return eager, pooled, pool, step


def _same_grads(eager: nn.Module, pooled: nn.Module, when: str) -> None:
    for (name, a), b in zip(eager.named_parameters(), pooled.parameters(), strict=True):
        assert (a.grad is None) == (b.grad is None), f"{when}: {name}.grad presence differs"
        if a.grad is not None:
            assert b.grad is not None
            assert torch.equal(a.grad, b.grad), f"{when}: {name}.grad differs from eager DDP's"


def _same_state(eager: nn.Module, pooled: nn.Module, when: str) -> None:
    for (name, a), b in zip(eager.state_dict().items(), pooled.state_dict().values(), strict=True):
        assert torch.equal(a, b), f"{when}: {name} differs from eager DDP's"


@case
def matches_eager_ddp(rank: int, world: int) -> None:
    # An MLP in one bucket, a conv net whose batch-norm buffers DDP broadcasts from rank 0,
    # and the MLP in many small buckets (the first one smaller, as DDP makes it).
    settings: list[tuple[Callable[[], nn.Module], dict[str, object]]] = [
        (_mlp, {}),
        (_conv_bn, {}),
        (_mlp, {"bucket_cap_mb": 0.004}),
        (_mlp, {"find_unused_parameters": True}),  # never rebuilds its buckets
        (_mlp, {"static_graph": True}),
    ]
    for make, kwargs in settings:
        eager, pooled, _, step = _pair(make, **kwargs)
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, pooled)]
        for i in range(4):  # the buckets are rebuilt after the first step, as DDP does
            x, y = _batch(eager, rank, i)
            for opt in opts:
                opt.zero_grad()
            expected = nn.functional.mse_loss(eager(x), y)
            expected.backward()
            loss = step(x, y)
            when = f"{make.__name__} {kwargs} step {i}"
            assert torch.equal(loss, expected.detach()), f"{when}: the loss differs"
            _same_grads(eager, pooled, when)
            for opt in opts:
                opt.step()
            _same_state(eager, pooled, when)
        # The all-reduce of a bucket starts inside the graph, right where its last gradient
        # is final: one call per gradient in the generated code.
        n_params = sum(1 for _ in pooled.parameters())
        assert step.source().count("_ready(") == n_params


@case
def no_sync_accumulates_locally(rank: int, world: int) -> None:
    eager, pooled, _, step = _pair(_mlp)
    for i in range(6):  # two accumulation cycles of three micro-batches
        x, y = _batch(eager, rank, i)
        last = i % 3 == 2
        contexts = [(m.no_sync() if not last else _nothing()) for m in (eager, pooled)]
        with contexts[0]:
            nn.functional.mse_loss(eager(x), y).backward()
        with contexts[1]:
            step(x, y)
        _same_grads(eager, pooled, f"micro-batch {i} ({'synced' if last else 'no_sync'})")
        if last:
            for m in (eager, pooled):
                m.zero_grad()


@case
def chunks_all_reduce_once_per_step(rank: int, world: int) -> None:
    # A budgeted step in chunks: the chunks before the last under no_sync(), the last
    # all-reducing the sum, as DDP's own accumulation over micro-batches does by hand.
    from sharedmem._executor import distributed

    torch.manual_seed(0)
    model = _mlp()
    eager = DDP(copy.deepcopy(model))
    pooled = DDP(model)
    step = sm.pooled_train_step(pooled, nn.functional.mse_loss, pool=sm.BufferPool("cpu"), chunks=3)
    # The eager fitted step too: DDP's reducer all-reduces in C++, counted by a comm hook.
    fitted = DDP(copy.deepcopy(model))
    hooked: list[int] = []

    # No annotations: DDP compares them with its classes, and this file's are strings.
    def hook(state, bucket):  # type: ignore[no-untyped-def]
        hooked.append(1)
        return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]

    fitted.register_comm_hook(None, hook)
    fit = sm.fit_step(fitted, nn.functional.mse_loss, chunks=3)
    calls: list[int] = []
    reduce = distributed.dist.all_reduce

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return reduce(*args, **kwargs)  # type: ignore[arg-type]

    distributed.dist.all_reduce = counted  # type: ignore[assignment]
    try:
        for i in range(3):
            x, y = _batch(eager, rank, i, batch=9)
            for m in (eager, pooled, fitted):
                m.zero_grad(set_to_none=True)
            for k, (cx, cy) in enumerate(zip(x.chunk(3), y.chunk(3), strict=True)):
                with eager.no_sync() if k < 2 else _nothing():
                    (nn.functional.mse_loss(eager(cx), cy) / 3).backward()
            before = len(calls)
            step(x, y)
            # The MLP's gradients fill one bucket: one all-reduce per step, not one per chunk.
            assert len(calls) - before == 1, f"step {i}: {len(calls) - before} all-reduces"
            before = len(hooked)
            fit(x, y)
            assert len(hooked) - before == 1, f"fit_step {i}: {len(hooked) - before} all-reduces"
            for other in (pooled, fitted):
                pairs = zip(eager.named_parameters(), other.parameters(), strict=True)
                for (name, a), b in pairs:
                    assert a.grad is not None and b.grad is not None
                    assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7), name
    finally:
        distributed.dist.all_reduce = reduce


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@case
def evaluation_adds_nothing(rank: int, world: int) -> None:
    _, pooled, pool, step = _pair(_conv_bn)
    for i in range(2):
        pooled.zero_grad()
        step(*_batch(pooled, rank, i, batch=16))
    before = pool.stats()["reserved_bytes"]
    # The buckets live in the pool, in one buffer of the parameters' bytes (16-byte aligned).
    nbytes = sum(-(-p.numel() * p.element_size() // 16) * 16 for p in pooled.parameters())
    assert pool.blob("act.ddp.buckets").data_memory.size == nbytes
    fwd = sm.pooled_forward(pooled.eval(), pool=pool)
    with torch.no_grad():
        for batch in (16, 4):
            x, _ = _batch(pooled, rank, 9, batch=batch)
            assert torch.equal(fwd(x), pooled(x))
    assert pool.stats()["reserved_bytes"] == before, f"rank {rank}: evaluation grew the pool"


@case
def estimate_is_per_rank(rank: int, world: int) -> None:
    model = _mlp()
    x, y = _batch(model, rank, 0)
    alone = sm.estimate(model, x, y, loss_fn=nn.functional.mse_loss)
    wrapped = sm.estimate(DDP(model), x, y, loss_fn=nn.functional.mse_loss)
    buckets = sum(p.numel() * p.element_size() for p in model.parameters())
    assert wrapped.train_peak_eager == alone.train_peak_eager + buckets
    assert wrapped.train_peak_pooled == alone.train_peak_pooled + buckets
    assert wrapped.train_bytes["gradients"] == alone.train_bytes["gradients"] + buckets
    assert wrapped.eval_peak_pooled == alone.eval_peak_pooled


@case
def out_of_memory_names_the_rank(rank: int, world: int) -> None:
    model = DDP(_mlp())
    step = sm.pooled_train_step(model, nn.functional.mse_loss, pool=sm.BufferPool(limit=1024))
    with pytest.raises(sm.OutOfMemoryError, match=rf"on cpu \(rank {rank} of {world}\)"):
        step(*_batch(model, rank, 0))


class _OwnForward(DDP):
    def forward(self, *inputs: object, **kwargs: object) -> object:
        return super().forward(*inputs, **kwargs)


@case
def refuses_what_it_cannot_honour(rank: int, world: int) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.distributed.fsdp import fully_shard

    hooked = DDP(_mlp())
    hooked.register_comm_hook(None, allreduce_hook)  # type: ignore[arg-type]
    # (An FSDP2 model trains: tests/test_fsdp.py; a pooled forward refuses it.)
    wrappers: dict[str, Callable[[], nn.Module]] = {
        "DataParallel": lambda: nn.DataParallel(_mlp()),
        "DistributedDataParallel (nested": lambda: nn.Sequential(DDP(_mlp())),
        "overrides forward": lambda: _OwnForward(_mlp()),
        "communication hook": lambda: hooked,
    }
    for what, make in wrappers.items():
        with pytest.raises(TypeError, match="^sharedmem: .*" + re.escape(what)) as refused:
            sm.pooled_train_step(make(), nn.functional.mse_loss, pool=sm.BufferPool())
        assert "DistributedDataParallel" in str(refused.value), str(refused.value)  # a way in
    with pytest.raises(TypeError, match=r"^sharedmem: .*fully_shard") as refused:
        sm.pooled_forward(fully_shard(_mlp()), pool=sm.BufferPool())
    assert "pool.step(" in str(refused.value), str(refused.value)


def _grads_with_and_without_offload(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    grads: list[list[torch.Tensor]] = []
    # A first step without offload: DDP rebuilds its buckets after it, which changes the
    # order three ranks' values are summed in; the two compared steps both use the new ones.
    for offload in (False, False, True):
        model.zero_grad()
        if offload:
            with sm.save_on_pool(sm.BufferPool("emulated"), min_bytes=0):
                loss = model(x).square().mean()
        else:
            loss = model(x).square().mean()
        loss.backward()
        grads.append([_full(p.grad) for p in model.parameters() if p.grad is not None])
    plain, offloaded = grads[1:]
    assert plain and len(plain) == len(offloaded)
    for a, b in zip(plain, offloaded, strict=True):
        assert torch.equal(a, b), "save_on_pool changed a gradient"
    return plain


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # FSDP2 gradients are DTensors


@case
def save_on_pool_keeps_gradients(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    x, _ = _batch(_conv_bn(), rank, 0)
    torch.manual_seed(0)
    _grads_with_and_without_offload(DDP(_conv_bn()), x)
    torch.manual_seed(0)
    model = _mlp()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x, _ = _batch(_mlp(), rank, 0)
    _grads_with_and_without_offload(model, x)


def _fsdp2_mlp(mesh: object, reshard: bool) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = _mlp()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)  # type: ignore[arg-type]
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)  # type: ignore[arg-type]
    return model


FSDP_STEPS = 6


@case
def pool_step_around_eager_fsdp2_matches_it(rank: int, world: int) -> None:
    # The eager FSDP2 step inside pool.step(), the model prepared by sm.prepare_fsdp: the same
    # losses and full gradients as eager FSDP2, bit for bit, over many steps, per layer and at
    # the root, reshard_after_forward True and False, and accumulating two micro-batches
    # (set_requires_gradient_sync(False) on the first). Every call after a block's first
    # follows its plan, FSDP2's all-gather and reduce-scatter buffers served from the arena.
    # Problems are collected and raised at the end: a rank that stopped early would leave the
    # others waiting in a collective.
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    problems: list[str] = []
    for reshard in (True, False):
        for micro in (1, 2):
            torch.manual_seed(0)
            eager = _fsdp2_mlp(mesh, reshard)
            torch.manual_seed(0)
            pooled = sm.prepare_fsdp(_fsdp2_mlp(mesh, reshard))
            pool = sm.BufferPool("cpu")
            opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, pooled)]
            for i in range(FSDP_STEPS):
                when = f"reshard_after_forward={reshard} micro-batches={micro} step {i}"
                for opt in opts:
                    opt.zero_grad()
                for k in range(micro):
                    for m in (eager, pooled):
                        m.set_requires_gradient_sync(k == micro - 1)  # type: ignore[operator]
                    x, y = _batch(eager, rank, micro * i + k)
                    expected = nn.functional.mse_loss(eager(x), y)
                    expected.backward()
                    with pool.step(f"micro{k}", x, y):  # each micro-batch's own sequence
                        loss = nn.functional.mse_loss(pooled(x), y)
                        loss.backward()
                    if not torch.equal(loss.detach(), expected.detach()):
                        problems.append(f"{when}: the loss of micro-batch {k} differs")
                pairs = zip(eager.named_parameters(), pooled.parameters(), strict=True)
                for (name, a), b in pairs:
                    if not torch.equal(_full(a.grad), _full(b.grad)):  # a collective
                        problems.append(f"{when}: {name}.grad differs from eager FSDP2's")
                for opt in opts:
                    opt.step()
            stats = pool.stats()
            routed = sm._routing.native() is not None  # the router was built: the arena served
            if routed and (stats.get("diverged_calls", 0) or not stats.get("arena_served_bytes")):
                problems.append(f"{when}: {stats}")
    assert not problems, "\n".join(problems)


@case
def fsdp2_refusals_name_the_alternative(rank: int, world: int) -> None:
    # What pool.step() cannot plan yet is refused before anything runs, with the way out.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    hsdp = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
    offloaded = fully_shard(_mlp(), mesh=init_device_mesh("cpu", (world,)))
    # CPU offload needs an accelerator to be built at all: set as fully_shard sets it there.
    for group in param_groups(offloaded):
        group.offload_policy = CPUOffloadPolicy()
    refused: dict[str, tuple[Callable[[], nn.Module], str]] = {
        "an HSDP mesh": (lambda: fully_shard(_mlp(), mesh=hsdp), "1-D mesh"),
        "a CPU offload policy": (lambda: offloaded, "without offload_policy"),
        "no such module": (_mlp, "needs no preparation"),
    }
    for what, (make, alternative) in refused.items():
        with pytest.raises(TypeError, match="^sharedmem: .*" + re.escape(what)) as error:
            sm.prepare_fsdp(make())
        assert alternative in str(error.value), str(error.value)


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}-ranks")
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Ranks:
    return worlds.ranks(request.param, tmp_path_factory, request.session)


_check = worlds.check


def test_gradients_losses_and_buffers_equal_eager_ddp(
    ranks: Ranks,
) -> None:
    _check(ranks, "matches_eager_ddp")


def test_no_sync_steps_skip_the_all_reduce(ranks: Ranks) -> None:
    _check(ranks, "no_sync_accumulates_locally")


def test_chunks_all_reduce_once_per_step_under_ddp(ranks: Ranks) -> None:
    _check(ranks, "chunks_all_reduce_once_per_step")


def test_evaluation_after_training_adds_zero_bytes_on_every_rank(
    ranks: Ranks,
) -> None:
    _check(ranks, "evaluation_adds_nothing")


def test_the_estimate_is_per_rank_and_counts_the_buckets(ranks: Ranks) -> None:
    _check(ranks, "estimate_is_per_rank")


def test_out_of_memory_message_names_the_rank(ranks: Ranks) -> None:
    _check(ranks, "out_of_memory_names_the_rank")


def test_wrappers_it_cannot_honour_are_refused(ranks: Ranks) -> None:
    _check(ranks, "refuses_what_it_cannot_honour")


def test_pool_step_around_eager_fsdp2_gives_its_gradients(ranks: Ranks) -> None:
    _check(ranks, "pool_step_around_eager_fsdp2_matches_it")


def test_fsdp2_it_cannot_plan_yet_is_refused_with_the_alternative(ranks: Ranks) -> None:
    _check(ranks, "fsdp2_refusals_name_the_alternative")


def test_save_on_pool_under_ddp_and_fsdp2_keeps_gradients(
    ranks: Ranks,
) -> None:
    _check(ranks, "save_on_pool_keeps_gradients")


def _demo_rank(rank: int, world: int, port: int, out: str) -> None:
    from sharedmem._cli.demo_data import DemoConfig
    from sharedmem._cli.demo_distributed import run_distributed_demo

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank)}
    os.environ.update(env, WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    config = DemoConfig(steps=2, train_batch=16, eval_batch=8, features=16, hidden=32)
    status = run_distributed_demo(config)
    threads = [(task / "comm").read_text().strip() for task in Path("/proc/self/task").iterdir()]
    Path(out, f"rank{rank}.json").write_text(json.dumps({"status": status, "threads": threads}))


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads the threads from /proc")
def test_distributed_demo_joins_the_groups_threads_before_it_returns(tmp_path: Path) -> None:
    # A gloo worker that frees the last reference to a tensor Python let go of takes the GIL;
    # doing so while the interpreter exits, it is ended inside a C++ destructor and the process
    # aborts ("terminate called without an active exception"). The demo destroys its group
    # for real before it returns: no gloo thread is left for the interpreter's exit.
    mp.spawn(_demo_rank, args=(2, worlds.free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        got = json.loads(Path(tmp_path, f"rank{rank}.json").read_text())
        assert got["status"] == 0
        assert not [name for name in got["threads"] if "gloo" in name], got["threads"]


@pytest.mark.parametrize("cap_mb", [None, 5])
@pytest.mark.parametrize(("static", "unused"), [(False, False), (False, True), (True, False)])
def test_ddp_bucket_limits_read_from_an_older_torchs_attributes_equal_its_config(
    cap_mb: int | None, static: bool, unused: bool
) -> None:
    # torch 2.11 (a GPU image's) has no _bucket_config: the limits come from DDP's attributes.
    from types import SimpleNamespace

    from torch.nn.parallel import distributed as ddp_module

    from sharedmem._executor.distributed import _limits

    config_type = getattr(ddp_module, "_BucketCapacityConfig", None)
    if config_type is None:
        pytest.skip("this torch has no _BucketCapacityConfig to compare with")
    config = config_type.create(
        bucket_cap_mb=cap_mb, bucket_cap_mb_list=None, use_python_reducer=False
    )
    newer = SimpleNamespace(
        _bucket_config=config, static_graph=static, find_unused_parameters=unused
    )
    older = SimpleNamespace(
        bucket_bytes_cap=config.bucket_bytes_cap,
        bucket_bytes_cap_default=cap_mb is None,
        bucket_bytes_cap_list=[],
        static_graph=static,
        find_unused_parameters=unused,
    )
    assert _limits(older) == _limits(newer)


def test_fsdp_parameter_groups_of_an_older_torch_are_its_one_group() -> None:
    from types import SimpleNamespace

    def wrapped(**state: object) -> nn.Module:
        module = nn.Linear(2, 2)
        module._get_fsdp_state = lambda: SimpleNamespace(**state)  # type: ignore[assignment]
        return module

    assert param_groups(wrapped(_fsdp_param_groups=("a", "b"))) == ["a", "b"]
    assert param_groups(wrapped(_fsdp_param_group="a")) == ["a"]  # torch 2.11
    assert param_groups(wrapped(_fsdp_param_group=None)) == []
