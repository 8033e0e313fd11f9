"""The executor fuzzer over many fresh seeds, outside the tests (issue 34: the test command runs
a fixed set of seeds; this is where new ones are tried, before a change lands).

Each seed is the fuzz test's 24 random programs (``tests/test_executor_fuzz.py``: views,
in-place writes, dropout, heavy recomputation), each run pooled and eagerly and compared. A
case that differs, raises or runs past its limit is printed with its seed and case, which
``pytest tests/test_executor_fuzz.py`` then runs as a regression once added to its
``REGRESSIONS``. The limit is ``--case-limit`` seconds of the process's CPU time (a planner
that does not return spends CPU; on a loaded machine a niced case that needs 3 CPU seconds
has taken more than 240 s of wall time), and ``--wall-limit`` seconds of wall time
(a case that waits for ever). Run it niced on a shared machine:

    nice python benchmarks/fuzz_executor.py [--seeds 2000] [--case-limit 240] [--first SEED]

Seeds are drawn from ``--first`` (default: a fresh random one, printed), so a run can be
repeated. The exit status is 1 where any case failed.
"""

from __future__ import annotations

import argparse
import random
import signal
import sys
import time
from pathlib import Path
from types import FrameType

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_executor_fuzz import CASES, cases, run_case


class CaseTimeout(BaseException):
    """A case ran past its limit (not an ``Exception``: ``run_case`` would report it as the
    case's own error)."""

    def __init__(self, signum: int) -> None:
        super().__init__("CPU" if signum == signal.SIGPROF else "wall")


def _alarm(signum: int, frame: FrameType | None) -> None:
    raise CaseTimeout(signum)


def run(seeds: int, first: int, case_limit: int, wall_limit: int | None = None) -> list[str]:
    """Run ``seeds`` seeds drawn from ``first``; the failures, one line each. Each case may
    spend ``case_limit`` seconds of CPU time and ``wall_limit`` of wall time (default ten
    times ``case_limit``)."""
    wall = 10 * case_limit if wall_limit is None else wall_limit
    rng = random.Random(first)
    failures: list[str] = []
    signal.signal(signal.SIGPROF, _alarm)  # ITIMER_PROF: the process's CPU time, every thread
    signal.signal(signal.SIGALRM, _alarm)
    start = time.monotonic()
    for done in range(seeds):
        seed = rng.randrange(2**31)
        for found in cases(seed):
            began, cpu = time.monotonic(), time.process_time()
            signal.setitimer(signal.ITIMER_PROF, case_limit)
            signal.alarm(wall)
            try:
                run_case(found)
                outcome = None
            except CaseTimeout as e:
                limit = case_limit if str(e) == "CPU" else wall
                outcome = f"{found}: did not finish in {limit} s of {e} time"
            except AssertionError as e:
                outcome = str(e).splitlines()[0]
            finally:
                signal.setitimer(signal.ITIMER_PROF, 0)
                signal.alarm(0)
            spent = time.process_time() - cpu
            if outcome is not None:
                failures.append(outcome)
                print(f"FAILED {outcome}\n{found.source}", flush=True)
            elif spent > case_limit / 4:
                print(
                    f"slow: {found} took {spent:.0f} CPU s ({time.monotonic() - began:.0f} s)",
                    flush=True,
                )
        elapsed = time.monotonic() - start
        print(
            f"seed {done + 1}/{seeds} ({seed}): {(done + 1) * CASES} cases, "
            f"{len(failures)} failed, {elapsed:.0f} s",
            flush=True,
        )
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=2000, help="fresh seeds (default 2000)")
    parser.add_argument(
        "--case-limit", type=int, default=240, help="CPU seconds per case (default 240)"
    )
    parser.add_argument(
        "--wall-limit", type=int, default=None, help="wall seconds per case (default 10x that)"
    )
    parser.add_argument("--first", type=int, default=None, help="draw the seeds from this one")
    args = parser.parse_args(argv)
    first = random.SystemRandom().randrange(2**31) if args.first is None else args.first
    print(f"fuzz_executor: {args.seeds} seeds drawn from --first {first}", flush=True)
    failures = run(args.seeds, first, args.case_limit, args.wall_limit)
    print(f"fuzz_executor: {len(failures)} failed case(s)")
    for line in failures:
        print(f"  {line}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
