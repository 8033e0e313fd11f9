"""Cheap values computed again where backward reads them, instead of kept from the forward.

A train graph keeps many activations from the forward to the backward only because a late
op reads them: the output of a ReLU after a batch norm is the next convolution's input (its
weight gradient reads it) and the ReLU's own backward reads it. Such a value can be computed
again right before its first late reader, from values that are alive there anyway (the
convolution's output, which the batch norm's backward reads; the parameters), so it does not
occupy memory across the whole gap. This is what ``torch.compile``'s partitioner does; here
it changes no bit: the recomputation is the very op eager ran, on the very same inputs, and
the kernels it takes are deterministic (pointwise ops without randomness, layer norm, and
batch norm in training mode, computed again without running statistics so they are updated
once).

A value is recomputed only where that gives the same bits and cannot cost memory: no input
of the recomputation is written in place in between; every input is alive at that point
anyway (or is itself recomputed there, up to a short chain, each link dying right after its
use); the value's readers before the gap stay as they are; the value is reached only through
itself and views of it (no in-place writes); and it is idle across the step's busiest node
(elsewhere it would cost time for nothing).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
from torch._ops import OpOverload
from torch.fx import Graph, GraphModule, Node
from torch.fx.node import Argument
from torch.multiprocessing.reductions import StorageWeakRef

from .graph import fake_mode, fresh_fake

__all__ = ["recompute"]

aten = torch.ops.aten

# The shortest gap, in nodes, between two reads of a value worth a recomputation.
MIN_GAP = 16
# How many values one recomputation may compute again (a ReLU over an add over a batch norm).
MAX_CHAIN = 4

_IDENTITY = frozenset({aten.detach.default, aten.alias.default})
_BATCH_NORM = aten.native_batch_norm.default
_LAYER_NORM = aten.native_layer_norm.default
_MULTI = frozenset({_BATCH_NORM, _LAYER_NORM})  # recomputed for their output (getitem 0)
# Recomputed only when time is given for memory (``heavy``): deterministic on the same inputs
# (the same kernel, the same threads, the same bits), but a convolution or a matrix product
# is a step's real work, so each costs time.
_HEAVY = frozenset(
    {aten.convolution.default, aten.mm.default, aten.addmm.default, aten.bmm.default}
)
HEAVY_MIN_GAP = 4


def recompute(gm: GraphModule, *, heavy: bool = False) -> tuple[GraphModule, int]:
    """A copy of ``gm`` whose cheap long-idle values are computed again where read late, and
    how many were (``gm`` itself when none is). ``heavy``: convolutions and matrix products
    too, and shorter gaps (time given for memory, to meet a budget without chunks)."""
    graph = Graph()
    copies: dict[Node, Node] = {}
    out = graph.graph_copy(gm.graph, copies)
    graph.output(out)
    fakes = fake_mode(graph)
    if fakes is None or not _static(graph):
        return gm, 0  # (a data-dependent shape is refused, with its source line, by analyse)
    count = 0
    index = _Index(graph)
    changed = True
    while changed:  # the busiest node moves as values are recomputed: look again
        changed = False
        for node in list(graph.nodes):
            value = _value(node, heavy)
            if value is None or value not in index.position:
                continue
            if _recompute_one(graph, index, value, fakes, heavy):
                count += 1
                changed = True
                index = _Index(graph)
    return (GraphModule(gm, graph), count) if count else (gm, 0)


class _Index:
    """Positions, storages and readers of a graph's values, as they are now."""

    def __init__(self, graph: Graph) -> None:
        self.nodes = list(graph.nodes)
        self.position = {n: i for i, n in enumerate(self.nodes)}
        self.key: dict[Node, StorageWeakRef] = {}
        self.members: dict[StorageWeakRef, list[Node]] = {}
        self.inputs: set[StorageWeakRef] = set()
        for n in self.nodes:
            val = n.meta.get("val")
            if isinstance(val, torch.Tensor):
                key = StorageWeakRef(val.untyped_storage())  # type: ignore[no-untyped-call]
                self.key[n] = key
                self.members.setdefault(key, []).append(n)
                if n.op in ("placeholder", "get_attr"):
                    self.inputs.add(key)
        # Where each storage is written in place (an op's mutable argument on it).
        self.written: dict[StorageWeakRef, list[int]] = {}
        for n in self.nodes:
            schema = getattr(n.target, "_schema", None)
            if n.op != "call_function" or schema is None:
                continue
            for argument, passed in zip(schema.arguments, n.args, strict=False):
                if argument.alias_info is None or not argument.alias_info.is_write:
                    continue
                for target in _nodes_in([passed]):
                    if target in self.key:
                        self.written.setdefault(self.key[target], []).append(self.position[n])
        self.busiest = self._busiest()

    def unchanged(self, node: Node, after: int, before: int) -> bool:
        """Whether nothing writes ``node``'s storage between those two positions."""
        key = self.key.get(node)
        return key is not None and not any(after < at < before for at in self.written.get(key, ()))

    def _busiest(self) -> int:
        """The node where the most bytes of the graph's own storages are alive (each from its
        first member to its last reader; an estimate that ignores in-place reuse and
        kernels' scratch, enough to tell which values are idle across the peak)."""
        live = [0] * (len(self.nodes) + 1)
        for key, members in self.members.items():
            if key in self.inputs:
                continue
            start = min(self.position[m] for m in members)
            readers = self.readers(key)
            end = self.position[readers[-1]] if readers else start
            nbytes = members[0].meta["val"].untyped_storage().nbytes()
            live[start] += nbytes
            live[end + 1] -= nbytes
        best = at = total = 0
        for i, delta in enumerate(live[:-1]):
            total += delta
            if total > best:
                best, at = total, i
        return at

    def readers(self, key: StorageWeakRef) -> list[Node]:
        """The nodes that read the storage ``key`` (not its aliases), in graph order."""
        members = set(self.members[key])
        found = {u for m in members for u in m.users if u not in members}
        return sorted(found, key=self.position.__getitem__)

    def alive_at(self, node: Node, at: int) -> bool:
        """Whether ``node``'s storage is alive at position ``at`` without recomputation."""
        key = self.key.get(node)
        if key is None:
            return False
        if key in self.inputs:
            return True
        return any(self.position[r] >= at for r in self.readers(key))


def _value(node: Node, heavy: bool = False) -> Node | None:
    """The value ``node`` makes that could be recomputed: the node itself for a pointwise op,
    the output (``getitem 0``) of a batch norm in training mode."""
    if node.op != "call_function":
        return None
    if node.target is operator.getitem and node.args[1] == 0:
        producer = node.args[0]
        return node if isinstance(producer, Node) and _recomputable(producer, heavy) else None
    return node if _recomputable(node, heavy) and node.target not in _MULTI else None


def _recomputable(node: Node, heavy: bool = False) -> bool:
    target = node.target
    if not isinstance(target, OpOverload):
        return False
    if heavy and target in _HEAVY:
        return isinstance(node.meta.get("val"), torch.Tensor)
    if target is _BATCH_NORM:
        return len(node.args) > 5 and node.args[5] is True
    if target is _LAYER_NORM:
        return True
    schema = target._schema
    return (
        torch.Tag.pointwise in target.tags
        and torch.Tag.nondeterministic_seeded not in target.tags
        and len(schema.returns) == 1
        and not any(a.alias_info is not None for a in (*schema.arguments, *schema.returns))
        and isinstance(node.meta.get("val"), torch.Tensor)
    )


def _only_views(index: _Index, value: Node) -> bool:
    # The value's storage is reached through the value and chains of views of it alone
    # (detach, reshape, transpose ...): nothing writes it, and each view can be taken again
    # of the recomputed value.
    key = index.key.get(value)
    if key is None or key in index.inputs:
        return False
    members = set(index.members[key])
    for member in members:
        if member is value:
            continue
        target = member.target
        if not isinstance(target, OpOverload) or _writes(member):
            return False
        returns = target._schema.returns
        if len(returns) != 1 or returns[0].alias_info is None:
            return False
        if not member.args or member.args[0] not in members:
            return False
        if _nodes_in([*member.args[1:], *member.kwargs.values()]):
            return False
    return True


def _recompute_one(
    graph: Graph, index: _Index, value: Node, fakes: object, heavy: bool = False
) -> bool:
    key = index.key.get(value)
    if key is None or not _only_views(index, value):
        return False
    readers = index.readers(key)
    if not readers or any(r.op == "output" for r in readers):
        return False
    points = [index.position[value], *(index.position[r] for r in readers)]
    gaps = [(points[i + 1] - points[i], i + 1) for i in range(len(points) - 1)]
    gap, split = max(gaps)
    at = points[split]
    # Only a value idle across the step's busiest node lowers its peak; others would cost
    # time for nothing.
    if gap < (HEAVY_MIN_GAP if heavy else MIN_GAP) or not points[split - 1] < index.busiest < at:
        return False
    late = [r for r in readers if index.position[r] >= at]
    if any(_writes(r) for r in late):
        return False
    chain = _chain(index, value, at, 0, heavy)
    if chain is None:
        return False
    first_late = index.nodes[at]
    made: dict[Node, Node] = {}
    members = index.members[key]
    with graph.inserting_before(first_late):
        for original in chain:
            made[original] = _emit(graph, original, made, fakes)
        for reader in late:
            for member in members:
                if member in reader.all_input_nodes:
                    reader.replace_input_with(member, _view_again(graph, member, made, fakes))
    # Detaches nobody reads any more (autograd's saved-tensor handles, recorded where the
    # backward unpacked them) would otherwise keep the original alive to their place.
    dead = [m for m in reversed(members) if m is not value]
    for member in dead:
        if not member.users:
            graph.erase_node(member)
    return True


def _view_again(graph: Graph, member: Node, made: dict[Node, Node], fakes: object) -> Node:
    """``member`` (the value or a view of it) taken of the recomputed value."""
    if member in made:
        return made[member]
    parent = member.args[0]
    assert isinstance(parent, Node)
    base = _view_again(graph, parent, made, fakes)
    if member.target in _IDENTITY:
        made[member] = base
        return base
    target = _op(member)
    again = graph.call_function(target, (base, *member.args[1:]), dict(member.kwargs))
    with fakes:  # type: ignore[attr-defined]
        again.meta["val"] = target(base.meta["val"], *member.args[1:], **member.kwargs)
    again.meta["stack_trace"] = member.meta.get("stack_trace")
    made[member] = again
    return again


def _writes(node: Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(
        a.alias_info is not None and a.alias_info.is_write for a in schema.arguments
    )


def _chain(
    index: _Index, value: Node, at: int, depth: int, heavy: bool = False
) -> list[Node] | None:
    """The values to compute again at position ``at`` to have ``value`` there, inputs
    first; ``None`` where some input is neither alive there nor cheaply recomputed."""
    producer = value.args[0] if value.target is operator.getitem else value
    assert isinstance(producer, Node)
    args = producer.args[:3] if producer.target is _BATCH_NORM else producer.args
    chain: list[Node] = []
    for arg in _nodes_in(args):
        if not index.unchanged(arg, index.position[producer], at):
            return None  # written in place since (a recurrent state): not the same inputs
        if index.alive_at(arg, at):
            continue
        if depth + 1 >= MAX_CHAIN or _value(arg, heavy) is not arg or not _only_views(index, arg):
            return None
        sub = _chain(index, arg, at, depth + 1, heavy)
        if sub is None:
            return None
        chain += [n for n in sub if n not in chain]
    return [*chain, value]


def _nodes_in(args: Sequence[object]) -> list[Node]:
    found: list[Node] = []
    for a in args:
        if isinstance(a, Node):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found += _nodes_in(a)
    return found


def _op(node: Node) -> OpOverload:
    target = node.target
    assert isinstance(target, OpOverload), "only ATen ops are recomputed or viewed again"
    return target


def _emit(graph: Graph, value: Node, made: dict[Node, Node], fakes: object) -> Node:
    def arg(a: Argument) -> Argument:
        if isinstance(a, Node):
            return made.get(a, a)
        if isinstance(a, (list, tuple)):
            return type(a)(arg(x) for x in a)
        return a

    if value.target is operator.getitem:
        producer = value.args[0]
        assert isinstance(producer, Node)
        if producer.target is _BATCH_NORM:
            # Without running statistics: they were updated once, by the forward.
            args = (*(arg(a) for a in producer.args[:3]), None, None, *producer.args[5:])
        else:
            args = tuple(arg(a) for a in producer.args)
        again = graph.call_function(_op(producer), args, dict(producer.kwargs))
        again.meta["val"] = tuple(fresh_fake(v, fakes) for v in producer.meta["val"])
        again.meta["stack_trace"] = producer.meta.get("stack_trace")
        out = graph.call_function(operator.getitem, (again, 0))
        out.meta["val"] = again.meta["val"][0]
    else:
        args = tuple(arg(a) for a in value.args)
        kwargs = {k: arg(v) for k, v in value.kwargs.items()}
        out = graph.call_function(_op(value), args, kwargs)
        out.meta["val"] = fresh_fake(value.meta["val"], fakes)
    out.meta["stack_trace"] = value.meta.get("stack_trace")
    return out


def _static(graph: Graph) -> bool:
    for n in graph.nodes:
        val = n.meta.get("val")
        for t in val if isinstance(val, (tuple, list)) else [val]:
            if isinstance(t, torch.Tensor) and not all(type(d) is int for d in t.shape):
                return False
    return True
