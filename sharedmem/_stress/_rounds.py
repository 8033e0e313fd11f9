"""What every round shares: the run's state, replaying operations on a fresh pool, and
recording a failure with the shortest sequence that still fails."""

from __future__ import annotations

import gc
import random
import time
import traceback
from collections.abc import Sequence
from typing import TextIO

import numpy as np

from .._backends import backend_names
from .._devices import normalize_device
from ._checks import StressFailure
from ._config import Failure, StressConfig, StressResult
from ._exec import OpRunner, RoundSpec
from ._faults import CorruptingBackend
from ._gen import Generator
from ._ops import Op, describe
from ._shrink import shrink

__all__ = ["Run", "as_failure", "record_failure", "replay_round"]

_NOISE_SPAN = 1 << 20  # writes start anywhere in the first MiB of the noise


class Run:
    """One run's state: the configuration, the noise, the clock and the totals."""

    def __init__(self, config: StressConfig, err: TextIO) -> None:
        self.config = config
        self.err = err
        self.executors = 0
        device = normalize_device(config.device)
        self.device = device
        self.backends = (config.backend,) if config.backend else backend_names(device)
        rng = np.random.default_rng(config.seed)
        self.noise = rng.integers(0, 256, config.max_bytes + _NOISE_SPAN, dtype=np.uint8)
        self.start = time.monotonic()
        seconds = config.seconds
        if seconds is None and config.ops is None:
            seconds = 10.0  # neither bound given: a short run that still covers a lot
        self.deadline = None if seconds is None else self.start + seconds
        self.result = StressResult()
        self.tty = err.isatty()
        self.next_progress = self.start + (1.0 if self.tty else 10.0)

    def time_left(self) -> bool:
        return self.deadline is None or time.monotonic() < self.deadline

    def ops_left(self) -> int:
        done = self.result.ops
        return (self.config.ops - done) if self.config.ops is not None else 1 << 62

    def progress(self, done: int) -> None:
        """The progress line, at most once a second on a terminal, every 10 s otherwise."""
        now = time.monotonic()
        if now < self.next_progress:
            return
        self.next_progress = now + (1.0 if self.tty else 10.0)
        elapsed = now - self.start
        r = self.result
        line = (
            f"stress: {done:,} ops, {r.mismatches} mismatches, {r.faults:,} faults injected, "
            f"{r.refusals:,} limit refusals, {done / max(elapsed, 1e-9) * 60:,.0f} ops/min, "
            f"{elapsed:.0f} s"
        )
        self.err.write(("\r" + line) if self.tty else (line + "\n"))
        self.err.flush()

    def spec(self, round_: int, names: tuple[str, ...]) -> RoundSpec:
        backend = self.backends[round_ % len(self.backends)]
        c = self.config
        return RoundSpec(self.device, backend, names, c.max_bytes, c.limit)

    def executor(self, spec: RoundSpec) -> OpRunner:
        # An executor and its pool form reference cycles, so finished rounds wait for the
        # cyclic collector, each holding a large reserved address range per buffer side;
        # collect now and then so that a long run never runs short of address space.
        self.executors += 1
        if self.executors % 16 == 0:
            gc.collect()
        extra = (CorruptingBackend,) if self.config.self_check else ()
        return OpRunner(spec, self.noise, (*self.config.adaptors, *extra))

    def generator(
        self, ex: OpRunner, round_: int, worker: int, blobs: Sequence[int], private: Sequence[int]
    ) -> Generator:
        c = self.config
        return Generator(
            random.Random(f"{c.seed}/{round_}/{worker}"),
            ex.model,
            blobs,
            private,
            max_bytes=c.max_bytes,
            noise_span=_NOISE_SPAN,
            faults=c.faults,
        )


def as_failure(error: BaseException) -> StressFailure:
    """What an error an operation or check raised says about the pool.

    A ``MemoryError`` (the pool's ``OutOfMemoryError`` from a real allocator included) says
    nothing about it: the machine ran out, and shrinking would only run out again. It is
    raised again, to end the run (the command line says so in one line).
    """
    if isinstance(error, StressFailure):
        return error
    if isinstance(error, MemoryError):
        raise error
    where = traceback.extract_tb(error.__traceback__)[-1]
    return StressFailure(
        f"error:{type(error).__name__}",
        f"{type(error).__name__}: {error} (at {where.filename}:{where.lineno})",
    )


def replay_round(run: Run, spec: RoundSpec, ops: Sequence[Op]) -> tuple[int, StressFailure] | None:
    """Run ``ops`` on a fresh pool, one thread; the failing index and failure, or None."""
    ex = run.executor(spec)
    for i, op in enumerate(ops):
        try:
            ex.execute(op)
        except Exception as error:
            return i, as_failure(error)
    try:
        ex.sweep()
    except Exception as error:
        return max(0, len(ops) - 1), as_failure(error)
    return None


def record_failure(
    run: Run,
    spec: RoundSpec,
    round_: int,
    log: Sequence[Op],
    index: int,
    error: StressFailure,
    op_number: int,
    during: bool,
) -> None:
    """Record the failure at (or after) ``log[index]`` and shrink the operations up to it."""
    r = run.result
    r.mismatches += 1
    failure = Failure(
        op_number=op_number,
        during=during,
        round=round_,
        backend=spec.backend,
        category=error.category,
        message=str(error),
        original=index + 1,
    )
    r.failure = failure
    run.err.write(
        f"\nstress: failure {failure.where} ({error.category}): {error}\n"
        f"stress: shrinking the {index + 1:,} operations of round {round_} ...\n"
    )
    run.err.flush()
    shrunk = shrink(
        log[: index + 1],
        lambda ops: replay_round(run, spec, ops),
        error.category,
        run.config.shrink_seconds,
    )
    if shrunk is None:
        failure.reproduced = False
        failure.shrunk = [describe(op, spec.names) for op in log[max(0, index - 19) : index + 1]]
        return
    failure.shrunk = [describe(op, spec.names) for op in shrunk.ops]
    failure.shrunk_message = str(shrunk.failure)
    failure.replays = shrunk.replays
