"""Trace a module into an ATen graph: the joint forward+backward, or the forward alone.

Tracing runs ``make_fx`` on fake tensors, so it computes nothing, draws no random numbers
and leaves the module as it was (see ``binding.Swap``). Parameters, buffers, tensor
attributes and input tensors become graph inputs; at run time the real ones are passed in,
so in-place updates that the module makes to its buffers (batch-norm running statistics,
``num_batches_tracked``) land on the module itself, exactly as in eager mode, and random ops
draw from the global generator in eager order. Tensors the forward stores on the module
(``self.avg = ...``) become extra graph outputs, written back after each call.

``make_fx`` keeps global state while it traces, so traces run one at a time in a process.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
import torch.fx.proxy as fx_proxy
import torch.utils._pytree as pytree
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.fx import GraphModule
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import (
    SYMPY_INTERP,
    DimDynamic,
    GuardOnDataDependentSymNode,
    ShapeEnv,
    StatelessSymbolicContext,
)

from .._errors import SharedMemError, quiet_fake_tensor_failures
from .._validate import call_loss_fn
from .binding import Binding, Place, State, Swap
from .calling import call_model, plain_mapping
from .ops import in_grad_mode

__all__ = ["Leaves", "Traced", "flatten", "trace_forward", "trace_train"]

_DATA_DEPENDENT = (DataDependentOutputException, DynamicOutputShapeException)
_LOCK = threading.RLock()  # make_fx is not thread-safe; re-entrant for a trace in a trace
_TORCH = os.path.dirname(torch.__file__) + os.sep
_TORCH_NN = os.path.join(_TORCH, "nn") + os.sep


@dataclass(frozen=True)
class Leaves:
    """A pytree of call arguments split into its tensors and a hashable description."""

    tensors: list[torch.Tensor]
    key: tuple[object, ...]
    spec: pytree.TreeSpec
    constants: tuple[object, ...]  # non-tensor leaves, TENSOR where a tensor goes

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> Any:
        it = iter(tensors)
        leaves = [next(it) if c is TENSOR else c for c in self.constants]
        return pytree.tree_unflatten(leaves, self.spec)


class _TensorSlot:
    """Marks where a tensor goes among the constants (``None`` is a constant like any other:
    an absent mask, ``step(x, None)``)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "TENSOR"


TENSOR = _TensorSlot()


_LEAF = pytree.tree_flatten(0)[1]


def flatten(tree: object, what: str) -> Leaves:
    """Split ``tree`` into tensors and a key: shapes, strides, dtypes, devices, constants."""
    if type(tree) is torch.Tensor and not tree.requires_grad:  # the common case, made cheap
        meta = (tree.shape, tree.stride(), tree.dtype, tree.device)
        return Leaves([tree], (_LEAF, meta), _LEAF, (TENSOR,))
    leaves, spec = pytree.tree_flatten(plain_mapping(tree))
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
            constants.append(TENSOR)
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
class Traced:
    """A traced graph; its last ``len(stored)`` outputs are tensors the forward stored on the
    module, to be written back to those places after each call."""

    gm: GraphModule
    stored: tuple[Place, ...]
    spec: pytree.TreeSpec | None = None  # the model output's tree (forward graphs)
    # A graph traced with symbolic sizes (``dynamic``): whether it serves data tensors of
    # other sizes (its shape guards, evaluated on them); ``None`` for a graph of fixed sizes.
    serves: Callable[[Sequence[torch.Tensor]], bool] | None = None
    # And the bytes of every storage and numel-times-itemsize its values have, for data
    # tensors of another size (what a recorded allocation's size is matched against).
    sizes: Callable[[Sequence[torch.Tensor]], list[int]] | None = None


def trace_train(
    model: nn.Module,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    binding: Binding,
    state: State,
    inputs: Leaves,
    targets: Leaves,
    dynamic: Sequence[frozenset[int]] | None = None,
) -> Traced:
    """Trace ``loss, *grads, *stored = f(*params, *buffers, *inputs, *targets)``.

    One gradient per parameter (``None`` where the parameter does not require grad or does
    not reach the loss), as ``torch.autograd.grad`` returns them. ``loss_fn`` runs with the
    traced parameters in place too, so a loss that reads them (a weight penalty) is traced.
    ``dynamic``: per input and target tensor, the dimensions traced as symbols (see
    ``_symbolic``); the graph then computes every size from its inputs' sizes.
    """
    n_params, n_buffers, n_inputs = len(state.params), len(state.buffers), len(inputs.tensors)
    wants_grad = [p.requires_grad for p in state.params]
    stored: list[tuple[Place, ...]] = []

    def joint(*flat: torch.Tensor) -> list[torch.Tensor | None]:
        params = [
            p.detach().requires_grad_(True) if g else p.detach()
            for p, g in zip(flat[:n_params], wants_grad, strict=True)
        ]
        buffers = flat[n_params : n_params + n_buffers]
        data = flat[n_params + n_buffers :]
        with Swap(binding, [*params, *buffers]) as swap, torch.enable_grad():
            out = call_model(model, inputs.rebuild(data[:n_inputs]))
            loss = call_loss_fn(loss_fn, out, targets.rebuild(data[n_inputs:]))
            found = swap.stored()
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"sharedmem: loss_fn must return a tensor, got {type(loss).__name__}")
        wrt = [p for p, g in zip(params, wants_grad, strict=True) if g]
        grads = iter(torch.autograd.grad(loss, wrt, allow_unused=True))
        stored.append(tuple(place for place, _ in found))
        return [
            loss.detach(),
            *(next(grads) if g else None for g in wants_grad),
            *(value.detach() for _, value in found),
        ]

    # Detached: a parameter's .grad is no part of the trace, and a gradient that a cast
    # (model.double()) changed in place confuses the fake copy of a parameter holding it.
    flat = [
        *(p.detach() for p in state.params),
        *_detached(state.buffers),
        *inputs.tensors,
        *targets.tensors,
    ]
    what = f"the train step of {type(model).__name__}"
    given = f"the inputs ({_shapes(inputs)}) and targets ({_shapes(targets)})"
    if dynamic is None:
        return Traced(_grad_mode_ops(_trace(joint, flat, what, binding, given)), stored[-1])
    gm, serves, sizes = _symbolic(joint, flat, dynamic, what, binding, given)
    return Traced(_grad_mode_ops(gm), stored[-1], serves=serves, sizes=sizes)


def trace_forward(model: nn.Module, binding: Binding, state: State, inputs: Leaves) -> Traced:
    """Trace ``*outputs, *stored = f(*params, *buffers, *inputs)`` without autograd, where
    ``outputs`` are the leaves of the model's output (its tree is ``Traced.spec``)."""
    n_params, n_buffers = len(state.params), len(state.buffers)
    specs: list[tuple[pytree.TreeSpec, tuple[Place, ...]]] = []

    def forward(*flat: torch.Tensor) -> list[Any]:
        with Swap(binding, flat[: n_params + n_buffers]) as swap, torch.no_grad():
            out = call_model(model, inputs.rebuild(flat[n_params + n_buffers :]))
            found = swap.stored()
        leaves, spec = pytree.tree_flatten(out)
        _check_outputs(model, leaves)
        specs.append((spec, tuple(place for place, _ in found)))
        return [*leaves, *(value for _, value in found)]

    # Parameters keep their requires_grad flag, as in an eager forward under no_grad: ATen's
    # kernel choices read it (matmul folds a batched input into one mm only where the weight
    # requires grad), and eager's kernel is what gives eager's bits.
    flat = [
        *(p.detach().requires_grad_(p.requires_grad) for p in state.params),
        *_detached(state.buffers),
        *inputs.tensors,
    ]
    given = f"the inputs ({_shapes(inputs)})"
    gm = _trace(forward, flat, f"the forward of {type(model).__name__}", binding, given)
    spec, places = specs[-1]
    return Traced(gm, places, spec)


_CONSTANTS = (type(None), bool, int, float, str)


def _check_outputs(model: nn.Module, leaves: list[Any]) -> None:
    """Refuse, before anything runs, an output a graph cannot return: only tensors and plain
    constants come out of one (a key/value cache object does not)."""
    for leaf in leaves:
        if isinstance(leaf, (torch.Tensor, *_CONSTANTS)):
            continue
        kind = type(leaf).__name__
        fix = "return tensors (and plain constants) only"
        if "cache" in kind.lower() or "cache" in type(leaf).__module__:
            fix = (
                "it is a key/value cache: pass use_cache=False with the inputs (or set "
                "model.config.use_cache = False) to evaluate without one"
            )
        raise TypeError(
            f"sharedmem: {type(model).__name__} returns a {kind}, which a pooled forward "
            f"cannot return; {fix}"
        )


def _detached(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    # A tensor attribute may be a non-leaf that requires grad (old-style weight_norm keeps
    # its last computed weight there); the graph takes it as data, as it does buffers.
    return [t.detach() if t.requires_grad else t for t in tensors]


def _symbolic(
    fn: Callable[..., Any],
    flat: list[torch.Tensor],
    dynamic: Sequence[frozenset[int]],
    what: str,
    binding: Binding,
    given: str,
) -> tuple[
    GraphModule,
    Callable[[Sequence[torch.Tensor]], bool],
    Callable[[Sequence[torch.Tensor]], list[int]],
]:
    """Trace ``fn`` with the dimensions ``dynamic`` of its last ``len(dynamic)`` inputs as
    symbols (as Dynamo traces a dimension it marked dynamic), the others fixed.

    Returns the graph, whose nodes compute every size from the inputs' (``sym_size`` and
    integer arithmetic), and its shape guards as a function of data tensors: whatever the
    trace assumed about the symbols (a branch on a length, a contiguous layout), true for
    them. The graph's values (``meta["val"]``) are then made concrete again at the traced
    call's sizes, so planning and recomputation see one concrete instance of it; that
    instance's decisions are valid at every size (they change where values live and what
    is computed twice, not what is computed).
    """
    from torch._dynamo.source import LocalSource  # imported by tracing anyway (_tracing_ready)
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    first = len(flat) - len(dynamic)
    mode = FakeTensorMode(
        allow_non_fake_inputs=True, shape_env=ShapeEnv(duck_shape=False, specialize_zero_one=True)
    )
    fixed = [mode.from_tensor(t, static_shapes=True) for t in flat[:first]]
    data = [
        mode.from_tensor(
            t,
            source=LocalSource(f"t{k}"),
            symbolic_context=StatelessSymbolicContext(
                dynamic_sizes=[
                    DimDynamic.DYNAMIC if d in dims else DimDynamic.STATIC for d in range(t.dim())
                ]
            ),
        )
        for k, (t, dims) in enumerate(zip(flat[first:], dynamic, strict=True))
    ]
    # "fake", not "symbolic": make_fx's symbolic mode turns on PyTorch's python dispatcher,
    # which runs composite ops through Python decompositions (dropout as native_dropout, an
    # LSTM unrolled): the fake mode of symbolic inputs traces the C++ kernels eager runs.
    gm = _trace(fn, [*fixed, *data], what, binding, given)
    shape_env = mode.shape_env
    assert shape_env is not None
    code = shape_env.produce_guards_expression(data)
    # Compiled once (``ShapeEnv.evaluate_guards_expression`` compiles the text at every
    # call): every new size of the family evaluates it.
    guards = None if code is None else compile(code, "<sharedmem shape guards>", "eval")

    def serves(tensors: Sequence[torch.Tensor]) -> bool:
        if guards is None:
            return True
        return bool(eval(guards, SYMPY_INTERP, {"L": {f"t{k}": t for k, t in enumerate(tensors)}}))

    exprs = list(dict.fromkeys(_byte_sizes(gm)))
    # Every new size of the family evaluates these: as one compiled Python function (a
    # few microseconds), not sympy's substitution (milliseconds per size).
    fast = _compiled_sizes(exprs, shape_env.bind_symbols(data, flat[first:]))

    def sizes(tensors: Sequence[torch.Tensor]) -> list[int]:
        values = shape_env.bind_symbols(data, tensors)
        if fast is not None:
            found = fast(values)
            if found is not None:
                return found
        return _substituted(exprs, values)

    concrete = FakeTensorMode(allow_non_fake_inputs=True)
    with _LOCK:
        FakeTensorProp(gm, concrete).propagate(*(concrete.from_tensor(t) for t in flat))
    return gm, serves, sizes


def _substituted(exprs: Sequence[Any], values: dict[Any, Any]) -> list[int]:
    """``exprs`` (ints and sympy expressions) at the symbols' ``values``; ``-1`` for one
    with a symbol ``values`` leaves unbound."""
    found = []
    for e in exprs:
        try:
            found.append(e if isinstance(e, int) else int(e.xreplace(values)))
        except TypeError:  # a symbol the inputs do not bind
            found.append(-1)
    return found


def _compiled_sizes(
    exprs: Sequence[Any], hints: dict[Any, Any]
) -> Callable[[dict[Any, Any]], list[int] | None] | None:
    """``exprs`` as one Python function of the symbols' values (``None`` where they do not
    print as Python, or where the function disagrees with sympy at the traced sizes,
    ``hints``); the function returns ``None`` where a symbol is unbound."""
    from torch.utils._sympy.printers import PythonPrinter

    symbols = sorted({s for e in exprs if not isinstance(e, int) for s in e.free_symbols}, key=str)
    names = [str(s) for s in symbols]
    if not all(n.isidentifier() for n in names) or len(set(names)) != len(names):
        return None
    printer = PythonPrinter()
    try:
        body = ", ".join(str(e) if isinstance(e, int) else f"({printer.doprint(e)})" for e in exprs)
        scope = {"__builtins__": {}, "math": math, "max": max, "min": min, "abs": abs}
        code = eval(f"lambda {', '.join(names)}: [{body}]", scope)
    except Exception:  # an expression PythonPrinter cannot write
        return None

    def evaluate(values: dict[Any, Any]) -> list[int] | None:
        try:
            found = code(*(int(values[s]) for s in symbols))
        except KeyError:  # a symbol the inputs do not bind
            return None
        return found if all(type(v) is int for v in found) else None

    try:
        if not symbols or any(s not in hints for s in symbols):
            return None
        if evaluate(hints) != _substituted(exprs, hints):
            return None
    except Exception:  # evaluation failed at the traced sizes: the slow path serves
        return None
    return evaluate


def _byte_sizes(gm: GraphModule) -> Iterator[Any]:
    """The bytes of each value's storage, and its elements times each itemsize, as sympy
    expressions of the symbolic sizes (what the allocations of a call are)."""
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        for v in val if isinstance(val, (list, tuple)) else [val]:
            if isinstance(v, torch.Tensor):
                numel = v.numel()
                for n in (v.untyped_storage().nbytes(), *(numel * k for k in (1, 2, 4, 8))):
                    yield n.node.expr if isinstance(n, torch.SymInt) else int(n)


class _WalkedStack:
    """Stands in for ``torch.utils._traceback.CapturedTraceback`` where torch.fx's tracer
    takes each node's stack (``torch.fx.proxy``): the same frames, read from Python's frame
    objects instead of captured and symbolized whole. That tracer keeps, of a node's stack,
    the frames of functions named ``forward`` and of its registered anchors
    (``_record_forward_stack_traces_only``, as ``make_fx`` sets it): only those are read, so a
    node costs a walk up its stack, not the symbolizing of every frame of it, which under a
    deep stack (a test runner's, a training loop's) was a quarter of tracing time. Any other
    tracer gets every frame, as it would have."""

    def __init__(self, frame: FrameType | None, only_forward: bool) -> None:
        self._frame = frame
        self._only_forward = only_forward

    @classmethod
    def extract(cls, **_: Any) -> _WalkedStack:
        caller = sys._getframe(1)  # the tracer's create_node
        tracer = caller.f_locals.get("self")
        return cls(caller, bool(getattr(tracer, "_record_forward_stack_traces_only", False)))

    def summary(self) -> traceback.StackSummary:
        # A torch without registered anchors (2.11 and older) filters the frames its own
        # way: give it every frame and let it choose.
        anchors = getattr(fx_proxy, "_STACK_TRACE_ANCHORS", None)
        frames = []
        frame = self._frame
        while frame is not None:
            code = frame.f_code
            if (
                not self._only_forward
                or anchors is None
                or code.co_name == "forward"
                or code.co_filename.endswith("torch/__init__.py")
                or (code.co_filename, code.co_name) in anchors
            ):
                frames.append(
                    traceback.FrameSummary(
                        code.co_filename, frame.f_lineno, code.co_name, lookup_line=False
                    )
                )
            frame = frame.f_back
        frames.reverse()  # outermost first, as a traceback lists them
        return traceback.StackSummary.from_list(frames)


@contextlib.contextmanager
def _frames_walked() -> Iterator[None]:
    """Node stacks taken by ``_WalkedStack`` while this traces (under ``_LOCK``)."""
    names = vars(fx_proxy)
    captured = names.get("CapturedTraceback")
    if captured is None:  # a torch that takes node stacks otherwise: its own way
        yield
        return
    names["CapturedTraceback"] = _WalkedStack
    try:
        yield
    finally:
        names["CapturedTraceback"] = captured


def _trace(
    fn: Callable[..., Any],
    flat: list[torch.Tensor],
    what: str,
    binding: Binding,
    given: str,
) -> GraphModule:
    try:
        # Errors said below in one line, not torch's 25. Module attributes that are plain
        # tensors reached only through containers (lists, dicts) are real tensors inside the
        # fake trace: graph constants. Stack traces let errors found in the graph name the
        # model's source line (_WalkedStack: the frames they keep, without symbolizing the
        # whole stack).
        with _LOCK, quiet_fake_tensor_failures(), _frames_walked():
            gm = make_fx(
                fn, tracing_mode="fake", _allow_non_fake_inputs=True, record_stack_traces=True
            )(*flat)
    except SharedMemError:
        raise
    except (TypeError, ValueError) as e:
        # The model's own argument checks (its code, torch.nn's) raise as they would in
        # eager; the same errors raised inside the tracing machinery are not the caller's.
        if str(e).startswith("sharedmem:") or not _raised_inside_torch(e):
            raise
        raise SharedMemError(f"sharedmem: could not trace {what}: {_first_line(e)}") from e
    except _DATA_DEPENDENT as e:
        raise SharedMemError(
            f"sharedmem: {e.func} is not supported by the pooled executor: the shape or value "
            f"of its result depends on tensor data, which a trace cannot fix "
            f"({what}{_culprit(e, binding)})"
        ) from e
    except GuardOnDataDependentSymNode as e:
        raise SharedMemError(
            "sharedmem: aten._local_scalar_dense is not supported by the pooled executor: "
            "the model or loss reads a tensor value into Python (.item(), float(t), if t: "
            f"...), which a trace cannot fix ({what}{_culprit(e, binding)}){_hint(e, binding)}"
        ) from e
    except UnsupportedOperatorException as e:
        raise SharedMemError(
            f"sharedmem: {e.func} is not supported by the pooled executor: it cannot be "
            f"traced with fake tensors ({what}{_culprit(e, binding)})"
        ) from e
    except Exception as e:
        # An op that refuses its operands (a width the model does not take) fails as it would
        # in eager: say where, and what was given.
        fix = ""
        if type(e) is RuntimeError:
            fix = f". Eager PyTorch fails there too: check {given} against the model"
        raise SharedMemError(
            f"sharedmem: could not trace {what}: {_first_line(e).rstrip('.')}"
            f"{_culprit(e, binding)}{fix}"
        ) from e
    return gm


def _shapes(leaves: Leaves) -> str:
    """``'4x8 float32, 4 int64'``: the tensors of a call's arguments, as a message names them."""
    return (
        ", ".join(
            f"{'x'.join(map(str, t.shape)) or 'scalar'} {str(t.dtype).removeprefix('torch.')}"
            for t in leaves.tensors
        )
        or "no tensors"
    )


def _grad_mode_ops(gm: GraphModule) -> GraphModule:
    """Make the ops whose kernels read grad mode run with it on, as they were traced in the
    train step (see ``ops.in_grad_mode``); a forward traced without grad keeps them as they
    are, since they choose their inference kernels there, as in eager."""
    changed = False
    for node in gm.graph.nodes:
        if node.op == "call_function" and (op := in_grad_mode(node.target)) is not None:
            node.target = op
            changed = True
    if changed:
        gm.recompile()
    return gm


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"


def _internal(filename: str) -> bool:
    # torch's own machinery (fx, fake tensors, dispatch), as opposed to model code and the
    # torch.nn modules and functions a model is written with.
    return filename.startswith(_TORCH) and not filename.startswith(_TORCH_NN)


def _frames(e: BaseException) -> Iterator[tuple[FrameType, int]]:
    """The frames an error passed through, outermost first, with their line numbers."""
    tb = e.__traceback__
    while tb is not None:
        yield tb.tb_frame, tb.tb_lineno
        tb = tb.tb_next


def _raised_inside_torch(e: BaseException) -> bool:
    frames = [frame for frame, _ in _frames(e)]
    return not frames or _internal(frames[-1].f_code.co_filename)


def _modules_in(e: BaseException, binding: Binding) -> list[tuple[str, nn.Module]]:
    """The submodules whose code an error passed through, outermost first."""
    paths = {id(m): path for path, m in binding.unique}
    found = []
    for frame, _ in _frames(e):
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in paths:
            found.append((paths[id(owner)], owner))
    return found


def _culprit(e: BaseException, binding: Binding) -> str:
    """Where in the model (or loss) an error was raised: '; in BatchNorm1d '1' (forward, at
    torch/nn/modules/batchnorm.py:193)'."""
    code = [(f, n) for f, n in _frames(e) if not _internal(f.f_code.co_filename)]
    modules = _modules_in(e, binding)
    parts = []
    if modules:
        path, module = modules[-1]
        parts.append(f"{type(module).__name__} {path!r}" if path else "the model itself")
    if code:
        frame, line = code[-1]
        filename = frame.f_code.co_filename
        short = "torch/" + filename[len(_TORCH) :] if filename.startswith(_TORCH) else filename
        parts.append(f"{frame.f_code.co_name}, at {short}:{line}")
    if not parts:
        return ""
    return "; in " + parts[0] + (f" ({parts[1]})" if len(parts) > 1 else "")


def _hint(e: BaseException, binding: Binding) -> str:
    modules = _modules_in(e, binding)
    module = modules[-1][1] if modules else None
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.momentum is None:
        return (
            ". BatchNorm with momentum=None (a cumulative average) reads num_batches_tracked "
            "into Python on every training call: give it a momentum (0.1 is the default) to "
            "use the pooled executor"
        )
    return (
        ". Compute that value before the call and pass it in, or compute without reading "
        "tensor values into Python"
    )
