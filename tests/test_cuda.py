"""CUDA backends: what needs a GPU is marked ``cuda`` and skipped without one.

The generic state-machine, invariant and growth tests already run on every CUDA backend
through ``TWO_SIDED`` / ``ALL_PLACEMENTS``; this file checks what only CUDA has: stable
addresses and zero-copy growth on ``vmm``, zero-copy wrapping on ``cudart``, pinned host
memory, copies on streams, real out-of-memory failures, ``cuda:N``. The first part runs on any
machine: the bookkeeping that needs no device, the mapping of cuda-python's results to our
errors, and what happens without a GPU.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import io
import json
import mmap
import subprocess
import sys
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeVar

import pytest
import torch
from conftest import HAS_CUDA, requires_cuda

import sharedmem as sm

F = TypeVar("F", bound=Callable[..., Any])
ROOT = Path(__file__).resolve().parent.parent
BACKENDS = ["vmm", "cudart", "torch"]
MiB = 1 << 20
PAGE = mmap.PAGESIZE
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs at least 2 GPUs")


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
        "cuMemUnmap", "cuMemSetAccess", "cuMemGetAllocationGranularity", "cuMemHostRegister",
        "cuMemHostUnregister",
    ]  # fmt: skip
    runtime = [
        "cudaMalloc", "cudaFree", "cudaGetDeviceCount", "cudaRuntimeGetVersion",
        "cudaDriverGetVersion",
    ]  # fmt: skip
    assert [n for n in driver if not hasattr(names.driver, n)] == []
    assert [n for n in runtime if not hasattr(names.runtime, n)] == []
    assert isinstance(names.driver.CU_MEMHOSTREGISTER_PORTABLE, int)
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


def test_a_driver_too_old_for_cuda_python_is_named_as_such_not_as_a_bug() -> None:
    cuda = cuda_modules()
    old_driver = cuda.bindings().runtime.cudaError_t.cudaErrorInsufficientDriver
    with pytest.raises(sm.SharedMemError) as caught:
        cuda.check((old_driver,), "cudaMalloc")
    text = str(caught.value)
    assert text.startswith("sharedmem: cudaMalloc failed with cudaErrorInsufficientDriver")
    assert "pip install 'cuda-python<13'" in text and "backend='torch'" in text
    assert "bug" not in text and "report" not in text


def versions_runtime(count_error: str, driver_version: int) -> SimpleNamespace:
    """A cuda-python runtime of CUDA 13.4 that answers cudaGetDeviceCount with ``count_error``."""
    real = cuda_modules().bindings().runtime
    codes = real.cudaError_t
    return SimpleNamespace(
        cudaError_t=codes,
        cudaGetDeviceCount=lambda: (getattr(codes, count_error), 0),
        cudaRuntimeGetVersion=lambda: (codes.cudaSuccess, 13040),
        cudaDriverGetVersion=lambda: (codes.cudaSuccess, driver_version),
    )


@pytest.fixture
def fresh_cuda_checks() -> Iterator[Any]:
    """The CUDA module with its once-per-process checks forgotten before and after."""
    cuda = cuda_modules()
    from sharedmem._backends import cudart

    def forget() -> None:
        for cached in (cudart.runtime_problem, cuda.default_backend, cuda._host_backend):
            cached.cache_clear()

    forget()
    yield cuda
    forget()


def test_cudart_on_a_driver_older_than_its_runtime_says_how_to_fix_it(
    monkeypatch: pytest.MonkeyPatch, fresh_cuda_checks: Any
) -> None:
    from sharedmem._backends import cudart

    runtime = versions_runtime("cudaErrorInsufficientDriver", 12090)
    monkeypatch.setattr(cudart, "bindings", lambda: SimpleNamespace(runtime=runtime))
    with pytest.raises(sm.SharedMemError) as caught:
        cudart.CudartBackend("cuda:0")
    text = str(caught.value)
    assert text.startswith("sharedmem: backend='cudart' cannot run on cuda:0")
    assert "CUDA 13.4" in text and "CUDA 12.9" in text and "cudaErrorInsufficientDriver" in text
    assert "pip install 'cuda-python<13'" in text
    assert "backend='vmm'" in text and "backend='torch'" in text and "bug" not in text


@pytest.mark.parametrize(
    ("broken", "default", "usable"),
    [
        ((), "vmm", ("vmm", "cudart", "torch")),
        (("cudart",), "vmm", ("vmm", "torch")),  # cuda-python 13 on a CUDA 12 driver
        (("vmm",), "cudart", ("cudart", "torch")),
        (("vmm", "cudart"), "torch", ("torch",)),
    ],
)
def test_the_default_backend_is_the_first_that_can_run(
    monkeypatch: pytest.MonkeyPatch,
    fresh_cuda_checks: Any,
    broken: tuple[str, ...],
    default: str,
    usable: tuple[str, ...],
) -> None:
    cuda = fresh_cuda_checks

    def build(index: int, kind: str) -> object:
        if kind in broken:
            raise sm.SharedMemError(f"sharedmem: {kind} cannot run here")
        return object()

    monkeypatch.setattr(cuda, "_device_backend", build)
    assert cuda.default_backend(0) == default
    assert cuda.usable_backends(0) == usable


def test_the_host_side_is_pytorch_pinned_tensors_where_registration_fails(
    monkeypatch: pytest.MonkeyPatch, fresh_cuda_checks: Any
) -> None:
    from sharedmem._backends import cuda_pinned

    if not HAS_CUDA:  # no driver answers here: the trial registration itself says no
        assert cuda_pinned.registration_works(0) is False
    monkeypatch.setattr(cuda_pinned, "registration_works", lambda index: False)
    assert isinstance(fresh_cuda_checks._host_backend(0), cuda_pinned.PinnedPageableBackend)
    monkeypatch.setattr(cuda_pinned, "registration_works", lambda index: True)
    fresh_cuda_checks._host_backend.cache_clear()
    assert isinstance(fresh_cuda_checks._host_backend(0), cuda_pinned.PinnedReservedBackend)


def reserving_driver(answers: list[str]) -> tuple[SimpleNamespace, list[int]]:
    """A driver whose cuMemAddressReserve answers with ``answers`` in turn; records sizes."""
    codes = cuda_modules().bindings().driver.CUresult
    asked: list[int] = []

    def reserve(size: int, alignment: int, addr: int, flags: int) -> tuple[Any, int]:
        asked.append(size)
        return getattr(codes, answers[len(asked) - 1]), 0x7000_0000

    return SimpleNamespace(cuMemAddressReserve=reserve), asked


def test_only_an_out_of_memory_reservation_is_out_of_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cuda = cuda_modules()
    from sharedmem._backends import cuda_vmm

    monkeypatch.setattr(cuda_vmm, "on_device", lambda index: contextlib.nullcontext())
    sizes = [64 * MiB, 32 * MiB, 16 * MiB]

    def use(answers: list[str]) -> list[int]:
        driver, asked = reserving_driver(answers)
        monkeypatch.setattr(cuda_vmm, "bindings", lambda: SimpleNamespace(driver=driver))
        return asked

    asked = use(["CUDA_ERROR_OUT_OF_MEMORY", "CUDA_SUCCESS"])
    assert cuda_vmm.reserve_range(0, sizes, 2 * MiB) == (0x7000_0000, 32 * MiB)
    assert asked == sizes[:2]  # a crowded address space may still hold a smaller range
    asked = use(["CUDA_ERROR_OUT_OF_MEMORY"] * 3)
    with pytest.raises(cuda.DeviceOutOfMemory):
        cuda_vmm.reserve_range(0, sizes, 2 * MiB)
    assert asked == sizes
    asked = use(["CUDA_ERROR_INVALID_VALUE"])
    with pytest.raises(sm.SharedMemError, match=r"cuMemAddressReserve.*CUDA_ERROR_INVALID_VALUE"):
        cuda_vmm.reserve_range(0, sizes, 2 * MiB)
    assert asked == sizes[:1]  # not retried smaller, and not an OutOfMemoryError later


def storage_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the storage under ``tensor``, what ``torch.save`` or ``deepcopy`` reads."""
    return int(tensor.untyped_storage().nbytes())


@pytest.fixture
def pins(monkeypatch: pytest.MonkeyPatch) -> dict[int, int]:
    """Host registrations recorded (address -> bytes) instead of made: no device needed."""
    from sharedmem._backends import cuda_pinned

    registered: dict[int, int] = {}

    def register(index: int, address: int, size: int) -> None:
        assert all(address + size <= a or a + n <= address for a, n in registered.items())
        registered[address] = size

    monkeypatch.setattr(cuda_pinned, "_register_range", register)
    monkeypatch.setattr(cuda_pinned, "_unregister_range", lambda i, a: registered.pop(a))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    return registered


def test_pinned_host_views_span_their_capacity_not_the_reserved_range(
    pins: dict[int, int],
) -> None:
    from sharedmem._backends.cuda_pinned import PinnedReservedBackend

    backend = PinnedReservedBackend(0, reservation=64 * PAGE)
    block = backend.allocate(1000)
    first = block.tensor
    first.fill_(3)
    assert storage_bytes(first) == PAGE
    buffer = io.BytesIO()
    torch.save(first, buffer)  # reads the storage: the capacity, not 64 pages of range
    assert buffer.tell() < 2 * PAGE
    grown, copied = backend.grow(block, 5 * PAGE, keep=PAGE)
    assert copied == 0 and grown.address == block.address
    assert storage_bytes(grown.tensor) == 5 * PAGE
    assert first.tolist() == [3] * PAGE  # the view from before the growth is still valid
    assert sorted(pins.values()) == [PAGE, 4 * PAGE] and backend.meter.held == 5 * PAGE
    shrunk, _ = backend.shrink(grown, 2 * PAGE, keep=PAGE)
    assert shrunk is not None
    assert storage_bytes(shrunk.tensor) == 2 * PAGE
    assert sum(pins.values()) == backend.meter.held == 2 * PAGE
    backend.free(shrunk)
    assert pins == {} and backend.meter.held == 0


def test_a_pinned_block_that_moves_leaves_old_views_their_bytes(pins: dict[int, int]) -> None:
    from sharedmem._backends.cuda_pinned import PinnedReservedBackend

    backend = PinnedReservedBackend(0, reservation=2 * PAGE)
    block = backend.allocate(PAGE)
    block.tensor.fill_(7)
    old, old_address = block.tensor, block.address
    moved, copied = backend.grow(block, 64 * PAGE, keep=PAGE)  # past the range: moves
    assert moved.address != old_address and copied == PAGE
    assert moved.tensor[:PAGE].tolist() == [7] * PAGE
    del block
    gc.collect()
    assert old.tolist() == [7] * PAGE  # DESIGN §4: a view from before keeps the old bytes
    assert pins == {moved.address: 64 * PAGE}  # the old range was unpinned with its block
    assert backend.meter.held == 64 * PAGE
    backend.free(moved)  # while registration is still recorded, not made


def test_pinning_past_memory_and_swap_is_refused_before_registering(
    pins: dict[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    from sharedmem._backends import cuda_pinned

    backend = cuda_pinned.PinnedReservedBackend(0, reservation=64 * PAGE)
    block = backend.allocate(PAGE)
    monkeypatch.setattr(cuda_pinned, "commit_limit", lambda: 8 * PAGE)
    with pytest.raises(sm.OutOfMemoryError, match="memory and swap"):
        backend.grow(block, 16 * PAGE, keep=PAGE)
    assert list(pins.values()) == [PAGE] and backend.meter.held == PAGE
    backend.free(block)  # while registration is still recorded, not made


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
    written = json.loads(out.read_text())
    assert written["rows"] == [] and written["meta"]["skipped"] == "no CUDA GPU"


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
        cuda._device_backend(torch.cuda.current_device(), backend)
    except sm.SharedMemError as error:
        pytest.skip(str(error))


def vmm_or_skip() -> None:
    usable_or_skip("vmm")


def settle_garbage() -> None:
    gc.collect()
    torch.cuda.synchronize()


@on_gpu
def test_default_backend_is_vmm_where_the_device_supports_it() -> None:
    cuda = cuda_modules()
    index = torch.cuda.current_device()
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
    usable_or_skip(backend)
    size = 64 * MiB
    m = sm.SyncedMemory(size, device="cuda", backend=backend)
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    for value, given in ((1, stream), (2, stream.cuda_stream), (3, None)):
        view = m.mutable_device_data()
        torch.cuda._sleep(20_000_000)  # type: ignore[no-untyped-call]  # the producer is still busy when the pull is issued
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


@on_gpu
@two_gpus
def test_a_stream_of_another_device_is_refused() -> None:
    m = sm.SyncedMemory(1000, device="cuda")
    m.mutable_host_data().fill_(1)
    other = (torch.cuda.current_device() + 1) % torch.cuda.device_count()
    with pytest.raises(ValueError, match=r"^sharedmem: the stream is on cuda:"):
        m.push_async(torch.cuda.Stream(device=other))  # type: ignore[no-untyped-call]


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
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
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
    last = torch.cuda.device_count() - 1
    with torch.cuda.device(0):
        m = sm.SyncedMemory(MiB, device=f"cuda:{last}", backend=backend)
        m.mutable_host_data().fill_(6)
        view = m.device_data()
        assert view.device == torch.device("cuda", last)
        assert torch.cuda.current_device() == 0
        assert int(view.min()) == int(view.max()) == 6
        if backend != "torch":  # ask the driver where the bytes are, not PyTorch
            driver = cuda_modules().bindings().driver
            ordinal = driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
            error, where = driver.cuPointerGetAttribute(ordinal, view.data_ptr())
            assert int(error) == 0 and int(where) == last


@on_gpu
def test_the_torch_backend_is_seen_by_the_caching_allocator() -> None:
    index = torch.cuda.current_device()
    before = torch.cuda.memory_stats(index).get("allocated_bytes.all.current", 0)
    m = sm.SyncedMemory(8 * MiB, device="cuda", backend="torch")
    m.mutable_device_data()
    after = torch.cuda.memory_stats(index)["allocated_bytes.all.current"]
    assert after - before >= m.device_capacity >= 8 * MiB
