"""CUDA without a GPU: the bookkeeping that needs no device, the mapping of cuda-python's
results to our errors, the choice of backend where some cannot run, and what happens with no
GPU at all. These run on every machine; ``test_cuda.py`` holds what needs a GPU.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import mmap
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import HAS_CUDA, storage_bytes

import sharedmem as sm

ROOT = Path(__file__).resolve().parent.parent
BACKENDS = ["vmm", "cudart", "torch"]
MiB = 1 << 20
PAGE = mmap.PAGESIZE


def cuda_modules() -> Any:
    """sharedmem's CUDA helpers and backend chooser in one namespace, or a skip where
    cuda-python cannot be imported."""
    from sharedmem._backends import cuda, cuda_api

    try:
        cuda_api.bindings()
    except sm.SharedMemError as error:
        pytest.skip(str(error))
    return SimpleNamespace(**{**vars(cuda_api), **vars(cuda)})


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
        "cuMemHostUnregister", "cuDeviceCanAccessPeer",
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
    """The CUDA backend chooser with its once-per-process checks forgotten before and after."""
    cuda_modules()  # skips where cuda-python cannot be imported
    from sharedmem._backends import cuda, cudart

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


def test_a_reservation_refused_by_either_documented_code_is_out_of_memory(
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

    # cuMemAddressReserve documents CUDA_ERROR_INVALID_VALUE and CUDA_ERROR_OUT_OF_MEMORY, and
    # not which one a range that cannot be had gets: both move on to a smaller size.
    for full in ("CUDA_ERROR_OUT_OF_MEMORY", "CUDA_ERROR_INVALID_VALUE"):
        asked = use([full, "CUDA_SUCCESS"])
        assert cuda_vmm.reserve_range(0, sizes, 2 * MiB) == (0x7000_0000, 32 * MiB)
        assert asked == sizes[:2]  # a crowded address space may still hold a smaller range
        asked = use([full] * 3)
        with pytest.raises(cuda.DeviceOutOfMemory):
            cuda_vmm.reserve_range(0, sizes, 2 * MiB)
        assert asked == sizes
    asked = use(["CUDA_ERROR_INVALID_CONTEXT"])
    with pytest.raises(sm.SharedMemError, match=r"cuMemAddressReserve.*CUDA_ERROR_INVALID_CONTEXT"):
        cuda_vmm.reserve_range(0, sizes, 2 * MiB)
    assert asked == sizes[:1]  # not retried smaller, and not an OutOfMemoryError later


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
    first = block.tensor[:PAGE]  # a view, as the state machine hands out
    first.fill_(3)
    assert storage_bytes(first) == PAGE
    buffer = io.BytesIO()
    torch.save(first, buffer)  # reads the storage: the capacity, not 64 pages of range
    assert buffer.tell() < 2 * PAGE
    grown, copied = backend.grow(block, 5 * PAGE, keep=PAGE)
    assert copied == 0 and grown.address == block.address
    assert storage_bytes(grown.tensor) == 5 * PAGE
    assert first.tolist() == [3] * PAGE  # the view from before the growth is still valid
    # One registration for the whole range (a copy may not span two: an H100 refuses it).
    assert list(pins.values()) == [5 * PAGE] and backend.meter.held == 5 * PAGE
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
    from sharedmem._backends import cuda_pinned, host

    backend = cuda_pinned.PinnedReservedBackend(0, reservation=64 * PAGE)
    block = backend.allocate(PAGE)
    monkeypatch.setattr(host, "commit_limit", lambda: 8 * PAGE)
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


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-GPU path of ./dev gpu-check")
def test_gpu_check_without_a_gpu_says_where_the_cuda_tests_run(tmp_path: Path) -> None:
    report = tmp_path / "report.txt"
    done = subprocess.run(
        ["bash", str(ROOT / "dev"), "gpu-check", str(report)],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert done.returncode == 2 and not report.exists()
    assert "gpu-check needs a CUDA GPU" in done.stderr and "stand-in" in done.stderr


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


def test_the_router_benchmark_takes_most_or_a_slowdown_to_recompute() -> None:
    # ``./dev gpu-check`` runs it with ``--recompute most``; a wrong spelling is refused with
    # the choices before any GPU is asked for.
    script = str(ROOT / "benchmarks" / "bench_cuda_router.py")
    for wrong in ("fast", "0.5"):
        done = subprocess.run(
            [sys.executable, script, "--recompute", wrong, "tv_resnet18"],
            capture_output=True,
            text=True,
            check=False,
        )
        assert done.returncode == 2, done.stderr
        assert "--recompute takes 'most' or a slowdown above 1" in done.stdout, done.stdout


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-GPU path of tests/gpu_answers.py")
def test_the_gpu_answers_script_says_it_needs_a_gpu() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "gpu_answers.py")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2 and "no CUDA GPU here" in done.stderr
