"""The command line: ``python -m sharedmem <command>`` (or the ``sharedmem`` script).

Exit status: 0 done, 1 a run that found a problem (a mismatch, a loss that did not go down, a
missed target under ``bench --check``), 2 bad arguments or a device this machine cannot use,
said in one line that starts with ``sharedmem:``, never as a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .._devices import normalize_device
from .._errors import SharedMemError
from .bench import TIMING_TOLERANCE
from .demo import DemoConfig, demo_verdict, run_demo
from .estimate import add_estimate_command
from .stress import _count, add_stress_command

__all__ = ["main"]


def _device(text: str) -> str:
    """An argparse type: a device this machine can use, checked before any work starts."""
    try:
        return normalize_device(text)
    except (SharedMemError, ValueError, TypeError) as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _output_path(text: str) -> str:
    """An argparse type: a file the run can write at its end, checked before any work starts."""
    path = Path(text).expanduser()
    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"sharedmem: {text!r} is a folder; give a file name")
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(
            f"sharedmem: cannot write {text!r}: the folder {str(folder)!r} does not exist"
        )
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(
            f"sharedmem: cannot write {text!r}: the folder {str(folder)!r} is not writable"
        )
    return text


def _demo(args: argparse.Namespace) -> int:
    config = DemoConfig(
        device=args.device,
        steps=args.steps,
        train_batch=args.train_batch,
        eval_batch=args.eval_batch,
        seed=args.seed,
    )
    if args.fsdp and not args.distributed:
        raise SharedMemError("sharedmem: --fsdp shards over ranks: add --distributed")
    if args.distributed:  # one process per rank (torchrun); loaded only then
        from .demo_distributed import run_distributed_demo

        return run_distributed_demo(config, fsdp=args.fsdp)
    result = run_demo(config, plot=args.plot)
    failure = demo_verdict(result["losses"], result["per_net_losses"])
    fit = result.get("fit")
    if failure is None and fit is not None:  # the run in chunks follows the unchunked one
        failure = demo_verdict(fit["losses"], fit["unchunked_losses"], tolerance=1e-3)
    if failure is not None:
        print(f"sharedmem: demo failed: {failure}", file=sys.stderr)
        return 1
    return 0


def _bench(args: argparse.Namespace) -> int:
    from .bench import run_bench  # the suite imports models and the executor: load on demand

    return run_bench(
        args.quick, args.device, args.json, check=args.check, tolerance=args.tolerance / 100
    )


def _percent(text: str) -> float:
    """An argparse type: a percentage, 0 or more."""
    try:
        value = float(text.removesuffix("%"))
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(
            f"sharedmem: --tolerance takes a percentage such as 15 or 15%, not {text!r}"
        )
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sharedmem", description="A capacity-aware shared-buffer memory pool for PyTorch."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")

    # Every option's default shows in --help.
    defaults = argparse.ArgumentDefaultsHelpFormatter
    demo = commands.add_parser(
        "demo",
        help="train and evaluate an MLP with per-net buffers, then on one shared pool",
        description="Train an MLP whose activations and gradients live in pool buffers and "
        "evaluate it at another batch size: first with per-net buffers, then on one shared "
        "pool, and print the bytes side by side.",
        formatter_class=defaults,
    )
    add = demo.add_argument
    add("--device", type=_device, default="cpu", help="cpu, emulated, cuda or cuda:N")
    add("--steps", type=_count("--steps", 1), default=DemoConfig.steps, help="training steps")
    add(
        "--train-batch",
        type=_count("--train-batch", 1),
        default=DemoConfig.train_batch,
        help="batch size of the training net",
    )
    add(
        "--eval-batch",
        type=_count("--eval-batch", 1),
        default=DemoConfig.eval_batch,
        help="batch size of the evaluation net (it shares the training net's buffers)",
    )
    add(
        "--seed",
        type=_count("--seed", 0),
        default=DemoConfig.seed,
        help="seed of the synthetic data and the initial weights",
    )
    add(
        "--plot",
        metavar="PATH",
        type=_output_path,
        help="write the pool's memory timeline as a PNG (needs matplotlib)",
    )
    add(
        "--distributed",
        action="store_true",
        help="one rank per process, launched by torchrun: DDP with a pooled step and one pool "
        "per rank; prints per-rank and total memory",
    )
    add(
        "--fsdp",
        action="store_true",
        help="with --distributed: shard the model with fully_shard (FSDP2) and run its eager "
        "step inside pool.step(), against eager FSDP2",
    )
    demo.set_defaults(run=_demo)
    add_stress_command(commands)
    add_estimate_command(commands)

    bench = commands.add_parser(
        "bench",
        help="measure every target of the design against its PyTorch baseline",
        description="Run the benchmark suite of benchmarks/ (a source checkout) and print one "
        "table with a verdict per target.",
        formatter_class=defaults,
    )
    add = bench.add_argument
    add("--quick", action="store_true", help="fewer repetitions (< 2 minutes)")
    add("--device", type=_device, default="cpu", help="cpu, emulated, cuda or cuda:N")
    add(
        "--json",
        metavar="PATH",
        type=_output_path,
        help="also write the figures and the environment as JSON",
    )
    add(
        "--check",
        action="store_true",
        help="exit 1 where a target was missed (without it, 0 whenever the suite ran): bytes "
        "and counts by any amount, a timing figure (a time, a rate, a ratio of times) by more "
        "than --tolerance",
    )
    add(
        "--tolerance",
        type=_percent,
        default=TIMING_TOLERANCE * 100,
        metavar="PCT",
        help="how far a timing figure may miss its target before --check fails: the "
        "run-to-run noise of a quick run on a 2-core machine shared with other work",
    )
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
