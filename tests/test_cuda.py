"""CUDA backends on a GPU: marked ``cuda``; without a GPU they run on the CUDA stand-in
(tests/cudasim), and the few that need PyTorch's own CUDA are skipped there.

The generic state-machine, invariant and growth tests already run on every CUDA backend
through ``TWO_SIDED`` / ``ALL_PLACEMENTS``; this file checks what only CUDA has: stable
addresses and zero-copy growth on ``vmm``, zero-copy wrapping on ``cudart``, pinned host
memory, copies on streams, real out-of-memory failures, ``cuda:N``. What runs without a GPU
is in ``test_cuda_setup.py``.
"""

from __future__ import annotations

import copy
import gc
import io
import weakref
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, TypeVar

import pytest
import torch
from conftest import HAS_CUDA, requires_cuda, requires_gpu, storage_bytes

import sharedmem as sm
from sharedmem._backends.cuda_torch_ops import ops

F = TypeVar("F", bound=Callable[..., Any])
BACKENDS = ["vmm", "cudart", "torch"]
MiB = 1 << 20
# The stand-in has two devices.
two_gpus = pytest.mark.skipif(
    HAS_CUDA and torch.cuda.device_count() < 2, reason="needs at least 2 GPUs"
)


def on_gpu(test: F) -> F:
    marked: F = pytest.mark.cuda(requires_cuda(test))
    return marked


def cuda_modules() -> Any:
    """sharedmem's CUDA helpers and backend chooser in one namespace, or a skip where
    cuda-python cannot be imported."""
    from sharedmem._backends import cuda, cuda_api

    try:
        cuda_api.bindings()
    except sm.SharedMemError as error:
        pytest.skip(str(error))
    return SimpleNamespace(**{**vars(cuda_api), **vars(cuda)})


# ---- on a GPU ------------------------------------------------------------------------------


def device_of(memory: sm.SyncedMemory) -> Any:
    backend = memory.placement.accel
    assert backend is not None
    return backend


def usable_or_skip(backend: str) -> None:
    """Skip, with the reason, where ``backend`` cannot run here (no VMM support, a
    cuda-python whose runtime does not match the driver)."""
    from sharedmem._backends import cuda

    try:
        cuda._device_backend(current_device(), backend)
    except sm.SharedMemError as error:
        pytest.skip(str(error))


def vmm_or_skip() -> None:
    usable_or_skip("vmm")


def current_device() -> int:
    return ops().current_device()


def settle_garbage() -> None:
    gc.collect()
    ops().synchronize(current_device())


def keep_the_device_busy() -> None:
    """Make the producer still busy when the next copy is issued (on the stand-in: its
    scheduler runs nothing of this device early until something waits for the sleep)."""
    if HAS_CUDA:
        torch.cuda._sleep(20_000_000)  # type: ignore[no-untyped-call]
    else:
        ops().sleep(current_device())  # type: ignore[attr-defined]


@on_gpu
def test_default_backend_is_vmm_where_the_device_supports_it() -> None:
    cuda = cuda_modules()
    index = current_device()
    expected = cuda.usable_backends(index)[0]
    assert expected == "vmm" or not cuda.vmm_supported(index)
    placement = sm.SyncedMemory(device="cuda").placement
    assert device_of(sm.SyncedMemory(device="cuda")).kind == expected
    assert placement == sm.SyncedMemory(device="cuda", backend=expected).placement
    assert placement.host.kind in ("pinned", "pinned-pageable")


@on_gpu
def test_vmm_growth_keeps_the_address_and_copies_nothing() -> None:
    vmm_or_skip()
    m = sm.SyncedMemory(64, device="cuda", backend="vmm")
    old = m.mutable_device_data()
    old.fill_(7)
    grows, copied = m.num_grows, m.grow_copy_bytes
    m.set_size(64 * MiB)
    new = m.mutable_device_data()
    assert new.data_ptr() == old.data_ptr()
    assert m.num_grows > grows and m.grow_copy_bytes == copied == 0
    assert new[:64].cpu().tolist() == [7] * 64
    new[:64].fill_(42)  # a write through the new view is seen by the view from before
    assert old.cpu().tolist() == [42] * 64


@on_gpu
def test_vmm_views_span_their_capacity_so_copying_one_reads_only_mapped_memory() -> None:
    vmm_or_skip()
    m = sm.SyncedMemory(100, device="cuda", backend="vmm")
    small = m.mutable_device_data()
    small.fill_(5)
    spans = storage_bytes(small)  # an int: a failing assert must not print the storage
    assert spans == m.device_capacity  # not the whole reservation
    m.set_size(m.device_capacity + 1)
    grown = m.mutable_device_data()
    assert grown.data_ptr() == small.data_ptr()
    assert storage_bytes(grown) == m.device_capacity
    # Each reads its whole storage; over the reservation that was unmapped device memory.
    assert copy.deepcopy(small).cpu().tolist() == [5] * 100
    buffer = io.BytesIO()
    torch.save(grown, buffer)
    buffer.seek(0)
    assert torch.load(buffer)[:100].cpu().tolist() == [5] * 100


@on_gpu
def test_vmm_growth_peaks_at_the_new_capacity() -> None:
    vmm_or_skip()
    m = sm.SyncedMemory(32 * MiB, device="cuda", backend="vmm")
    m.mutable_device_data().fill_(1)
    meter = device_of(m).meter
    settle_garbage()
    others = meter.held - m.device_capacity
    meter.reset_peak()
    m.set_size(96 * MiB)
    m.mutable_device_data()
    assert meter.peak - others <= m.device_capacity  # never old + new
    assert m._device.block.handle.mapped == m.device_capacity  # type: ignore[union-attr]


@on_gpu
def test_vmm_shrink_unmaps_and_release_waits_for_the_last_view() -> None:
    vmm_or_skip()
    expected = torch.arange(8 * MiB).remainder(251).to(torch.uint8)
    m = sm.SyncedMemory(64 * MiB, device="cuda", backend="vmm")
    written = m.mutable_device_data()
    written.fill_(1)
    written[: 8 * MiB].copy_(expected)
    del written
    meter = device_of(m).meter
    settle_garbage()
    held = meter.held
    m.set_size(8 * MiB)
    assert m.shrink_to_fit() > 0
    assert held - meter.held == 64 * MiB - m.device_capacity
    assert torch.equal(m.device_data().cpu(), expected)

    view = m.device_data()
    reservation = weakref.ref(m._device.block.handle)  # type: ignore[union-attr]
    m.release()
    settle_garbage()
    assert reservation() is not None  # the view keeps the mapping: reading it is safe
    assert torch.equal(view.cpu(), expected)
    del view
    settle_garbage()
    assert reservation() is None and meter.held == held - 64 * MiB


@on_gpu
def test_vmm_growth_beyond_the_reservation_moves_and_keeps_the_bytes() -> None:
    vmm_or_skip()
    from sharedmem._backends import Placement
    from sharedmem._backends.cuda_vmm import VmmBackend

    default = sm.SyncedMemory(device="cuda", backend="vmm").placement
    backend = VmmBackend(default.device, reservation=1)  # one chunk of address space
    m = sm.SyncedMemory(100, placement=Placement(default.device, default.host, backend))
    m.mutable_device_data().fill_(5)
    before = m.device_data().data_ptr()
    m.set_size(3 * backend.granularity)
    grown = m.device_data()
    assert grown.data_ptr() != before and m.grow_copy_bytes == 100
    assert grown[:100].cpu().tolist() == [5] * 100


@on_gpu
def test_cudart_wraps_without_copying_and_outlives_release() -> None:
    usable_or_skip("cudart")
    m = sm.SyncedMemory(MiB, device="cuda", backend="cudart")
    view = m.mutable_device_data()
    view.fill_(3)
    block = m._device.block
    assert block is not None
    assert view.data_ptr() == block.handle.address == m.device_data().data_ptr()  # type: ignore[attr-defined]
    assert m.mutable_device_data().data_ptr() == view.data_ptr()
    meter = device_of(m).meter
    owner = weakref.ref(block.handle)
    del block
    m.release()
    del m
    settle_garbage()
    assert owner() is not None  # the view keeps the allocation alive
    held = meter.held
    assert int(view.sum()) == 3 * MiB
    del view
    settle_garbage()
    assert owner() is None and meter.held == held - MiB


@on_gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_host_side_is_pinned_and_grows_in_place(backend: str) -> None:
    usable_or_skip(backend)
    m = sm.SyncedMemory(4096, device="cuda", backend=backend)
    first = m.mutable_host_data()
    assert ops().is_pinned(first)
    m.set_size(64 * MiB)
    grown = m.mutable_host_data()
    assert ops().is_pinned(grown[-4096:]) and ops().is_pinned(grown)
    if m.placement.host.kind == "pinned":
        assert grown.data_ptr() == first.data_ptr() and m.grow_copy_bytes == 0
    m.set_size(MiB)
    m.shrink_to_fit()
    assert ops().is_pinned(m.host_data())


@on_gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_memory_grown_in_steps_copies_in_one_piece(backend: str) -> None:
    # A GPU refuses a copy whose host range spans two registrations (cudaErrorInvalidValue,
    # seen on an H100): the host side grown in place must stay one registration.
    usable_or_skip(backend)
    m = sm.SyncedMemory(0, device="cuda", backend=backend)
    for step in range(1, 9):
        m.set_size(step * 256 * 1024 + 4096)
        m.mutable_host_data().fill_(step)
        assert m.device_data().cpu().unique().tolist() == [step]
    m.mutable_device_data().fill_(42)
    assert m.host_data().unique().tolist() == [42]


@on_gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_async_copies_on_a_side_stream_wait_for_the_producer(backend: str) -> None:
    usable_or_skip(backend)
    size = 64 * MiB
    m = sm.SyncedMemory(size, device="cuda", backend=backend)
    stream = ops().new_stream(current_device())
    for value, given in ((1, stream), (2, stream.cuda_stream), (3, None)):
        view = m.mutable_device_data()
        keep_the_device_busy()
        view.fill_(value)
        m.pull_async(given)
        host = m.host_data()
        assert int(host.min()) == int(host.max()) == value
        m.mutable_host_data().fill_(value + 10)
        keep_the_device_busy()  # the push (after the current stream) runs late
        m.push_async(given)
        device = m.device_data()  # ordered after the push on the current stream
        assert int(device.min()) == int(device.max()) == value + 10


@on_gpu
def test_stream_arguments_are_checked() -> None:
    m = sm.SyncedMemory(1000, device="cuda")
    m.mutable_host_data().fill_(1)
    with pytest.raises(TypeError, match=r"^sharedmem: stream must be a torch.cuda.Stream"):
        m.push_async("side")


@on_gpu
@two_gpus
def test_a_stream_of_another_device_is_refused() -> None:
    m = sm.SyncedMemory(1000, device="cuda")
    m.mutable_host_data().fill_(1)
    other = (current_device() + 1) % ops().device_count()
    with pytest.raises(ValueError, match=r"^sharedmem: the stream is on cuda:"):
        m.push_async(ops().new_stream(other))


@on_gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_running_out_of_memory_keeps_every_byte(backend: str) -> None:
    usable_or_skip(backend)
    m = sm.SyncedMemory(4096, device="cuda", backend=backend)
    m.mutable_device_data().fill_(9)
    capacity = m.device_capacity
    m.set_size(1 << 50)  # a pebibyte: more than any card has
    with pytest.raises(sm.OutOfMemoryError) as error:
        m.mutable_device_data()
    assert error.value.device == m.device and error.value.limit is None
    assert error.value.requested >= 1 << 50
    assert str(error.value).startswith(f"sharedmem: out of memory on {m.device}")
    assert m.device_capacity == capacity and m.head is sm.Head.AT_DEVICE
    m.set_size(4096)
    assert m.device_data().cpu().tolist() == [9] * 4096
    assert m.host_data().tolist() == [9] * 4096


@on_gpu
def test_vmm_runs_out_of_physical_memory_inside_its_reservation() -> None:
    vmm_or_skip()
    from sharedmem._backends import Placement
    from sharedmem._backends.cuda_vmm import VmmBackend

    default = sm.SyncedMemory(device="cuda", backend="vmm").placement
    total = ops().total_memory(current_device())
    backend = VmmBackend(default.device, reservation=2 * total)
    m = sm.SyncedMemory(100, placement=Placement(default.device, default.host, backend))
    m.mutable_device_data().fill_(4)
    held = backend.meter.held
    m.set_size(total + backend.granularity)  # the range holds it, the card does not
    with pytest.raises(sm.OutOfMemoryError):
        m.device_data()
    assert backend.meter.held == held  # refused before a chunk was created
    m.set_size(100)
    assert m.device_data().cpu().tolist() == [4] * 100


@on_gpu
def test_vmm_a_growth_that_fails_midway_gives_back_every_chunk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    vmm_or_skip()
    cuda = cuda_modules()
    from sharedmem._backends import cuda_vmm

    m = sm.SyncedMemory(100, device="cuda", backend="vmm")
    m.mutable_device_data().fill_(4)
    backend = device_of(m)
    held, capacity = backend.meter.held, m.device_capacity
    created: list[int] = []
    released: list[int] = []
    real_create, real_release = cuda_vmm._create_chunk, cuda_vmm._release_chunk
    calls = 0

    def create(size: int, prop: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls % 4 == 0:  # the 4th chunk of each attempt: three are mapped by then
            raise cuda.DeviceOutOfMemory("cuMemCreate: injected")
        handle = real_create(size, prop)
        created.append(int(handle))
        return handle

    def release(handle: Any) -> None:
        released.append(int(handle))
        real_release(handle)

    monkeypatch.setattr(cuda_vmm, "_create_chunk", create)
    monkeypatch.setattr(cuda_vmm, "_release_chunk", release)
    m.set_size(capacity + 8 * backend.granularity)
    with pytest.raises(sm.OutOfMemoryError):
        m.device_data()
    assert len(created) == 6  # two attempts (the second after emptying PyTorch's cache)
    assert sorted(released) == sorted(created)  # every chunk mapped on the way was given back
    assert backend.meter.held == held and m.device_capacity == capacity
    monkeypatch.undo()
    m.set_size(100)
    assert m.device_data().cpu().tolist() == [4] * 100


@on_gpu
@two_gpus  # with one GPU, device N is the current device and this proves nothing
@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_n_allocates_on_device_n(backend: str) -> None:
    usable_or_skip(backend)
    last = ops().device_count() - 1
    with ops().device(0):
        m = sm.SyncedMemory(MiB, device=f"cuda:{last}", backend=backend)
        m.mutable_host_data().fill_(6)
        view = m.device_data()
        assert view.device == ops().tensor_device(last)
        assert current_device() == 0
        assert int(view.min()) == int(view.max()) == 6
        if backend != "torch":  # ask the driver where the bytes are, not PyTorch
            driver = cuda_modules().bindings().driver
            ordinal = driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
            error, where = driver.cuPointerGetAttribute(ordinal, view.data_ptr())
            assert int(error) == 0 and int(where) == last


@on_gpu
@requires_gpu  # the stand-in has no caching allocator statistics
def test_the_torch_backend_is_seen_by_the_caching_allocator() -> None:
    index = torch.cuda.current_device()
    before = torch.cuda.memory_stats(index).get("allocated_bytes.all.current", 0)
    m = sm.SyncedMemory(8 * MiB, device="cuda", backend="torch")
    m.mutable_device_data()
    after = torch.cuda.memory_stats(index)["allocated_bytes.all.current"]
    assert after - before >= m.device_capacity >= 8 * MiB


# ---- what the stand-in can arrange and a GPU cannot on demand -------------------------------


@on_gpu
def test_pinning_refused_by_the_driver_is_out_of_memory_and_keeps_every_byte(
    cuda_sim: Any,
) -> None:
    m = sm.SyncedMemory(64 << 10, device="cuda", backend="vmm")
    m.mutable_host_data().fill_(5)
    cuda_sim.memory.pinned_capacity = sum(cuda_sim.memory.registered.values()) + (64 << 10)
    m.set_size(8 * MiB)
    with pytest.raises(sm.OutOfMemoryError, match="Could not pin host memory for cuda:0"):
        m.mutable_host_data()
    m.set_size(64 << 10)
    assert m.host_data().tolist() == [5] * (64 << 10)


@on_gpu
def test_memory_freed_during_a_graph_capture_goes_back_at_the_next_allocation(
    cuda_sim: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = sm.SyncedMemory(MiB, device="cuda", backend="vmm")
    m.mutable_device_data().fill_(1)
    meter = device_of(m).meter
    held = meter.held
    monkeypatch.setattr(cuda_sim.ops, "capturing", lambda: True)
    m.release()  # synchronizing is illegal while capturing: the free waits
    gc.collect()
    assert meter.held == held
    monkeypatch.setattr(cuda_sim.ops, "capturing", lambda: False)
    other = sm.SyncedMemory(MiB, device="cuda", backend="vmm")
    other.mutable_device_data()
    assert meter.held == held  # the queued free ran first: one buffer's worth is held
