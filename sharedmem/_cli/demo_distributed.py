"""The main job on several ranks: ``torchrun --nproc-per-node 2 -m sharedmem demo --distributed``.

Every rank trains the demo's MLP, wrapped in ``DistributedDataParallel``, with a pooled train
step whose activations and gradient buckets live in that rank's own pool (on ``cuda:LOCAL_RANK``
or ``cpu``), and evaluates it with a pooled forward on the same pool. The same model trained
eagerly with DDP beside it gives the reference losses. Rank 0 prints each rank's memory and
the total; every rank must add 0 bytes for evaluation.

The run ends with the process group destroyed for real, its gloo worker threads joined, before
the interpreter exits: a worker that frees the last reference to a tensor Python let go of takes
the GIL to do it, and one that does so while the interpreter finalizes is ended by Python inside
a C++ destructor, which aborts the process ("terminate called without an active exception").
"""

from __future__ import annotations

import gc
import importlib
import math
import os
import sys
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from .._errors import SharedMemError
from .._planning import pooled_forward, pooled_train_step
from .._pool import BufferPool
from .._pool.report import human_bytes
from .demo import demo_verdict
from .demo_data import DemoConfig, SyntheticData

__all__ = ["RankMemory", "run_distributed_demo"]


class RankMemory(NamedTuple):
    """One rank's pool after the run (bytes)."""

    rank: int
    device: str
    reserved: int
    buckets: int  # of ``reserved``: the DDP gradient buckets
    peak: int
    eval_added: int


def _mlp(config: DemoConfig) -> nn.Module:
    return nn.Sequential(
        nn.Linear(config.features, config.hidden),
        nn.ReLU(),
        nn.Linear(config.hidden, config.hidden),
        nn.ReLU(),
        nn.Linear(config.hidden, config.classes),
    )


def _init(config: DemoConfig) -> tuple[int, int, str]:
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise SharedMemError(
            "sharedmem: demo --distributed runs one process per rank: launch it with torchrun, "
            "for example `torchrun --standalone --nproc-per-node 2 -m sharedmem demo "
            "--distributed`"
        )
    cuda = config.device.startswith("cuda")
    device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if cuda else config.device
    if cuda:
        torch.cuda.set_device(torch.device(device))
    # DDP's constructor imports torch._dynamo, which imports torch.distributed.nn.functional,
    # whose functions take ``group=group.WORLD`` as a default: imported after the group exists,
    # they keep it alive past destroy_process_group, until the interpreter's last collection.
    # Imported first, they keep nothing.
    importlib.import_module("torch._dynamo")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    return dist.get_rank(), dist.get_world_size(), device


def run_distributed_demo(config: DemoConfig, *, fsdp: bool = False) -> int:
    """Train and evaluate on every rank; rank 0 prints the figures. Returns the exit status:
    0, or 1 when a loss is not finite, the pooled losses differ from eager DDP's, or an
    evaluation at a batch no larger than training's added bytes on some rank.

    ``fsdp``: shard the model with ``fully_shard`` (FSDP2) instead, train it with
    ``pooled_train_step`` (its eager step served from the pool) beside eager FSDP2, and require
    the same losses bit for bit."""
    if fsdp and config.device != "cpu":
        raise SharedMemError(
            "sharedmem: demo --distributed --fsdp runs on CPU ranks (gloo) for now; drop "
            f"--device {config.device}"
        )
    rank, world, device = _init(config)
    failure = (_train_fsdp if fsdp else _train)(config, rank, world, device)
    # Every object that held the group (the DDP wrappers, the pooled step's gradient sync) is
    # gone with _train's frame, once their reference cycles are collected: destroying the group
    # then drops its last reference, and its worker threads are joined here, while the
    # interpreter is whole, not while it exits.
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    if failure is not None:
        if rank == 0:
            print(f"sharedmem: demo failed: {failure}", file=sys.stderr)
        return 1
    return 0


def _train(config: DemoConfig, rank: int, world: int, device: str) -> str | None:
    """The demo's run on this rank; returns what failed (``None``: nothing)."""
    model_device = "cpu" if device == "emulated" else device
    torch.manual_seed(config.seed)  # the same initial weights everywhere (DDP broadcasts them)
    pooled_model = _mlp(config).to(model_device)
    eager_model = _mlp(config).to(model_device)
    eager_model.load_state_dict(pooled_model.state_dict())
    pooled = nn.parallel.DistributedDataParallel(pooled_model)
    eager = nn.parallel.DistributedDataParallel(eager_model)
    pool = BufferPool(device)
    loss_fn = nn.functional.cross_entropy
    step = pooled_train_step(pooled, loss_fn, pool=pool)
    evaluate = pooled_forward(pooled, pool=pool)
    opts = [torch.optim.SGD(m.parameters(), lr=config.lr) for m in (pooled, eager)]
    data = SyntheticData(DemoConfig(**{**config.__dict__, "seed": config.seed + rank}))
    losses: list[float] = []
    eager_losses: list[float] = []
    eval_added = 0
    say: Callable[..., None] = print if rank == 0 else (lambda *a, **k: None)
    say(
        f"distributed demo: {world} ranks ({dist.get_backend()}), one pool per rank on "
        f"{device if world == 1 else device.split(':')[0]}; MLP {config.features}-"
        f"{config.hidden}-{config.hidden}-{config.classes}, batch {config.train_batch} per rank"
    )
    for index in range(config.steps):
        x, y = (t.to(model_device) for t in data.batch(config.train_batch))
        for opt in opts:
            opt.zero_grad()
        losses.append(_mean(step(x, y)))
        eager_loss: torch.Tensor = loss_fn(eager(x), y)
        eager_loss.backward()  # type: ignore[no-untyped-call]
        eager_losses.append(_mean(eager_loss.detach()))
        for opt in opts:
            opt.step()
        if (index + 1) % config.eval_every == 0 or index + 1 == config.steps:
            before = pool.stats()["reserved_bytes"]
            pooled_model.eval()
            ex, ey = (t.to(model_device) for t in data.batch(config.eval_batch))
            accuracy = (evaluate(ex).argmax(1) == ey).float().mean()
            pooled_model.train()
            eval_added += pool.stats()["reserved_bytes"] - before
            say(
                f"  step {index + 1:4d}: train loss {losses[-1]:.4f} (eager DDP "
                f"{eager_losses[-1]:.4f}), eval accuracy {_mean(accuracy):.3f}"
            )
    stats = pool.stats()
    mine = RankMemory(
        rank,
        device,
        stats["reserved_bytes"],
        pool.blob("act.ddp.buckets").data_memory.size,
        stats["peak_reserved_bytes"],
        eval_added,
    )
    gathered: list[RankMemory | None] = [None] * world
    dist.all_gather_object(gathered, mine)
    figures = [f for f in gathered if f is not None]
    _print_memory(figures, say)
    failure = demo_verdict(losses, eager_losses)
    fits = config.eval_batch <= config.train_batch  # a bigger eval batch may well grow the pool
    if failure is None and fits and any(f.eval_added for f in figures):
        failure = "evaluation added bytes on a rank"
    return failure


def _train_fsdp(config: DemoConfig, rank: int, world: int, device: str) -> str | None:
    """The FSDP2 run on this rank: the MLP sharded per layer and at the root, trained by
    ``pooled_train_step`` (its eager step inside ``pool.step()``) beside the same model trained
    by eager FSDP2; returns what failed."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device, (world,))
    models = []
    for _ in range(2):
        torch.manual_seed(config.seed)  # the same initial weights in both, on every rank
        model = _mlp(config)
        for layer in model.children():
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        models.append(model)
    pooled, eager = models
    pool = BufferPool(device)
    loss_fn = nn.functional.cross_entropy
    step = pooled_train_step(pooled, loss_fn, pool=pool)
    opts = [torch.optim.SGD(m.parameters(), lr=config.lr) for m in (pooled, eager)]
    data = SyntheticData(DemoConfig(**{**config.__dict__, "seed": config.seed + rank}))
    say: Callable[..., None] = print if rank == 0 else (lambda *a, **k: None)
    say(
        f"distributed demo (FSDP2): {world} ranks ({dist.get_backend()}), the MLP "
        f"{config.features}-{config.hidden}-{config.hidden}-{config.classes} sharded per layer "
        f"and at the root, batch {config.train_batch} per rank; pooled_train_step against "
        "eager FSDP2"
    )
    differs = 0
    for index in range(config.steps):
        x, y = data.batch(config.train_batch)
        for opt in opts:
            opt.zero_grad()
        loss = step(x, y)
        expected = loss_fn(eager(x), y)
        expected.backward()  # type: ignore[no-untyped-call]
        differs += int(not torch.equal(loss.detach(), expected.detach()))
        for opt in opts:
            opt.step()
        if (index + 1) % config.eval_every == 0 or index + 1 == config.steps:
            say(
                f"  step {index + 1:4d}: train loss {_mean(loss.detach()):.4f} (eager FSDP2 "
                f"{_mean(expected.detach()):.4f})"
            )
    routes = list(pool._blocks.routes().values())  # the demo's one block
    route = routes[0] if routes else None
    recording, plan = (route.recording, route.plan) if route is not None else (None, None)
    eager_peak = recording.live_peak() if recording is not None else 0
    pooled_peak = pool.stats()["reserved_bytes"] + (plan.beside_peak if plan else eager_peak)
    served = plan.routed_bytes if plan is not None else 0
    total = recording.total_bytes if recording is not None else 0
    mine = (rank, eager_peak, pooled_peak, served, total, differs)
    gathered: list[tuple[int, ...] | None] = [None] * world
    dist.all_gather_object(gathered, mine)
    say("per rank, one step (the pool's peak: its arena plus the most bytes beside it):")
    say(f"  {'rank':>4}  {'eager FSDP2':>12}  {'pooled':>10}  {'from the pool':>14}  losses")
    for f in (g for g in gathered if g is not None):
        same = "equal" if f[5] == 0 else f"{f[5]} differ"
        say(
            f"  {f[0]:>4}  {human_bytes(f[1]):>12}  {human_bytes(f[2]):>10}  "
            f"{human_bytes(f[3]):>6} of {human_bytes(f[4]):>6}  {same}"
        )
    if any(g is not None and g[5] for g in gathered):
        return "the pooled losses differ from eager FSDP2's"
    return None


def _mean(value: torch.Tensor) -> float:
    """The mean of ``value`` over the ranks (what a DDP user reports)."""
    total = value.detach().float().reshape(1).clone()
    dist.all_reduce(total)
    mean = total.item() / dist.get_world_size()
    return mean if math.isfinite(mean) else math.nan


def _print_memory(figures: list[RankMemory], say: Callable[..., None]) -> None:
    say("memory per rank (each rank has its own pool):")
    say(f"  {'rank':>4}  {'device':<8}  {'pool':>10}  {'buckets':>10}  {'peak':>10}  eval adds")
    for f in figures:
        say(
            f"  {f.rank:>4}  {f.device:<8}  {human_bytes(f.reserved):>10}  "
            f"{human_bytes(f.buckets):>10}  {human_bytes(f.peak):>10}  {f.eval_added:,} B"
        )
    total = sum(f.reserved for f in figures)
    added = sum(f.eval_added for f in figures)
    say(f"  total over {len(figures)} ranks: {human_bytes(total)}, evaluation added {added:,} B")
