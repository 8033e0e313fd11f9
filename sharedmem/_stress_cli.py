"""``python -m sharedmem stress``: the command line of the stress runner.

Only argparse is needed to build the parser; the runner is imported when the command runs.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

__all__ = ["add_stress_command"]

_SCALE = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
# The run holds its noise (max-bytes of random bytes) and a model of every buffer in memory;
# past a GiB a buffer says nothing a smaller one would not, and the run would mostly page.
_MOST = 1 << 30


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


def _run(args: argparse.Namespace) -> int:
    # Imported here: building the parser must not pay for the runner.
    from ._backends import resolve
    from ._errors import SharedMemError
    from ._stress import StressConfig, run_stress

    parser: argparse.ArgumentParser = args.parser
    try:  # an unusable device or an unknown backend is a usage error, said before any work
        resolve(args.device, args.backend)
    except (SharedMemError, ValueError, TypeError) as error:
        parser.error(str(error))
    if args.self_check:
        print("stress: self-check: a deliberately broken backend flips bits; this run must fail")
    result = run_stress(
        StressConfig(
            device=args.device,
            backend=args.backend,
            seconds=args.seconds,
            ops=args.ops,
            seed=args.seed,
            threads=args.threads,
            buffers=args.buffers,
            max_bytes=args.max_bytes,
            limit=args.limit,
            faults=args.faults,
            self_check=args.self_check,
        )
    )
    return 1 if result.mismatches else 0


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
            "sequence that still fails, and exits 1."
        ),
    )
    add = stress.add_argument
    add("--device", default="emulated", help="cpu, emulated (default), cuda or cuda:N")
    add("--backend", default=None, help="one backend of the device (default: each in turn)")
    add(
        "--seconds",
        type=_number("--seconds", 0.0, None, open_low=True),
        default=None,
        help="stop after this long (default: 10 s, or no time bound when --ops is given)",
    )
    add("--ops", type=_count("--ops", 1), default=None, help="stop after this many operations")
    add("--seed", type=_count("--seed", 0), default=0, help="everything random follows from it")
    add("--threads", type=_count("--threads", 1), default=1, help="workers sharing the pool")
    add("--buffers", type=_count("--buffers", 1), default=8, help="buffers per worker")
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
        "the runner catch it and shrink it to a few operations; such a run exits 1",
    )
    stress.set_defaults(run=_run, parser=stress)
