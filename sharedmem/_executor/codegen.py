"""Turn an analysed graph and its slot plan into one straight-line Python function.

Everything that does not change between calls is decided here, once per signature: the op
(or its ``out=`` overload) each node calls, its arguments, the pool buffer name, shape and
dtype of every pooled result. The generated function is then one line per node, as cheap as
the same ops written by hand. Pool views are fetched inside it, on every call, right where
each result is written: on a moving backend a view taken before a growth goes stale.

A line of generated code looks like::

    v17 = op17(v9, v11, [2, 2], out=_t('act.3', (64, 8, 16, 16), d0), indices=_t(...))

An input may itself be a view into one of the slots the call writes (an earlier call's
``outputs_in_pool=True`` output, fed back in): it would be overwritten while still needed.
The header compares the input's bytes with the slots' and copies such an input out first;
its extent and the slots' sizes are fixed by the signature, so this costs a few pointer reads.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch._ops import OpOverload
from torch.fx import GraphModule, Node

from .._layout import extent
from .graph import Buffer, NodeRun, graph_outputs
from .ops import Kind, fill_value

__all__ = ["Runner", "generate", "mutates"]

# The generated function: (pool.tensor, *graph inputs) -> the graph's flat outputs.
Runner = Callable[..., list[Any]]

# detach and friends only matter to autograd, which never runs inside the executor.
_IDENTITY = frozenset({torch.ops.aten.detach.default, torch.ops.aten.alias.default})


class _Emitter:
    def __init__(self, slot_bytes: dict[str, int]) -> None:
        self.globals: dict[str, Any] = {"torch": torch}
        self.names: dict[Node, str] = {}
        self._consts: dict[int, str] = {}
        self._ops: dict[OpOverload, str] = {}  # op overloads called, by their entries
        self.slot_bytes = slot_bytes
        self.header: list[str] = []  # fetches of pool views, first thing in every call
        self._typed: dict[tuple[str, torch.dtype], str] = {}
        self.raw: dict[str, str] = {}  # slot -> its byte view in the generated code

    def const(self, value: object, hint: str) -> str:
        # Ints, bools, None, strings and finite floats are written as literals; anything else
        # (dtypes, devices, tensors, inf) is passed in as a global of the generated code.
        if value is None or isinstance(value, (bool, int, str)):
            return repr(value)
        if isinstance(value, float) and math.isfinite(value):
            return repr(value)
        key = id(value)
        if key not in self._consts:
            name = f"{hint}{len(self._consts)}"
            self._consts[key] = name
            self.globals[name] = value
        return self._consts[key]

    def op(self, target: object) -> str:
        # An op overload is called through its dispatcher entry (``OpOverload.__call__``
        # only forwards to it): one Python frame less for every op of every call.
        if not isinstance(target, OpOverload):
            return self.const(target, "o")
        name = self._ops.get(target)
        if name is None:
            name = self._ops[target] = f"op{len(self._ops)}"
            self.globals[name] = target._op
        return name

    def arg(self, value: object) -> str:
        if isinstance(value, Node):
            return self.names[value]
        if isinstance(value, list):
            return "[" + ", ".join(self.arg(v) for v in value) + "]"
        if isinstance(value, tuple):
            inner = ", ".join(self.arg(v) for v in value)
            return f"({inner},)" if len(value) == 1 else f"({inner})"
        return self.const(value, "c")

    def call(self, fn: str, args: Sequence[object], kwargs: dict[str, object], extra: str) -> str:
        parts = [self.arg(a) for a in args] + [f"{k}={self.arg(v)}" for k, v in kwargs.items()]
        if extra:
            parts.append(extra)
        return f"{fn}({', '.join(parts)})"

    def view(self, slot: str | None, buffer: Buffer, device: torch.device, offset: int = 0) -> str:
        dtype = self.const(buffer.dtype, "d")
        if slot is None:  # a result the caller keeps: fresh memory, as eager would allocate
            dev = self.const(device, "dev")
            return (
                f"torch.empty_strided({buffer.size!r}, {buffer.stride!r}, dtype={dtype}, "
                f"device={dev})"
            )
        typed = self._slot(slot, buffer.dtype)
        if offset:  # in elements: offsets are multiples of 64 bytes, so of every itemsize
            at = offset // buffer.dtype.itemsize
            return f"{typed}.as_strided({buffer.size!r}, {buffer.stride!r}, {at})"
        return f"{typed}.as_strided({buffer.size!r}, {buffer.stride!r})"

    def _slot(self, slot: str, dtype: torch.dtype) -> str:
        # Each slot is fetched once per call as bytes, with the same shape on every call, so
        # the pool's fast path serves it; each dtype living in it gets one typed view.
        if (slot, dtype) not in self._typed:
            raw = f"s{list(self.slot_bytes).index(slot)}"
            if slot not in self.raw:
                u8 = self.const(torch.uint8, "d")
                self.header.append(f"{raw} = _t({slot!r}, ({self.slot_bytes[slot]},), {u8})")
                self.raw[slot] = raw
            typed = f"{raw}_{len(self._typed)}"
            self.header.append(f"{typed} = {raw}.view({self.const(dtype, 'd')})")
            self._typed[slot, dtype] = typed
        return self._typed[slot, dtype]


def generate(
    gm: GraphModule,
    steps: Sequence[NodeRun],
    slots: Sequence[str | None],
    slot_bytes: dict[str, int],
    device: torch.device,
    label: str,
    guarded: Sequence[int] = (),
    taps: Mapping[Node, Sequence[tuple[int, int]]] | None = None,
    on_ready: Callable[[int, torch.Tensor], None] | None = None,
    offsets: Sequence[int] = (),
    eager: frozenset[int] = frozenset(),
    over: Mapping[int, Node] | None = None,
) -> tuple[Runner, str]:
    """Return the runner of ``gm`` and its source.

    Args:
        gm: the traced graph.
        steps: how each ``call_function`` node runs (from ``analyse``).
        slots: the pool buffer name of each lifetime (from ``assign_slots``), or ``None`` for
            results the caller keeps, which get fresh memory on every call.
        slot_bytes: the bytes to ask of each slot (a multiple of every itemsize).
        device: where fresh and zero-byte results are made.
        label: names the generated code in tracebacks.
        guarded: the placeholders (by position) that may be views into the pool: data
            inputs, copied out first where they overlap a slot this graph writes.
        taps: after each of these nodes, the outputs that are final then, as pairs ``(k,
            position among the outputs)``: ``on_ready(k, value)`` is called for each (a
            gradient's all-reduce starts there).
        on_ready: what the taps call.
        offsets: the byte offset of each lifetime in its slot (all ``0`` when left out).
        eager: the lifetimes the plan leaves out of the pool: a node all of whose results
            are such runs its own op, allocating as eager does.
        over: lifetimes left out of the pool that are written over a dying operand (this
            graph value) through the op's ``out=`` form, as its in-place form would.
    """
    em = _Emitter(slot_bytes)
    where = offsets or [0] * len(slots)
    nodes = list(gm.graph.nodes)
    by_node = {step.node: step for step in steps}
    position = {n: i for i, n in enumerate(nodes)}
    last_use = {n: max((position[u] for u in n.users), default=i) for i, n in enumerate(nodes)}
    dying: dict[int, list[str]] = {}
    outputs = graph_outputs(nodes[-1])
    params: list[str] = []
    body: list[str] = []
    for i, node in enumerate(nodes):
        name = f"v{i}"
        em.names[node] = name
        if node.op == "placeholder":
            params.append(name)
            continue
        if node.op == "get_attr":
            em.names[node] = em.const(operator.attrgetter(str(node.target))(gm), "g")
            continue
        if node.op == "output":
            body.append(f"return {em.arg(graph_outputs(node))}")
            break
        step = by_node[node]
        body.append(f"{name} = {_expression(em, step, slots, where, device, eager, over or {})}")
        if taps and node in taps:
            em.globals["_ready"] = on_ready
            body += [f"_ready({k}, {em.arg(outputs[at])})" for k, at in taps[node]]
        if not any(u.op == "output" for u in node.users):
            dying.setdefault(last_use[node], []).append(name)
        for gone in dying.pop(i, []):
            body.append(f"del {gone}")
    lines = [*em.header, *_guards(em, nodes, guarded), *body]
    source = "\n".join([f"def run(_t, {', '.join(params)}):", *(f"    {line}" for line in lines)])
    code = compile(source, f"<sharedmem graph {label}>", "exec")
    exec(code, em.globals)
    runner: Runner = em.globals["run"]
    return runner, source


def _guards(em: _Emitter, nodes: Sequence[Node], guarded: Sequence[int]) -> list[str]:
    placeholders = [n for n in nodes if n.op == "placeholder"]
    inputs = [(placeholders[k], extent(placeholders[k].meta["val"])) for k in guarded]
    inputs = [(node, nbytes) for node, nbytes in inputs if nbytes]
    if not em.raw or not inputs:
        return []
    em.globals["_copy_out"] = _copy_out
    lines = [f"_a{k} = {raw}.data_ptr()" for k, raw in enumerate(em.raw.values())]
    sizes = [em.slot_bytes[slot] for slot in em.raw]
    for node, nbytes in inputs:
        name = em.names[node]
        hits = " or ".join(
            f"(_p < _a{k} + {size} and _a{k} < _p + {nbytes})" for k, size in enumerate(sizes)
        )
        lines += [f"_p = {name}.data_ptr()", f"if {hits}:", f"    {name} = _copy_out({name})"]
    return lines


def _copy_out(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in fresh memory with the very same layout (the signature fixes it)."""
    span = extent(t) // t.element_size()
    fresh = torch.as_strided(t, (span,), (1,)).clone()
    return fresh.as_strided(t.shape, t.stride())


def _expression(
    em: _Emitter,
    step: NodeRun,
    slots: Sequence[str | None],
    offsets: Sequence[int],
    device: torch.device,
    eager: frozenset[int],
    over: Mapping[int, Node],
) -> str:
    node, rule = step.node, step.rule
    args: list[object] = list(node.args)
    kwargs: dict[str, object] = dict(node.kwargs)
    if node.target is operator.getitem:
        return f"{em.arg(args[0])}[{em.arg(args[1])}]"
    if node.target in _IDENTITY and not any(mutates(u) for u in node.users):
        return em.arg(args[0])
    lives = [life for life in step.lifetimes if life >= 0]
    if lives and all(life in eager and life not in over for life in lives):
        return em.call(em.op(node.target), args, kwargs, "")  # as eager: it allocates
    views = [
        _zero_size(em, node, k, device)
        if b is None
        else em.arg(over[life])
        if life in over
        else em.view(slots[life], b, device, offsets[life])
        for k, (b, life) in enumerate(zip(step.buffers, step.lifetimes, strict=True))
    ]
    match rule.kind:
        case Kind.ALIAS | Kind.PLAIN:
            return em.call(em.op(node.target), args, kwargs, "")
        case Kind.OUT:
            if rule.adapt is not None:
                adapted = rule.adapt(args, kwargs)
                assert adapted is not None, "analyse() keeps only rewrites that fit"
                args, kwargs = adapted
            outs = ", ".join(f"{k}={v}" for k, v in zip(rule.out_names, views, strict=True))
            return em.call(em.op(rule.out_op), args, kwargs, outs)
        case Kind.EMPTY:
            return views[0]
        case Kind.FILL:
            value = fill_value(node.target, args, kwargs)  # type: ignore[arg-type]
            return f"{views[0]}.fill_({em.arg(value)})"
        case Kind.COPY:
            return f"{views[0]}.copy_({em.arg(args[0])})"
    raise AssertionError(f"unhandled kind {rule.kind}")


def mutates(node: Node) -> bool:
    """Whether ``node`` writes one of its arguments in place. (An in-place op on a detached
    tensor, ``t_()`` changing its metadata, must not reach the tensor it was detached from,
    so such a detach runs for real.)"""
    target = node.target
    return isinstance(target, OpOverload) and _mutating(target)


@functools.cache  # (asked for every node at every step of the recomputation search)
def _mutating(target: OpOverload) -> bool:
    return any(a.alias_info is not None and a.alias_info.is_write for a in target._schema.arguments)


def _zero_size(em: _Emitter, node: Node, k: int, device: torch.device) -> str:
    # A zero-byte result of an out= op: one empty tensor made now serves every call.
    val = node.meta["val"]
    ref = val[k] if isinstance(val, (tuple, list)) else val
    empty = torch.empty_strided(ref.shape, ref.stride(), dtype=ref.dtype, device=device)
    return em.const(empty, "z")
