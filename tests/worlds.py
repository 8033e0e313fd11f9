"""Spawned gloo worlds that the distributed test files share: one spawn per world size.

tests/test_distributed.py and tests/test_fsdp.py register their cases here (``case``); the
first test that needs a world of N ranks spawns it, and every rank runs every case of every
file that applies to N (``MODULES``), recording per case ``None`` or the traceback. The
results are kept for the rest of the worker's run (both files are in one xdist group), so a
world size is spawned once for both files instead of once per file. A rank that does not end
in time is killed, with every other, and the test fails naming it: a distributed test never
hangs.
"""

from __future__ import annotations

import gc
import importlib
import json
import multiprocessing
import os
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import sharedmem as sm

Ranks = dict[int, dict[str, str | None]]  # per rank, per case: None or the traceback
Case = Callable[[int, int], None]

# The files whose cases a world runs (each rank imports them: importing registers the cases).
MODULES = ("test_distributed", "test_fsdp")
CASES: dict[str, tuple[Case, tuple[int, ...]]] = {}
RANK_SECONDS = 480  # every rank's whole run, spawn included; each collective times out sooner
_WORLDS: dict[int, Ranks] = {}


def case(*worlds: int) -> Callable[[Case], Case]:
    """A case, run on the world sizes ``worlds``."""
    assert worlds, "a case names the world sizes it runs on"

    def register(fn: Case) -> Case:
        assert fn.__name__ not in CASES, f"two cases named {fn.__name__}"
        CASES[fn.__name__] = (fn, worlds)
        return fn

    return register


def _rank_main(rank: int, world: int, port: int, out: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    for module in MODULES:
        importlib.import_module(module)
    # As the distributed demo: nothing keeps the group past destroy_process_group, which then
    # joins its threads (a gloo thread left for the interpreter's exit may abort the rank).
    importlib.import_module("torch._dynamo")
    # A failing rank must not leave the others waiting for ever in a collective.
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=180))
    torch.set_num_threads(1)
    results: dict[str, str | None] = {}
    try:
        for name, (fn, worlds) in CASES.items():
            if world not in worlds:
                continue
            try:
                fn(rank, world)
                results[name] = None
            except Exception:
                results[name] = traceback.format_exc()
            try:
                dist.barrier()
            except Exception:  # a rank stuck in a case: the group is broken, stop here
                results[name] = (results[name] or "") + "the barrier after it failed:\n"
                results[name] += traceback.format_exc()
                break
    finally:
        Path(out, f"rank{rank}.json").write_text(json.dumps(results))
        gc.collect()  # the DDP wrappers' cycles, which hold the group
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(world: int, out: Path) -> None:
    """Runs ``world`` ranks to their end; a rank still running after ``RANK_SECONDS`` is
    killed, with every other, and the test fails naming it."""
    context = multiprocessing.get_context("spawn")
    port = free_port()
    procs = [
        context.Process(target=_rank_main, args=(r, world, port, str(out)), daemon=True)
        for r in range(world)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + RANK_SECONDS
    try:
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
    finally:  # the test's own timeout included: no rank outlives it
        hung = [r for r, proc in enumerate(procs) if proc.is_alive()]
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(10)
    if hung:
        pytest.fail(f"ranks {hung} of {world} still ran after {RANK_SECONDS} s: killed")
    failed = {r: proc.exitcode for r, proc in enumerate(procs) if proc.exitcode}
    assert not failed, f"ranks ended with exit codes {failed}"


def ranks(world: int, tmp_path_factory: pytest.TempPathFactory) -> Ranks:
    """Every rank's results of a world of ``world`` ranks, spawned at the first call."""
    if world not in _WORLDS:
        out = tmp_path_factory.mktemp(f"world{world}")
        # The router is compiled at first use (30-90 s on a fresh machine): here, once, before
        # the ranks start, not inside a rank while the others wait at a barrier (a fresh
        # clone's CI run timed out there, the build racing the ranks).
        sm._routing.native()
        _spawn(world, out)
        _WORLDS[world] = {
            r: json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)
        }
    return _WORLDS[world]


def check(ranks: Ranks, name: str) -> None:
    """The case ``name`` passed on every rank (a rank that did not run it fails it)."""
    assert name in CASES, f"no case named {name}"
    failures = {r: res.get(name, "not run") for r, res in ranks.items()}
    failed = {r: text for r, text in failures.items() if text is not None}
    assert not failed, "\n".join(f"rank {r}:\n{text}" for r, text in failed.items())
