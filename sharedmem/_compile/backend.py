"""A ``torch.compile`` backend whose graphs are served from a pool: capture on PyTorch's
frontend, the pool as the backend.

Dynamo captures the user's code as FX graphs and keeps them valid: it guards every Python
value, module attribute, hook, grad mode and shape a graph depends on (a change recompiles),
replays side effects on real tensors (a hook that stores an activation gets a real one), and
marks a dimension that changes dynamic. AOTAutograd turns each graph into a forward and a
backward graph of ATen ops (or one inference graph where autograd is off), split where the
partition function says. This backend runs those ATen graphs as they are, op by op on
PyTorch's kernels (no code generation, no decomposition: the same kernels eager runs, so the
same bits), and serves each graph call's allocations from one arena of the pool through the
routing allocator, as ``pool.step()`` serves a block: the first call of a graph's signature
(its arguments' shapes, strides, dtypes, whether autograd is on) is recorded, planned at
offsets of the arena, and later calls replay the plan. Each graph (forward, backward,
inference, of every graph Dynamo makes) has routes of its own; all share the arena's bytes,
since no two graph calls of one thread overlap.

What a graph call returns outlives it and stays PyTorch's: the forward's outputs and the
activations it saves for the backward, the backward's gradients. The arena serves what dies
inside a call: the forward's temporaries, the backward's intermediate gradients and scratch.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch.fx import GraphModule

from .._executor.policy import Recompute
from .._pool import BufferPool
from .._routing import Route, routes_on
from .._validate import check_name
from . import compiling

__all__ = ["PARTITIONS", "SPANS", "PoolBackend", "PooledGraph", "StepSpans", "compile_backend"]

# The partition functions by name: ``min_cut`` is what ``torch.compile`` uses (it recomputes
# cheap ops in the backward where that saves memory), ``default`` saves what the forward
# computed that the backward reads, as eager autograd does.
PARTITIONS = ("min_cut", "default")
Partition = Literal["min_cut", "default"]
# What one plan spans: a whole training step (its forward graphs, the user's code up to
# the backward, its backward graphs), or each graph call on its own.
SPANS = ("step", "graph")
Span = Literal["step", "graph"]

# The most signatures each graph keeps routes for (least recently used dropped): with
# ``dynamic=True`` one graph serves every length, each length a signature of its own.
ROUTES_PER_GRAPH = 64

_Kind = Literal["forward", "backward", "inference"]


def _signature(args: Sequence[object]) -> tuple[object, ...]:
    """What fixes a graph call's allocation sequence: each tensor argument's shape, strides,
    dtype and ``requires_grad``, each other argument's value (a symbolic size is an int
    here), and whether autograd is on."""
    key: list[object] = [torch.is_grad_enabled()]
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((tuple(a.shape), a.stride(), a.dtype, a.requires_grad))
        elif isinstance(a, (int, float, bool)) or a is None:
            key.append(a)
        else:
            key.append(type(a).__name__)
    return tuple(key)


class PooledGraph:
    """One ATen graph of a compiled region, run with boxed arguments (each freed as soon as
    the graph is done with it), its calls served from the pool's arena.

    Args:
        pool: the pool whose arena serves the graph's allocations.
        arena: the arena's buffer name.
        label: the graph's name in reports (``"<backend>.<n>.<kind>"``).
        kind: ``"forward"``, ``"backward"`` or ``"inference"``.
        gm: the graph.
        steps: where a training step's graphs share one span (``span="step"``): the
            forward opens it, the end of the backward pass closes it.
    """

    def __init__(
        self,
        pool: BufferPool,
        arena: str,
        label: str,
        kind: _Kind,
        gm: GraphModule,
        steps: StepSpans | None = None,
    ) -> None:
        from torch.fx.graph import _BoxedCodeGen

        gm.graph.set_codegen(_BoxedCodeGen())
        gm.recompile()
        # AOTAutograd passes the arguments as one list the graph clears as they die; an
        # instance attribute, since Dynamo's wrappers copy ``__dict__``, not the class's.
        self._boxed_call = True
        self.label = label
        self.kind = kind
        self.graph = gm
        self._run: Callable[[list[Any]], Any] = gm.forward
        self._pool = pool
        self._arena = arena
        self._steps = steps
        self._routes: OrderedDict[tuple[object, ...], Route] = OrderedDict()
        self._lock = threading.Lock()
        self.calls = 0

    def __call__(self, args: list[Any]) -> Any:
        self.calls += 1
        steps = self._steps
        if steps is not None and self.kind == "forward":
            steps.forward(self, args)
            return self._run(args)
        if steps is not None and self.kind == "backward":
            steps.backward()
            return self._run(args)
        route = self.route(_signature(args))
        with route.scope():
            return self._run(args)

    def route(self, key: tuple[object, ...]) -> Route:
        """The route of the signature ``key`` (made on its first call)."""
        with self._lock:
            route = self._routes.get(key)
            if route is None:
                training = self.kind != "inference"
                route = self._routes[key] = Route(self._pool, self._arena, training=training)
                while len(self._routes) > ROUTES_PER_GRAPH:
                    self._routes.popitem(last=False)
            else:
                self._routes.move_to_end(key)
            return route

    def routes(self) -> list[Route]:
        """The routes kept now, least recently used first."""
        with self._lock:
            return list(self._routes.values())


class StepSpans:
    """One routed span per training step, per thread: opened by the step's first forward
    graph call, closed when the backward pass that runs its backward graphs ends (the
    autograd engine's end-of-pass callback), so the plan sees the whole step, the user's code
    between forward and backward included, as ``pool.step()`` around it would.

    Its route is chosen by the first forward graph and its arguments' signature. A step whose
    backward never runs keeps its span open until the next backward pass ends (everything
    allocated meanwhile is recorded or replayed with it; results are unchanged, since a call
    that leaves its plan is served by PyTorch).
    """

    def __init__(self, pool: BufferPool, arena: str) -> None:
        self._open = threading.local()
        self._pool = pool
        self._arena = arena
        # Spans opened before any graph (``open``): their routes, by the call's signature.
        self._routes: OrderedDict[tuple[object, ...], Route] = OrderedDict()
        self._lock = threading.Lock()

    def forward(self, graph: PooledGraph, args: list[Any]) -> None:
        state = self._open
        if getattr(state, "scope", None) is not None:
            return  # a later graph of the same step (a graph break): the span is open
        # The parameters (Dynamo passes them in as they are): which hold a gradient is part
        # of the route's key, as ``pool.step(..., params=)`` keys its blocks, since the
        # autograd engine allocates new gradients in one state and adds into them in the
        # other; and the bytes it adds into tell the route where they live (``Route.scope``).
        params = [a for a in args if isinstance(a, torch.nn.Parameter) and a.requires_grad]
        grads = tuple(p.grad is not None for p in params)
        adds_into = sum(p.grad.nbytes for p in params if p.grad is not None)
        self._enter(graph.route(("step", grads, *_signature(args))), adds_into)

    def open(self, args: Sequence[object]) -> None:
        """Open the step's span now, before its first graph runs (a model's own forward
        pre-hook: FSDP2 gathers the first block's parameters before that block's graph),
        its route chosen by ``args``' signature. Nothing where autograd is off (no backward
        would close it) or a span is open already."""
        if not torch.is_grad_enabled() or getattr(self._open, "scope", None) is not None:
            return
        key = _signature(list(args))
        with self._lock:
            route = self._routes.get(key)
            if route is None:
                route = self._routes[key] = Route(self._pool, self._arena, training=True)
                while len(self._routes) > ROUTES_PER_GRAPH:
                    self._routes.popitem(last=False)
            else:
                self._routes.move_to_end(key)
        self._enter(route)

    def routes(self) -> list[Route]:
        """The routes of spans opened by ``open``, least recently used first."""
        with self._lock:
            return list(self._routes.values())

    def _enter(self, route: Route, adds_into: int = 0) -> None:
        compiling.install()  # the blocks compiled inside the span (a reset cleared it)
        scope = route.scope(adds_into)
        scope.__enter__()
        self._open.scope = scope

    def backward(self) -> None:
        if getattr(self._open, "scope", None) is not None:
            # Queued by every backward graph: a pass that fails runs none of its callbacks,
            # and the next pass's then closes the span.
            torch.autograd.Variable._execution_engine.queue_callback(self._close)

    def _close(self) -> None:
        state = self._open
        scope, state.scope = getattr(state, "scope", None), None
        if scope is not None:
            scope.__exit__(None, None, None)


class PoolBackend:
    """A ``torch.compile`` backend: Dynamo and AOTAutograd capture, the pool serves the
    graphs' allocations (see the module's text). Made by ``compile_backend``.

    ``graphs`` lists every graph compiled so far, in order; ``stats()`` counts them.
    """

    def __init__(
        self,
        pool: BufferPool,
        *,
        partition: Partition | Recompute | Callable[..., Any] = "min_cut",
        span: Span = "step",
        arena: str = "act.0",
        name: str = "compiled",
    ) -> None:
        if span not in SPANS:
            raise ValueError(f"sharedmem: span must be one of {SPANS}, got {span!r}")
        if not isinstance(pool, BufferPool):
            raise TypeError(
                f"sharedmem: compile_backend takes a BufferPool, got {type(pool).__name__}; "
                "make one with sm.BufferPool('cpu')"
            )
        if not (callable(partition) or isinstance(partition, Recompute) or partition in PARTITIONS):
            raise ValueError(
                f"sharedmem: partition must be one of {PARTITIONS}, a sm.Recompute policy "
                "or a partition function (joint graph -> forward and backward graphs), "
                f"got {partition!r}"
            )
        check_name(arena, "arena name")
        check_name(name, "backend name")
        self.pool = pool
        self.arena = arena
        self.name = name
        self.partition = partition
        self.span = span
        self._steps = StepSpans(pool, arena) if span == "step" else None
        self.graphs: list[PooledGraph] = []
        self._numbers = itertools.count()
        self.__name__ = f"sharedmem_{name}"  # Dynamo names a backend by it
        # What compiling allocates inside a span or a pool.step() is set aside (compiling).
        compiling.install()

    def __call__(
        self, gm: GraphModule, example_inputs: list[Any], **kwargs: Any
    ) -> Callable[..., Any]:
        from torch._dynamo.backends.common import aot_autograd

        number = next(self._numbers)
        routed = routes_on(self.pool)
        compiling.install()  # for the compilations after this one (a reset cleared it)

        def compiler(kind: _Kind) -> Callable[[GraphModule, Any], Any]:
            def compile_graph(graph: GraphModule, _example: Any) -> Any:
                label = f"{self.name}.{number}.{kind}"
                pooled = PooledGraph(self.pool, self.arena, label, kind, graph, self._steps)
                self.graphs.append(pooled)
                if not routed:  # no router on this pool's device: the graph as it is
                    run = pooled._run
                    boxed: Any = lambda args: run(args)  # noqa: E731
                    boxed._boxed_call = True
                    return boxed
                return pooled

            return compile_graph

        # A fresh AOTAutograd per graph: it rewrites its own arguments when called.
        aot = aot_autograd(
            fw_compiler=compiler("forward"),
            bw_compiler=compiler("backward"),
            inference_compiler=compiler("inference"),
            partition_fn=_partition_fn(self.partition),
            keep_inference_input_mutations=True,
        )
        return aot(gm, example_inputs, **kwargs)

    def steps_from(self, model: torch.nn.Module) -> torch.nn.Module:
        """Open each training step's span when ``model``'s forward begins rather than at its
        first compiled graph (``span="step"`` only): what ``model`` allocates before that
        graph is planned with the step. An FSDP2 model whose blocks are compiled needs it:
        FSDP2 gathers the first block's parameters before that block's graph runs, and
        outside the span they would sit beside an arena reserved for the whole step (call it
        on the root, with ``sm.prepare_fsdp(model)``). Returns ``model``."""
        steps = self._steps
        if steps is None:
            raise ValueError(
                "sharedmem: steps_from(model) needs a backend with span='step'; this one plans "
                "each graph call on its own (span='graph')"
            )
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"sharedmem: steps_from takes an nn.Module, got {type(model).__name__}")
        if getattr(model, "_sharedmem_spans", None) is not steps:
            model.register_forward_pre_hook(lambda _m, args: steps.open(args), prepend=True)
            model._sharedmem_spans = steps  # type: ignore[assignment]
        return model

    def stats(self) -> dict[str, int]:
        """``graphs``: ATen graphs compiled (forward, backward and inference counted apart);
        ``routes``: signatures with a recording or plan kept, over every graph and span."""
        spans = 0 if self._steps is None else len(self._steps.routes())
        return {
            "graphs": len(self.graphs),
            "routes": sum(len(g.routes()) for g in self.graphs) + spans,
        }


def _partition_fn(partition: Partition | Recompute | Callable[..., Any]) -> Callable[..., Any]:
    from torch._functorch.partitioners import (
        default_partition,
        min_cut_rematerialization_partition,
    )

    if isinstance(partition, Recompute):
        return _recompute_partition(partition, default_partition)
    if callable(partition):
        return partition
    return min_cut_rematerialization_partition if partition == "min_cut" else default_partition


def _recompute_partition(policy: Recompute, split: Callable[..., Any]) -> Callable[..., Any]:
    """The project's recomputation by cost as a partition function: the joint graph's
    values that ``policy`` says to compute again get a copy right before their first
    backward reader (``recompute``), and the default partition then keeps in the forward
    only what its outputs need, so each copy lands in the backward and the forward saves
    its inputs instead of it."""
    from .._executor.recompute import recompute

    def partition(joint: GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
        rewritten, _count = recompute(joint, heavy=policy.heavy)
        return split(rewritten, joint_inputs, **kwargs)

    return partition


def compile_backend(
    pool: BufferPool,
    *,
    partition: Partition | Recompute | Callable[..., Any] = "min_cut",
    span: Span = "step",
    arena: str = "act.0",
    name: str = "compiled",
) -> PoolBackend:
    """A ``torch.compile`` backend that serves the compiled graphs' allocations from ``pool``.

    Dynamo captures and guards (a changed module attribute, hook, grad mode or shape is
    seen, and the region compiled again), AOTAutograd splits forward and backward, and each
    graph runs op by op on PyTorch's own kernels, as eager does, bit for bit, with what dies
    inside a graph call served from the pool's arena (recorded on the first call of a
    signature, replayed after; ``pool.stats()``'s ``arena_served_bytes``).

    Args:
        pool: a CPU pool (elsewhere, or where the router cannot be built, the graphs run
            unrouted).
        partition: ``"min_cut"`` (``torch.compile``'s: cheap ops recomputed in the backward
            where that saves memory), ``"default"`` (the backward reads what the forward
            computed, as in eager), a ``sm.Recompute`` policy (the project's recomputation
            by modelled cost on the joint graph, then the default partition) or a partition
            function of AOTAutograd's signature.
        span: what one plan spans: ``"step"``, a whole training step, from its first
            forward graph to the end of its backward pass (the user's code between them
            included), so the plan knows the step's peak and keeps it at or below eager's;
            or ``"graph"``, each graph call on its own (the activations a forward saves and
            the gradients a backward makes outlive their call and stay PyTorch's; the arena
            sits beside them, above eager's peak where its temporaries are not at the
            step's busiest moment). Inference graphs are planned per call either way.
        arena: the arena's buffer name (shared with ``pool.step()`` blocks of that arena).
        name: the backend's name in graph labels.

    Example::

        >>> import torch, sharedmem as sm
        >>> from sharedmem._compile import compile_backend
        >>> pool, model = sm.BufferPool("cpu"), torch.nn.Linear(8, 2)
        >>> step = torch.compile(model, backend=compile_backend(pool))
        >>> for _ in range(3):
        ...     step(torch.randn(4, 8)).square().sum().backward()
    """
    return PoolBackend(pool, partition=partition, span=span, arena=arena, name=name)
