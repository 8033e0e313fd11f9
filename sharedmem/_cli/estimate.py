"""``python -m sharedmem estimate PACKAGE.MODULE:FACTORY --input 8x3x224x224``: the memory of a
model's train step and evaluation, printed before anything runs.

``--input`` may be given several times: shapes alone are positional arguments (one is the
model's one argument, several a tuple), ``NAME=SHAPE`` keyword arguments (a dict), and any of
them may end in ``:DTYPE`` (``input_ids=8x128:int64``), as a step takes its inputs."""

from __future__ import annotations

import argparse
import importlib
from typing import Any, NamedTuple

import torch

from .._errors import SharedMemError

__all__ = ["add_estimate_command"]

# Class indices as targets, the output's sum, or the model's own loss (labels among inputs).
_LOSSES = ("cross_entropy", "sum", "model")
_OPTIMIZERS = ("none", "sgd", "momentum", "adam", "adamw")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_INPUT_DTYPES = {
    **_DTYPES,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "bool": torch.bool,
}


class Input(NamedTuple):
    """One ``--input``: a keyword (``None`` for a positional input), a shape, a dtype
    (``None``: the model's)."""

    name: str | None
    shape: tuple[int, ...]
    dtype: torch.dtype | None


def _shape(text: str) -> Input:
    name, _, rest = text.rpartition("=")
    rest, _, dtype_name = rest.partition(":")
    if name and not name.isidentifier():
        raise argparse.ArgumentTypeError(
            f"sharedmem: --input NAME=SHAPE needs a keyword name, got {name!r}"
        )
    dtype = None
    if dtype_name:
        if dtype_name not in _INPUT_DTYPES:
            raise argparse.ArgumentTypeError(
                f"sharedmem: --input's dtype is one of {', '.join(_INPUT_DTYPES)}, got "
                f"{dtype_name!r}"
            )
        dtype = _INPUT_DTYPES[dtype_name]
    try:
        shape = tuple(int(part) for part in rest.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"sharedmem: --input takes a shape like 8x3x224x224 (or NAME=SHAPE[:DTYPE], "
            f"input_ids=8x128:int64), got {text!r}"
        ) from None
    if not shape or any(d < 1 for d in shape):
        raise argparse.ArgumentTypeError(f"sharedmem: --input dimensions must be >= 1: {text!r}")
    return Input(name or None, shape, dtype)


def _inputs(given: list[Input], dtype: torch.dtype) -> Any:
    """The model's inputs, as a step takes them: one tensor, a tuple, or a dict."""

    def tensor(spec: Input) -> torch.Tensor:
        kind = spec.dtype or dtype
        if kind.is_floating_point:  # uninitialised: its pages are never touched
            return torch.empty(spec.shape, dtype=kind)
        return torch.zeros(spec.shape, dtype=kind)  # valid indices for an embedding

    named = [spec for spec in given if spec.name is not None]
    if named and len(named) != len(given):
        raise SharedMemError(
            "sharedmem: give every --input as a shape (positional arguments) or every one as "
            "NAME=SHAPE (keyword arguments), not both"
        )
    if named:
        return {spec.name: tensor(spec) for spec in named}
    tensors = tuple(tensor(spec) for spec in given)
    return tensors[0] if len(tensors) == 1 else tensors


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
    from .._planning import estimate

    model = args.model()
    if not isinstance(model, torch.nn.Module):
        raise SharedMemError(
            f"sharedmem: {args.model.__name__}() returned a {type(model).__name__}, not an "
            "nn.Module"
        )
    dtype = _DTYPES[args.dtype]
    model = model.to(dtype)
    inputs = _inputs(args.input, dtype)
    shapes = ", ".join(f"{spec.name + '=' if spec.name else ''}{spec.shape}" for spec in args.input)
    loss_fn: Any = None
    targets: Any = None
    if args.loss == "cross_entropy":
        targets = torch.zeros(args.input[0].shape[0], dtype=torch.int64)
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
            f"sharedmem: the model cannot take an input of shape {shapes} with the "
            f"{args.loss} loss ({type(error).__name__}: {first})"
        ) from None
    print(est.report())
    checks = [
        (
            "budget",
            args.budget,
            "what the step holds beyond parameters, inputs and optimizer state",
            est.fits,
            est.step_peak_pooled,
        ),
        ("memory", args.memory, "everything included", est.fits_memory, est.train_peak_pooled),
    ]
    fits = True
    for what, nbytes, meaning, judge, planned in checks:
        if nbytes is None:
            continue
        ok = judge(nbytes)
        print(
            f"{what} {nbytes:,} bytes ({meaning}): the pooled step "
            f"{'fits' if ok else 'does NOT fit'} ({planned:,} planned); eager "
            f"{'fits' if judge(nbytes, pooled=False) else 'does NOT fit'}"
        )
        fits = fits and ok
    return 0 if fits else 1


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
    add(
        "--input",
        type=_shape,
        action="append",
        required=True,
        help="an input's shape, e.g. 8x3x224x224; several are positional arguments, "
        "NAME=SHAPE a keyword argument, a :DTYPE suffix its dtype (input_ids=8x128:int64)",
    )
    add(
        "--loss",
        choices=_LOSSES,
        default="cross_entropy",
        help="the loss: cross entropy on class indices, the output's sum, or the model's own "
        "(labels among the inputs)",
    )
    add("--optimizer", choices=_OPTIMIZERS, default="adamw", help="the optimizer")
    add("--device", default="cpu", help="the device the figures are for (cuda needs no GPU)")
    add("--dtype", choices=list(_DTYPES), default="float32", help="parameters and input")
    add(
        "--budget",
        type=count("--budget", 0),
        default=None,
        help="bytes, e.g. 2G, as a step's budget= counts them (what the step holds beyond "
        "parameters, inputs and optimizer state): exit 1 if the pooled step does not fit",
    )
    add(
        "--memory",
        type=count("--memory", 0),
        default=None,
        help="a device's memory in bytes, e.g. 8G: exit 1 if the whole pooled train step "
        "(parameters, inputs and optimizer state included) does not fit",
    )
    parser.set_defaults(run=_run)
