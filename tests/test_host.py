"""Host memory: the reserved range, its address-space budget, and what it refuses."""

from __future__ import annotations

import gc
import mmap

import pytest
import torch

import sharedmem as sm
from sharedmem._backends import host
from sharedmem._backends.host import ReservedBackend, address_space_reserved

MiB = 1 << 20


def test_reservations_have_room_to_double_and_grow_in_place() -> None:
    assert 1 << 30 <= host.default_reservation() <= 4 << 30
    backend = ReservedBackend(reservation=MiB)
    block = backend.allocate(8 * MiB)  # more than the reservation: room to double
    assert isinstance(block.handle, mmap.mmap) and len(block.handle) >= 16 * MiB
    grown, copied = backend.grow(block, 16 * MiB, keep=0)
    assert copied == 0 and grown.address == block.address


def test_growth_past_the_range_moves_and_old_views_keep_the_old_bytes() -> None:
    backend = ReservedBackend(reservation=host.PAGE)
    block = backend.allocate(host.PAGE)  # a range of two pages
    block.tensor[:4].copy_(torch.tensor([1, 2, 3, 4], dtype=torch.uint8))
    old_view = block.tensor[:4]
    grown, copied = backend.grow(block, 8 * host.PAGE, keep=4)
    assert grown.address != block.address and copied == 4
    assert grown.tensor[:4].tolist() == [1, 2, 3, 4]
    # As after any moving growth: the old view still reads the old storage, not zeros.
    assert old_view.tolist() == [1, 2, 3, 4]


def test_the_address_space_is_budgeted(monkeypatch: pytest.MonkeyPatch) -> None:
    gc.collect()
    start = address_space_reserved()
    backend = ReservedBackend(reservation=64 * MiB)
    roomy = backend.allocate(host.PAGE)
    assert len(roomy.handle) == 64 * MiB  # type: ignore[arg-type]
    assert address_space_reserved() == start + 64 * MiB
    # A process whose reservations are past the budget: new blocks get room to double only.
    monkeypatch.setattr(host, "ADDRESS_BUDGET", address_space_reserved())
    crowded = backend.allocate(host.PAGE)
    assert len(crowded.handle) == 2 * host.PAGE  # type: ignore[arg-type]
    del roomy, crowded
    gc.collect()
    assert address_space_reserved() == start  # a range goes back with its last view


def test_many_small_buffers_do_not_exhaust_the_address_space(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 2,000 buffers against a budget of 100 full reservations: the rest reserve little, and
    # the process can still allocate afterwards (without the budget: 8 TiB of ranges).
    monkeypatch.setattr(host, "ADDRESS_BUDGET", address_space_reserved() + 100 * (4 << 30))
    memories = [sm.SyncedMemory(64, device="emulated") for _ in range(2_000)]
    for m in memories:
        m.mutable_host_data().fill_(1)
        m.device_data()
    assert address_space_reserved() <= host.ADDRESS_BUDGET + 4 * 2 * host.PAGE * 2_000
    assert torch.empty(64 * MiB, dtype=torch.uint8).numel() == 64 * MiB
    assert all(m.device_data()[0].item() == 1 for m in memories[::97])


def test_strict_overcommit_maps_only_what_is_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    # There every mapped byte counts against the machine's commit limit, flags or not.
    monkeypatch.setattr(host, "_strict_overcommit", lambda: True)
    block = ReservedBackend(reservation=64 * MiB).allocate(3 * host.PAGE)
    assert len(block.handle) == 3 * host.PAGE  # type: ignore[arg-type]


@pytest.mark.parametrize("device", ["cpu", "emulated"])
def test_more_than_the_machine_holds_is_refused_not_promised(device: str) -> None:
    # MAP_NORESERVE would map it; touching it would wake the out-of-memory killer.
    kept = sm.SyncedMemory(8, device=device)
    kept.mutable_host_data().fill_(9)
    huge = sm.SyncedMemory(host.commit_limit() + MiB, device=device)
    for access in (huge.mutable_host_data, huge.device_data):
        with pytest.raises(sm.OutOfMemoryError, match="more than this machine's memory and swap"):
            access()
    assert huge.host_capacity == 0 and huge.head is sm.Head.UNINITIALIZED
    assert kept.device_data().tolist() == [9] * 8


@pytest.mark.parametrize("device", ["cpu", "emulated"])
def test_a_view_carries_its_capacity_not_the_whole_range(device: str) -> None:
    # torch.save, pickle and deepcopy read a view's whole storage: that must be the bytes
    # the buffer holds, not the gigabytes of address space reserved behind them.
    import copy
    import io

    pool = sm.BufferPool(device)
    view = pool.tensor("a", (256,))
    view.fill_(1.0)
    assert view.untyped_storage().nbytes() == host.PAGE
    saved = io.BytesIO()
    torch.save(view, saved)
    assert saved.tell() < 4 * host.PAGE
    assert torch.equal(copy.deepcopy(view), view)
    grown = pool.tensor("a", (MiB,))  # grows in place: same address, a larger window
    assert grown.data_ptr() == view.data_ptr() and grown.untyped_storage().nbytes() == 4 * MiB
    grown[:256].fill_(2.0)
    assert view.tolist() == [2.0] * 256  # the old view sees writes made after the growth


def test_an_address_space_limit_shrinks_the_budget_not_the_first_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Under ulimit -v the budget is a quarter of it; a refused range falls back to twice the
    # request at once instead of halving 4 GiB down and spending the limit on a few blocks.
    import resource

    # A quarter of the limit leaves 8 GiB beside what the process reserves already (arenas
    # earlier tests' tensors still live in are kept mapped for them).
    limit = 4 * (address_space_reserved() + (8 << 30))
    monkeypatch.setattr(resource, "getrlimit", lambda which: (limit, resource.RLIM_INFINITY))
    assert host._budget() == limit // 4
    tried: list[int] = []
    real_mmap = mmap.mmap

    def refusing(fileno: int, size: int, **kwargs: int) -> mmap.mmap:
        tried.append(size)
        if size > 2 * host.PAGE:
            raise OSError(12, "Cannot allocate memory")
        return real_mmap(fileno, size, **kwargs)

    monkeypatch.setattr(host.mmap, "mmap", refusing)
    monkeypatch.setattr(host, "ADDRESS_BUDGET", 1 << 50)
    block = ReservedBackend(reservation=MiB).allocate(host.PAGE)
    assert tried == [MiB, 2 * host.PAGE] and len(block.handle) == 2 * host.PAGE  # type: ignore[arg-type]
