"""Argument checks shared by every public entry point.

Each check returns the normalised value or raises ``TypeError`` / ``ValueError`` with a message
that starts with ``sharedmem:`` and names what was wrong, so a bad call fails before any state
changes.
"""

from __future__ import annotations

import inspect
import math
import operator
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import torch

__all__ = [
    "MAX_NBYTES",
    "SIZE_SPELLING",
    "ShapeLike",
    "call_loss_fn",
    "check_blob_nbytes",
    "check_byte_tensor",
    "check_bytes",
    "check_dtype",
    "check_loss_fn",
    "check_name",
    "check_nbytes",
    "check_shape",
    "loss_fn_error",
]

ShapeLike: TypeAlias = "int | Sequence[int] | torch.Size"

# The largest size we accept (4 EiB): sizes and element counts stay within torch's int64
# with room for any element size, so no product overflows behind our back.
MAX_NBYTES = 1 << 62

# Dtypes whose elements are whole bytes and can be viewed from raw uint8 storage. Quantized and
# sub-byte dtypes carry extra state (scales, bit packing) that a byte buffer cannot hold.
_SUPPORTED_DTYPES: frozenset[torch.dtype] = frozenset(
    {
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint16,
        torch.uint32,
        torch.uint64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.complex32,
        torch.complex64,
        torch.complex128,
        torch.float8_e4m3fn,
        torch.float8_e4m3fnuz,
        torch.float8_e5m2,
        torch.float8_e5m2fnuz,
    }
)


def _as_int(value: object, what: str) -> int:
    # bool is an int subclass, but a size of True is always a bug in the caller.
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        raise TypeError(f"sharedmem: {what} must be an integer, got a bool ({value!r})")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"sharedmem: {what} must be an integer, got {type(value).__name__} ({value!r})"
        ) from None


def check_nbytes(value: object, what: str = "nbytes") -> int:
    """Return ``value`` as a non-negative int byte count."""
    n = _as_int(value, what)
    if n < 0:
        raise ValueError(f"sharedmem: {what} must be >= 0, got {n:,}")
    if n > MAX_NBYTES:
        raise ValueError(f"sharedmem: {what} must be at most {MAX_NBYTES:,} bytes, got {n:,}")
    return n


# How a size in bytes may be written wherever one is taken (a pool's limit, a step's budget,
# an estimate's memory, the command line's --budget and --memory): the spelling, once.
_SCALE = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
SIZE_SPELLING = "an int >= 0 or a size such as '8G', '512M' or '64K' (powers of 1024)"


def check_bytes(value: object, what: str) -> int:
    """Bytes from an int >= 0 or a size as the command line writes it: ``"8G"``, ``"512M"``,
    ``"64K"``, ``"1T"`` (powers of 1024; a trailing ``B``/``iB`` and ``_`` separators allowed).

    >>> check_bytes("8G", "limit"), check_bytes("1_000", "limit"), check_bytes(4096, "limit")
    (8589934592, 1000, 4096)
    """
    spelling = f"sharedmem: {what} must be bytes: {SIZE_SPELLING}, got {value!r}"
    if isinstance(value, str):
        text = value.strip().lower().replace("_", "").removesuffix("ib").removesuffix("b")
        scale = _SCALE.get(text[-1:], 1)
        digits = text[:-1] if scale > 1 else text
        if not (digits.isascii() and digits.isdigit()):
            raise ValueError(spelling)
        n = int(digits) * scale
    else:
        try:
            n = _as_int(value, what)
        except TypeError:
            raise TypeError(f"{spelling} ({type(value).__name__})") from None
        if n < 0:
            raise ValueError(spelling)
    return check_nbytes(n, what)  # within what a buffer can hold


def check_loss_fn(loss_fn: object) -> Callable[..., Any] | None:
    """Return ``loss_fn`` (or ``None``) if it can be called as ``loss_fn(output, targets)``.

    Where Python cannot tell a callable's parameters (some builtins), the call itself says
    at trace time (``loss_fn_error``).
    """
    if loss_fn is None:
        return None
    if not callable(loss_fn):
        raise TypeError(
            f"sharedmem: loss_fn must be callable as loss_fn(output, targets), got "
            f"{type(loss_fn).__name__}"
        )
    # A module's __call__ takes anything; its forward says what it takes.
    target = loss_fn.forward if isinstance(loss_fn, torch.nn.Module) else loss_fn
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):  # no signature to read: the call at trace time tells
        return loss_fn
    try:
        signature.bind(None, None)
    except TypeError as e:
        raise TypeError(loss_fn_error(loss_fn, f"it takes {_described(signature)} ({e})")) from None
    return loss_fn


def call_loss_fn(loss_fn: Callable[..., Any], output: object, targets: object) -> Any:
    """``loss_fn(output, targets)``. Where the call itself fails (a builtin whose parameters
    ``check_loss_fn`` could not read), the error says it was ``loss_fn`` that could not take
    them; an error raised inside ``loss_fn`` passes as it is."""
    try:
        return loss_fn(output, targets)
    except TypeError as e:
        # The traceback starts in this frame: a next frame means loss_fn's own code raised.
        inside = e.__traceback__ is not None and e.__traceback__.tb_next is not None
        if inside or str(e).startswith("sharedmem:"):
            raise
        raise TypeError(loss_fn_error(loss_fn, str(e))) from e


def loss_fn_error(loss_fn: object, why: str) -> str:
    """The message of a ``loss_fn`` that cannot be called with ``(output, targets)``."""
    name = getattr(loss_fn, "__qualname__", None) or type(loss_fn).__name__
    return (
        f"sharedmem: loss_fn is called with two arguments, loss_fn(output, targets), and "
        f"returns the loss; {name} cannot be called so: {why}. Give a function of (output, "
        "targets) (e.g. lambda out, y: my_loss(out)), or loss_fn=None to use the model's own "
        "loss (out.loss, out['loss'] or a scalar output)"
    )


def _described(signature: inspect.Signature) -> str:
    positional = [
        p
        for p in signature.parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    ]
    bare = signature.replace(  # the names a reader matches against the call, no annotations
        parameters=[p.replace(annotation=p.empty) for p in signature.parameters.values()],
        return_annotation=signature.empty,
    )
    n = len(positional)
    return f"{n} required positional argument{'' if n == 1 else 's'} {bare}"


def check_shape(shape: object) -> torch.Size:
    """Return ``shape`` (an int or a sequence of ints) as a ``torch.Size`` of sizes >= 0."""
    if isinstance(shape, (str, bytes)):
        raise TypeError(f"sharedmem: shape must be a sequence of integers, got {shape!r}")
    if isinstance(shape, Sequence):
        dims = [_as_int(d, f"shape dimension {i} of {tuple(shape)!r}") for i, d in enumerate(shape)]
    else:
        try:
            dims = [_as_int(shape, "shape")]
        except TypeError:
            raise TypeError(
                "sharedmem: shape must be an integer or a sequence of integers, "
                f"got {type(shape).__name__} ({shape!r})"
            ) from None
    for i, d in enumerate(dims):
        if d < 0:
            raise ValueError(f"sharedmem: shape dimension {i} must be >= 0, got {tuple(dims)!r}")
    # In Python ints: torch.Size.numel() wraps around silently past int64.
    if math.prod(dims) > MAX_NBYTES:
        raise ValueError(
            f"sharedmem: shape {tuple(dims)!r} has {math.prod(dims):,} elements, more than the "
            f"{MAX_NBYTES:,} a buffer can hold"
        )
    return torch.Size(dims)


def check_blob_nbytes(shape: torch.Size, dtype: torch.dtype) -> int:
    """The bytes of a ``shape`` x ``dtype`` view, if a buffer can hold them."""
    return check_nbytes(shape.numel() * dtype.itemsize, f"a {tuple(shape)!r} {dtype} view")


def check_dtype(dtype: object) -> torch.dtype:
    """Return ``dtype`` if it is a torch dtype a byte buffer can hold."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(
            f"sharedmem: dtype must be a torch.dtype such as torch.float32, got {dtype!r}"
        )
    if dtype not in _SUPPORTED_DTYPES:
        raise ValueError(
            f"sharedmem: dtype {dtype} is not supported (quantized and sub-byte dtypes cannot be "
            "viewed from raw bytes); use a plain integer, float, complex or bool dtype"
        )
    return dtype


def check_name(name: object, what: str = "buffer name") -> str:
    """Return ``name`` if it is a non-empty string (buffer, phase and counter names)."""
    if not isinstance(name, str):
        raise TypeError(f"sharedmem: {what} must be a str, got {type(name).__name__}")
    if not name:
        raise ValueError(f"sharedmem: {what} must not be empty")
    return name


def check_byte_tensor(tensor: object, nbytes: int, what: str) -> torch.Tensor:
    """Return ``tensor`` if it is a 1-D ``uint8`` tensor of exactly ``nbytes`` elements."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"sharedmem: {what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype != torch.uint8 or tensor.dim() != 1 or tensor.numel() != nbytes:
        raise ValueError(
            f"sharedmem: {what} must be a 1-D torch.uint8 tensor of the memory's size "
            f"({nbytes:,} bytes), got {tensor.dtype} of shape {tuple(tensor.shape)}"
        )
    return tensor
