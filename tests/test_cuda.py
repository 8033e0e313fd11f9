"""CUDA backends: what needs a GPU is marked ``cuda`` and skipped without one.

The generic state-machine, invariant and growth tests already run on every CUDA backend
through ``TWO_SIDED`` / ``ALL_PLACEMENTS``; this file checks what only CUDA has: stable
addresses and zero-copy growth on ``vmm``, zero-copy wrapping on ``cudart``, pinned host
memory, copies on streams, real out-of-memory failures, ``cuda:N``. The first part runs on any
machine: the bookkeeping that needs no device, the mapping of cuda-python's results to our
errors, and what happens without a GPU.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from conftest import HAS_CUDA, requires_cuda

import sharedmem as sm

F = TypeVar("F", bound=Callable[..., Any])
ROOT = Path(__file__).resolve().parent.parent
BACKENDS = ["vmm", "cudart", "torch"]
MiB = 1 << 20


def on_gpu(test: F) -> F:
    marked: F = pytest.mark.cuda(requires_cuda(test))
    return marked


def cuda_modules() -> Any:
    """sharedmem's CUDA helpers, or a skip where cuda-python cannot be imported."""
    from sharedmem._backends import cuda

    try:
        cuda.bindings()
    except sm.SharedMemError as error:
        pytest.skip(str(error))
    return cuda


# ---- without a GPU -------------------------------------------------------------------------


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-GPU error")
@pytest.mark.parametrize("backend", [None, *BACKENDS])
def test_cuda_without_a_gpu_raises_for_every_backend(backend: str | None) -> None:
    with pytest.raises(sm.SharedMemError, match=r"^sharedmem: device 'cuda' is not usable"):
        sm.SyncedMemory(device="cuda", backend=backend)


@pytest.mark.skipif(HAS_CUDA, reason="checks the fallback where no driver answers")
def test_default_backend_without_a_driver_is_torch() -> None:
    cuda = cuda_modules()
    assert cuda.default_backend(0) == "torch"


def test_the_cuda_python_names_we_call_exist() -> None:
    # The code cannot run here, so at least its spelling is checked against cuda-python.
    names = cuda_modules().bindings()
    driver = [
        "cuInit", "cuDeviceGet", "cuDeviceGetAttribute", "cuDevicePrimaryCtxRetain",
        "cuCtxPushCurrent", "cuCtxPopCurrent", "cuCtxSynchronize", "cuMemGetInfo",
        "cuMemAddressReserve", "cuMemAddressFree", "cuMemCreate", "cuMemRelease", "cuMemMap",
        "cuMemUnmap", "cuMemSetAccess", "cuMemGetAllocationGranularity",
    ]  # fmt: skip
    runtime = ["cudaMalloc", "cudaFree", "cudaHostRegister", "cudaHostUnregister"]
    assert [n for n in driver if not hasattr(names.driver, n)] == []
    assert [n for n in runtime if not hasattr(names.runtime, n)] == []
    assert isinstance(names.runtime.cudaHostRegisterPortable, int)
    attributes = names.driver.CUdevice_attribute
    assert hasattr(attributes, "CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED")
    assert hasattr(attributes, "CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED")
    flags = names.driver.CUmemAllocationGranularity_flags
    assert hasattr(flags, "CU_MEM_ALLOC_GRANULARITY_RECOMMENDED")


def test_an_attribute_this_cuda_python_lacks_is_a_clear_error() -> None:
    cuda = cuda_modules()
    with pytest.raises(sm.SharedMemError, match=r"^sharedmem: this cuda-python does not know"):
        cuda.attribute(0, "CU_DEVICE_ATTRIBUTE_NO_SUCH_THING")


@pytest.mark.parametrize("stream", ["side", 1.5, True, torch.Stream(device="cpu")])
def test_streams_that_are_not_cuda_streams_are_refused(stream: object) -> None:
    from sharedmem._backends.cuda_streams import _as_stream

    with pytest.raises(TypeError, match=r"^sharedmem: stream must be a torch.cuda.Stream"):
        _as_stream(stream, 0)


def test_vmm_structures_name_the_device() -> None:
    driver = cuda_modules().bindings().driver
    from sharedmem._backends.cuda_vmm import access_desc, allocation_prop

    prop = allocation_prop(3)
    assert prop.type == driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    assert prop.location.type == driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    assert prop.location.id == 3
    desc = access_desc(3)
    assert desc.location.id == 3
    assert desc.flags == driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE


def test_check_maps_cuda_python_results_to_our_errors() -> None:
    cuda = cuda_modules()
    driver, runtime = cuda.bindings().driver, cuda.bindings().runtime
    ok = driver.CUresult.CUDA_SUCCESS
    assert cuda.check((ok,), "x") is None
    assert cuda.check((ok, 5), "x") == 5
    assert cuda.check((ok, 1, 2), "x") == (1, 2)
    for oom in (
        driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY,
        runtime.cudaError_t.cudaErrorMemoryAllocation,
    ):
        with pytest.raises(cuda.DeviceOutOfMemory, match="cuMemCreate"):
            cuda.check((oom, None), "cuMemCreate")
    with pytest.raises(
        sm.SharedMemError, match=r"^sharedmem: cuMemMap failed with CUDA_ERROR_INVALID_VALUE"
    ):
        cuda.check((driver.CUresult.CUDA_ERROR_INVALID_VALUE,), "cuMemMap")


def test_reservations_halve_down_to_what_is_needed() -> None:
    cuda_modules()
    from sharedmem._backends.cuda_vmm import reservation_sizes

    assert reservation_sizes(64, 10, 4) == [64, 32, 16, 10]
    assert reservation_sizes(8, 12, 4) == [12]  # never less than needed
    assert reservation_sizes(16, 16, 4) == [16]


def test_unpinning_cuts_the_registration_that_straddles_the_end() -> None:
    cuda_modules()
    from sharedmem._backends.cuda_pinned import split_ranges

    ranges = [(0, 4096), (4096, 8192), (12288, 4096)]
    assert split_ranges(ranges, 8192) == ([(0, 4096)], [(12288, 4096), (4096, 8192)], (4096, 4096))
    assert split_ranges(ranges, 4096) == ([(0, 4096)], [(12288, 4096), (4096, 8192)], None)
    assert split_ranges(ranges, 0) == ([], ranges[::-1], None)
    assert split_ranges(ranges, 16384) == (ranges, [], None)


def test_meters_keep_the_peak_until_reset() -> None:
    from sharedmem._backends.cuda_owner import Meter

    meter = Meter()
    meter.add(10)
    meter.add(5)
    meter.sub(12)
    assert (meter.held, meter.peak) == (3, 15)
    meter.reset_peak()
    assert meter.peak == 3


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-GPU path of the benchmark")
def test_the_benchmark_skips_without_a_gpu(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_cuda.py"), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "skipped: no CUDA GPU" in done.stdout
    assert out.read_text().strip() == "[]"


# ---- on a GPU ------------------------------------------------------------------------------


def device_of(memory: sm.SyncedMemory) -> Any:
    backend = memory.placement.accel
    assert backend is not None
    return backend


def vmm_or_skip() -> None:
    if not cuda_modules().vmm_supported(torch.cuda.current_device()):
        pytest.skip("this GPU does not support CUDA virtual memory management")


def settle_garbage() -> None:
    gc.collect()
    torch.cuda.synchronize()


@on_gpu
def test_default_backend_is_vmm_where_the_device_supports_it() -> None:
    cuda = cuda_modules()
    index = torch.cuda.current_device()
    expected = "vmm" if cuda.vmm_supported(index) else "cudart"
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
    if backend == "vmm":
        vmm_or_skip()
    m = sm.SyncedMemory(4096, device="cuda", backend=backend)
    first = m.mutable_host_data()
    assert first.is_pinned()
    m.set_size(64 * MiB)
    grown = m.mutable_host_data()
    assert grown[-4096:].is_pinned() and grown.is_pinned()
    if m.placement.host.kind == "pinned":
        assert grown.data_ptr() == first.data_ptr() and m.grow_copy_bytes == 0
    m.set_size(MiB)
    m.shrink_to_fit()
    assert m.host_data().is_pinned()


@on_gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_async_copies_on_a_side_stream_wait_for_the_producer(backend: str) -> None:
    if backend == "vmm":
        vmm_or_skip()
    size = 64 * MiB
    m = sm.SyncedMemory(size, device="cuda", backend=backend)
    stream = torch.cuda.Stream()
    for value, given in ((1, stream), (2, stream.cuda_stream), (3, None)):
        view = m.mutable_device_data()
        torch.cuda._sleep(20_000_000)  # the producer is still busy when the pull is issued
        view.fill_(value)
        m.pull_async(given)
        host = m.host_data()
        assert int(host.min()) == int(host.max()) == value
        m.mutable_host_data().fill_(value + 10)
        m.push_async(given)
        device = m.device_data()  # ordered after the push on the current stream
        assert int(device.min()) == int(device.max()) == value + 10


@on_gpu
def test_stream_arguments_are_checked() -> None:
    m = sm.SyncedMemory(1000, device="cuda")
    m.mutable_host_data().fill_(1)
    with pytest.raises(TypeError, match=r"^sharedmem: stream must be a torch.cuda.Stream"):
        m.push_async("side")
    if torch.cuda.device_count() > 1:
        other = (torch.cuda.current_device() + 1) % torch.cuda.device_count()
        with pytest.raises(ValueError, match=r"^sharedmem: the stream is on cuda:"):
            m.push_async(torch.cuda.Stream(device=other))


@on_gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_running_out_of_memory_keeps_every_byte(backend: str) -> None:
    if backend == "vmm":
        vmm_or_skip()
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
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    backend = VmmBackend(default.device, reservation=2 * total)
    m = sm.SyncedMemory(100, placement=Placement(default.device, default.host, backend))
    m.mutable_device_data().fill_(4)
    held = backend.meter.held
    m.set_size(total + backend.granularity)
    with pytest.raises(sm.OutOfMemoryError):
        m.device_data()
    assert backend.meter.held == held  # every chunk mapped on the way was given back
    m.set_size(100)
    assert m.device_data().cpu().tolist() == [4] * 100


@on_gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_n_allocates_on_device_n(backend: str) -> None:
    if backend == "vmm":
        vmm_or_skip()
    last = torch.cuda.device_count() - 1
    with torch.cuda.device(0):
        m = sm.SyncedMemory(MiB, device=f"cuda:{last}", backend=backend)
        m.mutable_host_data().fill_(6)
        view = m.device_data()
        assert view.device == torch.device("cuda", last)
        assert torch.cuda.current_device() == 0
        assert int(view.min()) == int(view.max()) == 6
        if backend != "torch":
            runtime = cuda_modules().bindings().runtime
            error, attributes = runtime.cudaPointerGetAttributes(view.data_ptr())
            assert int(error) == 0 and attributes.device == last


@on_gpu
def test_the_torch_backend_is_seen_by_the_caching_allocator() -> None:
    index = torch.cuda.current_device()
    before = torch.cuda.memory_stats(index).get("allocated_bytes.all.current", 0)
    m = sm.SyncedMemory(8 * MiB, device="cuda", backend="torch")
    m.mutable_device_data()
    after = torch.cuda.memory_stats(index)["allocated_bytes.all.current"]
    assert after - before >= m.device_capacity >= 8 * MiB
