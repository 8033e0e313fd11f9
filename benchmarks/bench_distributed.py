"""Data parallel: a pooled train step on a DistributedDataParallel model against eager DDP.

Two gloo ranks on this machine (loopback, one thread each), spawned by the benchmark. In
every rank the same model is wrapped twice in ``DistributedDataParallel``: one copy runs
eagerly (``zero_grad``, forward, ``backward``, which all-reduces as DDP does), the other as
``sm.pooled_train_step(ddp_model, ...)``; both are timed interleaved in the same processes
(medians of many rounds, see ``harness.interleaved``), after warm-up (DDP's buckets rebuilt,
the pooled graph traced). Time is the slower rank's median per step.

Memory per rank is DESIGN §8's measure: the peak of the allocator's running sum over one step
relative to its start, with gradients set to ``None`` before it (not inside it), plus the
bytes held across steps that the step needs: for eager DDP its reducer's gradient buckets (the
parameters' bytes, allocated outside the step), for the pooled step the pool's
``reserved_bytes`` (activation slots and the same buckets).

FSDP2: the same models sharded with ``fully_shard`` (each child with parameters, then the
root), trained by ``sm.pooled_train_step`` (their eager step inside ``pool.step()``) against
the same step of eager FSDP2; memory as above, the pooled step's plus the pool's ``reserved_bytes``
(its arena), and the share of the step's dying bytes the arena served per call. Then the same
again with the pooled side compiled as torchtitan compiles (each unit its own ``torch.compile``
with the pool's backend, then sharded; ``sm.prepare_fsdp`` and the backend's ``steps_from``),
and compiled once more with the project's recomputation as AOTAutograd's partition
(``partition=sm.Recompute.MOST``), which takes the per-rank peak below eager FSDP2's.

Before sharding anything, ``sm.estimate(..., world_size=2)`` says what each rank's eager FSDP2
step needs (rank 0's shards, the largest): its step peak against the measured one.

Models: the MLP and the ResNet-style CNN of ``bench_step_memory``, float32 on CPU.
Target (DESIGN §7): pooled DDP step time <= 1.05x eager DDP on 2 CPU ranks; FSDP2's per-rank
peak at most eager FSDP2's: the same allocations cannot peak below eager's bytes, and the pool
holds whole pages, so a peak is held at most a page a pool buffer above it, and below it with
recomputation.

    python benchmarks/bench_distributed.py [--quick] [--json PATH]
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import socket
import sys
import tempfile
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Progress, Row, interleaved, row, script_main, smoke_models
from step_models import CASES

import sharedmem as sm
from sharedmem.testing import raw_allocator_peak as allocator_peak

WORLD = 2
# The compiled FSDP2 step once more with the project's recomputation as AOTAutograd's
# partition: below eager FSDP2's peak, at the time it costs. The partition decides per
# compiled unit: the MLP's units are one layer each, whose graphs recomputing cannot lower.
RECOMPUTE = sm.Recompute.MOST
MODELS = smoke_models(("mlp", "resnet"), "mlp")
RECOMPUTED = [name for name in MODELS if name == "resnet"]


def _measure(rank: int, name: str, quick: bool) -> dict[str, float]:
    _, make, data, _ = next(case for case in CASES if case[0] == name)
    torch.manual_seed(0)
    model = make()
    eager = DDP(make())
    eager.module.load_state_dict(model.state_dict())
    pooled = DDP(model)
    torch.manual_seed(rank)  # every rank its own batch
    x, y = data(16 if quick else 32)
    loss_fn = nn.functional.cross_entropy
    pool = sm.BufferPool("cpu")
    step = sm.pooled_train_step(pooled, loss_fn, pool=pool)

    def eager_step() -> None:
        eager.zero_grad()
        loss_fn(eager(x), y).backward()

    def pooled_step() -> None:
        pooled.zero_grad()
        step(x, y)

    rounds, number = (5, 3) if quick else (21, 5)
    times = interleaved({"eager": eager_step, "pooled": pooled_step}, rounds=rounds, number=number)
    buckets = sum(p.numel() * p.element_size() for p in model.parameters())
    eager.zero_grad()
    eager_peak = allocator_peak(lambda: loss_fn(eager(x), y).backward()) + buckets
    pooled.zero_grad()
    pooled_peak = allocator_peak(lambda: step(x, y)) + pool.stats()["reserved_bytes"]
    return {
        "eager_s": times["eager"],
        "pooled_s": times["pooled"],
        "eager_peak": eager_peak,
        "pooled_peak": pooled_peak,
        "rounding": _rounding(pool),
    }


def _rounding(pool: sm.BufferPool) -> int:
    """What the pool's rounding may add to a peak: one granule (a page on CPU) per buffer,
    since a buffer holds whole pages where eager's allocator events count bytes."""
    return pool.granularity * pool.stats()["num_buffers"]


def _units(model: nn.Module) -> list[str]:
    # As torchtitan shards: each child with parameters, then the root.
    return [name for name, child in model.named_children() if any(True for _ in child.parameters())]


def _sharded(make: Callable[[], nn.Module], mesh: object) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = make()
    for unit in _units(model):
        fully_shard(model.get_submodule(unit), mesh=mesh)  # type: ignore[arg-type]
    fully_shard(model, mesh=mesh)  # type: ignore[arg-type]
    return model


def _least_peak(model: nn.Module, run: Callable[[], None]) -> int:
    """The least of three allocator-event peaks of ``run``, gradients zeroed before each (gloo's
    worker thread allocates at times of its own, which moves a single reading)."""
    peaks = []
    for _ in range(3):
        model.zero_grad()
        peaks.append(allocator_peak(run))
    return min(peaks)


def _measure_fsdp(rank: int, name: str, quick: bool) -> dict[str, float]:
    from torch.distributed.device_mesh import init_device_mesh

    _, make, data, _ = next(case for case in CASES if case[0] == name)
    mesh = init_device_mesh("cpu", (WORLD,))
    eager = _sharded(make, mesh)
    pooled = _sharded(make, mesh)
    torch.manual_seed(rank)  # every rank its own batch
    x, y = data(16 if quick else 32)
    loss_fn = nn.functional.cross_entropy
    # What sm.estimate says of this rank's eager FSDP2 step before sharding anything.
    plain = make()
    estimated = sm.estimate(
        plain, x, y, loss_fn=loss_fn, world_size=WORLD, fsdp_units=_units(plain),
        measure_kernels=True,
    ).sharded  # fmt: skip
    assert estimated is not None
    pool = sm.BufferPool("cpu")
    step = sm.pooled_train_step(pooled, loss_fn, pool=pool)  # its eager step, from the pool

    def eager_step() -> None:
        eager.zero_grad()
        loss_fn(eager(x), y).backward()

    def pooled_step() -> None:
        pooled.zero_grad()
        step(x, y)

    rounds, number = (5, 3) if quick else (21, 5)
    times = interleaved({"eager": eager_step, "pooled": pooled_step}, rounds=rounds, number=number)

    # The least of three: gloo's worker thread frees its copies of a collective's buffers when
    # it drops the work, so a step's peak varies by how the threads ran (in both steps). The
    # gradients set to None before, outside the measured step, as for DDP above: freed inside
    # it, the previous step's sharded gradients would lower the figure by their bytes.
    eager_peak = _least_peak(eager, lambda: loss_fn(eager(x), y).backward())
    pooled_peak = _least_peak(pooled, lambda: step(x, y)) + pool.stats()["reserved_bytes"]
    stats = pool.stats()
    calls = max(stats.get("replayed_calls", 0), 1)
    return {
        "eager_s": times["eager"],
        "pooled_s": times["pooled"],
        "eager_peak": eager_peak,
        "pooled_peak": pooled_peak,
        "served": stats.get("arena_served_bytes", 0) / calls,
        "beside": stats.get("arena_fallback_bytes", 0) / calls,
        "diverged": stats.get("diverged_calls", 0),
        "estimated_peak": estimated.step_peak,
        "rounding": _rounding(pool),
    }


def _measure_fsdp_compiled(
    rank: int, name: str, quick: bool, partition: str | sm.Recompute = "min_cut"
) -> dict[str, float]:
    """As ``_measure_fsdp``, the pooled side compiled the way torchtitan compiles: each unit
    its own ``torch.compile`` with the pool's backend, then ``fully_shard`` on it and at the
    root, ``sm.prepare_fsdp`` and the backend's ``steps_from`` (FSDP2's hooks run eagerly
    between the compiled units, inside the step's span)."""
    from torch.distributed.device_mesh import init_device_mesh

    from sharedmem._compile import compile_backend

    _, make, data, _ = next(case for case in CASES if case[0] == name)
    torch._dynamo.reset()  # each measurement compiles its own copy, within Dynamo's limits
    mesh = init_device_mesh("cpu", (WORLD,))
    eager = _sharded(make, mesh)
    pool = sm.BufferPool("cpu")
    backend = compile_backend(pool, partition=partition)
    compiled = _compiled(make, mesh, backend)
    sm.prepare_fsdp(compiled)
    backend.steps_from(compiled)
    # torch.compile's own graphs without the pool (AOTAutograd, eager kernels): what the
    # compiled units alone hold at the peak, a few small tensors more than eager. Only the
    # unrecomputed rows allow for it (a recomputing row is judged against eager's alone).
    alone = None if isinstance(partition, sm.Recompute) else _compiled(make, mesh, "aot_eager")
    warmed = [compiled] if alone is None else [compiled, alone]
    torch.manual_seed(rank)  # every rank its own batch
    x, y = data(16 if quick else 32)
    loss_fn = nn.functional.cross_entropy

    def step(model: nn.Module) -> Callable[[], None]:
        def run() -> None:
            model.zero_grad()
            loss_fn(model(x), y).backward()

        return run

    for _ in range(4):  # compiled and recorded, then replayed (and warm)
        for model in warmed:
            step(model)()
    before = pool.stats()
    rounds, number = (5, 3) if quick else (21, 5)
    times = interleaved(
        {"eager": step(eager), "pooled": step(compiled)}, rounds=rounds, number=number
    )

    def backward(model: nn.Module) -> Callable[[], None]:
        return lambda: loss_fn(model(x), y).backward()

    eager_peak = _least_peak(eager, backward(eager))
    pooled_peak = _least_peak(compiled, backward(compiled)) + pool.stats()["reserved_bytes"]
    stats = pool.stats()
    since = {k: stats.get(k, 0) - before.get(k, 0) for k in stats}
    calls = max(since.get("replayed_calls", 0), 1)  # every call after the warm-up
    figures: dict[str, float] = {
        "eager_s": times["eager"],
        "pooled_s": times["pooled"],
        "eager_peak": eager_peak,
        "pooled_peak": pooled_peak,
        "served": since.get("arena_served_bytes", 0) / calls,
        "beside": since.get("arena_fallback_bytes", 0) / calls,
        "diverged": since.get("diverged_calls", 0),
        "rounding": _rounding(pool),
    }
    if alone is not None:
        figures["compile_own"] = max(_least_peak(alone, backward(alone)) - eager_peak, 0)
    return figures


def _compiled(make: Callable[[], nn.Module], mesh: object, backend: Any) -> nn.Module:
    """The model compiled as torchtitan compiles it: each unit its own ``torch.compile``,
    then ``fully_shard`` on it and at the root."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = make()
    for unit in _units(model):
        parent, _, leaf = unit.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, leaf, torch.compile(owner.get_submodule(leaf), backend=backend))
        fully_shard(owner.get_submodule(leaf), mesh=mesh)  # type: ignore[arg-type]
    fully_shard(model, mesh=mesh)  # type: ignore[arg-type]
    return model


def _rank_main(rank: int, port: int, quick: bool, out: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    # As the distributed demo: torch._dynamo (which DDP imports) imported before the group, so
    # that nothing keeps the group past destroy_process_group, which then joins its threads
    # (a gloo thread left for the interpreter's exit may abort the rank).
    importlib.import_module("torch._dynamo")
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(minutes=5))
    torch.set_num_threads(1)
    try:
        figures = {name: _measure(rank, name, quick) for name in MODELS}
        figures.update({f"fsdp-{name}": _measure_fsdp(rank, name, quick) for name in MODELS})
        figures.update(
            {f"fsdpc-{name}": _measure_fsdp_compiled(rank, name, quick) for name in MODELS}
        )
        figures.update(
            {
                f"fsdpr-{name}": _measure_fsdp_compiled(rank, name, quick, RECOMPUTE)
                for name in RECOMPUTED
            }
        )
        Path(out, f"rank{rank}.json").write_text(json.dumps(figures))
    finally:
        gc.collect()  # the DDP wrappers' cycles, which hold the group
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(quick: bool = False, device: str = "cpu", progress: Progress | None = None) -> list[Row]:
    if device != "cpu":
        return [row(f"data parallel ({device})", 0, "", target="CPU gloo ranks only: skipped")]
    if progress is not None:
        progress.say(f"data parallel: {WORLD} gloo ranks, {', '.join(MODELS)}")
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_rank_main, args=(_free_port(), quick, out), nprocs=WORLD, join=True)
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(WORLD)]
    rows = []
    for name in MODELS:
        rows += _rows(ranks, name, f"{name} DDP", "eager DDP", lambda f: "")
    for name in MODELS:
        rows += _rows(
            ranks, f"fsdp-{name}", f"{name} FSDP2", "eager FSDP2", _served, " in pool.step()"
        )
    for name in MODELS:
        rows += _rows(
            ranks, f"fsdpc-{name}", f"{name} FSDP2", "eager FSDP2", _served,
            " under torch.compile (the pool's backend, steps_from)",
        )  # fmt: skip
    for name in RECOMPUTED:
        rows += _rows(
            ranks, f"fsdpr-{name}", f"{name} FSDP2", "eager FSDP2", _served,
            f" under torch.compile, recomputing {RECOMPUTE.describe()}", below=True,
        )  # fmt: skip
    for name in MODELS:
        for rank, figures in enumerate(ranks):
            f = figures[f"fsdp-{name}"]
            rows.append(
                row(
                    f"{name} FSDP2 step peak estimated before sharding, rank {rank}",
                    f["estimated_peak"],
                    "B",
                    baseline=f["eager_peak"],
                    target="within 1% under, 3% over eager FSDP2's",
                    ok=0.99 * f["eager_peak"] <= f["estimated_peak"] <= 1.03 * f["eager_peak"],
                )
            )
    return rows


def _served(f: dict[str, float]) -> str:
    share = f["served"] / max(f["served"] + f["beside"], 1)
    return (
        f" ({share:.0%} of the step's dying bytes from the pool, {f['diverged']:.0f} replays "
        "off plan)"
    )


def _rows(
    ranks: list[dict[str, dict[str, float]]],
    key: str,
    label: str,
    against: str,
    note: Callable[[dict[str, float]], str],
    where: str = "",
    below: bool = False,
) -> list[Row]:
    """A model's step time (the slowest rank's) and each rank's peak, against ``against``.

    A peak is held where it is at most the baseline's plus the pool's rounding (a page per
    buffer: the same allocations can peak no lower than eager's bytes, and the pool holds whole
    pages) and, for a compiled step, what torch.compile's graphs alone hold above eager's (no
    pool: ``compile_own``), and no replay left its plan; with ``below`` (recomputation), where
    it is under the baseline's, the time then being what it costs (no target)."""
    eager_s = max(r[key]["eager_s"] for r in ranks)
    pooled_s = max(r[key]["pooled_s"] for r in ranks)
    rows = [
        row(
            f"{label} step time{where}, {WORLD} ranks",
            pooled_s,
            "s",
            baseline=eager_s,
            target="what recomputing costs" if below else f"<= 1.05x {against}",
            ok=None if below else pooled_s <= 1.05 * eager_s,
        )
    ]
    for rank, figures in enumerate(ranks):
        f = figures[key]
        own = f.get("compile_own", 0)  # what torch.compile's graphs alone hold above eager
        limit = f["eager_peak"] if below else f["eager_peak"] + f["rounding"] + own
        rows.append(
            row(
                f"{label} step peak, rank {rank}{note(f)}",
                f["pooled_peak"],
                "B",
                baseline=f["eager_peak"],
                target=f"< 1.0x {against}"
                if below
                else f"<= 1.0x {against}{' + compile alone' if own else ''} + a page a buffer",
                ok=(f["pooled_peak"] < limit if below else f["pooled_peak"] <= limit)
                and not f.get("diverged", 0),
            )
        )
    return rows


if __name__ == "__main__":
    script_main(__doc__, run, f"data parallel on {WORLD} CPU ranks ({{device}})")
