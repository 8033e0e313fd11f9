"""BufferPool: sharing by name, the fast path, limit and OOM, stats, report, phases, threads."""

from __future__ import annotations

import gc
import pickle
import sys
import threading
import weakref

import numpy as np
import pytest
import torch
from conftest import DEVICES

import sharedmem as sm

MiB = 1 << 20


@pytest.mark.parametrize("device", DEVICES)
def test_a_name_is_one_memory_grown_to_the_larger_need(device: str) -> None:
    pool = sm.BufferPool(device)
    # Sized from the allocation granularity (2 MiB on a GPU with vmm), so that the float64
    # request needs more than the float32 one was given on every backend.
    unit = max(MiB, sm.SyncedMemory(device=device).placement.device_backend.granularity)
    rows = unit // 4096  # rows of 1024 float32: ``unit`` bytes (1 MiB on cpu and emulated)
    train = pool.tensor("fc1.out", (rows, 1024))
    evaluation = pool.tensor("fc1.out", (rows - 6, 1024), torch.float64)  # almost twice
    assert evaluation.dtype == torch.float64 and evaluation.shape == (rows - 6, 1024)
    assert len(pool) == 1 and "fc1.out" in pool and pool.names() == ["fc1.out"]
    memory = pool.blob("fc1.out").data_memory
    assert memory.device_capacity >= (rows - 6) * 1024 * 8 > unit
    assert pool.stats()["device_reserved_bytes"] == memory.device_capacity
    again = pool.tensor("fc1.out", (rows, 1024))
    assert pool.stats()["num_grows"] == 2  # first allocation, then the float64 growth
    if device != "cuda":  # stable addresses on cpu and emulated
        assert train.data_ptr() == evaluation.data_ptr() == again.data_ptr()


def test_steady_state_does_not_grow_and_hits_the_fast_path() -> None:
    pool = sm.BufferPool("emulated")
    shapes = [(64, 128), (32, 128), (64, 100), (1, 1)]
    for shape in shapes:  # warm-up: grows once to the largest
        pool.tensor("act", shape)
    grows = pool.stats()["num_grows"]
    for _ in range(50):
        for shape in shapes:
            view = pool.tensor("act", shape)
            assert view.shape == shape
    assert pool.stats()["num_grows"] == grows
    first, second = pool.tensor("act", (4, 4)), pool.tensor("act", (4, 4))
    assert first is not second and first.data_ptr() == second.data_ptr()
    first.t_()  # changing a view's metadata does not disturb the next call's view
    assert pool.tensor("act", (4, 4)).shape == (4, 4) and pool.tensor("act", (4, 8)).shape == (4, 8)


def test_anything_that_moves_storage_invalidates_the_fast_path() -> None:
    pool = sm.BufferPool("emulated", backend="pageable")  # growth moves
    small = pool.tensor("x", (10,))
    small.fill_(3.0)
    pool.tensor("x", (100_000,))  # grows: new storage
    view = pool.tensor("x", (10,))
    assert view.data_ptr() != small.data_ptr()
    assert view.tolist() == [3.0] * 10  # content moved with it
    pool.host_tensor("x", (10,)).fill_(4.0)  # the host becomes the head
    assert pool.tensor("x", (10,)).tolist() == [4.0] * 10  # the device view syncs again
    pool.trim()  # shrinks (moves again)
    assert pool.tensor("x", (10,)).tolist() == [4.0] * 10
    pool.blob("x").data_memory.release()
    after = pool.tensor("x", (10,))
    assert pool.blob("x").data_memory.device_capacity > 0 and after.shape == (10,)


def test_shapes_spelt_as_ints_lists_and_sizes_all_work() -> None:
    pool = sm.BufferPool("cpu")
    assert pool.tensor("a", 5).shape == (5,)
    assert pool.tensor("a", [2, 3]).shape == (2, 3)
    assert pool.tensor("a", torch.Size([3, 2])).shape == (3, 2)
    assert pool.tensor("a", (np.int64(6),)).shape == (6,)


@pytest.mark.parametrize("device", DEVICES)
def test_a_refused_growth_loses_nothing(device: str) -> None:
    # Sized from the allocation granularity (2 MiB on a GPU with vmm): "a" and "b" fit under
    # the limit, and "a" grown to four units does not, on every backend.
    unit = max(MiB, sm.SyncedMemory(device=device).placement.device_backend.granularity)
    pool = sm.BufferPool(device, limit=3 * unit)
    pool.tensor("a", (unit // 4,)).fill_(1.0)  # one unit (1 MiB on cpu and emulated)
    pool.tensor("b", (unit // 8,)).fill_(2.0)  # half a unit: rounds up to one at most
    before = pool.stats()
    with pytest.raises(sm.OutOfMemoryError) as caught:
        pool.tensor("a", (unit,))  # four units: past the limit
    err = caught.value
    assert err.limit == 3 * unit and err.requested >= 4 * unit
    assert err.reserved == before["device_reserved_bytes"]
    after = pool.stats()
    assert after["reserved_bytes"] == before["reserved_bytes"]
    assert after["num_grows"] == before["num_grows"]
    assert pool.tensor("a", (unit // 4,)).min().item() == 1.0  # content kept
    assert pool.tensor("b", (unit // 8,)).max().item() == 2.0
    with pytest.raises(sm.OutOfMemoryError):
        pool.tensor("c", (unit,))  # a new buffer is refused too, and leaves no name behind
    assert "c" not in pool and pool.names() == ["a", "b"] and pool.stats()["num_buffers"] == 2
    with pytest.raises(sm.OutOfMemoryError):
        pool.host_tensor("c", (4 * unit,)) if device == "cpu" else pool.tensor("c", (4 * unit,))
    assert "c" not in pool
    pool.set_limit(None)
    assert pool.tensor("a", (unit,)).shape == (unit,)  # the fix works


def test_the_out_of_memory_message_says_what_and_what_to_do() -> None:
    pool = sm.BufferPool("emulated", limit=2 * MiB)
    for name, n in (("small", 1000), ("medium", 100_000), ("large", 200_000), ("tiny", 10)):
        pool.tensor(name, (n,))
    with pytest.raises(sm.OutOfMemoryError) as caught:
        pool.tensor("huge", (MiB,))
    text = str(caught.value)
    assert text.startswith("sharedmem: out of memory on emulated")
    assert "'huge'" in text  # the buffer
    assert f"{4 * MiB:,}" in text  # the request
    assert f"{2 * MiB:,}" in text  # the limit
    assert f"{pool.stats()['device_reserved_bytes']:,} reserved" in text
    assert "biggest buffers: 'large' 802,816 bytes, 'medium' 401,408 bytes, 'small'" in text
    assert "'tiny'" not in text  # only three
    assert "trim()" in text and "set_limit()" in text and "smaller batch" in text
    assert pickle.loads(pickle.dumps(caught.value)).limit == 2 * MiB


def test_limit_caps_device_bytes_only_on_two_sided_devices() -> None:
    pool = sm.BufferPool("emulated", limit=MiB)
    pool.host_tensor("staging", (MiB,))  # 4 MiB of host memory: not limited
    assert pool.stats()["host_reserved_bytes"] >= 4 * MiB
    with pytest.raises(sm.OutOfMemoryError):
        pool.tensor("staging", (MiB,))  # the same bytes on the device are
    assert pool.limit == MiB


def test_limit_validation() -> None:
    with pytest.raises(ValueError, match=r"^sharedmem: limit must be >= 0, got -1"):
        sm.BufferPool(limit=-1)
    pool = sm.BufferPool()
    with pytest.raises(TypeError, match=r"^sharedmem: limit must be an integer, got float"):
        pool.set_limit(1.5)  # type: ignore[arg-type]
    assert pool.limit is None


STATS_KEYS = {
    "num_buffers",
    "reserved_bytes",
    "device_reserved_bytes",
    "host_reserved_bytes",
    "active_bytes",
    "peak_reserved_bytes",
    "num_grows",
    "grow_copy_bytes",
    "host_to_device_bytes",
    "device_to_host_bytes",
}


def test_stats_keys_and_traffic_on_emulated() -> None:
    pool = sm.BufferPool("emulated")
    stats = pool.stats()
    assert set(stats) >= STATS_KEYS and all(type(v) is int for v in stats.values())
    pool.host_tensor("x", (1000,)).fill_(1.0)  # 4,000 bytes written on the host
    pool.tensor("x", (1000,))  # write intent on the device: takes the host's bytes first
    pool.host_tensor("x", (500,))  # back to the host: 2,000 bytes are needed there
    stats = pool.stats()
    assert stats["host_to_device_bytes"] == 4000
    assert stats["device_to_host_bytes"] == 4000  # the head must hold every written byte
    assert stats["num_buffers"] == 1 and stats["num_grows"] == 2
    assert stats["reserved_bytes"] == stats["host_reserved_bytes"] + stats["device_reserved_bytes"]
    assert stats["active_bytes"] == 2000


def test_cpu_counts_the_one_memory_once() -> None:
    pool = sm.BufferPool("cpu")
    pool.tensor("x", (1000,))
    pool.host_tensor("x", (1000,))
    stats = pool.stats()
    assert stats["reserved_bytes"] == stats["device_reserved_bytes"]
    assert stats["reserved_bytes"] == stats["host_reserved_bytes"] == 4096


def test_peak_counts_old_and_new_blocks_during_a_moving_growth() -> None:
    pool = sm.BufferPool("emulated", backend="pageable")
    pool.tensor("x", (1000,))  # 4,032 bytes (64-byte granularity)
    pool.tensor("x", (10_000,))  # moves: both blocks held for a moment
    stats = pool.stats()
    assert stats["device_reserved_bytes"] == 40_000
    assert stats["peak_reserved_bytes"] == 40_000 + 4_032
    assert stats["grow_copy_bytes"] == 4_000
    stable = sm.BufferPool("emulated")
    stable.tensor("x", (1000,))
    stable.tensor("x", (10_000,))
    assert stable.stats()["peak_reserved_bytes"] == stable.stats()["reserved_bytes"] == 40_960


def test_trim_and_release_give_bytes_back() -> None:
    pool = sm.BufferPool("emulated")
    pool.tensor("a", (MiB,)).fill_(1.0)
    pool.tensor("a", (1000,))
    freed = pool.trim()
    assert freed == 4 * MiB - 4096
    assert pool.stats()["device_reserved_bytes"] == 4096
    assert pool.tensor("a", (1000,)).max().item() == 1.0
    assert pool.release() == 4096 and pool.stats()["reserved_bytes"] == 0


@pytest.mark.parametrize("backend", ["reserved", "pageable"])
def test_what_trim_promises_to_views_taken_before_it(backend: str) -> None:
    # The documented promise (BufferPool.trim): on a stable-address backend a view of the bytes
    # below the size still reaches the buffer after trim(); on a moving backend trim() moves
    # the buffer and such a view no longer does (call trim() between steps, when no thread
    # holds a view), but nothing is lost: a view taken after trim() has every byte.
    pool = sm.BufferPool("cpu", backend=backend)
    pool.tensor("a", (MiB,)).fill_(1.0)
    before = pool.tensor("a", (1000,))
    assert pool.trim() > 0
    after = pool.tensor("a", (1000,))
    assert bool((after == 1.0).all())
    before.fill_(2.0)
    reaches = bool((pool.tensor("a", (1000,)) == 2.0).all())
    assert reaches is (backend == "reserved")
    assert pool.blob("a").data_memory.placement.host.stable_address is (backend == "reserved")


def test_report_is_biggest_first_with_totals_last() -> None:
    pool = sm.BufferPool("emulated")
    pool.tensor("small", (10,))
    pool.tensor("big", (100_000,))
    pool.tensor("middle", (5_000,), torch.float64)
    pool.blob("small").mutable_grad()
    lines = pool.report().splitlines()
    assert lines[0].startswith("BufferPool on emulated: 3 buffers (4 rows: a gradient")
    assert lines[1].split()[:4] == ["name", "shape", "dtype", "size"]
    names = [line.split()[0] for line in lines[3:7]]
    assert names[:2] == ["big", "middle"] and set(names[2:]) == {"small", "small.grad"}
    assert lines[-2].startswith("reserved ") and lines[-1].startswith("grows ")
    assert "100000" in lines[3] and "float32" in lines[3] and "AT_DEVICE" in lines[3]


def test_phases_attribute_growth_and_traffic() -> None:
    pool = sm.BufferPool("emulated")
    for _ in range(2):
        with pool.phase("train"):
            pool.host_tensor("input", (256, 10)).fill_(1.0)  # staged on the host,
            pool.blob("input").data()  # read on the device
            pool.tensor("hidden", (256, 100))
        with pool.phase("eval"):
            pool.host_tensor("input", (250, 10)).fill_(1.0)
            pool.blob("input").data()
            pool.tensor("hidden", (250, 100))
            pool.tensor("accuracy", (1,))
    phases = pool.phase_stats()
    assert phases["train"]["entries"] == phases["eval"]["entries"] == 2
    assert phases["train"]["added_reserved_bytes"] == pool.stats()["reserved_bytes"] - 4096
    assert phases["eval"]["added_reserved_bytes"] == 4096  # only the accuracy buffer
    assert phases["train"]["host_to_device_bytes"] == 2 * 256 * 10 * 4
    assert phases["eval"]["host_to_device_bytes"] == 2 * 250 * 10 * 4
    assert phases["train"]["device_to_host_bytes"] == phases["eval"]["device_to_host_bytes"] == 0
    assert phases["eval"]["peak_reserved_bytes"] == pool.stats()["peak_reserved_bytes"]
    with pool.phase("train"), pool.phase("train"):  # nesting counts once
        pass
    assert pool.phase_stats()["train"]["entries"] == 3


def test_count_unpooled() -> None:
    pool = sm.BufferPool()
    pool.count_unpooled(1000)
    pool.count_unpooled(24)
    assert pool.stats()["unpooled_bytes_total"] == 1024
    with pytest.raises(ValueError, match=r"^sharedmem: nbytes must be >= 0"):
        pool.count_unpooled(-1)


@pytest.mark.parametrize(
    ("name", "error", "message"),
    [
        ("", ValueError, r"^sharedmem: buffer name must not be empty$"),
        (3, TypeError, r"^sharedmem: buffer name must be a str, got int$"),
        (None, TypeError, r"^sharedmem: buffer name must be a str, got NoneType$"),
    ],
)
def test_bad_names(name: object, error: type[Exception], message: str) -> None:
    pool = sm.BufferPool()
    with pytest.raises(error, match=message):
        pool.tensor(name, (1,))  # type: ignore[arg-type]
    with pytest.raises(error, match=message):
        pool.blob(name)  # type: ignore[arg-type]
    with pytest.raises(error, match=message.replace("buffer", "phase")), pool.phase(name):  # type: ignore[arg-type]
        pass
    with pytest.raises(error, match=message.replace("buffer", "counter")):
        pool.count(name, 1)  # type: ignore[arg-type]
    assert len(pool) == 0


def test_bad_shapes_and_dtypes_change_nothing() -> None:
    pool = sm.BufferPool()
    pool.tensor("x", (4,)).fill_(1.0)
    with pytest.raises(ValueError, match=r"^sharedmem: shape dimension 0 must be >= 0"):
        pool.tensor("x", (-4,))
    with pytest.raises(TypeError, match=r"^sharedmem: dtype must be a torch\.dtype"):
        pool.tensor("x", (4,), "float32")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^sharedmem: shape dimension 0 of \(1\.5,\)"):
        pool.host_tensor("y", (1.5,))  # type: ignore[arg-type]
    assert pool.tensor("x", (4,)).tolist() == [1.0] * 4


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


def test_layers_count_their_bytes_and_the_report_shows_them() -> None:
    pool = sm.BufferPool("emulated")
    pool.tensor("x", (10,))
    assert "offloaded" not in pool.report()
    pool.count("offloaded_bytes_total", 4096)
    pool.count("offloaded_bytes_total", 4096)
    pool.count_unpooled(100)
    stats = pool.stats()
    assert stats["offloaded_bytes_total"] == 8192 and stats["unpooled_bytes_total"] == 100
    last = pool.report().splitlines()[-1]
    assert "unpooled total 100 bytes" in last and "offloaded total 8,192 bytes" in last
    with pytest.raises(ValueError, match=r"^sharedmem: nbytes must be >= 0"):
        pool.count("offloaded_bytes_total", -1)


def test_adaptors_wrap_both_sides_innermost_first() -> None:
    from sharedmem._backends import Backend, Block
    from sharedmem._pool.adaptors import BackendAdaptor

    calls: list[str] = []

    class Recording(BackendAdaptor):
        def __init__(self, upstream: Backend, tag: str) -> None:
            super().__init__(upstream)
            self.tag = tag

        def _allocate(self, nbytes: int) -> Block:
            calls.append(self.tag)
            return super()._allocate(nbytes)

    pool = sm.BufferPool(
        "emulated", adaptors=[lambda b: Recording(b, "inner"), lambda b: Recording(b, "outer")]
    )
    pool.host_tensor("x", (10,))
    pool.tensor("y", (10,))
    assert calls == ["outer", "inner", "outer", "inner"]
    assert pool.stats()["reserved_bytes"] == 2 * 4096  # accounted around the adaptors


@pytest.mark.parametrize("device", DEVICES)
def test_the_fast_path_follows_a_name_to_the_memory_it_now_shares(device: str) -> None:
    # Regression (found by the stress runner): share_data switches a name to another memory
    # without changing either memory's stamp, and pool.tensor / host_tensor kept handing out
    # views of the memory the name had left, so writes went where no reader looked.
    pool = sm.BufferPool(device)
    pool.tensor("x", (4,), torch.uint8).fill_(1)
    pool.host_tensor("x", (4,), torch.uint8)
    y = pool.blob("y", (4,), torch.uint8)
    y.mutable_data().fill_(2)
    pool.blob("x").share_data(y)
    assert pool.tensor("x", (4,), torch.uint8).tolist() == [2, 2, 2, 2]
    pool.tensor("x", (4,), torch.uint8).fill_(3)
    assert y.data().tolist() == [3, 3, 3, 3]
    pool.host_tensor("x", (4,), torch.uint8).fill_(4)
    assert y.data().tolist() == [4, 4, 4, 4]


def test_a_memory_a_blob_dropped_for_share_data_leaves_the_accounting() -> None:
    pool = sm.BufferPool("emulated")
    pool.tensor("a", (MiB,))  # 4 MiB
    pool.tensor("b", (1000,))
    before = pool.stats()["device_reserved_bytes"]
    pool.blob("a").share_data(pool.blob("b"))  # a's 4 MiB memory is no one's now
    pool.tensor("a", (1000,))  # (the fast path remembered the old memory until now)
    gc.collect()
    assert pool.stats()["device_reserved_bytes"] == before - 4 * MiB
    assert pool.release() == 4096 and pool.stats()["reserved_bytes"] == 0


def test_a_dropped_pool_frees_its_memory_without_waiting_for_the_collector() -> None:
    # Each block reserves a large address range; a pool kept alive by a reference cycle until
    # the next cyclic collection could exhaust the address space of a loop that makes pools.
    gc.disable()
    try:
        pool = sm.BufferPool("emulated", timeline=True)
        with pool.phase("train"):
            pool.tensor("x", (1000,))
        pool.set_limit(1 << 30)
        memory = weakref.ref(pool.blob("x").data_memory)
        del pool
        assert memory() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("device", ["cpu", "emulated"])
def test_views_outlive_the_pool_and_blobs_that_made_them(device: str) -> None:
    # Nothing is freed implicitly: a collected memory leaves the accounting, not its bytes.
    def forward(x: torch.Tensor) -> torch.Tensor:
        pool = sm.BufferPool(device)
        out = pool.tensor("out", tuple(x.shape))
        return torch.mul(x, 2, out=out)

    assert forward(torch.ones(3)).tolist() == [2.0] * 3
    a, b = sm.Blob((4,), device=device), sm.Blob((4,), device=device)
    view = b.mutable_data()
    view.fill_(5)
    b.share_data(a)  # b's old memory is nobody's now
    gc.collect()
    assert view.tolist() == [5.0] * 4


def test_release_and_trim_do_not_keep_old_blocks_alive_through_the_fast_path() -> None:
    pool = sm.BufferPool("emulated", backend="pageable")
    pool.tensor("x", (MiB,))  # a moving backend: the block goes with its last reference
    block = weakref.ref(pool.blob("x").data_memory._device.block.tensor)  # type: ignore[union-attr]
    assert pool.release() == 4 * MiB
    assert block() is None
    pool.tensor("x", (MiB,))
    pool.tensor("x", (10,))
    block = weakref.ref(pool.blob("x").data_memory._device.block.tensor)  # type: ignore[union-attr]
    assert pool.trim() > 0
    assert block() is None


@pytest.mark.parametrize("backend", ["reserved", "pageable"])
def test_an_allocator_failure_is_an_out_of_memory_error_naming_the_buffer(backend: str) -> None:
    pool = sm.BufferPool("cpu", backend=backend)
    pool.tensor("small", (10,)).fill_(1.0)
    with pytest.raises(sm.OutOfMemoryError) as caught:
        pool.tensor("huge", (1 << 50,), torch.uint8)  # a PiB: no allocator has it
    text = str(caught.value)
    assert caught.value.limit is None and caught.value.requested >= 1 << 50
    # The reserved range refuses what the machine cannot hold before mapping it; the pageable
    # allocator tries and fails.
    why = "memory and swap" if backend == "reserved" else "the allocator said"
    assert "'huge'" in text and "'small'" in text and why in text
    assert pool.tensor("small", (10,)).tolist() == [1.0] * 10


def test_a_memory_left_by_share_data_leaves_the_accounting_at_once() -> None:
    # The fast path had cached a view of the memory 'a' leaves: it must not keep it (and
    # its bytes) counted, or growth elsewhere is refused for memory nobody uses.
    pool = sm.BufferPool("emulated", limit=6 * MiB)
    pool.tensor("a", (MiB,), torch.uint8)
    pool.tensor("b", (4096,), torch.uint8)
    pool.tensor("c", (4096,), torch.uint8)
    pool.blob("a").share_data(pool.blob("b"))
    gc.collect()
    assert pool.stats()["device_reserved_bytes"] == 2 * 4096
    pool.tensor("c", (5 * MiB,), torch.uint8)  # fits: only 8 KiB is really held
    assert (
        pool.tensor("a", (4096,), torch.uint8).data_ptr()
        == pool.tensor("b", (4096,), torch.uint8).data_ptr()
    )


@pytest.mark.parametrize("device", ["cpu", "emulated"])
def test_a_refused_growth_changes_nothing_at_all(device: str) -> None:
    pool = sm.BufferPool(device, limit=MiB)
    pool.tensor("a", (1000,)).fill_(2.0)
    blob = pool.blob("a")
    before = (blob.shape, blob.dtype, blob.data_memory.size, blob.grad_memory.size)
    stats, report = pool.stats(), pool.report()
    for shape, dtype in (((MiB,), torch.float32), ((MiB // 2,), torch.float64)):
        with pytest.raises(sm.OutOfMemoryError):
            pool.tensor("a", shape, dtype)
        after = (blob.shape, blob.dtype, blob.data_memory.size, blob.grad_memory.size)
        assert after == before and pool.stats() == stats and pool.report() == report
    assert blob.host_data().tolist() == [2.0] * 1000  # and reading allocates no more
    assert pool.stats()["host_reserved_bytes"] <= 4096


def test_counters_never_go_backwards() -> None:
    # A memory that leaves the pool (share_data) leaves its traffic in the pool's history.
    pool = sm.BufferPool("emulated")
    with pool.phase("work"):
        pool.host_tensor("a", (1000,)).fill_(1.0)
        pool.blob("a").data()  # 4,000 bytes host -> device
        pool.tensor("b", (10,))
        pool.blob("a").share_data(pool.blob("b"))
    gc.collect()
    stats, work = pool.stats(), pool.phase_stats()["work"]
    assert stats["host_to_device_bytes"] == work["host_to_device_bytes"] == 4000
    assert stats["num_grows"] == work["num_grows"] == 3  # a: host, device; b: device
    assert all(value >= 0 for value in work.values())


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


def test_the_fast_path_checks_what_the_slow_path_checks() -> None:
    pool = sm.BufferPool("cpu")
    pool.tensor("a", (2, 3))
    pool.tensor("b", 1)
    with pytest.raises(TypeError, match=r"^sharedmem: shape dimension 0 of \(2\.0, 3\.0\)"):
        pool.tensor("a", (2.0, 3.0))  # equal to (2, 3), but no shape
    with pytest.raises(TypeError, match=r"^sharedmem: shape must be an integer"):
        pool.tensor("b", True)  # type: ignore[arg-type]
    for _ in range(2):  # an array is no shape, cached name or not (numpy ints in one are)
        with pytest.raises(TypeError, match=r"^sharedmem: shape must be an integer or a seq"):
            pool.tensor("a", np.array([2, 3]))  # type: ignore[arg-type]
    for bad in (["x"], {"x": 1}):
        with pytest.raises(TypeError, match=r"^sharedmem: buffer name must be a str"):
            pool.tensor(bad, (1,))  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"^sharedmem: buffer name must be a str"):
            pool.host_tensor(bad, (1,))  # type: ignore[arg-type]
        assert bad not in pool  # a name is a str: anything else is simply not in the pool


def test_a_rejected_call_creates_no_name_and_changes_no_buffer() -> None:
    pool = sm.BufferPool("cpu")
    for name, shape, dtype in (("n1", (-1,), torch.float32), ("n2", (2,), "float32")):
        with pytest.raises((TypeError, ValueError), match=r"^sharedmem: "):
            pool.tensor(name, shape, dtype)  # type: ignore[arg-type]
    assert pool.names() == [] and pool.stats()["num_buffers"] == 0
    pool.tensor("p", (4,))
    with pytest.raises(ValueError, match=r"^sharedmem: shape dimension 0 must be >= 0"):
        pool.tensor("p", (-1,), torch.float64)
    assert pool.blob("p").dtype == torch.float32 and pool.blob("p").shape == (4,)


def test_list_shapes_take_the_fast_path_too(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = sm.BufferPool("cpu")
    shape = [8, 16]
    pool.tensor("a", shape)
    slow: list[str] = []
    acquire = pool._acquire
    monkeypatch.setattr(pool, "_acquire", lambda *a: slow.append("x") or acquire(*a))
    for _ in range(5):
        assert pool.tensor("a", [8, 16]).shape == (8, 16)
    shape[0] = 4  # the caller's list changes: the pool kept its own copy
    assert pool.tensor("a", shape).shape == (4, 16)
    assert slow == ["x"]  # only the changed shape took the slow path


def test_a_moving_growth_outside_the_fast_path_drops_its_cached_views() -> None:
    # Otherwise the cache would keep the old block alive while the ledger says it is gone.
    pool = sm.BufferPool("emulated", backend="pageable")
    old = weakref.ref(pool.tensor("x", (10,)).untyped_storage())
    pool.blob("x").reshape(100_000).mutable_data()  # grows (moves) through the blob
    gc.collect()
    assert old() is None or old().data_ptr() == pool.tensor("x", (10,)).data_ptr()


def test_a_pool_buffer_shares_only_memory_of_its_own_pool() -> None:
    pool = sm.BufferPool("emulated", limit=MiB)
    outside = sm.Blob((10,), device="emulated")
    with pytest.raises(ValueError, match=r"^sharedmem: buffer 'x' of a BufferPool can only share"):
        pool.blob("x").share_data(outside)
    outside.share_data(pool.blob("x"))  # the other way round: the pool's memory, limited
    with pytest.raises(sm.OutOfMemoryError):
        outside.reshape(MiB).mutable_data()
    other = sm.BufferPool("emulated")
    with pytest.raises(ValueError, match=r"can only share memory of the same pool"):
        pool.blob("x").share_grad(other.blob("y"))


def test_the_out_of_memory_message_names_the_biggest_device_buffers() -> None:
    # The limit caps device bytes: a big host-only staging buffer is no help to trim.
    pool = sm.BufferPool("emulated", limit=2 * MiB)
    pool.host_tensor("staging", (8 * MiB,), torch.uint8)
    pool.tensor("act", (MiB,), torch.uint8)
    with pytest.raises(sm.OutOfMemoryError) as caught:
        pool.tensor("more", (2 * MiB,), torch.uint8)
    biggest = str(caught.value).split("biggest buffers: ")[1].splitlines()[0]
    assert biggest == f"'act' {MiB:,} bytes"


def test_layers_cannot_count_into_the_pools_own_figures() -> None:
    pool = sm.BufferPool("cpu")
    with pytest.raises(ValueError, match=r"^sharedmem: 'reserved_bytes' is one of the pool's"):
        pool.count("reserved_bytes", 1)
    pool.count_unpooled(5)  # the one shared key, through its own method
    assert pool.stats()["unpooled_bytes_total"] == 5 and pool.stats()["reserved_bytes"] == 0


def test_on_a_moving_backend_the_limit_caps_the_peak_of_a_growth_too() -> None:
    # Growing 20,480 -> 40,960 bytes holds both blocks while it copies: 61,440 at the peak.
    pool = sm.BufferPool("emulated", backend="pageable", limit=50_000)
    pool.tensor("x", (20_480,), torch.uint8).fill_(5)
    with pytest.raises(sm.OutOfMemoryError, match=r"moves when it grows: the old 20,480 bytes"):
        pool.tensor("x", (40_960,), torch.uint8)
    assert pool.tensor("x", (20_480,), torch.uint8).eq(5).all()
    pool.set_limit(61_440)
    pool.tensor("x", (40_960,), torch.uint8)
    assert (
        pool.stats()["peak_reserved_bytes"] <= 61_440
        and pool.stats()["device_reserved_bytes"] == 40_960
    )


class _DeferredCopies:
    """A copy engine whose copies run only when someone waits for them: a copy in flight
    stays in flight until the memory settles it, whatever the threads' timing."""

    class Pending:
        def __init__(self, copy: object, args: tuple[object, ...]) -> None:
            self.copy, self.args, self.done = copy, args, False

        def result(self) -> None:
            if not self.done:
                self.done = True
                self.copy(*self.args)  # type: ignore[operator]

    def submit(self, copy: object, *args: object) -> _DeferredCopies.Pending:
        return self.Pending(copy, args)


@pytest.mark.parametrize("backend", ["reserved", "pageable"])
def test_the_fast_path_waits_for_copies_to_and_from_tensors_outside(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sharedmem._backends import emulated

    monkeypatch.setattr(emulated, "_copy_engine", _DeferredCopies)
    pool = sm.BufferPool("emulated", backend=backend)
    pool.host_tensor("x", (1024,), torch.uint8).fill_(1)
    memory = pool.blob("x").data_memory
    target = torch.zeros(1024, dtype=torch.uint8)
    fence = memory.upload_async(target)  # reads the host bytes
    pool.host_tensor("x", (1024,), torch.uint8).fill_(2)  # must wait for that read first
    assert fence is not None
    fence.wait_host()
    assert target.eq(1).all()
    memory.download_async(torch.full((1024,), 7, dtype=torch.uint8))  # writes the host bytes
    view = pool.host_tensor("x", (1024,), torch.uint8)
    assert view.eq(7).all()  # the copy landed before the view was handed out
    view.fill_(9)
    assert memory.host_data().eq(9).all() and memory.device_data().eq(9).all()


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


def test_a_growth_past_a_reserved_range_counts_both_blocks_against_the_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from sharedmem._backends import host

    monkeypatch.setattr(host, "ADDRESS_BUDGET", 0)  # every range: twice its request
    pool = sm.BufferPool("emulated", limit=3 * MiB + MiB // 2)
    pool.tensor("x", (MiB,), torch.uint8).fill_(4)  # a 2 MiB range
    with pytest.raises(sm.OutOfMemoryError, match=r"moves when it grows: the old 1,048,576"):
        pool.tensor("x", (3 * MiB,), torch.uint8)  # past the range: 1 + 3 MiB at once
    assert pool.tensor("x", (MiB,), torch.uint8).eq(4).all()
    pool.set_limit(4 * MiB)
    pool.tensor("x", (3 * MiB,), torch.uint8)
    assert pool.stats()["peak_reserved_bytes"] - pool.stats()["host_reserved_bytes"] <= 4 * MiB


def test_a_shape_holding_something_mutable_is_compared_every_time() -> None:
    pool = sm.BufferPool("cpu")
    rows = torch.tensor(4)
    shape = (rows, 3)  # accepted like any index; but it can change in place
    assert pool.tensor("x", shape).shape == (4, 3)
    rows.fill_(8)
    assert pool.tensor("x", shape).shape == (8, 3)


def test_autograd_sees_a_saved_view_changed_through_a_view_taken_after_a_growth() -> None:
    pool = sm.BufferPool("cpu")
    weight = torch.ones(4, requires_grad=True)
    saved = pool.tensor("act", (4,))
    saved.fill_(2.0)
    loss = (saved * weight).sum()  # autograd saves the pool view
    pool.tensor("act", (MiB,))[:4].fill_(5.0)  # grows in place, then overwrites it
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
