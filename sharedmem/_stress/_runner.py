"""The stress runner: rounds of random operations over a fresh pool, checked against the model.

A run is a sequence of rounds. Each round builds a fresh pool (the device's backends take
turns, so moving and stable-address growth both run), draws operations and runs each on the
pool and the model at once; every few hundred operations, and at the end of each round, the raw
blocks and the ledger are checked and every byte the model knows is read back from both sides.
Everything a round does follows from the seed, so a failure replays: the runner shrinks the
failing round's operations to the shortest sequence that still fails and prints it. With
``threads``, workers share each round's pool (see ``_threads``).
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from ._config import StressConfig, StressResult
from ._ops import Op
from ._rounds import Run, as_failure, record_failure
from ._threads import run_threaded

__all__ = ["run_stress"]


def run_single(run: Run) -> None:
    """Rounds on the calling thread."""
    c, r = run.config, run.result
    names = tuple(f"b{i}" for i in range(c.buffers))
    everyone = list(range(c.buffers))
    round_ = 0
    while run.ops_left() > 0 and run.time_left():
        spec = run.spec(round_, names)
        ex = run.executor(spec)
        gen = run.generator(ex, round_, 0, everyone, everyone)
        log: list[Op] = []
        r.pool, r.rounds = ex.pool, round_ + 1
        quota = min(c.round_ops, run.ops_left())
        base = r.faults, r.refusals, r.ops
        try:
            for _ in range(quota):
                if not run.time_left():
                    break
                op = gen.next()
                log.append(op)
                ex.execute(op)
                r.ops += 1
                if r.ops % c.check_every == 0:
                    ex.check()
                    r.faults, r.refusals = base[0] + ex.faults, base[1] + ex.refusals
                    run.progress(r.ops)
            ex.sweep()
        except Exception as error:
            r.faults, r.refusals = base[0] + ex.faults, base[1] + ex.refusals
            during = len(log) > r.ops - base[2]  # the last operation never completed
            number = r.ops + during
            record_failure(run, spec, round_, log, len(log) - 1, as_failure(error), number, during)
            return
        r.faults, r.refusals = base[0] + ex.faults, base[1] + ex.refusals
        round_ += 1


def run_stress(
    config: StressConfig, out: TextIO | None = None, err: TextIO | None = None
) -> StressResult:
    """Run the stress test ``config`` describes and print what it found.

    Progress goes to ``err`` (a line a second on a terminal, every ten seconds otherwise); the
    failure with its shortest failing sequence, if any, the pool report and the summary line
    ``stress: N verified ops, M mismatches, seed S, device D`` go to ``out``.

    Args:
        config: the run.
        out, err: where to print (default: ``sys.stdout`` and ``sys.stderr``).

    Raises:
        MemoryError: the machine ran out of memory (an allocator failure no fault injected,
            or the runner's own arrays): that says nothing about the pool, so it ends the run.

    Example::

        >>> import io
        >>> from sharedmem._stress import StressConfig, run_stress
        >>> out = io.StringIO()
        >>> result = run_stress(StressConfig("cpu", ops=500, seed=1), out, io.StringIO())
        >>> out.getvalue().splitlines()[-1]
        'stress: 500 verified ops, 0 mismatches, seed 1, device cpu'
    """
    out = out if out is not None else sys.stdout
    run = Run(config, err if err is not None else sys.stderr)
    try:
        (run_threaded if config.threads > 1 else run_single)(run)
    except KeyboardInterrupt:  # Ctrl-C: stop, and still say what was verified
        run.result.interrupted = True
    r = run.result
    r.seconds = time.monotonic() - run.start
    if run.tty:
        run.err.write("\n")
    f = r.failure
    if f is not None:
        lines = [
            f"stress: MISMATCH {f.where} (seed {config.seed}, round {f.round}, "
            f"device {run.device}, backend {f.backend}): {f.message}",
        ]
        if f.reproduced:
            lines.append(
                f"stress: shortest failing sequence, {len(f.shrunk)} of {f.original:,} operations "
                f"({f.replays:,} replays on a fresh pool with backend {f.backend!r}):"
            )
        else:
            lines.append("stress: a replay on one thread did not fail; the operations before it:")
        lines += [f"  {i:>4}  {text}" for i, text in enumerate(f.shrunk, start=1)]
        if f.shrunk_message and f.shrunk_message != f.message:
            lines.append(f"stress: which fails with: {f.shrunk_message}")
        again = config.command(f.op_number)
        if config.threads > 1:
            again += "  (threads interleave differently on every run)"
        lines.append(f"stress: to run again: {again}")
        print("\n".join(lines), file=out)
    if r.pool is not None:
        print(r.pool.report(), file=out)
    if r.interrupted:
        print("stress: interrupted (Ctrl-C); the figures below cover what ran before it", file=out)
    refusals = f", {r.refusals:,} growths refused by the limit" if config.limit is not None else ""
    faults = f", {r.faults:,} injected faults surfaced" if config.faults else ""
    print(
        f"stress: {r.rounds:,} rounds over {', '.join(run.backends)}{faults}{refusals}, "
        f"{r.per_minute:,.0f} ops/minute in {r.seconds:.1f} s",
        file=out,
    )
    print(
        # Plain numbers: this is the line scripts and CI grep for.
        f"stress: {r.ops} verified ops, {r.mismatches} mismatches, seed {config.seed}, "
        f"device {run.device}",
        file=out,
    )
    return r
