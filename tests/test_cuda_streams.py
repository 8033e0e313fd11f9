"""CUDA stream ordering, devices one at a time, and the documented failure codes, proved on
the CUDA stand-in (tests/cudasim), whose every stream runs its queue late (or early, where a
seeded scheduler says), so that a missing wait shows up as wrong bytes or a recorded fault.

Each planted bug of ``cudasim.plants`` that concerns streams, devices or capture is caught by a
test here; ``test_cudasim.py`` runs them. Tests that need the stand-in's hands (a capture on
another thread, a device that cannot reach a peer) skip on a real GPU; ``./dev gpu-check``
prints what a GPU answers instead (``tests/gpu_answers.py``).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from conftest import requires_cuda

import sharedmem as sm
from sharedmem._backends.cuda_torch_ops import ops

BACKENDS = ["vmm", "cudart", "torch"]
# The order queued work runs in: None runs every copy as late as CUDA allows; a number seeds a
# scheduler that runs queued work early at points it picks. A test's id says which it ran.
SCHEDULES = [None, 1, 2, 3]
MiB = 1 << 20

pytestmark = [pytest.mark.cuda, requires_cuda]


def schedule(sim: Any, seed: int | None) -> None:
    from cudasim import Scheduler

    sim.ops.scheduler = Scheduler(seed)


def same(tensor: torch.Tensor, value: int) -> bool:
    return int(tensor.min()) == int(tensor.max()) == value


# ---- every stream runs late: each copy is waited for -----------------------------------------


@pytest.mark.parametrize("order", SCHEDULES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_current_stream_copies_are_waited_for(
    cuda_sim: Any, backend: str, order: int | None
) -> None:
    schedule(cuda_sim, order)
    m = sm.SyncedMemory(MiB, device="cuda", backend=backend)
    for value in (1, 2, 3):
        m.mutable_device_data().fill_(value)
        assert same(m.host_data(), value)  # the download on the current stream landed
        m.mutable_host_data().fill_(value + 10)  # ... and is not still to land over this
        assert same(m.device_data(), value + 10)  # the upload ran before the view came
        assert same(m.host_data(), value + 10)


@pytest.mark.parametrize("order", SCHEDULES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_source_is_not_overwritten_before_its_copy_ran(
    cuda_sim: Any, backend: str, order: int | None
) -> None:
    schedule(cuda_sim, order)
    m = sm.SyncedMemory(MiB, device="cuda", backend=backend)
    m.mutable_host_data().fill_(5)
    target = ops().empty(MiB, 0)
    fence = m.upload_async(target)  # reads the host side later
    assert fence is not None
    m.mutable_host_data().fill_(6)  # must wait until the upload has read the 5s
    fence.wait_device()
    assert same(target, 5)
    # The other way: a device write after a pull waits until the pull has read the bytes.
    m.mutable_device_data().fill_(7)
    m.pull_async()
    m.mutable_device_data().fill_(8)
    assert same(m.host_data(), 8)
    m.release()
    m.set_size(MiB)
    m.mutable_device_data().fill_(9)
    m.pull_async()
    m.mutable_device_data().fill_(10)  # after the pull has read the 9s
    host = torch.empty(MiB, dtype=torch.uint8)
    host.copy_(m._host.block.tensor[:MiB])  # type: ignore[union-attr]
    assert same(host, 9)


@pytest.mark.parametrize("order", SCHEDULES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_copy_paths_keep_every_byte_under_any_schedule(
    cuda_sim: Any, backend: str, order: int | None
) -> None:
    """Every copy path (synchronous accessors, push/pull on the side stream, a given stream,
    a raw handle, upload/download to outside tensors, growth, shrink) against a model."""
    schedule(cuda_sim, order)
    generator = torch.Generator().manual_seed(order or 0)
    stream = ops().new_stream(0)
    m = sm.SyncedMemory(4096, device="cuda", backend=backend)
    model = torch.zeros(0, dtype=torch.uint8)
    for step in range(60):
        choice = int(torch.randint(0, 9, (), generator=generator))
        size = m.size
        if choice == 0:  # a write on either side
            view = m.mutable_device_data() if step % 2 else m.mutable_host_data()
            model = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator)
            view.copy_(model)
        elif choice == 1:
            m.push_async((None, stream, stream.cuda_stream)[step % 3])
        elif choice == 2:
            m.pull_async((None, stream, stream.cuda_stream)[step % 3])
        elif choice == 3:  # growth keeps the bytes; the new part is whatever it was
            m.set_size(size + int(torch.randint(1, 3 * MiB, (), generator=generator)))
            m.device_data() if step % 2 else m.host_data()
            m.set_size(size)
        elif choice == 4:
            m.shrink_to_fit()
        elif choice == 5:
            target = ops().empty(size, 0)
            fence = m.upload_async(target)
            if fence is not None:
                fence.wait_device()
            assert torch.equal(target[: model.numel()], model), f"step {step}"
        elif choice == 6:
            source = ops().empty(size, 0)
            source.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator))
            m.download_async(source)
            model = source.clone()
        elif choice == 7:
            assert torch.equal(m.device_data()[: model.numel()], model), f"step {step}"
        else:
            assert torch.equal(m.host_data()[: model.numel()], model), f"step {step}"
    assert torch.equal(m.host_data()[: model.numel()], model)
    assert torch.equal(m.device_data()[: model.numel()], model)


def test_a_side_stream_copy_waits_for_work_queued_on_the_current_stream(cuda_sim: Any) -> None:
    # A producer still queued on the current stream (a kernel, here a copy) must run before a
    # pull on the side stream reads the bytes: the side stream waits for the current one.
    m = sm.SyncedMemory(MiB, device="cuda", backend="vmm")
    view = m.mutable_device_data()
    view.fill_(1)
    ops().copy_on(ops().current_stream(0), view, torch.full((MiB,), 4, dtype=torch.uint8))
    m.pull_async()
    assert same(m.host_data(), 4)


# ---- one device at a time ------------------------------------------------------------------------


def test_synchronizing_a_device_runs_its_own_streams_only(cuda_sim: Any) -> None:
    # Nothing may run early here (the test's seeded scheduler could run cuda:1's copy at any
    # point): what is checked is that synchronizing cuda:0 does not run it.
    schedule(cuda_sim, None)
    sim_ops = cuda_sim.ops
    on_0, on_1 = torch.zeros(4, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8)
    one = torch.ones(4, dtype=torch.uint8)
    sim_ops.copy_on(sim_ops.current_stream(0), on_0, one)
    sim_ops.copy_on(sim_ops.new_stream(1), on_1, one)
    sim_ops.synchronize(0)
    assert on_0.tolist() == [1] * 4 and on_1.tolist() == [0] * 4
    driver = cuda_sim.driver
    driver.cuCtxPushCurrent(driver.cuDevicePrimaryCtxRetain(driver.cuDeviceGet(1)[1])[1])
    try:
        assert int(driver.cuCtxSynchronize()[0]) == 0
    finally:
        driver.cuCtxPopCurrent()
    assert on_1.tolist() == [1] * 4


@pytest.mark.parametrize("backend", ["vmm", "cudart"])
def test_giving_memory_back_waits_for_work_of_its_own_device(cuda_sim: Any, backend: str) -> None:
    schedule(cuda_sim, None)  # queued work run early would hide a missing wait
    m = sm.SyncedMemory(8 * MiB, device="cuda:0", backend=backend)
    view = m.mutable_device_data()
    view.fill_(1)
    # A kernel of the user's still queued on cuda:0 writes the tail that shrinking gives back.
    tail = view[-1000:]
    ops().copy_on(ops().current_stream(0), tail, torch.full((1000,), 2, dtype=torch.uint8))
    other = sm.SyncedMemory(MiB, device="cuda:1", backend=backend)
    other.mutable_device_data().fill_(3)  # and cuda:1 has work of its own
    del view, tail
    m.set_size(1000)
    m.shrink_to_fit()
    assert cuda_sim.faults == []  # the unmap (or free) came after the queued write
    assert same(m.device_data(), 1)


def test_unpinning_waits_for_a_copy_of_any_device(cuda_sim: Any) -> None:
    schedule(cuda_sim, None)  # queued work run early would hide a missing wait
    # A host registration is portable: a copy on cuda:1 may read pinned pages of a cuda:0
    # memory, and unpinning them must wait for it.
    m = sm.SyncedMemory(8 * MiB, device="cuda:0", backend="vmm")
    host = m.mutable_host_data()
    host.fill_(6)
    target = ops().empty(1000, 1)
    ops().copy_on(ops().new_stream(1), target, host[-1000:])
    del host
    m.set_size(1000)
    m.shrink_to_fit()
    assert cuda_sim.faults == []
    ops().synchronize(1)
    assert same(target, 6)


def test_vmm_memory_is_granted_to_the_peers_that_can_reach_it(cuda_sim: Any) -> None:
    m = sm.SyncedMemory(MiB, device="cuda:1", backend="vmm")
    m.mutable_host_data().fill_(4)
    view = m.device_data()
    target = ops().empty(MiB, 0)
    ops().copy_on(ops().current_stream(0), target, view)  # a peer copy, issued on cuda:0
    ops().synchronize(0)  # raises where cuda:0 was not granted access
    assert same(target, 4)


def test_a_device_that_cannot_reach_a_peer_is_not_granted_and_faults(cuda_sim: Any) -> None:
    cuda_sim.memory.peers = False  # before the backend asks cuDeviceCanAccessPeer
    m = sm.SyncedMemory(MiB, device="cuda:1", backend="vmm")
    m.mutable_host_data().fill_(4)
    view = m.device_data()
    target = ops().empty(MiB, 0)
    ops().copy_on(ops().current_stream(0), target, view)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        ops().synchronize(0)
    assert "without access from cuda:0" in cuda_sim.faults[0]
    cuda_sim.memory.faults.clear()  # the test made this fault on purpose
    cuda_sim.memory.faulted.clear()


# ---- the documented failure codes ----------------------------------------------------------------


@pytest.mark.parametrize("code", ["CUDA_ERROR_INVALID_VALUE", "CUDA_ERROR_OUT_OF_MEMORY"])
def test_out_of_address_space_by_either_code_is_out_of_memory(cuda_sim: Any, code: str) -> None:
    cuda_sim.driver.impossible = getattr(cuda_sim.driver.CUresult, code)
    m = sm.SyncedMemory(4096, device="cuda", backend="vmm")
    m.mutable_device_data().fill_(9)
    capacity = m.device_capacity
    m.set_size(1 << 50)
    with pytest.raises(sm.OutOfMemoryError) as error:
        m.mutable_device_data()
    assert error.value.requested >= 1 << 50
    m.set_size(4096)
    assert m.device_capacity == capacity and same(m.device_data(), 9)
    assert same(m.host_data(), 9)


def capture_elsewhere(sim: Any, mode: str = "global") -> int:
    """Begin a capture on a new stream from another thread; returns its handle."""
    handles: list[int] = []
    thread = threading.Thread(target=lambda: handles.append(sim.ops.begin_capture(None, mode)))
    thread.start()
    thread.join()
    return handles[0]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", ["another thread", "a side stream of this thread"])
def test_growth_during_a_capture_is_refused_before_any_driver_call(
    cuda_sim: Any, backend: str, where: str
) -> None:
    m = sm.SyncedMemory(1000, device="cuda", backend=backend)
    m.mutable_device_data().fill_(1)
    m.host_data()
    if where == "another thread":
        handle = capture_elsewhere(cuda_sim)
    else:
        handle = cuda_sim.ops.begin_capture(cuda_sim.ops.new_stream(0))
    try:
        m.mutable_device_data().fill_(2)  # no growth: the capture may use what is held
        m.set_size(64 * MiB)
        for access in (m.mutable_device_data, m.mutable_host_data):
            with pytest.raises(sm.SharedMemError, match=r"^sharedmem: .* during a CUDA graph"):
                access()
        with pytest.raises(sm.SharedMemError, match="Grow before capturing"):
            m.device_data()
    finally:
        survived = cuda_sim.ops.end_capture(handle)
    assert survived  # refused before any driver call: the capture was not invalidated
    m.set_size(1000)
    assert same(m.device_data(), 2)


def test_a_relaxed_capture_elsewhere_lets_memory_grow(cuda_sim: Any) -> None:
    handle = capture_elsewhere(cuda_sim, "relaxed")
    m = sm.SyncedMemory(8 * MiB, device="cuda", backend="vmm")
    m.mutable_device_data().fill_(3)
    assert cuda_sim.ops.end_capture(handle)
    assert same(m.host_data(), 3)


def test_a_capture_the_driver_reports_is_named_with_what_to_do(cuda_sim: Any) -> None:
    from sharedmem._backends.cuda_api import check

    code = cuda_sim.driver.CUresult.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
    with pytest.raises(sm.SharedMemError, match=r"^sharedmem: cuMemCreate failed .* captured"):
        check((code, None), "cuMemCreate")
