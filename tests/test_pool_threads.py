"""BufferPool under threads: acquisition, growth, the limit and phases across threads."""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest
import torch

import sharedmem as sm

MiB = 1 << 20


@pytest.mark.parametrize("device", ["cpu", "emulated"])
def test_eight_threads_on_one_pool(device: str, seed: int) -> None:
    pool = sm.BufferPool(device, limit=512 * MiB)
    shared = pool.tensor("shared", (1000,), torch.int64)
    shared.copy_(torch.arange(1000))
    failures: list[BaseException] = []
    start = threading.Barrier(8)

    def worker(index: int) -> None:
        rng = np.random.default_rng(seed + index)
        try:
            start.wait()
            for step in range(200):
                n = int(rng.integers(1, 20_000))
                mine = f"private{index}"
                view = pool.tensor(mine, (n,), torch.int64)  # grows now and then
                view.fill_(index * 1000 + step)
                if rng.random() < 0.3:  # read it back through the host side
                    host = pool.blob(mine).host_data()
                    assert int(host.min()) == int(host.max()) == index * 1000 + step
                seen = pool.blob("shared").host_data()  # many readers of one buffer
                assert torch.equal(seen, torch.arange(1000))
                with pool.phase("work"):
                    pool.stats()
        except BaseException as failure:  # reported below, with the seed
            failures.append(failure)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "deadlock"
    assert not failures, f"seed {seed}: {failures[0]!r}"
    stats = pool.stats()
    assert stats["num_buffers"] == 9
    held = sum(
        pool.blob(n).data_memory.reserved_bytes + pool.blob(n).grad_memory.reserved_bytes
        for n in pool.names()
    )
    assert stats["reserved_bytes"] == held  # the ledger agrees with the buffers


def test_threads_racing_for_the_last_bytes_never_pass_the_limit() -> None:
    # Check-then-grow must be atomic: with a tiny switch interval, threads interleave inside it.
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(5):
            pool = sm.BufferPool("emulated", limit=4 * MiB)
            start = threading.Barrier(8)
            outcomes: list[str] = []

            def grab(
                index: int,
                pool: sm.BufferPool = pool,
                start: threading.Barrier = start,
                outcomes: list[str] = outcomes,
            ) -> None:
                start.wait()
                try:
                    pool.tensor(f"b{index}", (MiB // 4 + 1024,))  # a bit over 1 MiB each
                    outcomes.append("ok")
                except sm.OutOfMemoryError:
                    outcomes.append("refused")

            threads = [threading.Thread(target=grab, args=(i,)) for i in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert outcomes.count("ok") == 3 and outcomes.count("refused") == 5
            assert pool.stats()["peak_reserved_bytes"] <= 4 * MiB
    finally:
        sys.setswitchinterval(old)


def test_a_phase_is_open_until_its_last_thread_leaves() -> None:
    # A opens, B joins, A leaves, C joins while B is inside: C's growth is in the phase.
    pool = sm.BufferPool("emulated")
    steps = [threading.Event() for _ in range(6)]

    def a() -> None:
        with pool.phase("step"):
            steps[0].set()
            steps[1].wait(10)
        steps[2].set()

    def b() -> None:
        steps[0].wait(10)
        with pool.phase("step"):
            steps[1].set()
            steps[3].wait(10)

    def c() -> None:
        steps[2].wait(10)
        with pool.phase("step"):
            pool.tensor("grown", (MiB,))
            steps[3].set()

    threads = [threading.Thread(target=f) for f in (a, b, c)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    step = pool.phase_stats()["step"]
    assert step["entries"] == 1  # one span, from A's opening to the last one out
    assert step["added_device_bytes"] == 4 * MiB and step["num_grows"] == 1


def test_a_request_refused_in_one_thread_leaves_another_threads_request_whole() -> None:
    # T1's growth fails while T2 asks for the same shape: T2 must get that shape, and the
    # fast path must not remember a view of the shape T1 put back.
    from sharedmem._pool.adaptors import BackendAdaptor

    inside, go = threading.Event(), threading.Event()

    class FailFirstGrowth(BackendAdaptor):
        armed = True

        def _grow(self, block: object, nbytes: int, keep: int) -> tuple[object, int]:
            if FailFirstGrowth.armed:
                FailFirstGrowth.armed = False
                inside.set()
                go.wait(10)
                raise sm.OutOfMemoryError(nbytes, 0, None, "cpu", "a passing allocator failure")
            return super()._grow(block, nbytes, keep)  # type: ignore[arg-type]

    pool = sm.BufferPool("cpu", backend="pageable", adaptors=[FailFirstGrowth])
    pool.tensor("x", (4, 4))
    results: dict[str, object] = {}

    def ask(who: str) -> None:
        if who == "t2":
            go.set()  # T1 fails as soon as T2 is under way
        try:
            results[who] = tuple(pool.tensor("x", (64, 64)).shape)
        except sm.OutOfMemoryError:
            results[who] = "refused"

    first = threading.Thread(target=ask, args=("t1",))
    first.start()
    inside.wait(10)
    second = threading.Thread(target=ask, args=("t2",))
    second.start()
    first.join(10)
    second.join(10)
    assert results == {"t1": "refused", "t2": (64, 64)}
    assert pool.tensor("x", (64, 64)).shape == (64, 64)
    assert pool.blob("x").shape == (64, 64)
