"""Trace a module into an ATen graph: the joint forward+backward, or the forward alone.

Tracing runs ``make_fx`` on fake tensors, so it computes nothing, draws no random numbers
and leaves the module's buffers as they were. Parameters, buffers and input tensors become
graph inputs; at run time the real ones are passed in, so in-place updates that the module
makes to its buffers (batch-norm running statistics, ``num_batches_tracked``) land on the
module itself, exactly as in eager mode, and random ops draw from the global generator in
eager order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    UnsupportedOperatorException,
)
from torch.fx import GraphModule
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from .._errors import SharedMemError

__all__ = ["Binding", "Leaves", "State", "flatten", "trace_forward", "trace_train"]

_DATA_DEPENDENT = (DataDependentOutputException, DynamicOutputShapeException)


@dataclass(frozen=True)
class Leaves:
    """A pytree of call arguments split into its tensors and a hashable description."""

    tensors: list[torch.Tensor]
    key: tuple[object, ...]
    spec: pytree.TreeSpec
    constants: tuple[object, ...]  # non-tensor leaves, None where a tensor goes

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> Any:
        it = iter(tensors)
        leaves = [next(it) if c is None else c for c in self.constants]
        return pytree.tree_unflatten(leaves, self.spec)


_LEAF = pytree.tree_flatten(0)[1]


def flatten(tree: object, what: str) -> Leaves:
    """Split ``tree`` into tensors and a key: shapes, strides, dtypes, devices, constants."""
    if type(tree) is torch.Tensor and not tree.requires_grad:  # the common case, made cheap
        meta = (tree.shape, tree.stride(), tree.dtype, tree.device)
        return Leaves([tree], (_LEAF, meta), _LEAF, (None,))
    leaves, spec = pytree.tree_flatten(tree)
    tensors: list[torch.Tensor] = []
    key: list[object] = [spec]
    constants: list[object] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            if leaf.requires_grad:
                raise ValueError(
                    f"sharedmem: {what} must not require grad: the pooled executor computes "
                    "parameter gradients only; pass them detached"
                )
            tensors.append(leaf)
            key.append((leaf.shape, leaf.stride(), leaf.dtype, leaf.device))
            constants.append(None)
        else:
            try:
                hash(leaf)
            except TypeError:
                raise TypeError(
                    f"sharedmem: {what} may hold tensors and hashable constants only, got a "
                    f"{type(leaf).__name__}"
                ) from None
            key.append((type(leaf), leaf))
            constants.append(leaf)
    return Leaves(tensors, tuple(key), spec, tuple(constants))


@dataclass(frozen=True)
class State:
    """A module's parameters and buffers, by name, as they are at this call."""

    param_names: tuple[str, ...]
    params: list[torch.Tensor]
    buffer_names: tuple[str, ...]
    buffers: list[torch.Tensor]
    key: tuple[object, ...]


class Binding:
    """Where a module keeps its parameters and buffers, found once and read cheaply per call.

    Walking ``named_parameters()`` on every call would cost more than a small model's step;
    the owning submodule and attribute of each tensor are found at the first call instead, so
    a parameter replaced later (``model.fc.weight = nn.Parameter(...)``) is still seen, but a
    submodule added later is not.
    """

    def __init__(self, model: nn.Module) -> None:
        self.modules = list(model.modules())
        self.param_names = tuple(n for n, _ in model.named_parameters())
        self.buffer_names = tuple(n for n, _ in model.named_buffers())
        self._params = [_owner(model, n) for n in self.param_names]
        self._buffers = [_owner(model, n) for n in self.buffer_names]

    def state(self) -> State:
        """The tensors as they are now, and a key of everything a trace fixes about them."""
        params = [_present(m._parameters.get(a), a) for m, a in self._params]
        buffers = [_present(m._buffers.get(a), a) for m, a in self._buffers]
        key = (
            tuple(m.training for m in self.modules),
            tuple((p.shape, p.dtype, p.device, p.requires_grad) for p in params),
            tuple((b.shape, b.dtype, b.device) for b in buffers),
        )
        return State(self.param_names, params, self.buffer_names, buffers, key)


def _present(tensor: torch.Tensor | None, name: str) -> torch.Tensor:
    if tensor is None:
        raise ValueError(
            f"sharedmem: the model's {name!r} was removed or set to None after the first call; "
            "make a new step for the changed model"
        )
    return tensor


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return model.get_submodule(path), attr


def trace_train(
    model: nn.Module,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    state: State,
    inputs: Leaves,
    targets: Leaves,
) -> GraphModule:
    """Trace ``loss, *grads = f(*params, *buffers, *inputs, *targets)``.

    One gradient per parameter (``None`` where the parameter does not require grad or does
    not reach the loss), as ``torch.autograd.grad`` returns them.
    """
    n_params, n_buffers, n_inputs = len(state.params), len(state.buffers), len(inputs.tensors)
    wants_grad = [p.requires_grad for p in state.params]

    def joint(*flat: torch.Tensor) -> list[torch.Tensor | None]:
        params = [
            p.detach().requires_grad_(True) if g else p.detach()
            for p, g in zip(flat[:n_params], wants_grad, strict=True)
        ]
        buffers = flat[n_params : n_params + n_buffers]
        data = flat[n_params + n_buffers :]
        with torch.enable_grad():
            out = _call(model, state, params, buffers, inputs.rebuild(data[:n_inputs]))
            loss = loss_fn(out, targets.rebuild(data[n_inputs:]))
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"sharedmem: loss_fn must return a tensor, got {type(loss).__name__}")
        wrt = [p for p, g in zip(params, wants_grad, strict=True) if g]
        grads = iter(torch.autograd.grad(loss, wrt, allow_unused=True))
        return [loss.detach(), *(next(grads) if g else None for g in wants_grad)]

    flat = [*state.params, *state.buffers, *inputs.tensors, *targets.tensors]
    return _trace(joint, flat, f"the train step of {type(model).__name__}")


def trace_forward(
    model: nn.Module, state: State, inputs: Leaves
) -> tuple[GraphModule, pytree.TreeSpec]:
    """Trace ``outputs = f(*params, *buffers, *inputs)`` without autograd; return the graph
    and the tree of the model's output (whose leaves are the graph's outputs)."""
    n_params, n_buffers = len(state.params), len(state.buffers)
    specs: list[pytree.TreeSpec] = []

    def forward(*flat: torch.Tensor) -> list[Any]:
        with torch.no_grad():
            out = _call(
                model,
                state,
                flat[:n_params],
                flat[n_params : n_params + n_buffers],
                inputs.rebuild(flat[n_params + n_buffers :]),
            )
        leaves, spec = pytree.tree_flatten(out)
        specs.append(spec)
        return leaves

    flat = [*(p.detach() for p in state.params), *state.buffers, *inputs.tensors]
    gm = _trace(forward, flat, f"the forward of {type(model).__name__}")
    return gm, specs[-1]


def _call(
    model: nn.Module,
    state: State,
    params: Sequence[torch.Tensor],
    buffers: Sequence[torch.Tensor],
    inputs: object,
) -> Any:
    tensors = dict(zip(state.param_names, params, strict=True))
    tensors.update(zip(state.buffer_names, buffers, strict=True))
    return torch.func.functional_call(model, tensors, (inputs,))


def _trace(fn: Callable[..., Any], flat: list[torch.Tensor], what: str) -> GraphModule:
    try:
        # Module attributes that are plain tensors (neither parameter nor buffer) are real
        # tensors inside the fake trace; they become constants of the graph.
        return make_fx(fn, tracing_mode="fake", _allow_non_fake_inputs=True)(*flat)
    except (SharedMemError, TypeError, ValueError):
        raise
    except _DATA_DEPENDENT as e:
        raise SharedMemError(
            f"sharedmem: {e.func} is not supported by the pooled executor: the shape or value "
            f"of its result depends on tensor data, which a trace cannot fix ({what})"
        ) from e
    except GuardOnDataDependentSymNode as e:
        raise SharedMemError(
            "sharedmem: aten._local_scalar_dense is not supported by the pooled executor: "
            "the model reads a tensor value into Python (.item(), float(t), if t: ...), which "
            f"a trace cannot fix ({what})"
        ) from e
    except UnsupportedOperatorException as e:
        raise SharedMemError(
            f"sharedmem: {e.func} is not supported by the pooled executor: it cannot be "
            f"traced with fake tensors ({what})"
        ) from e
    except Exception as e:
        first = (str(e).splitlines() or [""])[0]
        raise SharedMemError(
            f"sharedmem: could not trace {what}: {type(e).__name__}: {first}"
        ) from e
