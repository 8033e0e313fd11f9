"""Cheap values computed again where backward reads them, instead of kept from the forward.

A train graph keeps many activations from the forward to the backward only because a late op
reads them: the output of a ReLU after a batch norm is the next convolution's input (its
weight gradient reads it) and the ReLU's own backward reads it. Such a value can be computed
again right before its first late reader, from values that are alive there anyway (the
convolution's output, which the batch norm's backward reads; the parameters), so it does not
occupy memory across the whole gap. This is what ``torch.compile``'s partitioner does; here
it changes no bit: the recomputation is the very op eager ran, on the very same inputs, and
the kernels it takes are deterministic (pointwise ops without randomness, layer norm, and
batch norm in training mode, computed again without running statistics so they are updated
once). Giving time for memory (``heavy``), convolutions, matrix products and attention are
computed again too (and the softmax of a math attention, from its recomputed scores), and
dropout's noise is drawn again from the generator state saved right before the forward drew
it (``replay``): the same masks, and the generator put back after.

A value is recomputed only where that gives the same bits and cannot cost memory (giving
time, no more than a quarter of what it frees): no input of the recomputation is written in
place in between; every input is alive at that point anyway (or is itself recomputed there,
up to a short chain, each link dying right after its use; or, giving time, is kept there,
where it is a quarter or less of the value: GPT-2's causal mask beside its attention
scores); the value's readers before the gap stay as they are; the value is reached only
through itself and views of it (no in-place writes); and it is idle across the step's
busiest node (elsewhere it would cost time for nothing). The search that chooses them is
bounded in steps (``PATIENCE``, ``STEPS_PER_NODE``, and giving time ``MAX_GENERATIONS``) and
returns the best plan it went through, so planning always returns, with the same plan for
the same graph. Giving time, it runs four ways (``_Way``) and keeps the plan whose modelled
peak, counting a result written over its dying operand once as the executor places it, is
the lowest.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch._ops import OpOverload
from torch.fx import Graph, GraphModule, Node
from torch.fx.node import Argument
from torch.multiprocessing.reductions import StorageWeakRef

from .codegen import mutates
from .cost import graph_cost, op_cost
from .graph import fake_mode, fresh_fake, storage_key, value_layout
from .ops import EMPTY_FACTORIES
from .replay import replay_op, replayable, rng_state_op, state_bytes

__all__ = ["recompute"]

aten = torch.ops.aten

# The shortest gap, in nodes, between two reads of a value worth a recomputation.
MIN_GAP = 16
# How many values one recomputation may compute again (a ReLU over an add over a batch norm).
MAX_CHAIN = 4
# Giving time for memory: a matrix product over a layer norm, or GPT-2's tanh GELU (five
# pointwise ops over a matrix product).
MAX_CHAIN_HEAVY = 8

_IDENTITY = frozenset({aten.detach.default, aten.alias.default})
_BATCH_NORM = aten.native_batch_norm.default
_LAYER_NORM = aten.native_layer_norm.default
_ATTENTION = aten._scaled_dot_product_flash_attention_for_cpu.default
# Recomputed for their output (getitem 0); what else they return stays as it was.
_MULTI = frozenset({_BATCH_NORM, _LAYER_NORM, _ATTENTION})
# Recomputed only when time is given for memory (``heavy``): deterministic on the same inputs
# (the same kernel, the same threads, the same bits), but a convolution, a matrix product or
# an attention is a step's real work, so each costs time; a concatenation (a ViT's class
# token before its patches) copies its inputs whole.
_HEAVY = frozenset(
    {
        aten.convolution.default,
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        _ATTENTION,
        aten.cat.default,
    }
)
# Recomputed only when time is given too: a softmax reduces each row before it writes it, so
# it costs more than a pointwise op of its size; deterministic on the same input. The math
# attention's (``_safe_softmax``: attention with dropout, or a mask SDPA's fused kernel does
# not take) is kept from the forward for backward otherwise, four bytes an element of every
# head's scores.
_SOFTMAX = frozenset({aten._softmax.default, aten._safe_softmax.default})
HEAVY_MIN_GAP = 4
# What a recomputation keeps to free a value (a random fill's generator state; an input no
# chain makes again, such as an attention's mask) is at most this fraction of what it frees.
REPLAY_MIN_RATIO = 4


# Planning one graph is bounded. A step of the search computes one value again (chosen by a
# scan of the graph); the search stops after PATIENCE steps in a row that found no plan with a
# lower modelled peak than the best so far, and after STEPS_PER_NODE steps per node of the
# graph as traced whatever it finds, and returns the best plan it went through. On the graphs
# we know the peak falls at nearly every step (a plateau of four at most, a rise undone by the
# next step) and the search ends on its own; without a bound, values computed again can be
# computed again from their copies in turn for ever, as a conveyor (issue 34: each move frees
# the busiest node and makes another as busy).
PATIENCE = 32
STEPS_PER_NODE = 1
# Giving time, a value computed again may be computed again from its copy, and that copy
# from its own, up to this many copies deep. Two copies read late can otherwise move past
# each other for ever at the cost of a matrix product each, as a conveyor (ViT-tiny's search,
# counting a result written over its dying operand once, did from step 60 on and stopped at
# 197.7 MB; with this bound, 45.9 MB); GPT-2's lowest plans take copies of copies.
MAX_GENERATIONS = 3
_GENERATION = "sharedmem_recomputed"  # a copy's meta: how many copies deep it is


def recompute(
    gm: GraphModule,
    *,
    heavy: bool | float = False,
    steps: int | None = None,
    scratch: Callable[[Node], int] | None = None,
) -> tuple[GraphModule, int]:
    """A copy of ``gm`` whose cheap long-idle values are computed again where read late, and
    how many were (``gm`` itself when none is).

    ``heavy`` gives time for memory, to meet a budget without chunks: convolutions, matrix
    products and attention are recomputed too (through views and splits, chains up to
    ``MAX_CHAIN_HEAVY``), and shorter gaps are taken. ``True``: every such value idle
    across the busiest node; a number: values chosen cheapest first (modelled time per byte
    freed, see ``cost``) while their modelled time stays within that fraction of the step's
    own. The copy's ``meta["recompute_cost"]`` is the fraction its recomputation adds.

    ``steps`` bounds the search (default ``STEPS_PER_NODE`` per node of ``gm``): after that
    many values computed again it stops, as it does after ``PATIENCE`` steps that did not
    lower its modelled peak. What it returns is the plan, among those it went through, with
    the lowest modelled peak (the latest of equals): it never ends on a step that made the
    peak worse.

    ``scratch`` gives the bytes a node's kernel works in while it runs (``measured_scratch``):
    the modelled peak counts them at that node, so the search aims at the real busiest node
    (ConvNeXt-T: stage 4's depthwise convolution backward, 38.7 MB of oneDNN scratch, where
    without them it aimed at stage 1's GELU backward); ``None``: none counted."""
    limit = STEPS_PER_NODE * len(gm.graph.nodes) if steps is None else steps
    # How a search runs (``_Way``): the default's, one way. Giving time, four: which gap of a
    # value's reads it is computed again across (``_candidate``: its longest, or the one
    # across the busiest node), and whether the peak that steers it counts a result written
    # over its dying operand once, as the executor places it. No way wins everywhere (GPT-2
    # within 35%: the longest gap 39.9 MB, the busiest node's 35.7 MB; ViT-tiny within 15%:
    # 127.5 MB steered without the shared count, 173.5 MB with it; as much as lowers the
    # peak, 55.6 MB without, 45.9 MB with; the demo's MLP adding into its gradients meets
    # its budget by the longest gap alone), so every plan of every way is judged on the
    # model closest to the measured peak, the shared count, and the lowest kept.
    ways = _WAYS if _gives_time(heavy) else (_Way(spanning=False, shared=False),)
    found = [_search(gm, heavy, limit, scratch, way) for way in ways]
    searches = [s for s in found if s is not None]
    if not searches:
        return gm, 0  # (a data-dependent shape is refused, with its source line, by analyse)
    search = min(searches, key=lambda s: min(s.peaks))  # the first of equals
    peaks = search.peaks
    best = max(i for i, peak in enumerate(peaks) if peak == min(peaks))
    if best < search.count:  # found again, as deterministic as the first time
        again = _search(gm, heavy, best, scratch, search.way)
        assert again is not None and again.peaks[-1] == peaks[best], (peaks, best)
        search = again
    if not search.count:
        return gm, 0
    result = GraphModule(gm, search.graph)
    result.meta["recompute_cost"] = search.spent
    return result, search.count


class _Way(NamedTuple):
    """How one search runs: which gap of a value's reads it is computed again across (the
    one that spans the busiest node, or its longest: ``_candidate``), and whether the peak
    that steers it counts a result written over its dying operand once (``_Index``)."""

    spanning: bool
    shared: bool


_WAYS = tuple(_Way(spanning, shared) for shared in (False, True) for spanning in (False, True))


def _search(
    gm: GraphModule,
    heavy: bool | float,
    limit: int,
    scratch: Callable[[Node], int] | None,
    way: _Way,
) -> _Search | None:
    """Up to ``limit`` steps of the search on a copy of ``gm``, or ``None`` where its shapes
    are not static. Its plans are judged (``_Search.peaks``) with the shared count where
    time is given, as the default's always were without it."""
    graph = Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    fakes = fake_mode(graph)
    if fakes is None or not _static(graph):
        return None
    giving = _gives_time(heavy)
    total = graph_cost(graph) if giving else 0.0  # the step's own, as traced
    search = _Search(graph, fakes, limit, scratch, way, judged_shared=giving)
    _in_graph_order(search)  # the default's, free: always first
    if giving:
        _cheapest_first(search, math.inf if heavy is True else float(heavy) * total)
        search.spent /= total or 1.0
    return search


def _gives_time(heavy: bool | float) -> bool:
    """Whether ``heavy`` gives time for memory (``True`` or a fraction above 0)."""
    return heavy is not False and heavy != 0


class _Search:
    """One graph's recomputation as it goes: the graph and its index, and the peak its plan
    is judged by (``judged_shared``: counting a result written over its dying operand once)
    before the first step and after each."""

    def __init__(
        self,
        graph: Graph,
        fakes: object,
        limit: int,
        scratch: Callable[[Node], int] | None,
        way: _Way,
        *,
        judged_shared: bool,
    ) -> None:
        self.graph, self.fakes, self.limit, self.way = graph, fakes, limit, way
        self.judged_shared = judged_shared
        self.index = _Index(graph, scratch=scratch, shared=way.shared)
        self.peaks = [self.index.judged(judged_shared)]
        self.best = 0  # the first step count at the lowest peak so far
        self.spent = 0.0  # the modelled time of the heavy steps

    @property
    def count(self) -> int:
        return len(self.peaks) - 1

    @property
    def done(self) -> bool:
        return self.count >= self.limit or self.count - self.best >= PATIENCE

    def take(self, found: _Candidate, cost: float = 0.0) -> None:
        _apply(self.graph, self.index, found, self.fakes)
        # The busiest node moves as values are recomputed: indexed again, from the last.
        self.index = _Index(self.graph, self.index)
        self.peaks.append(self.index.judged(self.judged_shared))
        if self.peaks[-1] < self.peaks[self.best]:
            self.best = self.count
        self.spent += cost


def _in_graph_order(search: _Search) -> None:
    """Recompute every cheap value that qualifies, in graph order."""
    changed = True
    while changed and not search.done:  # the busiest node has moved: look again
        changed = False
        for node in list(search.graph.nodes):
            value = _value(node)
            if value is None or value not in search.index.position:
                continue
            found = _candidate(search.index, value, spanning=search.way.spanning)
            if found is not None:
                search.take(found)
                changed = True
                if search.done:
                    return


def _cheapest_first(search: _Search, allowance: float) -> None:
    """Recompute, one at a time, the qualifying value (heavy ones included) whose chain costs
    the least modelled time per byte it frees, while the total stays within ``allowance``."""
    values: dict[Node, Node | None] = {}
    while not search.done:
        index = search.index
        best: tuple[float, float, _Candidate] | None = None
        for node in search.graph.nodes:
            if node not in values:  # (a node's target and kind of arguments never change)
                values[node] = _value(node, heavy=True)
            value = values[node]
            if value is None or value not in search.index.position:
                continue
            if value.meta.get(_GENERATION, 0) >= MAX_GENERATIONS:
                continue
            found = _candidate(index, value, heavy=True, spanning=search.way.spanning)
            if found is None:
                continue
            ops = [*_producers(found.chain), *_chain_writers(index, found.chain)]
            cost = sum(op_cost(n) for n in ops)
            if search.spent + cost > allowance:
                continue
            freed = value.meta["val"].untyped_storage().nbytes() or 1
            if best is None or cost / freed < best[0]:
                best = (cost / freed, cost, found)
        if best is None:
            return
        search.take(best[2], best[1])


def _chain_writers(index: _Index, chain: list[Node]) -> list[Node]:
    """The in-place writes a chain replays."""
    return [w for value in chain for w in _writers(index, value)]


def _producers(chain: list[Node]) -> list[Node]:
    """The ops a chain runs again (a batch norm's output is its producer's)."""
    return [n.args[0] if n.target is operator.getitem else n for n in chain]  # type: ignore[misc]


class _Index:
    """Positions, storages and readers of a graph's values, as they are now.

    Built again after every step of the search (the busiest node moves as values are
    recomputed), from ``before``, the index of the graph before that step, where given: what
    a node's value and arguments give (its storage, the storages it writes, a storage's
    readers) is taken from ``before`` wherever the step left it as it was. A step inserts
    nodes, erases some and rewires the late readers; the storages whose readers that changes
    are those of the nodes it added, erased or rewired and of their inputs, before and after
    (the rest keep their readers, in the same order: nodes never move)."""

    def __init__(
        self,
        graph: Graph,
        before: _Index | None = None,
        scratch: Callable[[Node], int] | None = None,
        shared: bool = False,
    ) -> None:
        self.nodes = list(graph.nodes)
        # Whether the modelled peak counts a result written over its dying operand once.
        self._shared: bool = shared if before is None else before._shared
        # Per node: its kernel's scratch (``recompute``'s ``scratch``), asked once per node.
        self._scratch_of: Callable[[Node], int] | None = (
            scratch if before is None else before._scratch_of
        )
        self._scratch: dict[Node, int] = {} if before is None else before._scratch
        self.position = {n: i for i, n in enumerate(self.nodes)}
        # Per node: its arguments as indexed (to tell a rewired node), its value's storage and
        # the nodes whose storages it writes in place.
        self._args: dict[Node, tuple[object, object, list[Node]]] = {}
        self._key: dict[Node, StorageWeakRef | None] = {} if before is None else before._key
        self._writes_to: dict[Node, list[Node]] = {}
        self._readers: dict[StorageWeakRef, list[Node]] = {}
        self._nbytes: dict[StorageWeakRef, int] = {} if before is None else before._nbytes
        self.key: dict[Node, StorageWeakRef] = {}
        self._over: dict[Node, int] = {}  # per node, its ``_written_over`` once asked
        self.members: dict[StorageWeakRef, list[Node]] = {}
        self.inputs: set[StorageWeakRef] = set()
        touched: list[Node] = []  # nodes whose users may differ from ``before``'s
        for n in self.nodes:
            args = n.args, n.kwargs
            seen = None if before is None else before._args.get(n)
            if seen is not None and seen[0] is args[0] and seen[1] is args[1]:
                self._args[n] = seen
                self._writes_to[n] = before._writes_to[n]  # type: ignore[union-attr]
            else:
                inputs = n.all_input_nodes
                self._args[n] = (*args, inputs)
                self._writes_to[n] = _written_by(n)
                if before is not None:
                    touched += [n, *inputs, *(seen[2] if seen is not None else ())]
            if n in self._key:
                key = self._key[n]
            else:
                val = n.meta.get("val")
                if isinstance(val, torch.Tensor):
                    key = storage_key(val)
                    self._nbytes.setdefault(key, val.untyped_storage().nbytes())
                else:
                    key = None
                self._key[n] = key
            if key is not None:
                self.key[n] = key
                self.members.setdefault(key, []).append(n)
                if n.op in ("placeholder", "get_attr"):
                    self.inputs.add(key)
        if before is not None:
            for n, (_, _, inputs) in before._args.items():
                if n not in self.position:  # erased
                    touched += [n, *inputs]
            stale = {self._key.get(n) for n in touched}
            self._readers = {k: r for k, r in before._readers.items() if k not in stale}
            # A node's ``_written_over`` reads its storage's first member and its arguments'
            # last readers: kept where none of those storages changed.
            self._over = {
                n: over
                for n, over in before._over.items()
                if n in self.position
                and self._key.get(n) not in stale
                and not any(self._key.get(a) in stale for a in self._args[n][2])
            }
        # Where each storage is written in place (an op's mutable argument on it).
        self.written: dict[StorageWeakRef, list[int]] = {}
        for n in self.nodes:
            for target in self._writes_to[n]:
                if target in self.key:
                    self.written.setdefault(self.key[target], []).append(self.position[n])
        self.busiest, self.peak = self._busiest(self._shared)

    def unchanged(self, node: Node, after: int, before: int) -> bool:
        """Whether nothing writes ``node``'s storage between those two positions."""
        key = self.key.get(node)
        return key is not None and not any(after < at < before for at in self.written.get(key, ()))

    def judged(self, shared: bool) -> int:
        """The modelled peak, ``shared`` or not (``_busiest``)."""
        return self.peak if shared == self._shared else self._busiest(shared)[1]

    def _busiest(self, shared: bool) -> tuple[int, int]:
        """The node where the most bytes are alive (``_alive``), and how many (the modelled
        peak). ``shared``: a result written over its dying operand counts once, as the
        executor places it (closer to the measured peak: the search steered so reaches
        ViT-tiny's least memory 14% lower, measured)."""
        alive = self._alive
        if shared:  # a result written over its dying operand: one buffer
            alive = [a - self._written_over(n) for a, n in zip(alive, self.nodes, strict=True)]
        best = at = 0
        for i, total in enumerate(alive):
            if total > best:
                best, at = total, i
        return at, best

    @functools.cached_property
    def _alive(self) -> list[int]:
        """Per node, the bytes of the graph's own storages alive there (each from its first
        member to its last reader) and its kernel's scratch where ``scratch`` gives it: an
        estimate, enough to tell which values are idle across the peak. Both ways of
        counting the peak (``_busiest``) start from it."""
        live = [0] * (len(self.nodes) + 1)
        for key, members in self.members.items():
            if key in self.inputs:
                continue
            start = self.position[members[0]]  # members are in graph order
            readers = self.readers(key)
            end = self.position[readers[-1]] if readers else start
            nbytes = self._nbytes[key]
            live[start] += nbytes
            live[end + 1] -= nbytes
        alive, total = [], 0
        for n, delta in zip(self.nodes, live, strict=False):  # (live has one more)
            total += delta
            scratch = 0  # live at its node only
            if self._scratch_of is not None and n.op == "call_function":
                if n not in self._scratch:
                    self._scratch[n] = self._scratch_of(n)
                scratch = self._scratch[n]
            alive.append(total + scratch)
        return alive

    def _written_over(self, node: Node) -> int:
        """The bytes of ``node``'s result where the executor writes it over an operand that
        dies there (a pointwise op, an operand of the result's very layout: ``analyse``'s
        ``inplace``), 0 elsewhere: at that node the two take one buffer."""
        over = self._over.get(node)
        if over is None:
            over = self._over[node] = self._written_over_now(node)
        return over

    def _written_over_now(self, node: Node) -> int:
        target = node.target
        if node.op != "call_function" or not isinstance(target, OpOverload):
            return 0
        if torch.Tag.pointwise not in target.tags or mutates(node):
            return 0
        val, key = node.meta.get("val"), self.key.get(node)
        if not isinstance(val, torch.Tensor) or key is None or self.members[key][0] is not node:
            return 0
        layout = value_layout(node)
        for arg in node.args:
            other = self.key.get(arg) if isinstance(arg, Node) else None
            if other is None or other == key or other in self.inputs:
                continue
            readers = self.readers(other)
            dies = bool(readers) and readers[-1] is node
            if dies and value_layout(arg) == layout:  # type: ignore[arg-type]
                return self._nbytes[key]
        return 0

    def readers(self, key: StorageWeakRef) -> list[Node]:
        """The nodes that read the storage ``key`` (not its aliases), in graph order."""
        found = self._readers.get(key)
        if found is None:
            members = set(self.members[key])
            # A split of the storage is a view, not a reader: its pieces are members, and
            # their users read it.
            readers = {
                u
                for m in members
                for u in m.users
                if u not in members and not _split_of(u, members)
            }
            found = self._readers[key] = sorted(readers, key=self.position.__getitem__)
        return found

    def alive_at(self, node: Node, at: int) -> bool:
        """Whether ``node``'s storage is alive at position ``at`` without recomputation."""
        key = self.key.get(node)
        if key is None:
            return False
        if key in self.inputs:
            return True
        return any(self.position[r] >= at for r in self.readers(key))


def _written_by(node: Node) -> list[Node]:
    """The nodes whose storages ``node`` writes in place (its mutable arguments)."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None:
        return []
    return [
        target
        for argument, passed in zip(schema.arguments, node.args, strict=False)
        if argument.alias_info is not None and argument.alias_info.is_write
        for target in _nodes_in([passed])
    ]


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
        return isinstance(node.meta.get("val"), torch.Tensor) or target in _MULTI
    if heavy and target in EMPTY_FACTORIES:
        return _random_filled(node)
    if heavy and target in _SOFTMAX:
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


def _random_filled(node: Node) -> bool:
    """Whether ``node`` is a fresh tensor (dropout's noise) that a random fill overwrites
    whole, and big enough that keeping the generator's state instead is worth it."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return False
    if val.untyped_storage().nbytes() < REPLAY_MIN_RATIO * state_bytes(val.device):
        return False
    return any(replayable(u) and u.args[0] is node for u in node.users)


def _only_views(index: _Index, value: Node, *, writers: bool = False) -> bool:
    # The value's storage is reached through the value and chains of views of it alone
    # (detach, reshape, transpose ...), and each view can be taken again of the recomputed
    # value. ``writers``: in-place pointwise ops on it are allowed too (torchvision's
    # ``ReLU(inplace=True)`` after a batch norm, the ``+=`` of a residual), and random fills
    # from the default generator (dropout's noise), replayed in order on the recomputed value
    # (``_apply``); elsewhere nothing may write it.
    key = index.key.get(value)
    if key is None or key in index.inputs:
        return False
    members = set(index.members[key])
    for member in members:
        if member is value:
            continue
        target = member.target
        if target is operator.getitem:  # one piece of a split (GPT-2's q, k, v)
            if not _split_of(member.args[0], members):
                return False
            continue
        if not isinstance(target, OpOverload):
            return False
        if mutates(member):
            replayed = _inplace_pointwise(member) or replayable(member)
            if not (writers and replayed and member.args[0] in members):
                return False
            continue
        if not _is_view(target):
            return False
        if not member.args or member.args[0] not in members:
            return False
        if _nodes_in([*member.args[1:], *member.kwargs.values()]):
            return False
    return True


def _split_of(node: object, members: set[Node]) -> bool:
    """Whether ``node`` splits one of ``members`` into views (``_splits``)."""
    return isinstance(node, Node) and _splits(node) and node.args[0] in members


def _splits(node: object) -> bool:
    """Whether ``node`` splits its first argument into views (``split``, ``unbind``): a list
    of aliases, with no other tensor input."""
    if not isinstance(node, Node) or not isinstance(node.target, OpOverload) or mutates(node):
        return False
    returns = node.target._schema.returns
    return (
        len(returns) == 1
        and returns[0].alias_info is not None
        and isinstance(node.meta.get("val"), (list, tuple))
        and bool(node.args)
        and isinstance(node.args[0], Node)
        and not _nodes_in([*node.args[1:], *node.kwargs.values()])
    )


def _inplace_pointwise(node: Node) -> bool:
    """An in-place pointwise op without randomness that writes its first argument only."""
    target = node.target
    if not isinstance(target, OpOverload) or not node.args:
        return False
    arguments = target._schema.arguments
    first = arguments[0].alias_info if arguments else None
    return (
        torch.Tag.pointwise in target.tags
        and torch.Tag.nondeterministic_seeded not in target.tags
        and first is not None
        and first.is_write
        and not any(a.alias_info is not None and a.alias_info.is_write for a in arguments[1:])
    )


def _writers(index: _Index, value: Node) -> list[Node]:
    """The in-place ops on ``value``'s storage, in graph order."""
    members = index.members[index.key[value]]
    return sorted((m for m in members if mutates(m)), key=index.position.__getitem__)


class _Candidate(NamedTuple):
    """A value that can be computed again: where (``at``), for which late readers, and the
    values computed again there (inputs first, the value last)."""

    value: Node
    at: int
    late: list[Node]
    chain: list[Node]


def _candidate(
    index: _Index, value: Node, heavy: bool = False, spanning: bool = False
) -> _Candidate | None:
    """``value`` computed again for its readers after a gap of its reads that spans the
    busiest node: its longest gap, or (``spanning``) whichever spans it, its first reader
    after that node the first it serves (a depthwise convolution's output, read by the next
    layer norm and long after by its own backward, right after the busiest node); ``None``
    where it cannot be (see the module's rules)."""
    key = index.key.get(value)
    if key is None or key in index.inputs:
        return None
    readers = index.readers(key)
    if not readers or any(r.op == "output" for r in readers):
        return None
    points = [index.position[value], *(index.position[r] for r in readers)]
    if spanning:
        split = next((i for i in range(1, len(points)) if index.busiest < points[i]), 0)
    else:
        split = max((points[i] - points[i - 1], i) for i in range(1, len(points)))[1]
    at = points[split]
    # Only a value idle across the step's busiest node lowers its peak; others would cost
    # time for nothing.
    if not split or not points[split - 1] < index.busiest < at:
        return None
    if at - points[split - 1] < (HEAVY_MIN_GAP if heavy else MIN_GAP):
        return None
    if not _only_views(index, value, writers=True):  # (the costliest test, asked last)
        return None
    late = [r for r in readers if index.position[r] >= at]
    if any(mutates(r) for r in late) or not _writes_replayable(index, value, at):
        return None
    chain = _chain(index, value, at, 0, heavy)
    if chain is None:
        return None
    return _Candidate(value, at, late, chain)


def _writes_replayable(index: _Index, value: Node, at: int) -> bool:
    """Whether ``value``'s in-place writes can be replayed on it computed again at ``at``:
    each comes before that, and its other inputs are there, unchanged, when it is replayed;
    a fresh tensor's first write is a random fill of the whole of it."""
    writers = _writers(index, value)
    if value.target in EMPTY_FACTORIES and (
        not writers or not replayable(writers[0]) or writers[0].args[0] is not value
    ):
        return False
    members = set(index.members[index.key[value]])
    for writer in writers:
        if index.position[writer] >= at:
            return False
        for arg in _nodes_in([*writer.args[1:], *writer.kwargs.values()]):
            if arg in members:
                continue  # the value itself (``h.add_(h)``): read from its copy, replayed so far
            if not index.alive_at(arg, at) or not index.unchanged(arg, index.position[writer], at):
                return False
    return True


def _apply(graph: Graph, index: _Index, found: _Candidate, fakes: object) -> None:
    key = index.key[found.value]
    first_late = index.nodes[found.at]
    made: dict[Node, Node] = {}
    members = index.members[key]
    with graph.inserting_before(first_late):
        for original in found.chain:  # each value with its in-place writes, in order
            made[original] = _emit(graph, original, made, fakes)
            for writer in _writers(index, original):
                made[writer] = _emit_write(graph, writer, made, fakes)
        for reader in found.late:
            for member in members:
                if member in reader.all_input_nodes:
                    reader.replace_input_with(member, _view_again(graph, member, made, fakes))
    # Detaches nobody reads any more (autograd's saved-tensor handles, recorded where the
    # backward unpacked them) would otherwise keep the original alive to their place, and a
    # value all of whose readers were late would run for nothing. (An in-place op is kept:
    # the forward's readers read what it wrote.)
    erased: set[Node] = set()
    for member in reversed(members):
        _erase_unread(graph, member, erased)


def _erase_unread(graph: Graph, node: Node, erased: set[Node]) -> None:
    """Erase ``node`` if nothing reads it and running it changes nothing else (no in-place
    write, no draw from a generator), and then each of its inputs left so. A value whose
    readers were all late is one such (a copy of a copy: ConvNeXt-T's least memory ran five
    matrix products of up to 25 MB for nothing)."""
    if node in erased or node.op != "call_function" or node.users or mutates(node):
        return
    target = node.target
    if target is not operator.getitem and (
        not isinstance(target, OpOverload) or torch.Tag.nondeterministic_seeded in target.tags
    ):
        return
    inputs = node.all_input_nodes
    graph.erase_node(node)
    erased.add(node)
    for arg in inputs:
        _erase_unread(graph, arg, erased)


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
    if member.target is operator.getitem:  # a piece of a split taken again
        again = graph.call_function(operator.getitem, (base, member.args[1]))
        again.meta["val"] = base.meta["val"][member.args[1]]
        made[member] = again
        return again
    target = _op(member)
    again = graph.call_function(target, (base, *member.args[1:]), dict(member.kwargs))
    with fakes:  # type: ignore[attr-defined]
        again.meta["val"] = target(base.meta["val"], *member.args[1:], **member.kwargs)
    again.meta["stack_trace"] = member.meta.get("stack_trace")
    made[member] = again
    return again


def _emit_write(graph: Graph, writer: Node, made: dict[Node, Node], fakes: object) -> Node:
    """The in-place op ``writer`` again, on the recomputed value (its first argument); a
    random fill draws again from the generator state saved right before the forward's."""
    target = _op(writer)
    base = _view_again(graph, writer.args[0], made, fakes)  # type: ignore[arg-type]
    # Its other inputs as the forward's write read them: the recomputed value itself (or a
    # view of it) where the write reads its own target (``h.add_(h)``), as replayed so far.
    rest = tuple(_again(graph, a, made, fakes) for a in writer.args[1:])
    kwargs = {k: _again(graph, v, made, fakes) for k, v in writer.kwargs.items()}
    if replayable(writer):
        with graph.inserting_before(writer):
            state = graph.call_function(rng_state_op(), (writer.args[0],))
        with fakes:  # type: ignore[attr-defined]
            state.meta["val"] = rng_state_op()(writer.args[0].meta["val"])  # type: ignore[union-attr]
        again = graph.call_function(replay_op(target), (state, base, *rest), kwargs)
    else:
        again = graph.call_function(target, (base, *rest), kwargs)

    def val(a: object) -> object:
        return a.meta["val"] if isinstance(a, Node) else a

    with fakes:  # type: ignore[attr-defined]
        # The fake result aliases the recomputed value's fake storage, as the op's does.
        again.meta["val"] = target(
            base.meta["val"], *(val(a) for a in rest), **{k: val(v) for k, v in kwargs.items()}
        )
    again.meta["stack_trace"] = writer.meta.get("stack_trace")
    return again


def _chain(
    index: _Index, value: Node, at: int, depth: int, heavy: bool = False
) -> list[Node] | None:
    """The values to compute again at position ``at`` to have ``value`` there, inputs
    first; ``None`` where some input is neither alive there nor cheaply recomputed."""
    producer = value.args[0] if value.target is operator.getitem else value
    assert isinstance(producer, Node)
    args = producer.args[:3] if producer.target is _BATCH_NORM else producer.args
    if producer.target in EMPTY_FACTORIES:
        args = ()  # made again from its layout alone
    chain: list[Node] = []
    for arg in _nodes_in(args):
        if not index.unchanged(arg, index.position[producer], at):
            return None  # written in place since (a recurrent state): not the same inputs
        if index.alive_at(arg, at):
            continue
        if heavy and _small_beside(arg, value):
            continue  # kept to ``at`` instead (an attention's mask beside its scores)
        # Giving time for memory, an input that is a view (the reshape before a matrix
        # product) is taken again of its value computed again (``_emit``), and one written
        # in place (dropout's noise, filled and scaled) is its value with the writes replayed.
        base = _written_root(_view_root(arg)) if heavy else arg
        limit = MAX_CHAIN_HEAVY if heavy else MAX_CHAIN
        if depth + 1 >= limit or _value(base, heavy) is not base:
            return None
        if not _only_views(index, base, writers=heavy and base.target in EMPTY_FACTORIES):
            return None
        if heavy and not _writes_replayable(index, base, at):
            return None
        sub = _chain(index, base, at, depth + 1, heavy)
        if sub is None:
            return None
        chain += [n for n in sub if n not in chain]
    return [*chain, value]


def _small_beside(arg: Node, value: Node) -> bool:
    """Whether keeping ``arg`` until ``value`` is computed again costs at most a
    ``REPLAY_MIN_RATIO``-th of what recomputing ``value`` frees (GPT-2's causal mask, a
    quarter of the scores it is added to, made from index ops no chain recomputes)."""
    kept, freed = arg.meta.get("val"), value.meta.get("val")
    if not isinstance(kept, torch.Tensor) or not isinstance(freed, torch.Tensor):
        return False
    return REPLAY_MIN_RATIO * kept.untyped_storage().nbytes() <= freed.untyped_storage().nbytes()


def _written_root(node: Node) -> Node:
    """The value an in-place op's result is (``node`` itself if it writes nothing)."""
    while mutates(node) and node.args and isinstance(node.args[0], Node):
        node = node.args[0]
    return node


def _is_view(target: OpOverload) -> bool:
    """Whether ``target`` returns a view of its first argument: an aliasing result, or
    ``_unsafe_view`` (a reshape's result that declares no alias, but is one: matmul's)."""
    returns = target._schema.returns
    return target is aten._unsafe_view.default or (
        len(returns) == 1 and returns[0].alias_info is not None
    )


def _view_root(node: Node) -> Node:
    """The value ``node`` views through a chain of views and pieces of splits (timm's
    ``q, k, v = qkv.unbind(0)``), ``node`` itself if it is none of them."""
    while True:
        if node.target is operator.getitem and _splits(node.args[0]):
            node = node.args[0]  # type: ignore[assignment]
        elif (
            isinstance(node.target, OpOverload)
            and not mutates(node)
            and _is_view(node.target)
            and node.args
            and isinstance(node.args[0], Node)
            and not _nodes_in([*node.args[1:], *node.kwargs.values()])
        ):
            node = node.args[0]
        else:
            return node


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


def _again(graph: Graph, a: Argument, made: dict[Node, Node], fakes: object) -> Argument:
    """Argument ``a`` of an op computed again: a value computed again (or a view of one, taken
    again) in place of the original, any other as it is."""
    if isinstance(a, Node):
        if a not in made and _view_root(a) in made:  # a view of a value computed again
            return _view_again(graph, a, made, fakes)
        return made.get(a, a)
    if isinstance(a, (list, tuple)):
        return type(a)(_again(graph, x, made, fakes) for x in a)
    return a


def _emit(graph: Graph, value: Node, made: dict[Node, Node], fakes: object) -> Node:
    def arg(a: Argument) -> Argument:
        return _again(graph, a, made, fakes)

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
    elif value.target in EMPTY_FACTORIES:  # fresh memory of the same layout (a fill follows)
        val = value.meta["val"]
        out = graph.call_function(
            aten.empty_strided.default,
            (list(val.shape), list(val.stride())),
            {"dtype": val.dtype, "device": val.device, "pin_memory": False},
        )
        out.meta["val"] = fresh_fake(val, fakes)
    else:
        args = tuple(arg(a) for a in value.args)
        kwargs = {k: arg(v) for k, v in value.kwargs.items()}
        out = graph.call_function(_op(value), args, kwargs)
        out.meta["val"] = fresh_fake(value.meta["val"], fakes)
    out.meta["stack_trace"] = value.meta.get("stack_trace")
    out.meta[_GENERATION] = value.meta.get(_GENERATION, 0) + 1
    return out


def _static(graph: Graph) -> bool:
    for n in graph.nodes:
        val = n.meta.get("val")
        for t in val if isinstance(val, (tuple, list)) else [val]:
            if isinstance(t, torch.Tensor) and not all(type(d) is int for d in t.shape):
                return False
    return True
