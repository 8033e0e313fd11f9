"""The stress runner: the pool API against the reference model (hypothesis, and the runner's
own seeded rounds), with injected faults, a limit and threads; a deliberately broken backend
is caught and shrunk to a few operations; and the command line."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from collections.abc import Callable, Sequence

import numpy as np
import pytest
import torch
from conftest import ALL_PLACEMENTS, DEVICES, STATEFUL_EXAMPLES
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from sharedmem._backends import Backend
from sharedmem._cli import main
from sharedmem._errors import OutOfMemoryError
from sharedmem._pool import BufferPool
from sharedmem._stress import StressConfig, StressResult, run_stress
from sharedmem._stress._checks import StressFailure, check_pool
from sharedmem._stress._exec import OpRunner, RoundSpec
from sharedmem._stress._faults import FAULT_KINDS, CorruptingBackend
from sharedmem._stress._model import MemoryModel
from sharedmem._stress._ops import DTYPES, KINDS, WHOLE, Op, describe
from sharedmem._stress._shrink import shrink
from sharedmem._synced import SyncedMemory
from sharedmem.testing import FaultInjector

SUMMARY = re.compile(r"^stress: (\d+) verified ops, (\d+) mismatches, seed (\d+), device (\S+)$")


def run(config: StressConfig) -> tuple[StressResult, str]:
    out = io.StringIO()
    result = run_stress(config, out=out, err=io.StringIO())
    return result, out.getvalue()


def summary(text: str) -> tuple[int, int, int, str]:
    match = SUMMARY.match(text.rstrip("\n").splitlines()[-1])
    assert match is not None, text[-500:]
    ops, mismatches, seed, device = match.groups()
    return int(ops), int(mismatches), int(seed), device


def flip_every_copy(upstream: Backend) -> Backend:
    return CorruptingBackend(upstream, every=1)


def halve_the_size_after(copy: Callable[..., None]) -> Callable[..., None]:
    """A deliberate bug: an asynchronous copy that also halves the memory's logical size.

    Nothing shows at once (every accessor sets the size again before it reads), but the next
    shrink_to_fit drops half of what the memory holds.
    """

    def drifting(self: SyncedMemory, stream: object = None) -> None:
        copy(self, stream)
        with self._lock:
            self._size //= 2

    return drifting


@pytest.fixture
def size_drift(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("push_async", "pull_async"):
        monkeypatch.setattr(SyncedMemory, name, halve_the_size_after(getattr(SyncedMemory, name)))


# ---- hypothesis: the pool API against the model ------------------------------------------

NAMES = ("a", "b", "c")
MAX_BYTES = 16 << 10
NOISE = np.random.default_rng(0).integers(0, 256, MAX_BYTES + 4096, dtype=np.uint8)
BLOBS = st.integers(0, len(NAMES) - 1)
SIDES = st.sampled_from(["host", "device"])
# Sizes at page and allocation boundaries find the off-by-one mistakes.
SIZES = st.one_of(
    st.integers(0, 80), st.sampled_from([4095, 4096, 4097, 8192, 12_289]), st.integers(0, MAX_BYTES)
)
FAULTS = st.none() | st.tuples(st.sampled_from(FAULT_KINDS), st.integers(1, 2))
RANGES = st.tuples(st.integers(0, MAX_BYTES), st.integers(0, MAX_BYTES), st.integers(0, 4096))


def machine_for(device: str, backend: str) -> type[RuleBasedStateMachine]:
    class PoolMachine(RuleBasedStateMachine):
        """Each rule is one call of the pool API, run on a pool and the model together."""

        def __init__(self) -> None:
            super().__init__()
            self.ex = OpRunner(RoundSpec(device, backend, NAMES, MAX_BYTES), NOISE)

        def run(self, op: Op) -> None:
            self.ex.execute(op)

        @rule(blob=BLOBS, nbytes=SIZES, dtype=st.sampled_from(DTYPES), rows=st.integers(1, 3))
        def reshape(self, blob: int, nbytes: int, dtype: torch.dtype, rows: int) -> None:
            numel = nbytes // dtype.itemsize // rows
            self.run(Op("reshape", blob, shape=(rows, numel), dtype=dtype))

        @rule(blob=BLOBS, factor=st.sampled_from([2, 3, 5]), side=SIDES, fault=FAULTS)
        def grow_and_write(
            self, blob: int, factor: int, side: str, fault: tuple[str, int] | None
        ) -> None:
            # The loop every variable-shape user runs: a larger batch than fits, then fill it.
            memory = self.ex.blobs[blob].data_memory
            fits = max(memory.host_capacity, memory.device_capacity)
            nbytes = min(MAX_BYTES, max(self.ex.model.blobs[blob].nbytes * factor, fits + 1))
            self.run(Op("reshape", blob, shape=(nbytes,)))
            self.run(Op("write", blob, False, side, stop=WHOLE, offset=nbytes % 4096, fault=fault))

        @rule(blob=BLOBS, grad=st.booleans(), side=SIDES, span=RANGES, fault=FAULTS)
        def write(
            self,
            blob: int,
            grad: bool,
            side: str,
            span: tuple[int, int, int],
            fault: tuple[str, int] | None,
        ) -> None:
            a, b, offset = span
            self.run(
                Op(
                    "write",
                    blob,
                    grad,
                    side,
                    0,
                    (),
                    torch.uint8,
                    min(a, b),
                    max(a, b),
                    offset,
                    fault,
                )
            )

        @rule(blob=BLOBS, side=SIDES, offset=st.integers(0, 4096), fault=FAULTS)
        def pool_tensor(
            self, blob: int, side: str, offset: int, fault: tuple[str, int] | None
        ) -> None:
            self.run(Op("tensor", blob, False, side, stop=WHOLE, offset=offset, fault=fault))

        @rule(blob=BLOBS, grad=st.booleans(), side=SIDES, fault=FAULTS)
        def read(self, blob: int, grad: bool, side: str, fault: tuple[str, int] | None) -> None:
            self.run(Op("read", blob, grad, side, fault=fault))

        @rule(blob=BLOBS, other=BLOBS, grad=st.booleans())
        def share(self, blob: int, other: int, grad: bool) -> None:
            if blob != other:
                self.run(Op("share", blob, grad, other=other))

        @rule(
            kind=st.sampled_from(["shrink", "release", "release_side", "push", "pull"]),
            blob=BLOBS,
            grad=st.booleans(),
            side=SIDES,
            fault=FAULTS,
        )
        def memory_call(
            self, kind: str, blob: int, grad: bool, side: str, fault: tuple[str, int] | None
        ) -> None:
            self.run(Op(kind, blob, grad, side, fault=None if kind == "release" else fault))

        @rule(fault=FAULTS)
        def trim(self, fault: tuple[str, int] | None) -> None:
            self.run(Op("trim", fault=fault))

        @rule()
        def pool_release(self) -> None:
            self.run(Op("pool_release"))

        @rule(blob=BLOBS, grad=st.booleans(), side=SIDES, nbytes=SIZES, fault=FAULTS)
        def grow_past_the_limit(
            self, blob: int, grad: bool, side: str, nbytes: int, fault: tuple[str, int] | None
        ) -> None:
            op = Op("limit", blob, grad, side, shape=(nbytes,), stop=WHOLE, fault=fault)
            self.run(op)

        @invariant()
        def blocks_and_ledger_agree_with_the_model(self) -> None:
            self.ex.check()

        def teardown(self) -> None:
            self.ex.sweep()  # every byte the model knows, read back from both sides

    PoolMachine.__name__ = f"PoolMachine[{device}-{backend}]"
    return PoolMachine


@pytest.mark.parametrize("placement", ALL_PLACEMENTS)
def test_the_pool_api_holds_to_the_model_under_any_sequence(placement: tuple[str, str]) -> None:
    run_state_machine_as_test(
        machine_for(*placement),
        settings=settings(stateful_step_count=40, max_examples=STATEFUL_EXAMPLES),
    )


# ---- the runner ------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_a_short_run_verifies_every_operation_on_every_backend(device: str, seed: int) -> None:
    result, out = run(StressConfig(device=device, ops=3000, seed=seed, round_ops=750))
    assert summary(out) == (3000, 0, seed, result.pool.device if result.pool else "")
    assert result.failure is None and result.rounds == 4
    assert "BufferPool on" in out  # the pool report comes before the summary
    assert "rounds over reserved, pageable" in out or device.startswith("cuda")


@pytest.mark.parametrize("device", DEVICES)
def test_injected_faults_surface_as_errors_and_lose_nothing(device: str, seed: int) -> None:
    result, out = run(StressConfig(device=device, ops=3000, seed=seed, faults=0.3))
    assert result.mismatches == 0 and result.ops == 3000, out[-2000:]
    assert result.faults > 0  # allocations, growths and shrinks everywhere; copies off cpu


@pytest.mark.parametrize("device", ["cpu", "emulated"])
def test_growth_past_a_limit_is_refused_and_loses_nothing(device: str, seed: int) -> None:
    result, out = run(StressConfig(device=device, ops=3000, seed=seed, limit=48 << 10))
    assert result.mismatches == 0, out[-2000:]
    assert result.refusals > 0


@pytest.mark.parametrize("device", DEVICES)
def test_threads_over_private_and_shared_buffers_are_fully_verified(device: str, seed: int) -> None:
    config = StressConfig(device=device, ops=4000, seed=seed, threads=4, faults=0.05)
    result, out = run(config)
    assert summary(out)[:2] == (4000, 0), out[-2000:]
    names = result.pool.names() if result.pool else []
    assert "w3.b0" in names and "shared.b0" in names


@pytest.mark.parametrize(("device", "threads"), [("cpu", 1), ("emulated", 1), ("emulated", 3)])
@pytest.mark.usefixtures("size_drift")
def test_a_logical_size_no_call_set_is_caught(device: str, threads: int, seed: int) -> None:
    # The model keeps every memory's size itself; a model that took it from the memory would
    # follow the drift and then forget the bytes shrink_to_fit drops along with the pool.
    result, out = run(StressConfig(device=device, ops=5000, seed=seed, threads=threads))
    failure = result.failure
    assert failure is not None and failure.category == "size", out[-2000:]
    assert failure.reproduced and 2 <= len(failure.shrunk) <= 4, failure.shrunk
    assert any("_async()" in line for line in failure.shrunk), failure.shrunk
    assert result.mismatches == 1 and summary(out)[1] == 1
    assert "but the calls so far set it to" in failure.message


def test_the_model_allows_the_sizes_the_hot_path_may_leave() -> None:
    # pool.tensor on a cache hit leaves the gradient memory at the size another blob sharing
    # it set; on a miss it applies the blob's. Either is right; the model must accept both.
    ex = OpRunner(RoundSpec("emulated", "reserved", ("a", "b"), 1 << 12), NOISE)
    for op in (
        Op("reshape", 0, shape=(100,)),
        Op("tensor", 0, stop=WHOLE),
        Op("share", 1, True, other=0),
        Op("reshape", 1, shape=(50,)),  # the shared gradient memory takes 50 bytes
        Op("write", 1, True, stop=WHOLE),
        Op("tensor", 0, stop=WHOLE),
        Op("shrink", 0, True),
        Op("read", 1, True, "host"),
    ):
        ex.execute(op)
    ex.sweep()
    grad = ex.blobs[0].grad_memory
    assert grad is ex.blobs[1].grad_memory and grad.size == ex.model.blobs[0].grad.size


def test_threads_check_the_ledger_while_a_round_runs(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []

    def counting(pool: BufferPool, memories: Sequence[SyncedMemory], limit: int | None) -> None:
        calls.append(len(memories))
        check_pool(pool, memories, limit)

    monkeypatch.setattr("sharedmem._stress._exec.check_pool", counting)
    config = StressConfig(device="emulated", ops=2000, seed=seed, threads=3, check_every=100)
    result, out = run(config)
    assert result.failure is None and result.rounds == 1, out[-2000:]
    # One check every 100 operations, with the pool to itself; two more in the final sweep.
    assert len(calls) == 2000 // 100 + 2


def test_an_allocator_that_runs_out_ends_the_run_instead_of_failing_it(seed: int) -> None:
    # Not the runner's injector: to the runner this is the machine running out, which says
    # nothing about the pool, so the run ends rather than reporting and shrinking a mismatch.
    exhausted = FaultInjector(allocate=3)
    with pytest.raises(OutOfMemoryError):
        run(StressConfig(device="emulated", ops=2000, seed=seed, adaptors=(exhausted,)))
    assert [fault.kind for fault in exhausted.fired] == ["allocate"]


def test_the_same_seed_makes_the_same_run(seed: int) -> None:
    first, _ = run(StressConfig(device="emulated", ops=1500, seed=seed, faults=0.1))
    second, _ = run(StressConfig(device="emulated", ops=1500, seed=seed, faults=0.1))
    assert first.pool is not None and second.pool is not None
    assert first.pool.stats() == second.pool.stats()
    assert (first.faults, first.refusals) == (second.faults, second.refusals)


@pytest.mark.parametrize("device", ["cpu", "emulated"])
def test_a_corruption_is_caught_and_shrunk_to_a_few_operations(device: str, seed: int) -> None:
    result, out = run(StressConfig(device=device, ops=5000, seed=seed, adaptors=(flip_every_copy,)))
    failure = result.failure
    assert failure is not None and failure.reproduced
    assert result.mismatches == 1 and failure.category == "mismatch"
    assert 1 <= len(failure.shrunk) <= 4, failure.shrunk
    assert summary(out)[1:3] == (1, seed)
    assert f"MISMATCH at op {failure.op_number:,} (seed {seed}" in out
    assert "shortest failing sequence" in out and failure.shrunk[-1] in out
    assert result.ops == failure.op_number - 1


def test_a_corruption_under_threads_is_replayed_on_one_thread_and_shrunk(seed: int) -> None:
    config = StressConfig(
        device="emulated", ops=5000, seed=seed, threads=3, adaptors=(flip_every_copy,)
    )
    result, out = run(config)
    assert result.failure is not None and result.failure.reproduced, out[-2000:]
    assert len(result.failure.shrunk) <= 4
    assert "threads interleave differently" in out


def test_shrinking_keeps_only_the_operations_the_failure_needs() -> None:
    # A synthetic bug: a host read of blob 2 fails after a write to blob 2 that came after a
    # reshape of blob 2; every other operation is noise.
    ops = [Op("read", i % 3) for i in range(40)]
    ops[7], ops[19], ops[33] = Op("reshape", 2), Op("write", 2), Op("read", 2, side="host")

    def replay(candidate: Sequence[Op]) -> tuple[int, StressFailure] | None:
        reshaped = written = False
        for i, op in enumerate(candidate):
            if op.blob == 2:
                reshaped |= op.kind == "reshape"
                written |= reshaped and op.kind == "write"
                if written and op.kind == "read" and op.side == "host":
                    return i, StressFailure("mismatch", "synthetic")
        return None

    shrunk = shrink(ops, replay, "mismatch", seconds=30)
    assert shrunk is not None and shrunk.complete
    assert shrunk.ops == [Op("reshape", 2), Op("write", 2), Op("read", 2, side="host")]
    assert shrink(ops[:10], replay, "mismatch", seconds=30) is None


def test_every_operation_reads_as_one_line_of_the_api() -> None:
    names = ("x", "y")
    lines = {
        kind: describe(Op(kind, 0, other=1, shape=(2, 3), fault=("copy", 2)), names)
        for kind in KINDS
    }
    assert lines["reshape"] == "x.reshape(2, 3).astype(uint8)  # fail the 2nd copy"
    assert lines["share"].startswith("x.share_data(y)")
    assert lines["shrink"].startswith("x.data_memory.shrink_to_fit()")
    assert lines["trim"].startswith("pool.trim()")
    assert lines["pool_release"].startswith("pool.release()")
    assert all("\n" not in line for line in lines.values())


# ---- the command line ----------------------------------------------------------------------


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "sharedmem", "stress", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def test_the_command_runs_and_ends_with_the_summary_line() -> None:
    done = cli("--device", "cpu", "--ops", "2000", "--seed", "3", "--faults")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert summary(done.stdout) == (2000, 0, 3, "cpu")
    assert "BufferPool on cpu" in done.stdout


@pytest.mark.usefixtures("size_drift")
def test_the_command_exits_1_on_a_mismatch_and_prints_how_to_replay_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["stress", "--device", "emulated", "--ops", "5000", "--seed", "1"]) == 1
    out = capsys.readouterr().out
    assert summary(out)[1:] == (1, 1, "emulated")
    assert "MISMATCH at op" in out and "shortest failing sequence" in out
    assert "to run again: python -m sharedmem stress --device emulated --seed 1 --ops" in out


def test_a_self_check_passes_when_the_corruption_is_caught() -> None:
    done = cli("--device", "emulated", "--ops", "5000", "--seed", "1", "--self-check")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert summary(done.stdout)[1:] == (1, 1, "emulated")
    assert "MISMATCH at op" in done.stdout and "shortest failing sequence" in done.stdout
    assert "stress: self-check passed: the broken backend was caught at op" in done.stderr


def test_a_self_check_that_caught_nothing_says_so_and_fails(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # One operation cannot reach the broken backend's third copy or growth.
    assert main(["stress", "--device", "emulated", "--ops", "1", "--self-check"]) == 1
    captured = capsys.readouterr()
    assert summary(captured.out)[:2] == (1, 0)
    assert "stress: self-check FAILED: 1 verified ops and the broken backend was not caught" in (
        captured.err
    )


def test_running_out_of_memory_is_said_in_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def exhausted(self: MemoryModel, view: np.ndarray) -> None:
        raise MemoryError(f"Unable to allocate {len(view):,} bytes")

    monkeypatch.setattr(MemoryModel, "adopt", exhausted)
    assert main(["stress", "--device", "cpu", "--ops", "100"]) == 1
    err = capsys.readouterr().err.split("\n", 1)[1]  # after the "stress: seed S" line
    assert err.startswith("sharedmem: the stress run ran out of memory (MemoryError: Unable to")
    assert "Traceback" not in err and "MISMATCH" not in err


@pytest.mark.parametrize("threads", ["1", "3"])
def test_ctrl_c_prints_what_was_verified_and_exits_130(
    threads: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from sharedmem._stress._rounds import Run

    real = Run.progress

    def interrupted(self: Run, done: int) -> None:  # Ctrl-C once some work is verified
        real(self, done)
        if done >= 300:
            raise KeyboardInterrupt

    monkeypatch.setattr(Run, "progress", interrupted)
    args = ["stress", "--device", "emulated", "--ops", "1000000", "--threads", threads]
    assert main([*args, "--seed", "5"]) == 130
    captured = capsys.readouterr()
    ops, mismatches, seed, device = summary(captured.out)
    assert ops >= 300 and mismatches == 0 and seed == 5 and device == "emulated"
    assert "stress: interrupted (Ctrl-C)" in captured.out and "Traceback" not in captured.err


def test_the_default_seed_is_random_and_printed_and_limits_are_said_only_when_set(
    capsys: pytest.CaptureFixture[str],
) -> None:
    seeds = set()
    for _ in range(3):
        assert main(["stress", "--device", "cpu", "--ops", "50"]) == 0
        captured = capsys.readouterr()
        seed = summary(captured.out)[2]
        assert f"stress: seed {seed}" in captured.err
        assert "refused by the limit" not in captured.out
        assert "injected faults" not in captured.out
        seeds.add(seed)
    assert len(seeds) > 1  # three draws from 2**31 seeds
    assert main(["stress", "--device", "cpu", "--ops", "50", "--limit", "1M"]) == 0
    assert "growths refused by the limit" in capsys.readouterr().out


def test_the_api_walk_runs_and_catches_a_stale_fast_path(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main(["stress", "--api", "--device", "cpu", "--ops", "600", "--seed", "3"]) == 0
    assert summary(capsys.readouterr().out) == (600, 0, 3, "cpu")
    from sharedmem._pool.pool import _Cached

    def stale(self: _Cached, shape: object, dtype: torch.dtype) -> bool:  # the bug it found
        return dtype is self.dtype and self.memory.version == self.version and shape == self.key

    monkeypatch.setattr(_Cached, "serves", stale)
    args = ["stress", "--api", "--device", "cpu", "--backend", "reserved", "--ops", "20000"]
    assert main([*args, "--seed", "3"]) == 1
    out = capsys.readouterr().out
    assert "stress: MISMATCH (seed 3, backend reserved) after op" in out
    assert "to run again: python -m sharedmem stress --api --device cpu" in out
    assert summary(out)[1] == 1


def test_a_run_that_verified_nothing_fails(capsys: pytest.CaptureFixture[str]) -> None:
    # Building the first pool takes far longer than a microsecond: the clock runs out first.
    assert main(["stress", "--ops", "5", "--seconds", "0.000001"]) == 1
    captured = capsys.readouterr()
    assert summary(captured.out)[:2] == (0, 0)
    assert "stress: FAILED: no operation was verified" in captured.err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ops", "0"], "--ops must be >= 1"),
        (["--seconds", "-1"], "--seconds must be > 0"),
        (["--faults", "1.5"], "--faults must be >= 0 and <= 1"),
        (["--max-bytes", "12Q"], "--max-bytes takes a whole number"),
        (["--seed", "64K"], "--seed takes a whole number >= 0, got '64K'"),
        (["--seed", "-3"], "--seed must be >= 0"),
        (["--device", "tpu"], "unknown device 'tpu'"),
        (["--backend", "vmm"], "unknown backend 'vmm' for device 'emulated'"),
        (["--threads", "100000"], "--threads must be at most 256, got 100000"),
        (["--buffers", "100000000"], "--buffers must be at most 4,096, got 100000000"),
        (["--threads", "256", "--buffers", "4096"], "makes 1,048,576 buffers, more than 16,384"),
        (["--buffers", "4096", "--max-bytes", "1G"], "more than the"),
    ],
)
def test_bad_arguments_get_a_clear_message(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["stress", *args])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert "sharedmem:" in err and message in err, err
