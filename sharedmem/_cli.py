"""The command line: ``python -m sharedmem <command>`` (or the ``sharedmem`` script)."""

from __future__ import annotations

import argparse

from ._demo import DemoConfig, run_demo
from ._stress_cli import add_stress_command

__all__ = ["main"]


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
    from ._bench import run_bench  # the suite imports models and the executor: load on demand

    return run_bench(args.quick, args.device, args.json)


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the command; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="sharedmem", description="A capacity-aware shared-buffer memory pool for PyTorch."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")

    demo = commands.add_parser(
        "demo", help="train and evaluate an MLP with per-net buffers, then on one shared pool"
    )
    demo.add_argument("--device", default="cpu", help="cpu, emulated, cuda or cuda:N")
    demo.add_argument("--steps", type=int, default=DemoConfig.steps)
    demo.add_argument("--train-batch", type=int, default=DemoConfig.train_batch)
    demo.add_argument("--eval-batch", type=int, default=DemoConfig.eval_batch)
    demo.add_argument("--seed", type=int, default=DemoConfig.seed)
    demo.add_argument("--plot", metavar="PATH", help="write the pool's memory timeline as a PNG")
    demo.set_defaults(run=_demo)
    add_stress_command(commands)

    bench = commands.add_parser(
        "bench", help="measure every target of the design against its PyTorch baseline"
    )
    bench.add_argument("--quick", action="store_true", help="fewer repetitions (< 2 minutes)")
    bench.add_argument("--device", default="cpu", help="cpu, emulated, cuda or cuda:N")
    bench.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    bench.set_defaults(run=_bench)

    args = parser.parse_args(argv)
    status: int = args.run(args)
    return status
