"""BufferPool's figures: stats, counters, phases, the report, trim and release."""

from __future__ import annotations

import gc
import re

import pytest
import torch

import sharedmem as sm
from sharedmem._pool.report import figure_label, is_bytes

MiB = 1 << 20


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
def test_give_back_above_keeps_the_bytes_below_and_only_on_a_stable_address(backend: str) -> None:
    # What a passing state grew a routed arena by is given back; the bytes below (held
    # gradients) stay where they are, every byte intact. A moving buffer gives nothing back.
    pool = sm.BufferPool("cpu", backend=backend)
    pool.tensor("a", (MiB,)).fill_(1.0)
    given = pool.give_back_above("a", 5000)
    stable = backend == "reserved"
    assert given == (4 * MiB - 8192 if stable else 0)
    assert pool.stats()["device_reserved_bytes"] == (8192 if stable else 4 * MiB)
    assert bool((pool.tensor("a", (2000,)) == 1.0).all())
    assert pool.give_back_above("absent", 0) == 0
    with pytest.raises(ValueError, match=r"^sharedmem: nbytes must be >= 0"):
        pool.give_back_above("a", -1)
    with pytest.raises(TypeError, match=r"^sharedmem: buffer name must be a str"):
        pool.give_back_above(3, 0)  # type: ignore[arg-type]


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


@pytest.mark.parametrize("device", ["cpu", "emulated"])
def test_counts_are_counts_and_bytes_are_bytes_in_the_report(device: str) -> None:
    # A pool with every kind of figure: its own traffic, a routed step's calls and bytes, a
    # layer's byte counter. Each figure the totals show carries its unit, and only its own.
    torch.manual_seed(0)
    pool = sm.BufferPool(device)
    pool.host_tensor("input", (1000,)).fill_(1.0)
    pool.blob("input").data()  # host -> device on emulated
    pool.tensor("x", (10,))
    pool.tensor("x", (5000,))  # a growth that copies
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    step = sm.pooled_train_step(model, torch.nn.functional.mse_loss, pool=pool)
    for _ in range(3):
        step(torch.randn(4, 8), torch.randn(4, 2))
    pool.count("offloaded_bytes_total", 4096)
    pool.count("diverged_calls", 2)
    stats = pool.stats()
    counts = {key for key in stats if not is_bytes(key)}
    assert {"num_buffers", "num_grows", "recorded_calls", "replayed_calls"} <= counts
    assert {"arena_served_bytes", "unpooled_bytes_per_call", "offloaded_bytes_total"} <= set(
        stats
    ) - counts
    lines = pool.report().splitlines()
    totals = "\n".join(lines[max(i for i, line in enumerate(lines) if set(line) == {"-"}) :])
    shown = 0
    for key, value in stats.items():
        if key in ("num_buffers", "high_water_bytes"):  # the title's count, the table's column
            continue
        if device == "cpu" and key in ("host_reserved_bytes", "device_reserved_bytes"):
            continue  # one memory: said in words
        label = re.escape(figure_label(key))
        found = re.search(rf"(?<![\w>-]){label} {value:,}(?!,?\d)( bytes)?", totals)
        if found is None:
            assert not value and key not in ("num_grows", "reserved_bytes"), (key, totals)
            continue  # a layer's counter shows once it is not zero
        shown += 1
        assert (found[1] is not None) == is_bytes(key), (key, found[0])
    assert shown >= 12 and stats["replayed_calls"] >= 1 and stats["arena_served_bytes"] > 0
    assert not re.search(r"calls [\d,]+ bytes|grows [\d,]+ bytes", totals)


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
    assert pool.release() == 4096 + 5 * MiB and pool.stats()["reserved_bytes"] == 0  # b and c


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


def test_layers_cannot_count_into_the_pools_own_figures() -> None:
    pool = sm.BufferPool("cpu")
    with pytest.raises(ValueError, match=r"^sharedmem: 'reserved_bytes' is one of the pool's"):
        pool.count("reserved_bytes", 1)
    pool.count_unpooled(5)  # the one shared key, through its own method
    assert pool.stats()["unpooled_bytes_total"] == 5 and pool.stats()["reserved_bytes"] == 0
