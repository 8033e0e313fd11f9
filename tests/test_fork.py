"""Fork: a child made by os.fork (or multiprocessing's fork start method) keeps working.

The emulated device copies on a thread of its own; a child has no such thread. The child must
finish its own asynchronous copies, see the bytes of copies the parent started before the fork,
and never hang. A hung child is killed after a generous bound and the test fails (the bound only
guards against a hang; nothing here is timed).

Buffers stay below torch's intra-op grain size (32,768 elements): torch's OpenMP thread pool
does not survive a fork (a child whose parent ran a parallel op hangs on its own next parallel
op, with or without sharedmem), so the children here only run serial ops.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time

import pytest
import torch
from conftest import requires_cuda

import sharedmem as sm

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork (POSIX)")

_HANG_BOUND_S = 120.0


def _wait_for(pid: int) -> int:
    """The child's exit status; kills it and fails if it is still running after the bound."""
    deadline = time.monotonic() + _HANG_BOUND_S
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail(f"the forked child hung for {_HANG_BOUND_S:.0f} s")


def _in_child(body: object) -> int:
    pid = os.fork()
    if pid == 0:  # the child: report through the exit code only, never return into pytest
        code = 1
        try:
            code = 0 if body() else 3  # type: ignore[operator]
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 2
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return _wait_for(pid)


def _started_memory(nbytes: int, value: int) -> sm.SyncedMemory:
    memory = sm.SyncedMemory(nbytes, device="emulated")
    memory.mutable_host_data().fill_(value)
    memory.push_async()  # starts the copy-engine thread
    return memory


def test_a_child_runs_its_own_asynchronous_copies_after_the_parent_used_the_engine() -> None:
    memory = _started_memory(16 << 10, 5)
    assert bool((memory.device_data() == 5).all())

    def child() -> bool:
        memory.mutable_host_data().fill_(9)
        memory.push_async()
        memory.mutable_device_data().add_(1)
        memory.pull_async()
        return bool((memory.host_data() == 10).all())

    assert _in_child(child) == 0
    # The parent's engine still works after the fork.
    memory.mutable_host_data().fill_(3)
    memory.push_async()
    assert bool((memory.device_data() == 3).all())


def test_a_copy_in_flight_at_the_fork_is_complete_in_the_child() -> None:
    # Many copies queued at once: some are still waiting for the engine when the fork comes.
    memories = [_started_memory(16 << 10, value % 100) for value in range(64)]

    def child() -> bool:
        return all(bool((m.device_data() == v % 100).all()) for v, m in enumerate(memories))

    assert _in_child(child) == 0
    assert all(bool((m.device_data() == v % 100).all()) for v, m in enumerate(memories))


def test_a_pool_works_in_a_multiprocessing_fork_child() -> None:
    pool = sm.BufferPool("emulated")
    pool.host_tensor("x", (1024,)).fill_(2.0)
    pool.blob("x").data_memory.push_async()

    def child() -> None:  # a fork child runs the target as it is: nothing is pickled
        pool.tensor("x", (1024,)).add_(1.0)
        pool.blob("x").data_memory.pull_async()
        sys.exit(0 if pool.blob("x").host_data().sum().item() == 3.0 * 1024 else 3)

    process = multiprocessing.get_context("fork").Process(target=child)
    process.start()
    process.join(_HANG_BOUND_S)
    if process.is_alive():
        process.kill()
        pytest.fail(f"the forked child hung for {_HANG_BOUND_S:.0f} s")
    assert process.exitcode == 0


def test_tensors_survive_a_fork_on_cpu() -> None:
    pool = sm.BufferPool("cpu")
    pool.tensor("y", (8,), torch.int64).fill_(4)

    def child() -> bool:
        return int(pool.tensor("y", (8,), torch.int64).sum().item()) == 32

    assert _in_child(child) == 0


def test_cuda_in_a_fork_child_of_a_cuda_parent_says_why_it_cannot_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # No GPU is needed to check the refusal: it comes before any driver call.
    from sharedmem._backends import cuda_api

    monkeypatch.setattr(cuda_api, "_used", True)  # as after a CUDA memory was used here

    def child() -> bool:
        try:
            with cuda_api.on_device(0):
                return False
        except sm.SharedMemError as error:
            return "a CUDA context does not survive fork" in str(error) and "spawn" in str(error)

    assert _in_child(child) == 0
    assert not cuda_api._forked_after_use  # the parent itself is unaffected


@pytest.mark.cuda
@requires_cuda
def test_cuda_in_a_fork_child_of_a_parent_that_used_only_pytorch_cuda(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The parent initialised CUDA through PyTorch alone (no sharedmem memory): the child is as
    # unable to use CUDA, and must hear why, not a generic driver error.
    from sharedmem._backends import cuda_api
    from sharedmem._backends.cuda_torch_ops import ops

    monkeypatch.setattr(cuda_api, "_used", False)
    ops().empty(16, 0)  # PyTorch's CUDA is initialised

    def child() -> bool:
        try:
            sm.SyncedMemory(16, device="cuda").mutable_device_data()
        except sm.SharedMemError as error:
            return "a CUDA context does not survive fork" in str(error) and "spawn" in str(error)
        return False

    assert _in_child(child) == 0
