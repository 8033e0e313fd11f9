"""BufferPool's limit and out-of-memory errors: a refused growth changes nothing and says
what to do."""

from __future__ import annotations

import pickle

import pytest
import torch
from conftest import DEVICES

import sharedmem as sm
from sharedmem._planning.budget import check_budget

MiB = 1 << 20


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
    # Nothing at all changed: shape, dtype, sizes, every figure and the report, whatever
    # dtype the refused request asked for; reading allocates no more.
    blob = pool.blob("a")
    typing = (blob.shape, blob.dtype, blob.data_memory.size, blob.grad_memory.size)
    stats, report = pool.stats(), pool.report()
    for shape, dtype in (((unit,), torch.float32), ((unit // 2,), torch.float64)):
        with pytest.raises(sm.OutOfMemoryError):
            pool.tensor("a", shape, dtype)
        now = (blob.shape, blob.dtype, blob.data_memory.size, blob.grad_memory.size)
        assert now == typing and pool.stats() == stats and pool.report() == report
    assert blob.host_data().min().item() == 1.0
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
    # The limit caps device bytes: a big host-only staging buffer is no help to trim, and the
    # biggest buffers named are the device's.
    pool = sm.BufferPool("emulated", limit=2 * MiB)
    pool.host_tensor("staging", (8 * MiB,), torch.uint8)
    pool.tensor("act", (MiB,), torch.uint8)
    with pytest.raises(sm.OutOfMemoryError) as caught:
        pool.tensor("more", (2 * MiB,), torch.uint8)
    biggest = str(caught.value).split("biggest buffers: ")[1].splitlines()[0]
    assert biggest == f"'act' {MiB:,} bytes"


def test_limit_caps_device_bytes_only_on_two_sided_devices() -> None:
    pool = sm.BufferPool("emulated", limit=MiB)
    pool.host_tensor("staging", (MiB,))  # 4 MiB of host memory: not limited
    assert pool.stats()["host_reserved_bytes"] >= 4 * MiB
    with pytest.raises(sm.OutOfMemoryError):
        pool.tensor("staging", (MiB,))  # the same bytes on the device are
    assert pool.limit == MiB


def test_a_limit_takes_the_spellings_of_a_budget() -> None:
    # One spelling of a size wherever one is taken: a pool's limit as a step's budget.
    assert sm.BufferPool(limit="1G").limit == 1 << 30
    pool = sm.BufferPool()
    for text, nbytes in [
        ("8G", 8 << 30),
        ("512M", 512 << 20),
        ("64KiB", 64 << 10),
        ("1_000", 1000),
    ]:
        pool.set_limit(text)
        assert pool.limit == nbytes == check_budget(text, None)
    pool.set_limit(None)
    with pytest.raises(ValueError, match=r"^sharedmem: limit must be bytes: an int >= 0 or a "):
        sm.BufferPool(limit=-1)
    with pytest.raises(ValueError, match=r"^sharedmem: limit must be bytes: .*'8G'.*got '1.5G'"):
        pool.set_limit("1.5G")
    with pytest.raises(TypeError, match=r"^sharedmem: limit must be bytes: .*got 1.5 \(float\)"):
        pool.set_limit(1.5)  # type: ignore[arg-type]
    assert pool.limit is None


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
