"""How each ATen op of a traced graph runs: into pool buffers, as a view, or allocating.

An op is pooled only where that costs nothing extra: through an ``out=`` overload that the
backend implements itself, or, for factories and copies, by filling a pool view directly.
Many ``out=`` overloads (``convolution.out``, ``convolution_backward.out`` ...) are generated
wrappers that compute the functional result and copy it into ``out``; they would allocate
anyway and add a copy, so such ops run as they are and their results count as unpooled bytes.
"""

from __future__ import annotations

import enum
import functools
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch._ops import OpOverload

__all__ = [
    "EMPTY_FACTORIES",
    "Adapt",
    "Kind",
    "OpRule",
    "fill_value",
    "in_grad_mode",
    "library",
    "rule_for",
]

aten = torch.ops.aten


class Kind(enum.Enum):
    """What the executor does with one op."""

    ALIAS = "alias"  # views and in-place ops: run as they are, nothing is allocated
    OUT = "out"  # fresh results written into pool buffers through a native out= overload
    EMPTY = "empty"  # uninitialised factories: the pool view itself is the result
    FILL = "fill"  # constant factories: the pool view, filled with the constant
    COPY = "copy"  # clone / _to_copy on one device: the pool view, copied into
    PLAIN = "plain"  # no native out= form: runs as it is and allocates (counted as unpooled)


@dataclass(frozen=True)
class OpRule:
    """The resolved way to run one op on one device type.

    Attributes:
        kind: what the executor does with it.
        out_op: the ``out=`` overload (``Kind.OUT`` only).
        out_names: the keyword names of its out arguments, one per result, in order.
        adapt: for an op rewritten to another op's ``out=`` overload, turns the traced
            arguments into that op's arguments (``None`` where they do not fit the rewrite).
    """

    kind: Kind
    out_op: OpOverload | None = None
    out_names: tuple[str, ...] = ()
    adapt: Adapt | None = None


# Factories whose result is uninitialised memory: a pool view is exactly as good.
EMPTY_FACTORIES: frozenset[OpOverload] = frozenset(
    {
        aten.empty.memory_format,
        aten.empty_like.default,
        aten.empty_strided.default,
        aten.new_empty.default,
        aten.new_empty_strided.default,
    }
)

_Args = Sequence[object]
_Kwargs = Mapping[str, object]
Adapt = Callable[[_Args, _Kwargs], "tuple[list[object], dict[str, object]] | None"]

# Factories of one constant, with where the constant sits in their arguments. Their out=
# overloads take no dtype or device, so they could never be matched by signature below.
_FILL: dict[OpOverload, Callable[[_Args, _Kwargs], object]] = {
    aten.zeros.default: lambda a, k: 0,
    aten.zeros_like.default: lambda a, k: 0,
    aten.new_zeros.default: lambda a, k: 0,
    aten.ones.default: lambda a, k: 1,
    aten.ones_like.default: lambda a, k: 1,
    aten.new_ones.default: lambda a, k: 1,
    aten.full.default: lambda a, k: a[1] if len(a) > 1 else k["fill_value"],
    aten.full_like.default: lambda a, k: a[1] if len(a) > 1 else k["fill_value"],
    aten.new_full.default: lambda a, k: a[2] if len(a) > 2 else k["fill_value"],
    aten.scalar_tensor.default: lambda a, k: a[0] if a else k["s"],
}

# Copies of their first argument (dtype conversion included: copy_ converts exactly as the
# functional kernels do, since they are written with copy_ themselves).
_COPY: frozenset[OpOverload] = frozenset({aten.clone.default, aten._to_copy.default})

# Ops whose schema claims a fresh result although the kernel returns a view of the input.
_UNANNOTATED_VIEWS: frozenset[OpOverload] = frozenset({aten._unsafe_view.default})


def _positional(n: int, extra: Callable[[_Args], list[object]]) -> Adapt:
    # Rewrites below take the traced arguments positionally; a call with keywords or omitted
    # defaults simply stays unpooled rather than risk a wrong argument.
    def adapt(args: _Args, kwargs: _Kwargs) -> tuple[list[object], dict[str, object]] | None:
        return (extra(args), {}) if len(args) == n and not kwargs else None

    return adapt


# Ops whose own out= form is a generated wrapper, but whose kernel is, by definition in ATen,
# another op that has a native out= form. The rewrite runs the very kernel eager runs.
_REWRITES: dict[OpOverload, tuple[OpOverload, Adapt]] = {
    # relu(x) is clamp_min(x, 0) on CPU and CUDA (aten/src/ATen/native/Activation.cpp).
    aten.relu.default: (aten.clamp_min.out, _positional(1, lambda a: [a[0], 0])),
    # sum(x) is sum(x, [], keepdim=False) (ReduceOps.cpp).
    aten.sum.default: (aten.sum.IntList_out, _positional(1, lambda a: [a[0], [], False])),
    # The eval-mode batch norm is _native_batch_norm_legit(..., training=False, ...).
    aten._native_batch_norm_legit_no_training.default: (
        aten._native_batch_norm_legit.out,
        _positional(7, lambda a: [*a[:5], False, *a[5:]]),
    ),
    # _adaptive_avg_pool2d and adaptive_avg_pool2d.out share one CPU and CUDA template.
    aten._adaptive_avg_pool2d.default: (
        aten.adaptive_avg_pool2d.out,
        _positional(2, lambda a: list(a)),
    ),
}


def _unreduced(position: int) -> Adapt:
    # These losses' out= kernels use a reduced (0-dim) ``out`` as scratch: they resize it to
    # the input's shape while they work, writing past the buffer (huber, soft margin, BCE) or,
    # where a pool view's storage is exactly the buffer (the pageable backend), reallocating
    # the pool's memory behind its back. Unreduced (reduction=0) they write just ``out``.
    def adapt(args: _Args, kwargs: _Kwargs) -> tuple[list[object], dict[str, object]] | None:
        reduction = args[position] if len(args) > position else kwargs.get("reduction", 1)
        return (list(args), dict(kwargs)) if reduction == 0 else None

    return adapt


_SCRATCH_OUT: dict[OpOverload, Adapt] = {
    aten.mse_loss.default: _unreduced(2),
    aten.smooth_l1_loss.default: _unreduced(2),
    aten.huber_loss.default: _unreduced(2),
    aten.soft_margin_loss.default: _unreduced(2),
    aten.binary_cross_entropy.default: _unreduced(3),
}


# Ops whose kernel reads autograd's grad mode, which the executor runs with off: mkldnn's RNN
# layer (every CPU nn.LSTM/nn.GRU step in float32) returns the workspace its backward reads
# only while grad mode is on, and an undefined tensor otherwise.
_GRAD_MODE: frozenset[OpOverload] = frozenset({aten.mkldnn_rnn_layer.default})
_LIBRARY: list[torch.library.Library] = []  # kept alive: an op lives as long as its library


def in_grad_mode(op: object) -> OpOverload | None:
    """The op that runs ``op`` with grad mode on, or ``None`` where ``op`` does not read it.

    It is an op of its own (``sharedmem::grad_mode_<name>``) with ``op``'s schema, so a graph
    keeps its node as it was traced and the executor runs it as any op without an ``out=``
    form; it records no autograd graph (its inputs do not require grad). Fake tensors pass
    through it to ``op``'s own fake kernel.
    """
    return _grad_mode_op(op) if op in _GRAD_MODE else None


def library() -> torch.library.Library:
    """The ``sharedmem`` op namespace, where the executor defines the ops it adds to graphs."""
    if not _LIBRARY:
        _LIBRARY.append(torch.library.Library("sharedmem", "FRAGMENT"))  # type: ignore[no-untyped-call]
    return _LIBRARY[0]


@functools.cache
def _grad_mode_op(op: OpOverload) -> OpOverload:
    namespace = library()
    base = op._schema.name.split("::")[-1]
    name = f"grad_mode_{base}"
    namespace.define(name + str(op._schema).split("::", 1)[1].removeprefix(base))  # type: ignore[no-untyped-call]

    def run(*args: object, **kwargs: object) -> object:
        with torch.enable_grad():
            return op(*args, **kwargs)

    namespace.impl(name, run, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]
    found: OpOverload = getattr(torch.ops.sharedmem, name).default
    return found


def fill_value(op: OpOverload, args: _Args, kwargs: _Kwargs) -> object:
    """The constant a ``Kind.FILL`` factory fills its result with."""
    return _FILL[op](args, kwargs)


@functools.cache
def rule_for(op: OpOverload, device_type: str) -> OpRule:
    """How ``op`` runs in the executor on ``device_type`` (``"cpu"`` or ``"cuda"``)."""
    if op in EMPTY_FACTORIES:
        return OpRule(Kind.EMPTY)
    if op in _FILL:
        return OpRule(Kind.FILL)
    if op in _COPY:
        return OpRule(Kind.COPY)
    schema = op._schema
    if op in _UNANNOTATED_VIEWS or any(r.alias_info is not None for r in schema.returns):
        return OpRule(Kind.ALIAS)
    if op in _REWRITES:
        out_op, adapt = _REWRITES[op]
        if _is_native(out_op, device_type):
            names = tuple(a.name for a in out_op._schema.arguments if a.is_out)
            return OpRule(Kind.OUT, out_op, names, adapt)
    found = _native_out_overload(op, device_type)
    if found is None:
        return OpRule(Kind.PLAIN)
    out_op, names = found
    return OpRule(Kind.OUT, out_op, names, _SCRATCH_OUT.get(op))


def _signature(arguments: Sequence[Any]) -> list[tuple[str, str]]:
    return [(a.name, str(a.type)) for a in arguments]


def _native_out_overload(
    op: OpOverload, device_type: str
) -> tuple[OpOverload, tuple[str, ...]] | None:
    # The out= overload takes the functional's arguments unchanged plus one Tensor out
    # argument per result (mm -> mm.out, threshold_backward -> threshold_backward.grad_input,
    # max_pool2d_with_indices -> .out(..., out, indices)).
    returns = op._schema.returns
    if not returns or any(str(r.type) != "Tensor" for r in returns):
        return None
    wanted = _signature(op._schema.arguments)
    packet = op.overloadpacket
    for overload in packet.overloads():
        candidate: OpOverload = getattr(packet, overload)
        arguments = candidate._schema.arguments
        outs = [a for a in arguments if a.is_out]
        if len(outs) != len(returns) or any(str(a.type) != "Tensor" for a in outs):
            continue
        if _signature([a for a in arguments if not a.is_out]) != wanted:
            continue
        if not _is_native(candidate, device_type):
            return None
        return candidate, tuple(a.name for a in outs)
    return None


def _is_native(op: OpOverload, device_type: str) -> bool:
    # A generated ("autogen") out= kernel runs the functional op and copies into out; it is
    # registered as CompositeExplicitAutograd, like a few real composites of other out= ops
    # (stack.out is cat.out). Real ones are registered for the backend itself.
    name: str = op.name()  # type: ignore[no-untyped-call]
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    if has(name, device_type.upper()) or has(name, "CompositeImplicitAutograd"):
        return True
    return has(name, "CompositeExplicitAutograd") and bool(_autogen()) and name not in _autogen()


@functools.cache
def _autogen() -> frozenset[str]:
    """The generated out= overloads, as listed in ATen's native_functions.yaml (empty when
    torchgen is missing: then every composite out= counts as generated, which is safe)."""
    try:
        import torchgen  # type: ignore[import-untyped]

        path = torchgen.__path__[0] + "/packaged/ATen/native/native_functions.yaml"
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (ImportError, OSError):
        return frozenset()
    names = re.findall(r"^\s*autogen:\s*(.+)$", text, flags=re.MULTILINE)
    return frozenset(f"aten::{n.strip()}" for line in names for n in line.split(","))
