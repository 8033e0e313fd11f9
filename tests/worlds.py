"""Spawned gloo worlds that the distributed test files share: one spawn for every world size.

tests/test_distributed.py and tests/test_fsdp.py register their cases here (``case``); the
first test that needs a world spawns as many ranks as the largest world the run needs, and
these ranks form every world the run's tests need, smallest first, one after the other (a
rank that a world does not include waits for the next): each rank of a world runs every case
of every file that applies to its size (``MODULES``), recording per case ``None`` or the
traceback, and leaves the group before the next world forms. Each process imports torch and
the package once for all the worlds (spawning the ranks of each world anew was most of their
time). The results are kept for the rest of the worker's run (both files are in one xdist
group). A rank that does not end in time is killed, with every other, and the test fails
naming it: a distributed test never hangs.
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
# Every rank's whole run, spawn included, per world it forms; each collective times out
# sooner. The tests that wait for the worlds have a timeout above the sum.
RANK_SECONDS = 240
# The timeout of a test that waits for the worlds: the three of a whole run, and spare.
TIMEOUT_S = 3 * RANK_SECONDS + 180
_WORLDS: dict[int, Ranks | str] = {}  # per world size: its ranks' results, or why there are none


def case(*worlds: int) -> Callable[[Case], Case]:
    """A case, run on the world sizes ``worlds``."""
    assert worlds, "a case names the world sizes it runs on"

    def register(fn: Case) -> Case:
        assert fn.__name__ not in CASES, f"two cases named {fn.__name__}"
        CASES[fn.__name__] = (fn, worlds)
        return fn

    return register


def _rank_main(rank: int, sizes: list[int], out: str) -> None:
    for module in MODULES:
        importlib.import_module(module)
    # As the distributed demo: nothing keeps the group past destroy_process_group, which then
    # joins its threads (a gloo thread left for the interpreter's exit may abort the rank).
    importlib.import_module("torch._dynamo")
    torch.set_num_threads(1)
    for world in sizes:
        if rank < world:
            _run_world(rank, world, Path(out))


def _run_world(rank: int, world: int, out: Path) -> None:
    # Rank 0 chooses the world's port once the world before it has ended on rank 0; the others
    # wait for it (a rank the world before did not include waits here, not in a collective).
    said = out / f"port{world}"
    if rank == 0:
        Path(f"{said}.tmp").write_text(str(free_port()))
        os.replace(f"{said}.tmp", said)
    while not said.exists():
        time.sleep(0.05)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", said.read_text()
    # A failing rank must not leave the others waiting for ever in a collective.
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=180))
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
        Path(out, f"world{world}-rank{rank}.json").write_text(json.dumps(results))
        gc.collect()  # the DDP wrappers' cycles, which hold the group
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(sizes: list[int], out: Path) -> str:
    """Runs the worlds ``sizes`` to their end; ranks still running after ``RANK_SECONDS`` a
    world are killed, with every other. What went wrong, or ``""``."""
    context = multiprocessing.get_context("spawn")
    procs = [
        context.Process(target=_rank_main, args=(r, sizes, str(out)), daemon=True)
        for r in range(max(sizes))
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + RANK_SECONDS * len(sizes)
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
        return f"ranks {hung} of worlds {sizes} still ran after {RANK_SECONDS} s a world: killed"
    failed = {r: proc.exitcode for r, proc in enumerate(procs) if proc.exitcode}
    return f"ranks ended with exit codes {failed}" if failed else ""


def ranks(world: int, tmp_path_factory: pytest.TempPathFactory, session: pytest.Session) -> Ranks:
    """Every rank's results of a world of ``world`` ranks; at the first call, every world the
    session's tests need is formed (``ranks`` parameters of the tests of ``MODULES``)."""
    if world not in _WORLDS:
        needed = {world}
        for item in session.items:
            callspec = getattr(item, "callspec", None)
            if item.module is not None and item.module.__name__ in MODULES and callspec:
                needed.add(int(callspec.params.get("ranks", world)))
        sizes = sorted(needed - set(_WORLDS))
        out = tmp_path_factory.mktemp("worlds")
        # The router is compiled at first use (30-90 s on a fresh machine): here, once, before
        # the ranks start, not inside a rank while the others wait at a barrier (a fresh
        # clone's CI run timed out there, the build racing the ranks).
        sm._routing.native()
        failure = _spawn(sizes, out)
        for size in sizes:
            files = [Path(out, f"world{size}-rank{r}.json") for r in range(size)]
            if failure:  # whichever world it came from, no world of these ranks passes
                ended = "its ranks wrote their results" if all(f.exists() for f in files) else ""
                _WORLDS[size] = f"{failure}{' (' + ended + ')' if ended else ''}"
            elif not all(f.exists() for f in files):
                _WORLDS[size] = "a rank wrote no results"
            else:
                _WORLDS[size] = {r: json.loads(f.read_text()) for r, f in enumerate(files)}
    found = _WORLDS[world]
    if isinstance(found, str):
        pytest.fail(f"the world of {world} ranks: {found}")
    return found


def check(ranks: Ranks, name: str) -> None:
    """The case ``name`` passed on every rank (a rank that did not run it fails it)."""
    assert name in CASES, f"no case named {name}"
    failures = {r: res.get(name, "not run") for r, res in ranks.items()}
    failed = {r: text for r, text in failures.items() if text is not None}
    assert not failed, "\n".join(f"rank {r}:\n{text}" for r, text in failed.items())
