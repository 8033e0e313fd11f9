"""``python -m sharedmem estimate PACKAGE.MODULE:FACTORY --input 8x3x224x224``: the memory of a
model's train step and evaluation, printed before anything runs."""

from __future__ import annotations

import argparse
import importlib
from typing import Any

import torch

__all__ = ["add_estimate_command"]

_LOSSES = ("cross_entropy", "sum")  # class indices as targets, or the output's sum
_OPTIMIZERS = ("none", "sgd", "momentum", "adam", "adamw")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"sharedmem: --input takes a shape like 8x3x224x224, got {text!r}"
        ) from None
    if not shape or any(d < 1 for d in shape):
        raise argparse.ArgumentTypeError(f"sharedmem: --input dimensions must be >= 1: {text!r}")
    return shape


def _factory(text: str) -> Any:
    module_name, _, attribute = text.partition(":")
    if not module_name or not attribute:
        raise argparse.ArgumentTypeError(
            f"sharedmem: the model is PACKAGE.MODULE:FACTORY (a callable that returns the "
            f"nn.Module, e.g. mypkg.models:resnet18), got {text!r}"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # an import failing for any reason: say which and why
        raise argparse.ArgumentTypeError(
            f"sharedmem: cannot import {module_name!r} ({type(error).__name__}: {error}); "
            "check the name and that it is on PYTHONPATH"
        ) from None
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise argparse.ArgumentTypeError(
            f"sharedmem: {module_name!r} has no callable {attribute!r}"
        )
    return factory


def _run(args: argparse.Namespace) -> int:
    from .._errors import SharedMemError
    from .._planning import estimate

    model = args.model()
    if not isinstance(model, torch.nn.Module):
        raise SharedMemError(
            f"sharedmem: {args.model.__name__}() returned a {type(model).__name__}, not an "
            "nn.Module"
        )
    dtype = _DTYPES[args.dtype]
    model = model.to(dtype)
    # Uninitialised: its pages are never touched, so it costs no memory to speak of.
    inputs = torch.empty(args.input, dtype=dtype)
    loss_fn: Any = None
    targets: Any = None
    if args.loss == "cross_entropy":
        targets = torch.zeros(args.input[0], dtype=torch.int64)
        loss_fn = torch.nn.functional.cross_entropy
    optimizer = _optimizer(args.optimizer, model)
    try:
        est = estimate(
            model, inputs, targets, loss_fn=loss_fn, optimizer=optimizer, device=args.device
        )
    except (SharedMemError, ValueError, TypeError):
        raise
    except Exception as error:  # the model cannot take this input: say so, not a traceback
        first = (str(error).splitlines() or [""])[0]
        raise SharedMemError(
            f"sharedmem: the model cannot take an input of shape {args.input} with the "
            f"{args.loss} loss ({type(error).__name__}: {first})"
        ) from None
    print(est.report())
    if args.budget is not None:
        fits = est.fits(args.budget)
        print(
            f"budget {args.budget:,} bytes: the pooled step {'fits' if fits else 'does NOT fit'} "
            f"({est.train_peak_pooled:,} planned); eager "
            f"{'fits' if est.fits(args.budget, pooled=False) else 'does NOT fit'}"
        )
        return 0 if fits else 1
    return 0


def _optimizer(name: str, model: torch.nn.Module) -> torch.optim.Optimizer | None:
    params = list(model.parameters())
    if name == "none" or not params:
        return None
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    if name == "momentum":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return (torch.optim.Adam if name == "adam" else torch.optim.AdamW)(params)


def add_estimate_command(commands: Any, count: Any) -> None:
    """Add ``estimate`` to the subcommands ``commands`` (from ``add_subparsers``)."""
    parser: argparse.ArgumentParser = commands.add_parser(
        "estimate",
        help="a model's train-step and evaluation memory, before running anything",
        description="Estimate the memory of one train step and one evaluation of the model a "
        "factory returns, eager and pooled, by category and per module, allocating nothing "
        "(fake tensors). The input is a shape; the batch is its first dimension.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("model", type=_factory, help="PACKAGE.MODULE:FACTORY, a callable returning the model")
    add("--input", type=_shape, required=True, help="the input's shape, e.g. 8x3x224x224")
    add("--loss", choices=_LOSSES, default="cross_entropy", help="the loss")
    add("--optimizer", choices=_OPTIMIZERS, default="adamw", help="the optimizer")
    add("--device", default="cpu", help="the device the figures are for (cuda needs no GPU)")
    add("--dtype", choices=list(_DTYPES), default="float32", help="parameters and input")
    add(
        "--budget",
        type=count("--budget", 0),
        default=None,
        help="bytes, e.g. 2G: exit 1 if the pooled step does not fit",
    )
    parser.set_defaults(run=_run)
