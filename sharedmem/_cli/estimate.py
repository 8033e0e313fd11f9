"""``python -m sharedmem estimate PACKAGE.MODULE:FACTORY --input 8x3x224x224``: the memory of a
model's train step and evaluation, printed before anything runs.

``--input`` may be given several times: shapes alone are positional arguments (one is the
model's one argument, several a tuple), ``NAME=SHAPE`` keyword arguments (a dict), and any of
them may end in ``:DTYPE`` (``input_ids=8x128:int64``), as a step takes its inputs.
``--arg`` gives the factory its arguments (``torch.nn:Linear --arg 16 --arg 4``).

Every way it can fail before printing (a factory that needs arguments or raises, an input the
model cannot take, a bad device) ends in one line starting ``sharedmem:`` and exit status 2."""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from .._errors import SharedMemError
from .._validate import check_bytes

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


class Factory(NamedTuple):
    """The model's factory, as the command line named it (``torch.nn:Linear``)."""

    text: str
    make: Callable[..., Any]


class Argument(NamedTuple):
    """One ``--arg``: a keyword (``None`` for a positional argument) and its value."""

    name: str | None
    value: object


def _argument(text: str) -> Argument:
    """``16`` or ``out_features=4``: a Python literal (``16``, ``0.1``, ``True``, ``(3, 3)``),
    or else the text itself (``activation=gelu``)."""
    name, sep, rest = text.partition("=")
    if not (sep and name.isidentifier()):
        name, rest = "", text
    try:
        value: object = ast.literal_eval(rest)
    except (ValueError, SyntaxError):
        value = rest
    return Argument(name or None, value)


def _build(factory: Factory, given: list[Argument]) -> torch.nn.Module:
    """Call the factory with the ``--arg`` values; a call it cannot take, or that fails, says
    how to give it what it needs."""
    args = [a.value for a in given if a.name is None]
    kwargs = {a.name: a.value for a in given if a.name is not None}
    try:
        signature: inspect.Signature | None = inspect.signature(factory.make)
    except (TypeError, ValueError):  # a builtin: its call says
        signature = None
    if signature is not None:
        try:
            signature.bind(*args, **kwargs)
        except TypeError as error:
            needed = [
                p.name
                for p in signature.parameters.values()
                if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
            ]
            example = " ".join(f"--arg {name}=VALUE" for name in needed) or "no --arg"
            raise SharedMemError(
                f"sharedmem: cannot call {factory.text} with the arguments given ({error}): "
                f"give them with --arg, in order or as NAME=VALUE ({example}), or name a "
                "function that builds the model (mypkg.models:make_model)"
            ) from None
    try:
        model = factory.make(*args, **kwargs)
    except Exception as error:  # the factory's own failure: say whose and why, in one line
        first = (str(error).splitlines() or [""])[0]
        raise SharedMemError(
            f"sharedmem: {factory.text}(...) failed ({type(error).__name__}: {first}); check "
            "the arguments given with --arg"
        ) from None
    if not isinstance(model, torch.nn.Module):
        raise SharedMemError(
            f"sharedmem: {factory.text} returned a {type(model).__name__}, not an nn.Module: "
            "name a class or function that returns the model"
        )
    return model


def _byte_option(what: str) -> Callable[[str], int]:
    """An argparse type: bytes spelled as every size is (``2G``, ``512M``, ``1000``)."""

    def parse(text: str) -> int:
        try:
            return check_bytes(text, what)
        except (TypeError, ValueError) as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return parse


def _factory(text: str) -> Factory:
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
    return Factory(text, factory)


def _run(args: argparse.Namespace) -> int:
    from .._planning import estimate

    model = _build(args.model, args.arg or [])
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
        est = estimate(  # its own process: kernels are measured (the router installed)
            model,
            inputs,
            targets,
            loss_fn=loss_fn,
            optimizer=optimizer,
            device=args.device,
            measure_kernels=True,
            world_size=args.world_size,
        )
    except SharedMemError:
        raise
    except (ValueError, TypeError) as error:
        if str(error).startswith("sharedmem:"):  # an argument of ours: its message says it
            raise SharedMemError(str(error)) from None
        first = (str(error).splitlines() or [""])[0]
        raise SharedMemError(
            f"sharedmem: the model cannot take an input of shape {shapes} with the "
            f"{args.loss} loss ({type(error).__name__}: {first})"
        ) from None
    except Exception as error:  # the model cannot take this input: say so, not a traceback
        first = (str(error).splitlines() or [""])[0]
        raise SharedMemError(
            f"sharedmem: the model cannot take an input of shape {shapes} with the "
            f"{args.loss} loss ({type(error).__name__}: {first})"
        ) from None
    print(est.report())

    def whole(nbytes: int, pooled: bool = True) -> bool:  # the whole step, everything included
        return (est.train_peak_pooled if pooled else est.train_peak_eager) <= nbytes

    checks = [
        (
            "budget",
            args.budget,
            "what the step holds beyond parameters, inputs and optimizer state",
            est.fits,
            est.step_peak_pooled,
        ),
        ("memory", args.memory, "everything included", whole, est.train_peak_pooled),
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


def add_estimate_command(commands: Any) -> None:
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
        "--arg",
        type=_argument,
        action="append",
        metavar="VALUE|NAME=VALUE",
        help="an argument of the factory (a Python literal, or else text); several are "
        "passed in order: torch.nn:Linear --arg 16 --arg 4",
    )
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
        "--world-size",
        type=int,
        default=None,
        metavar="N",
        help="also one rank's memory with the model sharded by FSDP2 over N ranks (fully_shard "
        "on each child holding parameters, then the model)",
    )
    add(
        "--budget",
        type=_byte_option("--budget"),
        default=None,
        help="bytes, e.g. 2G, as a step's budget= counts them (what the step holds beyond "
        "parameters, inputs and optimizer state): exit 1 if the pooled step does not fit",
    )
    add(
        "--memory",
        type=_byte_option("--memory"),
        default=None,
        help="a device's memory in bytes, e.g. 8G: exit 1 if the whole pooled train step "
        "(parameters, inputs and optimizer state included) does not fit",
    )
    parser.set_defaults(run=_run)
