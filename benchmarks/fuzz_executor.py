"""The executor fuzzer over many fresh seeds, outside the tests (issue 34: the test command runs
a fixed set of seeds; this is where new ones are tried, before a change lands).

Each seed is the fuzz test's 24 random programs (``tests/test_executor_fuzz.py``: views,
in-place writes, dropout, heavy recomputation), each run pooled and eagerly and compared. A
case that differs, raises or runs past ``--case-limit`` seconds is printed with its seed and
case, which ``pytest tests/test_executor_fuzz.py`` then runs as a regression once added to
its ``REGRESSIONS``. Run it niced on a shared machine:

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


def _alarm(signum: int, frame: FrameType | None) -> None:
    raise CaseTimeout


def run(seeds: int, first: int, case_limit: int) -> list[str]:
    """Run ``seeds`` seeds drawn from ``first``; the failures, one line each."""
    rng = random.Random(first)
    failures: list[str] = []
    signal.signal(signal.SIGALRM, _alarm)
    start = time.monotonic()
    for done in range(seeds):
        seed = rng.randrange(2**31)
        for found in cases(seed):
            began = time.monotonic()
            signal.alarm(case_limit)
            try:
                run_case(found)
                outcome = None
            except CaseTimeout:
                outcome = f"{found}: did not finish in {case_limit} s"
            except AssertionError as e:
                outcome = str(e).splitlines()[0]
            finally:
                signal.alarm(0)
            if outcome is not None:
                failures.append(outcome)
                print(f"FAILED {outcome}\n{found.source}", flush=True)
            elif time.monotonic() - began > case_limit / 4:
                print(f"slow: {found} took {time.monotonic() - began:.0f} s", flush=True)
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
    parser.add_argument("--case-limit", type=int, default=240, help="seconds per case")
    parser.add_argument("--first", type=int, default=None, help="draw the seeds from this one")
    args = parser.parse_args(argv)
    first = random.SystemRandom().randrange(2**31) if args.first is None else args.first
    print(f"fuzz_executor: {args.seeds} seeds drawn from --first {first}", flush=True)
    failures = run(args.seeds, first, args.case_limit)
    print(f"fuzz_executor: {len(failures)} failed case(s)")
    for line in failures:
        print(f"  {line}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
