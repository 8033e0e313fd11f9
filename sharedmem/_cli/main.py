"""The command line: ``python -m sharedmem <command>`` (or the ``sharedmem`` script).

Exit status: 0 done (and every target met), 1 a run that found a problem (a missed target, a
mismatch, a loss that did not go down), 2 bad arguments or a device this machine cannot use,
said in one line that starts with ``sharedmem:``, never as a traceback.
"""

from __future__ import annotations

import argparse
import sys

from .._devices import normalize_device
from .._errors import SharedMemError
from .demo import DemoConfig, run_demo
from .stress import _count, add_stress_command

__all__ = ["main"]


def _device(text: str) -> str:
    """An argparse type: a device this machine can use, checked before any work starts."""
    try:
        return normalize_device(text)
    except (SharedMemError, ValueError, TypeError) as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _demo(args: argparse.Namespace) -> int:
    config = DemoConfig(
        device=args.device,
        steps=args.steps,
        train_batch=args.train_batch,
        eval_batch=args.eval_batch,
        seed=args.seed,
    )
    result = run_demo(config, plot=args.plot)
    return 0 if result["losses"][-1] < result["losses"][0] else 1


def _bench(args: argparse.Namespace) -> int:
    from .bench import run_bench  # the suite imports models and the executor: load on demand

    return run_bench(args.quick, args.device, args.json)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sharedmem", description="A capacity-aware shared-buffer memory pool for PyTorch."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")

    demo = commands.add_parser(
        "demo", help="train and evaluate an MLP with per-net buffers, then on one shared pool"
    )
    add = demo.add_argument
    add("--device", type=_device, default="cpu", help="cpu (default), emulated, cuda or cuda:N")
    add("--steps", type=_count("--steps", 1), default=DemoConfig.steps, help="training steps")
    add("--train-batch", type=_count("--train-batch", 1), default=DemoConfig.train_batch)
    add("--eval-batch", type=_count("--eval-batch", 1), default=DemoConfig.eval_batch)
    add("--seed", type=_count("--seed", 0), default=DemoConfig.seed)
    add("--plot", metavar="PATH", help="write the pool's memory timeline as a PNG")
    demo.set_defaults(run=_demo)
    add_stress_command(commands)

    bench = commands.add_parser(
        "bench", help="measure every target of the design against its PyTorch baseline"
    )
    add = bench.add_argument
    add("--quick", action="store_true", help="fewer repetitions (< 2 minutes)")
    add("--device", type=_device, default="cpu", help="cpu (default), emulated, cuda or cuda:N")
    add("--json", metavar="PATH", help="also write the figures and the environment as JSON")
    bench.set_defaults(run=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the command; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        status: int = args.run(args)
    except SharedMemError as error:
        # A device that went away mid-run, bench outside a source checkout: the message says
        # what to do, a traceback would only bury it.
        print(" ".join(str(error).split()), file=sys.stderr)
        return 2
    return status
