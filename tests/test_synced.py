"""SyncedMemory: head transitions step by step, growth, shrink and release, on every placement."""

from __future__ import annotations

import mmap
import sys

import pytest
import torch
from conftest import ALL_PLACEMENTS, TWO_SIDED, make_memory

import sharedmem as sm

H = sm.Head


def fill(view: torch.Tensor, value: int) -> None:
    view.fill_(value)


def traffic(m: sm.SyncedMemory) -> tuple[int, int]:
    return m.host_to_device_bytes, m.device_to_host_bytes


def on_host(t: torch.Tensor) -> list[int]:
    return [int(x) for x in t.cpu().tolist()]


@pytest.mark.parametrize("placement", TWO_SIDED)
def test_every_head_transition(placement: tuple[str, str]) -> None:
    m = make_memory(placement)
    assert (m.head, m.size, m.host_capacity, m.device_capacity) == (H.UNINITIALIZED, 0, 0, 0)

    m.set_size(100)  # O(1): nothing allocated
    assert (m.head, m.size, m.host_capacity, m.device_capacity) == (H.UNINITIALIZED, 100, 0, 0)

    assert m.host_data().numel() == 100  # first touch of the host: allocated, nothing copied
    assert m.head is H.AT_HOST and m.host_capacity >= 100 and m.device_capacity == 0

    assert m.device_data().numel() == 100  # nothing was ever written: nothing to copy
    assert m.head is H.SYNCED and m.device_capacity >= 100 and traffic(m) == (0, 0)

    fill(m.mutable_host_data(), 1)  # SYNCED -> AT_HOST
    assert m.head is H.AT_HOST and traffic(m) == (0, 0)

    assert on_host(m.device_data()) == [1] * 100  # AT_HOST -> SYNCED, copies the 100 bytes
    assert m.head is H.SYNCED and traffic(m) == (100, 0)

    assert on_host(m.host_data()) == [1] * 100  # SYNCED stays SYNCED, no copy
    assert m.head is H.SYNCED and traffic(m) == (100, 0)

    fill(m.mutable_device_data(), 2)  # SYNCED -> AT_DEVICE
    assert m.head is H.AT_DEVICE and traffic(m) == (100, 0)

    assert on_host(m.device_data()) == [2] * 100  # reading the head side never copies
    assert m.head is H.AT_DEVICE and traffic(m) == (100, 0)

    assert on_host(m.host_data()) == [2] * 100  # AT_DEVICE -> SYNCED
    assert m.head is H.SYNCED and traffic(m) == (100, 100)

    fill(m.mutable_device_data(), 3)  # SYNCED -> AT_DEVICE
    fill(m.mutable_host_data(), 4)  # AT_DEVICE -> (sync) -> AT_HOST
    assert m.head is H.AT_HOST and traffic(m) == (100, 200)

    fill(m.mutable_device_data(), 5)  # AT_HOST -> (sync) -> AT_DEVICE
    assert m.head is H.AT_DEVICE and traffic(m) == (200, 200)

    fill(m.mutable_device_data(), 6)  # AT_DEVICE -> AT_DEVICE, no copy
    assert m.head is H.AT_DEVICE and traffic(m) == (200, 200)

    assert m.release() > 0
    assert (m.head, m.size, m.host_capacity, m.device_capacity) == (H.UNINITIALIZED, 100, 0, 0)

    fill(m.mutable_device_data(), 7)  # UNINITIALIZED -> AT_DEVICE
    assert m.head is H.AT_DEVICE and m.host_capacity == 0

    fill(m.mutable_host_data(), 8)  # AT_DEVICE -> (sync) -> AT_HOST
    assert m.head is H.AT_HOST and traffic(m) == (200, 300)


@pytest.mark.parametrize("placement", TWO_SIDED)
def test_side_synced_small_never_passes_its_stale_tail(placement: tuple[str, str]) -> None:
    # The bug the invariant's extra bookkeeping exists for: the device is synced while the size
    # is small, then the size grows back; the device must not serve (or pass on) its stale tail.
    m = make_memory(placement, 100)
    m.mutable_host_data().copy_(torch.arange(100, dtype=torch.uint8))
    m.set_size(40)
    assert on_host(m.device_data()) == list(range(40))
    assert m.head is H.AT_HOST  # the device holds only bytes below 40: not synced
    assert traffic(m) == (40, 0)

    m.set_size(100)
    assert on_host(m.device_data()) == list(range(100))  # the missing 60 bytes come now
    assert m.head is H.SYNCED and traffic(m) == (100, 0)

    # Synced small, then written small on the stale side, then read large on the other side.
    m.mutable_host_data().copy_(torch.arange(100, 200, dtype=torch.uint8))
    m.set_size(30)
    m.device_data()
    m.mutable_device_data().fill_(9)  # the device takes over bytes 30..100 before writing
    m.set_size(100)
    assert on_host(m.host_data()) == [9] * 30 + list(range(130, 200))


@pytest.mark.parametrize("placement", ALL_PLACEMENTS)
def test_growth_keeps_every_byte_at_its_offset(placement: tuple[str, str]) -> None:
    m = make_memory(placement, 1000)
    m.mutable_device_data().copy_(torch.arange(1000).remainder(251).to(torch.uint8))
    for size in (5000, 70_000, 1 << 20):
        m.set_size(size)
        grown = m.mutable_device_data()
        assert m.device_capacity >= size
        assert torch.equal(grown[:1000].cpu(), torch.arange(1000).remainder(251).to(torch.uint8))
        m.set_size(size)
        assert torch.equal(m.host_data()[:1000], torch.arange(1000).remainder(251).to(torch.uint8))


@pytest.mark.parametrize(
    "placement",
    [
        pytest.param(("cpu", "reserved"), id="cpu"),
        pytest.param(("emulated", "reserved"), id="emulated"),
    ],
)
def test_stable_address_growth_keeps_old_views_valid(placement: tuple[str, str]) -> None:
    m = make_memory(placement, 64)
    old_host = m.mutable_host_data()
    old_device = m.device_data()
    grows, copied = m.num_grows, m.grow_copy_bytes

    m.set_size(8 << 20)
    new_device = m.mutable_device_data()
    new_host = m.mutable_host_data()
    assert new_host.data_ptr() == old_host.data_ptr()
    assert new_device.data_ptr() == old_device.data_ptr()
    assert m.grow_copy_bytes == copied and m.num_grows > grows  # grew, copied nothing

    new_host[:64].fill_(42)  # a write through the new view is seen by the view from before
    assert on_host(old_host) == [42] * 64


def test_moving_growth_counts_the_copied_bytes() -> None:
    m = sm.SyncedMemory(100, device="emulated", backend="pageable")
    m.mutable_device_data().fill_(3)
    before = m.device_data().data_ptr()
    m.set_size(10_000)
    m.device_data()
    assert m.grow_copy_bytes == 100  # exactly the bytes the device held
    assert m.device_data().data_ptr() != before
    assert on_host(m.host_data()[:100]) == [3] * 100


def test_growth_of_a_stale_side_copies_nothing() -> None:
    m = sm.SyncedMemory(100, device="emulated", backend="pageable")
    m.device_data()
    m.mutable_host_data().fill_(1)  # the device is now stale
    m.set_size(10_000)
    m.mutable_host_data()
    m.device_data()
    assert m.grow_copy_bytes == 0  # neither growth had a current byte to keep
    assert on_host(m.device_data()[:100]) == [1] * 100


def test_cpu_is_one_memory() -> None:
    m = sm.SyncedMemory(64, device="cpu")
    host = m.mutable_host_data()
    assert m.head is H.SYNCED
    device = m.mutable_device_data()
    assert device.data_ptr() == host.data_ptr() and device.device.type == "cpu"
    assert m.head is H.SYNCED and traffic(m) == (0, 0)
    assert m.host_capacity == m.device_capacity == m.reserved_bytes
    assert m.release_device() == 0 and m.host_capacity > 0


@pytest.mark.parametrize("placement", ALL_PLACEMENTS)
def test_shrink_to_fit_keeps_content_below_the_size(placement: tuple[str, str]) -> None:
    # Sizes in units of the device granularity (a page; 2 MiB on CUDA vmm), so that the
    # shrink has whole units to give back on every backend.
    m = make_memory(placement)
    big = max(1 << 20, 4 * m.placement.device_backend.granularity)
    small = big // 10
    m.set_size(big)
    m.mutable_device_data().copy_(torch.arange(big).remainder(199).to(torch.uint8))
    m.host_data()
    before = m.reserved_bytes
    m.set_size(small)
    freed = m.shrink_to_fit()
    assert freed == before - m.reserved_bytes > 0
    assert small <= m.device_capacity < big
    expected = torch.arange(small).remainder(199).to(torch.uint8)
    assert torch.equal(m.host_data(), expected)
    assert torch.equal(m.device_data().cpu(), expected)
    # Bytes beyond the size were dropped on purpose: growing again does not resurrect them
    # as "written", and the first bytes are still there.
    m.set_size(big)
    assert torch.equal(m.mutable_device_data()[:small].cpu(), expected)
    assert m.shrink_to_fit() == 0  # already fits


@pytest.mark.parametrize("placement", ALL_PLACEMENTS)
def test_release_frees_everything_and_starts_over(placement: tuple[str, str]) -> None:
    m = make_memory(placement, 10_000)
    m.mutable_host_data().fill_(5)
    m.device_data()
    reserved = m.reserved_bytes
    assert m.release() == reserved > 0
    assert (m.head, m.host_capacity, m.device_capacity, m.size) == (H.UNINITIALIZED, 0, 0, 10_000)
    assert m.release() == 0
    assert m.device_data().numel() == 10_000  # usable again: allocated afresh


@pytest.mark.parametrize("placement", TWO_SIDED)
def test_release_one_side_loses_nothing(placement: tuple[str, str]) -> None:
    m = make_memory(placement, 4096)
    m.mutable_device_data().copy_(torch.arange(4096).remainder(256).to(torch.uint8))
    capacity = m.device_capacity
    assert m.release_device() == capacity
    assert m.head is H.AT_HOST and m.device_capacity == 0 and traffic(m) == (0, 4096)
    assert torch.equal(m.device_data().cpu(), torch.arange(4096).remainder(256).to(torch.uint8))

    m.mutable_host_data()[:10].fill_(0)
    assert m.release_host() > 0
    assert m.head is H.AT_DEVICE and m.host_capacity == 0
    assert on_host(m.host_data()[:12]) == [0] * 10 + [10, 11]


@pytest.mark.parametrize("placement", TWO_SIDED)
def test_release_device_after_a_small_sync_keeps_the_tail(placement: tuple[str, str]) -> None:
    m = make_memory(placement, 200)
    m.mutable_device_data().copy_(torch.arange(200, dtype=torch.uint8))
    m.set_size(50)
    m.host_data()  # the host holds bytes below 50 only
    m.release_device()
    m.set_size(200)
    assert on_host(m.host_data()) == list(range(200))


def _rss_of_mapping(address: int) -> int:
    """Resident bytes of the mapping that contains ``address`` (Linux /proc/self/smaps)."""
    current = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            first = line.split()[0]
            if "-" in first and not first.endswith(":"):
                start, end = (int(x, 16) for x in first.split("-"))
                current = start <= address < end
            elif current and first == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping contains {address:#x}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
@pytest.mark.parametrize("device", ["cpu", "emulated"])
def test_shrink_and_release_give_pages_back_to_the_system(device: str) -> None:
    # The kernel merges neighbouring mappings with the same flags into one entry of smaps, so
    # measure how our operations change the resident bytes, not the absolute figure.
    size, slack = 32 << 20, 64 * mmap.PAGESIZE
    m = sm.SyncedMemory(size, device=device)
    view = m.mutable_device_data()
    address = view.data_ptr()
    untouched = _rss_of_mapping(address)
    view.fill_(1)  # commit every page
    assert _rss_of_mapping(address) - untouched >= size

    m.set_size(size // 4)
    assert m.shrink_to_fit() == size - size // 4
    assert abs(_rss_of_mapping(address) - untouched - size // 4) < slack
    assert on_host(m.host_data()[-4:]) == [1] * 4

    m.release()
    # The view above keeps the mapping alive, but its pages went back: it reads zeros.
    assert abs(_rss_of_mapping(address) - untouched) < slack
    assert int(view[:1000].sum()) == 0


def test_a_refused_growth_leaves_the_memory_as_it_was() -> None:
    from sharedmem._backends import Block, PageableBackend, Placement

    class Refusing(PageableBackend):
        def _grow(self, block: Block, nbytes: int, keep: int) -> tuple[Block, int]:
            raise sm.OutOfMemoryError(nbytes, block.capacity, None, "emulated")

    placement = Placement("emulated", PageableBackend(), Refusing())
    m = sm.SyncedMemory(100, placement=placement)
    m.mutable_device_data().fill_(8)
    state = (m.head, m.device_capacity, m.host_capacity, m.num_grows, m.version)
    m.set_size(100_000)
    with pytest.raises(sm.OutOfMemoryError):
        m.mutable_device_data()
    assert (m.head, m.device_capacity, m.host_capacity, m.num_grows) == state[:4]
    m.set_size(100)
    assert on_host(m.host_data()) == [8] * 100


@pytest.mark.parametrize("placement", TWO_SIDED)
def test_reads_right_after_push_async_see_every_byte(placement: tuple[str, str]) -> None:
    size = 64 << 20  # large enough that an unfenced read would catch the copy half-way
    m = make_memory(placement, size)
    for value in (1, 2, 3):
        m.mutable_host_data().fill_(value)
        m.push_async()
        assert m.host_to_device_bytes == value * size  # counted when started
        view = m.device_data()
        assert m.head is H.SYNCED
        assert int(view.min()) == int(view.max()) == value


@pytest.mark.parametrize("placement", TWO_SIDED)
def test_reads_right_after_pull_async_see_every_byte(placement: tuple[str, str]) -> None:
    size = 64 << 20
    m = make_memory(placement, size)
    for value in (4, 5, 6):
        m.mutable_device_data().fill_(value)
        m.pull_async()
        view = m.host_data()
        assert m.head is H.SYNCED
        assert int(view.min()) == int(view.max()) == value


@pytest.mark.parametrize("placement", TWO_SIDED)
def test_a_write_after_push_async_does_not_race_the_copy(placement: tuple[str, str]) -> None:
    size = 64 << 20
    m = make_memory(placement, size)
    m.mutable_host_data().fill_(1)
    m.push_async()
    m.mutable_host_data().fill_(2)  # must wait for the push to finish reading the host bytes
    # White-box: the push delivered the bytes as they were when it started, all of them 1.
    pushed = m._device.block.tensor[:size]  # type: ignore[union-attr]
    assert int(pushed.min()) == int(pushed.max()) == 1
    m.release_host()  # the device takes the newest bytes, then the host goes
    view = m.device_data()
    assert int(view.min()) == int(view.max()) == 2


def test_async_copies_are_no_ops_when_up_to_date_and_on_cpu() -> None:
    m = sm.SyncedMemory(1000, device="emulated")
    m.mutable_device_data().fill_(1)
    m.push_async()  # the device is the head: nothing to push
    assert traffic(m) == (0, 0)
    cpu = sm.SyncedMemory(1000, device="cpu")
    cpu.mutable_host_data()
    cpu.push_async()
    cpu.pull_async()
    assert traffic(cpu) == (0, 0) and cpu.head is H.SYNCED


@pytest.mark.parametrize("placement", ALL_PLACEMENTS)
def test_download_and_upload_copy_to_and_from_tensors_outside(placement: tuple[str, str]) -> None:
    m = make_memory(placement, 1 << 20)
    device = m.placement.device_backend.device
    source = torch.arange(1 << 20).remainder(251).to(torch.uint8).to(device)
    fence = m.download_async(source)  # like a write to the host side
    assert m.head is (H.SYNCED if m.device == "cpu" else H.AT_HOST)
    assert torch.equal(m.host_data().to(device), source)  # waits for the copy
    if m.device != "cpu":
        assert fence is not None and m.device_capacity == 0  # the device side is not used
    target = torch.zeros(1 << 20, dtype=torch.uint8, device=device)
    fence = m.upload_async(target)
    if fence is not None:
        fence.wait_device()
    assert torch.equal(target, source)
    two_sided = m.device != "cpu"
    assert traffic(m) == ((1 << 20, 1 << 20) if two_sided else (0, 0))
    with pytest.raises(ValueError, match=r"^sharedmem: source must be a 1-D torch.uint8"):
        m.download_async(torch.zeros(1 << 18))
    with pytest.raises(TypeError, match=r"^sharedmem: target must be a torch.Tensor"):
        m.upload_async(bytes(1 << 20))  # type: ignore[arg-type]


def test_an_empty_view_is_a_fresh_tensor_every_time() -> None:
    sm.SyncedMemory(0).host_data().resize_(16)  # a caller's resize_ stays the caller's
    assert sm.SyncedMemory(0).host_data().numel() == 0
    assert sm.SyncedMemory(0, device="emulated").device_data().numel() == 0
