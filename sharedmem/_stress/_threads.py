"""Threads: workers share a round's pool, over private buffers and shared ones.

A shared buffer is read by many workers at once and written by one at a time (writers racing
on one buffer race on its bytes, as on a tensor: that is the caller's to avoid, not the pool's);
operations on the whole pool run alone. Every operation is logged under its locks, so the log
is an order the operations could have run in one after another, and a failure replays on one
thread from it. Every ``check_every`` operations a worker takes the pool alone, as a whole-pool
operation does, and checks every memory and the ledger: with no operation in flight, the
ledger's figures and the memories' capacities must agree exactly.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

from ._checks import StressFailure
from ._ops import EXCLUSIVE, Op
from ._rounds import Run, as_failure, record_failure

__all__ = ["RWLock", "run_threaded"]


class RWLock:
    """Many readers or one writer. Waiting writers go first, so rare whole-pool operations
    are not starved by a steady stream of readers."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0
        self._writer = False
        self._waiting = 0

    @contextmanager
    def reading(self) -> Iterator[None]:
        with self._cond:
            while self._writer or self._waiting:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    @contextmanager
    def writing(self) -> Iterator[None]:
        with self._cond:
            self._waiting += 1
            while self._writer or self._readers:
                self._cond.wait()
            self._waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()


class _ThreadedRound:
    """One round whose operations ``threads`` workers share, each on its own thread."""

    def __init__(self, run: Run, round_: int, names: tuple[str, ...], shared: list[int]) -> None:
        self.run, self.round = run, round_
        self.spec = run.spec(round_, names)
        self.ex = run.executor(self.spec)
        self.shared = shared
        self.pool_lock = RWLock()
        self.blob_locks = {i: RWLock() for i in shared}
        self.log: list[Op] = []
        self.log_lock = threading.Lock()
        self.stop = threading.Event()
        self.errors: list[tuple[int, StressFailure, bool]] = []  # (index, failure, during)
        self.done = [0] * run.config.threads
        self.out_of_memory: MemoryError | None = None  # raised by ``play`` (see ``as_failure``)

    def worker(self, w: int, quota: int) -> None:
        try:
            self._work(w, quota)
        except MemoryError as error:
            self.out_of_memory = error
            self.stop.set()
        except BaseException as error:  # a failure must stop the round, whatever raised it
            with self.log_lock:
                self.errors.append((len(self.log) - 1, as_failure(error), True))
            self.stop.set()

    def _work(self, w: int, quota: int) -> None:
        per = self.run.config.buffers
        own = list(range(w * per, (w + 1) * per))
        gen = self.run.generator(self.ex, self.round, w, own + self.shared, own)
        for _ in range(quota):
            if self.stop.is_set() or not self.run.time_left():
                return
            op = gen.next()
            whole = op.kind in EXCLUSIVE
            # Whole-pool operations run alone; a shared buffer has many readers or one writer.
            outer = self.pool_lock.writing() if whole else self.pool_lock.reading()
            lock = self.blob_locks.get(op.blob)
            inner: AbstractContextManager[None] = nullcontext()
            if lock is not None and not whole:
                inner = lock.reading() if op.kind == "read" else lock.writing()
            with outer, inner:
                with self.log_lock:  # logged under the op's locks: the order replays
                    index = len(self.log)
                    self.log.append(op)
                try:
                    self.ex.execute(op)
                except Exception as error:
                    self.errors.append((index, as_failure(error), True))
                    self.stop.set()
                    return
            self.done[w] += 1
            if (index + 1) % self.run.config.check_every == 0 and not self._check():
                return

    def _check(self) -> bool:
        """The periodic whole-pool check, with the pool to itself; False if it failed."""
        with self.pool_lock.writing():
            # Holding the pool alone: every logged operation has finished, none has begun.
            try:
                self.ex.check()
            except Exception as error:
                self.errors.append((len(self.log) - 1, as_failure(error), False))
                self.stop.set()
                return False
        return True

    def play(self, quota: int) -> None:
        t, r = self.run.config.threads, self.run.result
        threads = [
            threading.Thread(target=self.worker, args=(w, quota // t + (w < quota % t)))
            for w in range(t)
        ]
        for thread in threads:
            thread.start()
        base, faults, refusals = r.ops, r.faults, r.refusals
        try:
            for thread in threads:
                while thread.is_alive():
                    thread.join(timeout=0.5)
                    r.faults, r.refusals = faults + self.ex.faults, refusals + self.ex.refusals
                    self.run.progress(base + sum(self.done))
        except KeyboardInterrupt:  # Ctrl-C lands here: stop the workers before saying so
            self.stop.set()
            for thread in threads:
                thread.join()
            r.ops = base + sum(self.done)
            raise
        r.ops = base + sum(self.done)
        if self.out_of_memory is not None:
            raise self.out_of_memory
        if not self.errors:
            try:
                self.ex.sweep()
            except Exception as error:
                self.errors.append((len(self.log) - 1, as_failure(error), False))
        if self.errors:
            index, failure, during = min(self.errors, key=lambda e: e[0])
            number = base + index + 1
            record_failure(
                self.run, self.spec, self.round, self.log, index, failure, number, during
            )


def run_threaded(run: Run) -> None:
    """Rounds whose operations ``threads`` workers share."""
    c, r = run.config, run.result
    t, per = c.threads, c.buffers
    private = [f"w{w}.b{i}" for w in range(t) for i in range(per)]
    shared = [f"shared.b{i}" for i in range(max(1, per // 2))]
    names = tuple(private + shared)
    round_ = 0
    while run.ops_left() > 0 and run.time_left():
        this = _ThreadedRound(run, round_, names, list(range(len(private), len(names))))
        r.pool, r.rounds = this.ex.pool, round_ + 1
        this.play(min(c.round_ops, run.ops_left()))
        if r.failure is not None:
            return
        round_ += 1
