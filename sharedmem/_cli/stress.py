"""``python -m sharedmem stress``: the command line of the stress runner.

Only argparse is needed to build the parser; the runner is imported when the command runs.

Exit status: 0 when every operation was verified and none failed; 1 on a mismatch, or when the
run verified no operation at all (a ``--seconds`` too short to finish one: a run that checked
nothing must not pass); 2 for bad arguments. With ``--self-check`` the point is to see the
planted corruption caught: 0 when it was, 1 when the run ended without catching it.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the runner is imported when the command runs, not to build the parser
    from .._stress import StressConfig, StressResult

__all__ = ["add_stress_command"]

_SCALE = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
# The run holds its noise (max-bytes of random bytes) and a model of every buffer in memory;
# past a GiB a buffer says nothing a smaller one would not, and the run would mostly page.
_MOST = 1 << 30
# Workers are threads of one process on a few cores: past a few hundred they only queue for
# the GIL and the pool's locks, and a round would spend its time starting them.
_MOST_THREADS = 256
# Each round builds a fresh pool of every buffer and reads all of them back at its end (about
# 60 us a buffer); past these counts a round is mostly that, and a short run never ends on time.
_MOST_BUFFERS = 4096  # per worker
_MOST_IN_ALL = 16_384  # threads times buffers


def _count(what: str, minimum: int, most: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in [minimum, most] with an optional K, M or G (KiB, MiB,
    GiB) suffix."""

    def parse(text: str) -> int:
        scale = _SCALE.get(text[-1:].lower(), 1)
        try:
            value = int((text[:-1] if scale > 1 else text).replace("_", "")) * scale
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"sharedmem: {what} takes a whole number (64K, 4M and 1G work too), got {text!r}"
            ) from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"sharedmem: {what} must be >= {minimum}, got {text}")
        if most is not None and value > most:
            raise argparse.ArgumentTypeError(
                f"sharedmem: {what} must be at most {most:,}, got {text}"
            )
        return value

    return parse


def _seed(text: str) -> int:
    """An argparse type: a seed, a whole number >= 0 (no size suffixes: it is no size)."""
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"sharedmem: --seed takes a whole number >= 0, got {text!r}"
        ) from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"sharedmem: --seed must be >= 0, got {text}")
    return value


def _number(what: str, low: float, high: float | None, *, open_low: bool) -> Callable[[str], float]:
    """An argparse type: a number above ``low`` (or equal, unless ``open_low``), at most
    ``high``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"sharedmem: {what} takes a number, got {text!r}"
            ) from None
        above = value > low if open_low else value >= low
        if not (above and (high is None or value <= high)):  # NaN fails both
            bound = f"{'>' if open_low else '>='} {low:g}" + (f" and <= {high:g}" if high else "")
            raise argparse.ArgumentTypeError(f"sharedmem: {what} must be {bound}, got {text}")
        return value

    return parse


def _memory() -> int | None:
    """Bytes this process may use: physical memory, or less under an address-space limit
    (``ulimit -v``); ``None`` where the system does not say."""
    try:
        most = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    try:
        import resource  # POSIX only

        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    except (ImportError, OSError, ValueError):
        return most
    return most if soft == resource.RLIM_INFINITY else min(most, soft)


def _size_check(args: argparse.Namespace, two_sided: bool) -> str | None:
    """Why the run's buffers cannot fit, or None. What the options bound one by one is not
    enough: threads times buffers times max-bytes is what the run may come to hold."""
    private = args.threads * args.buffers
    if private > _MOST_IN_ALL:
        return (
            f"sharedmem: --threads {args.threads} with --buffers {args.buffers} makes "
            f"{private:,} buffers, more than {_MOST_IN_ALL:,}; use fewer threads or buffers"
        )
    count = private + (max(1, args.buffers // 2) if args.threads > 1 else 0)  # + shared
    # Each buffer has a data and a gradient memory; at its largest each is held by the model
    # and by each side of the pool.
    worst = count * 2 * args.max_bytes * (3 if two_sided else 2)
    memory = _memory()
    if memory is not None and worst > memory:
        return (
            f"sharedmem: {count:,} buffers of up to {args.max_bytes:,} bytes may come to hold "
            f"{worst:,} bytes (data and gradient, in the model and on each side), more than "
            f"the {memory:,} bytes this process may use; use fewer buffers or a smaller "
            "--max-bytes"
        )
    return None


def _run(args: argparse.Namespace) -> int:
    # Imported here: building the parser must not pay for the runner.
    from .._backends import resolve
    from .._errors import SharedMemError
    from .._stress import StressConfig, run_stress

    parser: argparse.ArgumentParser = args.parser
    try:  # an unusable device or an unknown backend is a usage error, said before any work
        placement = resolve(args.device, args.backend)
    except (SharedMemError, ValueError, TypeError) as error:
        parser.error(str(error))
    problem = _size_check(args, placement.accel is not None)
    if problem is not None:
        parser.error(problem)
    if args.api:
        return _run_api_walk(args, placement_names(args.device, args.backend))
    if args.self_check:
        print("stress: self-check: a deliberately broken backend flips bits; the run must catch it")
    config = StressConfig(
        device=args.device,
        backend=args.backend,
        seconds=args.seconds,
        ops=args.ops,
        # A fresh seed each run unless one is given; the summary prints it, so any run replays.
        seed=secrets.randbelow(2**31) if args.seed is None else args.seed,
        threads=args.threads,
        buffers=args.buffers,
        max_bytes=args.max_bytes,
        limit=args.limit,
        faults=args.faults,
        self_check=args.self_check,
    )
    print(f"stress: seed {config.seed}", file=sys.stderr)
    try:
        result = run_stress(config)
    except MemoryError as error:  # the machine's limit, not a finding: one line, no traceback
        said = " ".join(str(error).split()) or "no detail"
        memory = _memory()
        print(
            f"sharedmem: the stress run ran out of memory ({type(error).__name__}: {said}); "
            + (f"this process may use {memory:,} bytes. " if memory is not None else "")
            + "Use fewer buffers or a smaller --max-bytes, or give the process more memory.",
            file=sys.stderr,
        )
        return 1
    return _verdict(config, result)


def placement_names(device: str, backend: str | None) -> tuple[str, ...]:
    """The backends a run takes turns over: the one named, or each of the device's."""
    from .._backends import backend_names

    if backend is not None:
        return (backend,)
    if device.startswith("cuda"):
        from .._backends.cuda import usable_backends
        from .._devices import normalize_device

        return usable_backends(int(normalize_device(device).partition(":")[2]))
    return backend_names(device)


def _run_api_walk(args: argparse.Namespace, backends: tuple[str, ...]) -> int:
    """``stress --api``: the random walk over the pool's public API, backend after backend."""
    from .._pool import BufferPool
    from .._stress._api_walk import walk_pool_api

    seed = secrets.randbelow(2**31) if args.seed is None else args.seed
    print(f"stress: seed {seed}", file=sys.stderr)
    ops = args.ops
    seconds = args.seconds if args.seconds is not None else (None if ops is not None else 10.0)
    share = None if seconds is None else seconds / len(backends)
    total, failed = 0, None
    try:
        for k, backend in enumerate(backends):
            quota = None if ops is None else ops // len(backends) + (k < ops % len(backends))
            pool = BufferPool(args.device, backend=backend)
            result = walk_pool_api(pool, seed + k, quota, share)
            total += result.ops
            if result.mismatch is not None:
                failed = (backend, result)
                break
    except KeyboardInterrupt:
        print(f"stress: interrupted (Ctrl-C) after {total} verified API operations")
        print(f"stress: {total} verified ops, 0 mismatches, seed {seed}, device {args.device}")
        return 130
    if failed is not None:
        backend, result = failed
        print(f"stress: MISMATCH (seed {seed}, backend {backend}) {result.mismatch}")
        print("stress: the last operations:")
        print("\n".join(f"  {line}" for line in result.log[-12:]))
        print(
            f"stress: to run again: python -m sharedmem stress --api --device {args.device} "
            f"--backend {backend} --seed {seed + backends.index(backend)} --ops {result.ops}"
        )
    print(
        f"stress: {total} verified ops, {0 if failed is None else 1} mismatches, seed {seed}, "
        f"device {args.device}"
    )
    if failed is None and total == 0:
        print("stress: FAILED: no operation was verified; give the run more time", file=sys.stderr)
    return 0 if failed is None and total else 1


def _verdict(config: StressConfig, result: StressResult) -> int:
    """The exit status of a finished run (see the module's docstring), said on stderr where it
    is not the plain one."""
    failure = result.failure
    if config.self_check:
        if failure is None:
            print(
                f"stress: self-check FAILED: {result.ops:,} verified ops and the broken backend "
                "was not caught (it spoils every 3rd copy or growth: give the run more "
                "operations)",
                file=sys.stderr,
            )
            return 1
        print(
            f"stress: self-check passed: the broken backend was caught at op {failure.op_number:,}",
            file=sys.stderr,
        )
        return 0
    if result.mismatches:
        return 1
    if result.interrupted:  # the summary above says what was verified up to Ctrl-C
        return 130
    if result.ops == 0:
        print(
            "stress: FAILED: no operation was verified (--seconds ran out before the first "
            "finished); give the run more time",
            file=sys.stderr,
        )
        return 1
    return 0


def add_stress_command(commands: Any) -> None:
    """Add ``stress`` to the subcommands ``commands`` (from ``add_subparsers``)."""
    stress: argparse.ArgumentParser = commands.add_parser(
        "stress",
        help="random resize/read/write loops over a pool, checked byte for byte against a model",
        description=(
            "Random operations over a pool (reshape, writes through mutable views on either "
            "side, reads checked byte for byte, share_data, shrink_to_fit, release, trim, "
            "growth past a limit), checked against a reference model of the invariant "
            "(every byte reads back the last value written to it, from either side). On a "
            "mismatch it prints the seed, the operation number and the shortest operation "
            "sequence that still fails, and exits 1; a run that verified no operation exits 1 "
            "too. With --self-check it exits 0 when the planted corruption was caught, 1 when "
            "it was not."
        ),
    )
    add = stress.add_argument
    add("--device", default="emulated", help="cpu, emulated (default), cuda or cuda:N")
    add(
        "--api",
        action="store_true",
        help="walk the pool's public API instead (names, both fast paths, retyping, "
        "share_data, trim, release) against a model of each name's shape, dtype and bytes",
    )
    add("--backend", default=None, help="one backend of the device (default: each in turn)")
    add(
        "--seconds",
        type=_number("--seconds", 0.0, None, open_low=True),
        default=None,
        help="stop after this long (default: 10 s, or no time bound when --ops is given)",
    )
    add("--ops", type=_count("--ops", 1), default=None, help="stop after this many operations")
    add(
        "--seed",
        type=_seed,
        default=None,
        help="everything random follows from it (default: a random seed, printed)",
    )
    add(
        "--threads",
        type=_count("--threads", 1, _MOST_THREADS),
        default=1,
        help=f"workers sharing the pool (at most {_MOST_THREADS})",
    )
    add(
        "--buffers",
        type=_count("--buffers", 1, _MOST_BUFFERS),
        default=8,
        help=f"buffers per worker (at most {_MOST_BUFFERS:,}; threads x buffers {_MOST_IN_ALL:,})",
    )
    add(
        "--max-bytes",
        type=_count("--max-bytes", 1, _MOST),
        default=64 << 10,
        help="the largest buffer (default 64K)",
    )
    add(
        "--limit",
        type=_count("--limit", 0),
        default=None,
        help="the pool's cap on reserved device bytes, e.g. 256K (default: none)",
    )
    add(
        "--faults",
        type=_number("--faults", 0.0, 1.0, open_low=False),
        nargs="?",
        const=0.05,
        default=0.0,
        help="the chance that an operation runs with an allocation, growth, shrink or copy "
        "failure injected (--faults alone: 0.05)",
    )
    add(
        "--self-check",
        action="store_true",
        help="break the pool on purpose (a bit flips in every 3rd copy and growth) to watch "
        "the runner catch it and shrink it to a few operations; exits 0 when it was caught, "
        "1 when it was not",
    )
    stress.set_defaults(run=_run, parser=stress)
