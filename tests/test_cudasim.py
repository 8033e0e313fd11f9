"""The CUDA stand-in (tests/cudasim): it keeps the documented rules of the driver calls that
sharedmem makes, so the CUDA tests that run on it check something; and bugs planted in the
CUDA backends each fail one of those tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import HAS_CUDA

pytest.importorskip("cuda.bindings", reason="the CUDA stand-in needs cuda-python's modules")

from cudasim import GRANULARITY, MINIMUM_GRANULARITY, SimulatedCuda
from cudasim.memory import FRESH
from cudasim.plants import PLANTS, plant

from sharedmem._backends import cuda_api
from sharedmem._backends.cuda_vmm import access_desc, allocation_prop

ROOT = Path(__file__).resolve().parent.parent
G = GRANULARITY
M = MINIMUM_GRANULARITY


@pytest.fixture
def sim() -> Iterator[SimulatedCuda]:
    with SimulatedCuda(capacity=8 * G, pinned_capacity=64 << 10) as cuda, cuda_api.on_device(0):
        yield cuda


def name(result: tuple[Any, ...]) -> str:
    return str(result[0].name)


def reserve(sim: SimulatedCuda, size: int) -> int:
    error, address = sim.driver.cuMemAddressReserve(size, 0, 0, 0)
    assert name((error,)) == "CUDA_SUCCESS"
    return int(address)


def create(sim: SimulatedCuda, size: int = G) -> Any:
    error, handle = sim.driver.cuMemCreate(size, allocation_prop(0), 0)
    assert name((error,)) == "CUDA_SUCCESS"
    return handle


def grant(sim: SimulatedCuda, address: int, size: int) -> str:
    return name(sim.driver.cuMemSetAccess(address, size, [access_desc(0)], 1))


# ---- the documented rules of the virtual memory calls ----------------------------------------


def test_sizes_and_addresses_off_the_minimum_granularity_are_invalid_values(
    sim: SimulatedCuda,
) -> None:
    driver = sim.driver
    flags = driver.CUmemAllocationGranularity_flags
    recommended, minimum = (
        flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
        flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM,
    )
    assert driver.cuMemGetAllocationGranularity(allocation_prop(0), recommended)[1] == G
    assert driver.cuMemGetAllocationGranularity(allocation_prop(0), int(minimum))[1] == M < G
    assert name(driver.cuMemAddressReserve(M + 1, 0, 0, 0)) == "CUDA_ERROR_INVALID_VALUE"
    assert name(driver.cuMemAddressReserve(M, M // 2, 0, 0)) == "CUDA_ERROR_INVALID_VALUE"
    assert name(driver.cuMemCreate(M // 2, allocation_prop(0), 0)) == "CUDA_ERROR_INVALID_VALUE"
    small = driver.cuMemCreate(M, allocation_prop(0), 0)  # the minimum is enough
    assert name(small) == "CUDA_SUCCESS" and name(driver.cuMemRelease(small[1])) == "CUDA_SUCCESS"
    address, handle = reserve(sim, 4 * G), create(sim)
    assert name(driver.cuMemMap(address + 4096, G, 0, handle, 0)) == "CUDA_ERROR_INVALID_VALUE"
    assert name(driver.cuMemMap(address, G, 4096, handle, 0)) == "CUDA_ERROR_INVALID_VALUE"
    assert name(driver.cuMemMap(address, 2 * G, 0, handle, 0)) == "CUDA_ERROR_INVALID_VALUE"
    assert name(driver.cuMemRelease(handle)) == "CUDA_SUCCESS"
    assert name(driver.cuMemAddressFree(address, 4 * G)) == "CUDA_SUCCESS"


def test_maps_go_only_inside_a_reservation_onto_unmapped_addresses(sim: SimulatedCuda) -> None:
    driver = sim.driver
    address, first, second = reserve(sim, 2 * G), create(sim), create(sim)
    assert name(driver.cuMemMap(address + 2 * G, G, 0, first, 0)) == "CUDA_ERROR_INVALID_VALUE"
    assert name(driver.cuMemMap(address + G, 2 * G, 0, first, 0)) == "CUDA_ERROR_INVALID_VALUE"
    assert name(driver.cuMemMap(address, G, 0, first, 0)) == "CUDA_SUCCESS"
    assert name(driver.cuMemMap(address, G, 0, second, 0)) == "CUDA_ERROR_INVALID_VALUE"
    assert name(driver.cuMemMap(address + G, G, 0, second, 0)) == "CUDA_SUCCESS"
    # A range still mapped cannot be freed; whole mappings unmap, one part of one does not.
    assert name(driver.cuMemAddressFree(address, 2 * G)) == "CUDA_ERROR_INVALID_VALUE"
    assert name(driver.cuMemUnmap(address, G // 2)) == "CUDA_ERROR_INVALID_VALUE"
    assert name(driver.cuMemUnmap(address + G // 2, G)) == "CUDA_ERROR_INVALID_VALUE"
    assert name(driver.cuMemUnmap(address, 2 * G)) == "CUDA_SUCCESS"  # two whole mappings
    assert name(driver.cuMemUnmap(address, G)) == "CUDA_ERROR_INVALID_VALUE"  # not mapped now
    for handle in (first, second):
        assert name(driver.cuMemRelease(handle)) == "CUDA_SUCCESS"
    assert name(driver.cuMemRelease(first)) == "CUDA_ERROR_INVALID_VALUE"  # released already
    assert name(driver.cuMemAddressFree(address, G)) == "CUDA_ERROR_INVALID_VALUE"  # wrong size
    assert name(driver.cuMemAddressFree(address, 2 * G)) == "CUDA_SUCCESS"
    assert sim.leaks() == []


def test_mapped_memory_is_usable_only_once_access_is_set(sim: SimulatedCuda) -> None:
    driver = sim.driver
    address, handle = reserve(sim, 2 * G), create(sim)
    assert grant(sim, address, G) == "CUDA_ERROR_INVALID_VALUE"  # nothing mapped there yet
    assert name(driver.cuMemMap(address, G, 0, handle, 0)) == "CUDA_SUCCESS"
    assert not sim.memory.is_device_memory(address, G)
    assert grant(sim, address, 2 * G) == "CUDA_ERROR_INVALID_VALUE"  # half of it unmapped
    assert grant(sim, address, G) == "CUDA_SUCCESS"
    assert sim.memory.is_device_memory(address, G)
    assert not sim.memory.is_device_memory(address, G + 1)
    assert name(driver.cuMemUnmap(address, G)) == "CUDA_SUCCESS"
    assert not sim.memory.is_device_memory(address, G)  # a new mapping starts without access
    driver.cuMemRelease(handle)
    driver.cuMemAddressFree(address, 2 * G)


def test_touching_memory_mapped_without_access_is_a_fault() -> None:
    # On a GPU it is an illegal address that kills the context; here the process dies too.
    script = (
        "import ctypes, cudasim\n"
        "from sharedmem._backends import cuda_api\n"
        "from sharedmem._backends.cuda_vmm import allocation_prop\n"
        "with cudasim.SimulatedCuda() as sim, cuda_api.on_device(0):\n"
        "    d, g = sim.driver, cudasim.GRANULARITY\n"
        "    address = int(d.cuMemAddressReserve(g, 0, 0, 0)[1])\n"
        "    d.cuMemMap(address, g, 0, d.cuMemCreate(g, allocation_prop(0), 0)[1], 0)\n"
        "    print('mapped', flush=True)\n"
        "    ctypes.c_uint8.from_address(address).value = 1\n"
        "    print('written', flush=True)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=False
    )
    assert done.stdout == "mapped\n", done.stderr
    assert done.returncode < 0  # killed by SIGSEGV


def test_a_released_handle_keeps_its_memory_until_unmapped(sim: SimulatedCuda) -> None:
    driver = sim.driver
    address, handle = reserve(sim, G), create(sim)
    driver.cuMemMap(address, G, 0, handle, 0)
    assert sim.memory.used == G
    assert name(driver.cuMemRelease(handle)) == "CUDA_SUCCESS"  # allowed while mapped
    assert sim.memory.used == G
    driver.cuMemUnmap(address, G)
    assert sim.memory.used == 0
    driver.cuMemAddressFree(address, G)


def test_device_memory_runs_out_at_the_configured_capacity(sim: SimulatedCuda) -> None:
    driver = sim.driver
    handles = [create(sim) for _ in range(8)]
    assert driver.cuMemGetInfo()[1:] == (0, 8 * G)
    assert name(driver.cuMemCreate(G, allocation_prop(0), 0)) == "CUDA_ERROR_OUT_OF_MEMORY"
    assert name(sim.runtime.cudaMalloc(1)) == "cudaErrorMemoryAllocation"
    with pytest.raises(torch.OutOfMemoryError):
        sim.ops.empty(1, 0)
    for handle in handles:
        driver.cuMemRelease(handle)
    # Past the address space: either documented code, as the stand-in is told.
    assert name(driver.cuMemAddressReserve(1 << 50, 0, 0, 0)) == "CUDA_ERROR_INVALID_VALUE"
    driver.impossible = driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY
    assert name(driver.cuMemAddressReserve(1 << 50, 0, 0, 0)) == "CUDA_ERROR_OUT_OF_MEMORY"
    error, address = sim.runtime.cudaMalloc(100)
    assert name((error,)) == "cudaSuccess" and sim.memory.is_device_memory(int(address), 100)
    assert name(sim.runtime.cudaFree(int(address) + 8)) == "cudaErrorInvalidValue"
    assert name(sim.runtime.cudaFree(address)) == "cudaSuccess"
    assert sim.leaks() == []


def test_host_registration_rules(sim: SimulatedCuda) -> None:
    driver, flags = sim.driver, sim.driver.CU_MEMHOSTREGISTER_PORTABLE
    pages = torch.zeros(16 * 4096, dtype=torch.uint8)
    start = (pages.data_ptr() + 4095) // 4096 * 4096
    assert name(driver.cuMemHostRegister(start, 8192, flags)) == "CUDA_SUCCESS"
    # Pages are locked whole: a registration that shares a page with another is refused.
    shared = driver.cuMemHostRegister(start + 8191, 100, flags)
    assert name(shared) == "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED"
    assert name(driver.cuMemHostRegister(start + 8192, 4096, 1 << 20)) == "CUDA_ERROR_INVALID_VALUE"
    assert name(driver.cuMemHostRegister(start + 8192, 4096, flags)) == "CUDA_SUCCESS"
    assert sim.ops.is_pinned(pages[start - pages.data_ptr() :][: 3 * 4096])  # back to back
    assert name(driver.cuMemHostRegister(start + 3 * 4096, 128 << 10, flags)) == (
        "CUDA_ERROR_OUT_OF_MEMORY"  # past the pinned capacity
    )
    missing = driver.cuMemHostUnregister(start + 4096)  # only where a registration starts
    assert name(missing) == "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED"
    assert name(driver.cuMemHostUnregister(start)) == "CUDA_SUCCESS"
    assert name(driver.cuMemHostUnregister(start + 8192)) == "CUDA_SUCCESS"
    assert sim.leaks() == []


def test_calls_check_the_types_and_fields_they_are_given(sim: SimulatedCuda) -> None:
    driver = sim.driver
    with pytest.raises(TypeError):
        driver.cuMemCreate(G, object(), 0)  # not a CUmemAllocationProp
    with pytest.raises(TypeError):
        driver.cuMemRelease("7")  # the bindings convert ints, not strings
    # ... and convert as they do: a float address, an int handle, a float size.
    assert name(driver.cuMemRelease(7)) == "CUDA_ERROR_INVALID_VALUE"  # no such handle
    assert name(driver.cuMemMap(1.5, G, 0, create(sim), 0)) == "CUDA_ERROR_INVALID_VALUE"
    assert name(driver.cuMemAddressReserve(float(G), 0, 0, 0)) == "CUDA_SUCCESS"
    # Every value of a failed call is None, as the bindings return it.
    assert driver.cuMemCreate(M // 2, allocation_prop(0), 0)[1] is None
    assert driver.cuMemAddressReserve(M + 1, 0, 0, 0)[1] is None
    assert sim.runtime.cudaMalloc(1 << 40)[1] is None
    prop = allocation_prop(0)
    prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST
    assert name(driver.cuMemCreate(G, prop, 0)) == "CUDA_ERROR_INVALID_VALUE"
    assert name(driver.cuMemCreate(G, allocation_prop(2), 0)) == "CUDA_ERROR_INVALID_VALUE"
    address = reserve(sim, G)
    driver.cuMemMap(address, G, 0, create(sim), 0)
    desc = access_desc(0)
    assert name(driver.cuMemSetAccess(address, G, [desc], 2)) == "CUDA_ERROR_INVALID_VALUE"
    desc.location.id = 3
    assert name(driver.cuMemSetAccess(address, G, [desc], 1)) == "CUDA_ERROR_INVALID_VALUE"
    with pytest.raises(NotImplementedError, match="cuMemcpy"):
        driver.cuMemcpy  # noqa: B018 (a call the backends do not make is not simulated)
    driver.cuCtxPopCurrent()  # no context current: calls that need one refuse
    try:
        assert name(driver.cuMemCreate(G, allocation_prop(0), 0)) == "CUDA_ERROR_INVALID_CONTEXT"
        assert name(driver.cuCtxSynchronize()) == "CUDA_ERROR_INVALID_CONTEXT"
        assert driver.cuMemGetInfo()[1:] == (None, None)
    finally:
        driver.cuCtxPushCurrent(driver.cuDevicePrimaryCtxRetain(driver.cuDeviceGet(0)[1])[1])


def test_a_copy_on_a_side_stream_runs_when_its_event_is_waited_for(sim: SimulatedCuda) -> None:
    ops = sim.ops
    side, current = ops.new_stream(0), ops.current_stream(0)
    dst, src = torch.zeros(4, dtype=torch.uint8), torch.ones(4, dtype=torch.uint8)
    ops.copy_on(side, dst, src)
    event = ops.new_event()
    event.record(side)
    ops.copy_on(side, dst, src * 2)  # queued after the event
    assert dst.tolist() == [0] * 4 and not event.query()  # as late as CUDA allows
    current.wait_event(event)  # the current stream's waits are followed by use: they run
    assert dst.tolist() == [1] * 4 and event.query() and not side.query()
    ops.copy_on(current, dst, src * 3)  # the current stream runs late too
    assert dst.tolist() == [1] * 4
    ops.synchronize(0)  # in order per stream, in no order between streams
    assert dst.tolist() in ([2] * 4, [3] * 4) and side.query() and current.query()
    assert ops.own_stream(side.cuda_stream, 0) is side
    with pytest.raises(ValueError, match="no stream has the handle"):
        ops.own_stream(12345, 0)


def test_a_wait_on_a_side_stream_is_a_barrier_there_not_a_wait_of_the_host(
    sim: SimulatedCuda,
) -> None:
    ops = sim.ops
    first, second = ops.new_stream(0), ops.new_stream(0)
    middle, dst = torch.zeros(4, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8)
    ops.copy_on(first, middle, torch.full((4,), 7, dtype=torch.uint8))
    second.wait_stream(first)
    ops.copy_on(second, dst, middle)  # must read the 7s, whenever it runs
    assert middle.tolist() == [0] * 4 and first.pending() == 1  # nothing ran yet
    second.synchronize()
    assert dst.tolist() == [7] * 4 and first.query()


def test_the_scheduler_runs_queued_work_early_as_its_seed_says() -> None:
    from cudasim import Scheduler

    def ran_early(seed: int | None) -> list[int]:
        with SimulatedCuda(seed=seed) as cuda:
            ops, done = cuda.ops, []
            stream = ops.new_stream(0)
            for _ in range(40):
                ops.copy_on(
                    stream, torch.zeros(1, dtype=torch.uint8), torch.ones(1, dtype=torch.uint8)
                )
                done.append(stream.done)
            ops.synchronize(0)
            return done

    assert ran_early(None) == [0] * 40  # as late as CUDA allows
    assert ran_early(5) == ran_early(5) != [0] * 40  # the same seed, the same schedule
    assert "seed=5" in repr(Scheduler(5))


def test_a_device_kept_busy_runs_nothing_early_until_its_sleep_is_waited_for(seed: int) -> None:
    def copy(stream: Any) -> None:
        one = torch.ones(1, dtype=torch.uint8)
        sim.ops.copy_on(stream, torch.zeros(1, dtype=torch.uint8), one)

    with SimulatedCuda(seed=seed) as sim:
        ops = sim.ops
        ops.scheduler.eagerness = 1.0  # every point would run something, but for the sleep
        side, other = ops.new_stream(0), ops.new_stream(1)
        copy(side)
        before = side.record_event()
        ops.sleep(0)
        for _ in range(20):
            copy(side)
            copy(other)
        assert side.done <= 1 and other.done > 0  # the other device was not kept busy
        before.synchronize()  # work queued before the sleep: the device stays busy
        copy(side)
        assert side.done == 1
        after = ops.current_stream(0).record_event()
        after.synchronize()  # the sleep has run: the device is free again
        for _ in range(4):
            copy(side)
        assert side.done > 1
        ops.synchronize(0)
        ops.synchronize(1)


def test_fresh_device_memory_is_not_cleared(sim: SimulatedCuda) -> None:
    error, address = sim.runtime.cudaMalloc(4096)
    assert name((error,)) == "cudaSuccess"
    assert torch.equal(sim.ops.empty(4096, 0), torch.full((4096,), FRESH, dtype=torch.uint8))
    sim.runtime.cudaFree(address)
    start, handle = reserve(sim, G), create(sim)
    sim.driver.cuMemMap(start, G, 0, handle, 0)
    assert grant(sim, start, G) == "CUDA_SUCCESS"
    import ctypes

    assert ctypes.string_at(start, 64) == bytes([FRESH]) * 64
    sim.driver.cuMemUnmap(start, G)
    sim.driver.cuMemRelease(handle)
    sim.driver.cuMemAddressFree(start, G)


def test_vmm_access_is_per_device_and_a_fault_is_sticky(sim: SimulatedCuda) -> None:
    driver, ops = sim.driver, sim.ops
    start, handle = reserve(sim, G), create(sim)
    driver.cuMemMap(start, G, 0, handle, 0)
    assert grant(sim, start, G) == "CUDA_SUCCESS"  # device 0 only
    assert sim.memory.is_device_memory(start, G, 0)
    assert not sim.memory.is_device_memory(start, G, 1)
    with pytest.raises(RuntimeError, match="accessible from cuda:1"):
        ops.wrap(SimpleNamespace(__cuda_array_interface__=window(start, G)), 1)
    view = ops.wrap(SimpleNamespace(__cuda_array_interface__=window(start, G)), 0)
    ops.copy_on(ops.new_stream(1), torch.zeros(16, dtype=torch.uint8), view[:16])
    with pytest.raises(RuntimeError, match="illegal memory access"):
        ops.synchronize(1)
    assert "without access from cuda:1" in sim.faults[0]
    ops.synchronize(0)  # the other device is fine
    push = driver.cuCtxPushCurrent(driver.cuDevicePrimaryCtxRetain(driver.cuDeviceGet(1)[1])[1])
    assert name(push) == "CUDA_SUCCESS"
    try:  # every later call of the faulted context fails
        assert name(driver.cuMemGetInfo()) == "CUDA_ERROR_ILLEGAL_ADDRESS"
        assert name(driver.cuCtxSynchronize()) == "CUDA_ERROR_ILLEGAL_ADDRESS"
    finally:
        driver.cuCtxPopCurrent()
    sim.memory.faults.clear()
    sim.memory.faulted.clear()
    del view
    driver.cuMemUnmap(start, G)
    driver.cuMemRelease(handle)
    driver.cuMemAddressFree(start, G)


def test_memory_given_back_under_queued_work_is_a_fault(sim: SimulatedCuda) -> None:
    _, address = sim.runtime.cudaMalloc(4096)
    ops = sim.ops
    view = ops.wrap(SimpleNamespace(__cuda_array_interface__=window(address, 4096)), 0)
    ops.copy_on(ops.current_stream(0), view, torch.ones(4096, dtype=torch.uint8))
    del view
    assert sim.runtime.free(address, 0)  # without the wait cudaFree would have made
    assert "freeing of 4,096 bytes" in sim.faults[0] and "still touches it" in sim.faults[0]
    sim.memory.faults.clear()
    sim.memory.faulted.clear()
    ops.flush()  # the queued copy is skipped: its pages are gone (a fault, not a crash)
    assert len(sim.faults) == 1
    sim.memory.faults.clear()
    sim.memory.faulted.clear()


def test_a_global_capture_on_any_thread_refuses_unsafe_calls_and_is_invalidated(
    sim: SimulatedCuda,
) -> None:
    ops, driver = sim.ops, sim.driver
    for mode, refused in (("global", True), ("thread_local", False), ("relaxed", False)):
        handles: list[int] = []

        def begin(mode: str = mode, handles: list[int] = handles) -> None:
            handles.append(ops.begin_capture(None, mode))

        thread = threading.Thread(target=begin)
        thread.start()
        thread.join()
        assert ops.capturing() is refused
        answer = name(driver.cuMemCreate(G, allocation_prop(0), 0))
        assert (answer == "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED") is refused, mode
        if not refused:
            driver.cuMemRelease(sim.memory.next_handle - 1)
        assert ops.end_capture(handles[0]) is not refused  # the unsafe call broke it
    handle = ops.begin_capture(None, "thread_local")  # on this thread: refused here
    assert name(driver.cuCtxSynchronize()) == "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"
    assert name(sim.runtime.cudaMalloc(16)) == "cudaErrorStreamCaptureUnsupported"
    with pytest.raises(RuntimeError, match="capturing"):
        ops.synchronize(0)
    assert not ops.end_capture(handle)


def window(address: int, nbytes: int) -> dict[str, object]:
    return {
        "shape": (nbytes,),
        "typestr": "|u1",
        "data": (address, False),
        "strides": None,
        "version": 3,
    }


# ---- planted bugs ------------------------------------------------------------------------------


def test_every_plant_still_finds_its_line() -> None:
    for each in PLANTS:
        plant(each)()  # planted and taken out again; raises when the line is gone


# Runs pytest once per planted bug, each in a fork of one process that has imported torch,
# pytest and the package already (a fresh interpreter per plant spent most of its time there).
_PLANTED_RUNS = """
import json, os, sys
import pytest, torch, sharedmem, cudasim  # noqa: F401  (imported once, before the forks)

runs, out = json.loads(sys.argv[1]), sys.argv[2]
children = {}
for each, where, catches in runs:
    pid = os.fork()
    if pid == 0:
        log = os.open(os.path.join(out, each), os.O_WRONLY | os.O_CREAT)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.environ["CUDASIM_PLANT"] = each
        args = ["-q", "-x", "-p", "no:cacheprovider", "-p", "cudasim.plants", where, "-k", catches]
        code = pytest.main(args)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(int(code))
    children[each] = pid
codes = {each: os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for each, pid in children.items()}
print(json.dumps(codes))
"""


@pytest.mark.slow  # a pytest run per planted bug
@pytest.mark.timeout(900)
@pytest.mark.skipif(HAS_CUDA, reason="plants bugs on the stand-in only, never on a real GPU")
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork (POSIX)")
def test_every_planted_bug_fails_a_cuda_test(seed: int, tmp_path: Path) -> None:
    # Each run draws its schedules from this test's seed, so a survivor can be run again.
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
        "SHAREDMEM_SEED": str(seed),
    }
    env.pop("PYTEST_ADDOPTS", None)
    runs = [(each, spec.where, spec.catches) for each, spec in PLANTS.items()]
    done = subprocess.run(
        [sys.executable, "-c", _PLANTED_RUNS, json.dumps(runs), str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    codes = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(codes) == sorted(PLANTS)
    for each, code in codes.items():
        out = (tmp_path / each).read_text()
        last = out.strip().splitlines()[-1] if out.strip() else ""
        assert code != 0 and ("1 failed" in last or code < 0), f"{each}: {out[-3000:]}"


# ---- the stress runner on the stand-in ---------------------------------------------------------


@pytest.mark.parametrize("backend", ["vmm", "cudart", "torch"])
def test_the_stress_runner_verifies_each_cuda_backend_on_the_stand_in(
    backend: str, seed: int, capsys: pytest.CaptureFixture[str]
) -> None:
    from cudasim.__main__ import run

    argv = ["stress", "--device", "cuda", "--backend", backend, "--ops", "1500"]
    code = run([*argv, "--threads", "2", "--faults", "--seed", str(seed)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"1500 verified ops, 0 mismatches, seed {seed}, device cuda:0" in out
