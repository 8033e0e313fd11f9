"""Fault injection: the k-th allocation, growth, shrink or copy fails with the right error, and
nothing is lost: every byte written reads back from both sides afterwards."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from conftest import DEVICES, TWO_SIDED

import sharedmem as sm
from sharedmem._stress._faults import CorruptingBackend, Fault
from sharedmem.testing import FaultInjector

PLACEMENTS = [
    pytest.param(("cpu", "reserved"), id="cpu-reserved"),
    pytest.param(("cpu", "pageable"), id="cpu-pageable"),
    *TWO_SIDED,
]


def pattern(n: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8))


def both_sides(blob: sm.Blob) -> tuple[torch.Tensor, torch.Tensor]:
    host = blob.host_data().view(torch.uint8).reshape(-1).clone()
    device = blob.data().view(torch.uint8).reshape(-1).cpu()
    return host, device


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_kth_allocation_fails_as_out_of_memory_and_the_others_keep_their_bytes(
    device: str, k: int
) -> None:
    faults = FaultInjector(allocate=k)
    pool = sm.BufferPool(device, adaptors=[faults])
    for i in range(1, k):  # each first touch of a device side allocates once
        pool.tensor(f"x{i}", (100,), torch.uint8).copy_(pattern(100, i))
    with pytest.raises(sm.OutOfMemoryError) as caught:
        pool.tensor(f"x{k}", (100,), torch.uint8)
    error = caught.value
    assert error.limit is None and error.requested >= 100
    assert str(error).startswith("sharedmem: out of memory") and f"'x{k}'" in str(error)
    assert faults.fired == [Fault("allocate", k, error.requested)]
    assert pool.blob(f"x{k}").data_memory.reserved_bytes == 0
    for i in range(1, k):
        host, dev = both_sides(pool.blob(f"x{i}"))
        assert torch.equal(host, pattern(100, i)) and torch.equal(dev, pattern(100, i))
    pool.tensor(f"x{k}", (100,), torch.uint8).fill_(7)  # the fault was one event: retry works
    assert int(pool.blob(f"x{k}").host_data().sum()) == 700


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_kth_growth_fails_and_leaves_content_and_capacities_as_they_were(
    placement: tuple[str, str], k: int
) -> None:
    device, backend = placement
    faults = FaultInjector(grow=k)
    pool = sm.BufferPool(device, backend=backend, adaptors=[faults])
    size = 1000
    pool.tensor("x", (size,), torch.uint8).copy_(pattern(size, 0))
    # Each step must pass the capacity: 2 MiB chunks on vmm.
    more = max(5000, pool.blob("x").data_memory.placement.device_backend.granularity)
    for step in range(1, k + 1):
        blob = pool.blob("x")
        memory = blob.data_memory
        before = (memory.host_capacity, memory.device_capacity)
        grown = size + more
        if step < k:
            view = pool.tensor("x", (grown,), torch.uint8)
            view[size:].copy_(pattern(grown - size, step))
            size = grown
            continue
        with pytest.raises(sm.OutOfMemoryError) as caught:
            pool.tensor("x", (grown,), torch.uint8)
        assert caught.value.limit is None
        assert (memory.host_capacity, memory.device_capacity) == before
    want = torch.cat([pattern(1000, 0)] + [pattern(more, s) for s in range(1, k)])
    host, dev = both_sides(pool.blob("x").reshape(size))
    assert torch.equal(host, want) and torch.equal(dev, want)
    assert [f.kind for f in faults.fired] == ["grow"]


@pytest.mark.parametrize("placement", TWO_SIDED)
@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_kth_copy_fails_as_a_device_error_and_the_torn_bytes_are_not_trusted(
    placement: tuple[str, str], k: int
) -> None:
    device, backend = placement
    faults = FaultInjector(copy=k)
    pool = sm.BufferPool(device, backend=backend, adaptors=[faults])
    blob = pool.blob("x", (4096,), torch.uint8)
    for step in range(1, k + 1):  # each round trip host -> device is one copy
        blob.mutable_host_data().copy_(pattern(4096, step))
        memory = blob.data_memory
        if step < k:
            assert torch.equal(blob.data().cpu(), pattern(4096, step))
            continue
        with pytest.raises(sm.SharedMemError) as caught:
            blob.data()
        assert not isinstance(caught.value, sm.OutOfMemoryError)  # not a shortage of memory
        assert str(caught.value).startswith("sharedmem: injected fault: copy")
        assert memory.head is sm.Head.AT_HOST  # half the bytes landed; none of them count
        assert memory._device.valid == 0
    assert faults.fired == [Fault("copy", k, 4096)]
    host, dev = both_sides(blob)
    assert torch.equal(host, pattern(4096, k)) and torch.equal(dev, pattern(4096, k))


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("k", [1, 2], ids=["first-side-fails", "second-side-fails"])
def test_a_failed_shrink_keeps_every_byte_below_the_size(
    placement: tuple[str, str], k: int
) -> None:
    # Regression: shrink_to_fit used to drop its ``written`` mark only after both sides shrank.
    # When the host shrank and the device's shrink failed, the host head still claimed the tail
    # it had given back, and the next sync to the device tripped over it.
    device, backend = placement
    faults = FaultInjector(shrink=k)
    pool = sm.BufferPool(device, backend=backend, adaptors=[faults])
    blob = pool.blob("b0", (0,), torch.uint8)
    # Big enough that the trim shrinks both sides: 2 MiB chunks on vmm.
    n = max(14_397, 2 * blob.data_memory.placement.device_backend.granularity + 397)
    blob.reshape(n).data()  # the device side exists
    pool.host_tensor("b0", (n,), torch.uint8).copy_(pattern(n, 1))
    blob.reshape(128)
    if k == 2 and device == "cpu":
        pytest.skip("cpu has one side, so a trim shrinks once")
    with pytest.raises(sm.OutOfMemoryError):
        pool.trim()
    host, dev = both_sides(blob)
    assert torch.equal(host, pattern(128, 1)) and torch.equal(dev, pattern(128, 1))
    grown = blob.reshape(n).data()  # bytes past 128 were dropped as asked, none lost
    assert torch.equal(grown.view(torch.uint8)[:128].cpu(), pattern(128, 1))


def test_every_kth_event_fails_when_asked() -> None:
    faults = FaultInjector(grow=2, every=True)
    pool = sm.BufferPool("cpu", backend="pageable", adaptors=[faults])
    outcomes = []
    for n in range(1, 7):
        try:
            pool.tensor("x", (n * 1024,), torch.uint8)
            outcomes.append("ok")
        except sm.OutOfMemoryError:
            outcomes.append("refused")
    # The first access allocates; growths 1..5 follow, the 2nd and 4th refused.
    assert outcomes == ["ok", "ok", "refused", "ok", "refused", "ok"]


def test_an_armed_fault_fires_only_in_its_own_thread() -> None:
    faults = FaultInjector()
    pool = sm.BufferPool("emulated", adaptors=[faults])
    seen: list[str] = []
    with faults.armed("allocate", 1):
        worker = threading.Thread(target=lambda: seen.append(str(pool.tensor("a", (8,)).shape)))
        worker.start()
        worker.join()
        with pytest.raises(sm.OutOfMemoryError):
            pool.tensor("b", (8,))
    assert seen == ["torch.Size([8])"] and faults.fired_here() == 1
    assert faults.last_here() == "allocate"
    pool.tensor("b", (8,))  # disarmed after the block


def test_bad_fault_plans_are_refused_with_a_message() -> None:
    with pytest.raises(ValueError, match=r"^sharedmem: grow= must be an integer >= 1"):
        FaultInjector(grow=0)
    with (
        pytest.raises(ValueError, match=r"^sharedmem: fault kind must be one of"),
        FaultInjector().armed("explode", 1),
    ):
        pass
    faults = FaultInjector()
    with (
        faults.armed("copy", 1),
        pytest.raises(RuntimeError, match="does not nest"),
        faults.armed("copy", 2),
    ):
        pass


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_the_corrupting_backend_really_corrupts(placement: tuple[str, str]) -> None:
    # The runner's self-check relies on this backend spoiling bytes; make sure it does.
    device, backend = placement
    pool = sm.BufferPool(device, backend=backend, adaptors=[lambda b: CorruptingBackend(b, 1)])
    blob = pool.blob("x", (4096,), torch.uint8)
    blob.mutable_host_data().copy_(pattern(4096, 3))
    blob.reshape(3 * 4096).mutable_host_data()  # grows, keeping the first page
    host, dev = both_sides(blob.reshape(4096))
    assert not (torch.equal(host, pattern(4096, 3)) and torch.equal(dev, pattern(4096, 3)))
