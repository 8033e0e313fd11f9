"""What each node of a traced graph needs: which results go into the pool, and for how long.

Aliasing is read from the traced fake tensors themselves: every result shares a storage with
exactly the values it aliases (views, in-place results, ``detach``), so the lifetime of a
pooled intermediate ends at the last read of any tensor on its storage. This needs no list of
view ops; where a view's fake result shows a fresh storage anyway, it is taken to alias all
of its inputs.

A pooled result must hold its value in exactly the layout the trace gave it: later ops were
traced against that layout (the views taken of it, a result written over it). An out= kernel
that may ignore ``out``'s strides is therefore given a pool view only where that layout is
contiguous, and otherwise allocates as it does in eager.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._ops import OpOverload
from torch.fx import Graph, GraphModule, Node
from torch.multiprocessing.reductions import StorageWeakRef

from .._errors import SharedMemError
from .._layout import extent
from .._routing.kernels import KernelMemory, kernel_memory
from .ops import Kind, OpRule, rule_for
from .plan import Lifetime

aten = torch.ops.aten

__all__ = [
    "BATCH_NORMS",
    "Analysis",
    "Buffer",
    "NodeRun",
    "analyse",
    "fake_mode",
    "fresh_fake",
    "graph_outputs",
    "measured_scratch",
    "node_results",
    "op_name",
    "op_sequence",
    "size_arithmetic",
    "storage_key",
    "value_layout",
]

_PLAIN = OpRule(Kind.PLAIN)
_ALIAS = OpRule(Kind.ALIAS)


@dataclass(frozen=True)
class Buffer:
    """A pooled result: the layout it is written in, and its bytes in the pool."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int


@dataclass(frozen=True)
class NodeRun:
    """One ``call_function`` node, how it runs, and its pooled results.

    ``buffers`` has one entry per result for pooled kinds; an entry is ``None`` for a result
    of zero bytes, and ``lifetimes`` indexes parallel to ``buffers`` (``-1`` for ``None``).
    """

    node: Node
    index: int
    rule: OpRule
    buffers: tuple[Buffer | None, ...] = ()
    lifetimes: tuple[int, ...] = ()


@dataclass(frozen=True)
class Analysis:
    """The steps of a graph, the lifetimes of its pooled results, and what is not pooled.

    Attributes:
        steps: one per ``call_function`` node.
        lifetimes: one per pooled result.
        returned: the lifetimes that graph outputs read (their storage outlives the call).
        returned_by: per graph output, the lifetimes it reads.
        owned: per graph output, whether it is the whole of a storage made during the call
            that no other output shares, so the caller may keep it as it is.
        inplace: pairs ``(result, operand)`` of lifetimes where a pointwise op may write its
            result over an operand that dies at that op (same shape, strides and dtype), as
            its in-place form would; planning puts each pair in one buffer.
        over: per pair of ``inplace``, the graph value of the operand (what a result that is
            not pooled is written over).
        unpooled_bytes: bytes of intermediates allocated outside the pool per call.
        unpooled_ops: the ops that allocate them.
        beside: the lifetime of every fresh result of an op that always allocates (no native
            ``out=`` form), graph outputs included: what runs beside the pool, in time.
        scratch: per such op, the memory its kernel works in while it runs, measured or
            modelled (see ``_measured``, ``_scratch``) and live at its node only.
        beside_returned: per value of ``beside``, whether a graph output reads it (it
            outlives the call).
        floor: the most bytes one op needs live at once: its operands, results and measured
            scratch beside what outlives the call (gradients) made before it
            (``_floor``), a pointwise result counted once with an operand it can be
            written over. No placement and no recomputation that runs these ops in this
            order goes below it: the executor gives the floor of the step as traced, before
            anything is computed again (``plan_summary().floor``).
        floor_op: that op, and where in the model it comes from.
    """

    steps: list[NodeRun]
    lifetimes: list[Lifetime]
    returned: frozenset[int]
    returned_by: tuple[frozenset[int], ...]
    owned: tuple[bool, ...]
    inplace: tuple[tuple[int, int], ...]
    over: tuple[Node, ...]
    unpooled_bytes: int
    unpooled_ops: tuple[str, ...]
    beside: tuple[Lifetime, ...] = ()
    scratch: tuple[Lifetime, ...] = ()
    beside_returned: tuple[bool, ...] = ()
    floor: int = 0
    floor_op: str = ""
    # Per node whose kernel was measured, its allocations in order (``KernelMemory.sequence``).
    sequences: dict[int, tuple[tuple[int, int, int], ...]] = field(default_factory=dict)


def op_name(target: object) -> str:
    """A readable name of a node target: ``aten.mm.default``."""
    return str(target) if isinstance(target, OpOverload) else getattr(target, "__name__", "?")


def node_results(node: Node) -> list[object]:
    """The values ``node`` computes (its ``meta["val"]``, a tuple or list of them unpacked)."""
    val = node.meta.get("val")
    return list(val) if isinstance(val, (tuple, list)) else [val]


def analyse(gm: GraphModule, device: torch.device, *, measure: bool = True) -> Analysis:
    """Decide how each node runs on ``device`` and when each pooled result dies; with
    ``measure``, kernels' scratch and real result sizes are measured (``kernel_memory``)
    where they can be, else modelled."""
    nodes = list(gm.graph.nodes)
    position = {node: i for i, node in enumerate(nodes)}
    inputs: set[StorageWeakRef] = set()  # storages of placeholders and constants
    seen: set[StorageWeakRef] = set()
    storages: dict[Node, set[StorageWeakRef]] = {}
    owner: dict[StorageWeakRef, int] = {}  # storage of a pooled result -> its lifetime index
    starts: list[tuple[int, int]] = []  # (nbytes, start) per lifetime
    steps: list[NodeRun] = []
    plain: list[tuple[StorageWeakRef, int, str]] = []  # fresh results of PLAIN ops
    plain_owner: dict[StorageWeakRef, int] = {}  # their storages -> index into ``plain``
    plain_starts: list[int] = []
    scratch: list[Lifetime] = []
    measured_scratch: dict[int, int] = {}
    sequences: dict[int, tuple[tuple[int, int, int], ...]] = {}
    for i, node in enumerate(nodes):
        results = [r for r in node_results(node) if isinstance(r, torch.Tensor)]
        for r in results:
            if not all(type(d) is int for d in (*r.shape, *r.stride(), r.storage_offset())):
                raise SharedMemError(
                    f"sharedmem: {op_name(node.target)} is not supported by the pooled "
                    "executor: the shape of its result depends on tensor data, which a trace "
                    f"cannot fix{where(node)}. Compute it outside the model (a boolean mask "
                    "index, nonzero, unique ...) or use a form of fixed shape (torch.where, "
                    "masked_fill)"
                )
            if r.layout != torch.strided:
                raise SharedMemError(
                    f"sharedmem: {op_name(node.target)} returns a {r.layout} tensor; the pooled "
                    "executor runs strided (dense) tensors only"
                )
        keys = [storage_key(r) for r in results]
        storages[node] = set(keys)
        if node.op == "call_function":
            rule = _rule(node, device, all_fresh=len(set(keys) - seen) == len(results))
            if rule.kind is Kind.PLAIN:
                measured = _measured(node, results) if measure else None
                for k, (r, key) in enumerate(zip(results, keys, strict=True)):
                    if key not in seen and key not in plain_owner:
                        plain_owner[key] = len(plain)
                        # a result bigger than its fake shape (an RNN's workspace) counts
                        # at its real size
                        size = max(extent(r), measured.results[k]) if measured else extent(r)
                        plain.append((key, size, op_name(node.target)))
                        plain_starts.append(i)
                work = measured.scratch if measured else _scratch(node, results)
                if work:
                    scratch.append(Lifetime(work, i, i))
                if measured and measured.scratch:  # a floor counts no modelled bytes
                    measured_scratch[i] = measured.scratch
                if measured and measured.sequence:
                    sequences[i] = measured.sequence
                steps.append(NodeRun(node, i, rule))
            elif rule.kind is Kind.ALIAS:
                if not set(keys) <= seen:
                    # A view whose fake result did not share its input's storage: assume it
                    # aliases every input, which can only make lifetimes longer.
                    for used in node.all_input_nodes:
                        storages[node] |= storages[used]
                steps.append(NodeRun(node, i, rule))
            else:
                buffers = tuple(_buffer(r) for r in node_results(node))  # type: ignore[arg-type]
                ids = []
                for buffer, key in zip(buffers, keys, strict=True):
                    ids.append(-1 if buffer is None else len(starts))
                    if buffer is not None:
                        owner[key] = len(starts)
                        starts.append((buffer.nbytes, i))
                # Routed, the op runs as eager does and its kernel allocates its own temporaries
                # beside its results (a training batch norm's running-statistics updates: four
                # per layer, 36.5 MB of EfficientNet-B0's first accumulation call off its plan
                # unforeseen): the guided first call's prediction takes them from the measured
                # kernel, as for ops without out=. Only the batch norms: measuring every op
                # with out= cost a sixth more tracing time for kernels that allocate nothing.
                measured = (
                    _measured(node, results) if measure and node.target in BATCH_NORMS else None
                )
                if measured and measured.sequence:
                    sequences[i] = measured.sequence
                steps.append(NodeRun(node, i, rule, buffers, tuple(ids)))
        elif node.op in ("placeholder", "get_attr"):
            inputs.update(keys)
        elif node.op != "output":
            raise SharedMemError(
                f"sharedmem: the pooled executor cannot run graph node {node.format_node()}"
            )
        seen.update(keys)
    ends = [start for _, start in starts]
    plain_ends = list(plain_starts)
    for node in nodes:
        for used in node.all_input_nodes:
            for key in storages[used]:
                if key in owner:
                    ends[owner[key]] = max(ends[owner[key]], position[node])
                if key in plain_owner:
                    k = plain_owner[key]
                    plain_ends[k] = max(plain_ends[k], position[node])
    lifetimes = [Lifetime(n, s, e) for (n, s), e in zip(starts, ends, strict=True)]
    outputs = graph_outputs(nodes[-1])
    out_keys = [storages[o] if isinstance(o, Node) else set() for o in outputs]
    everything = [k for keys in out_keys for k in keys]
    kept = set(everything)
    beside, beside_returned = [], []
    for (key, n, _), s, e in zip(plain, plain_starts, plain_ends, strict=True):
        if n:
            beside.append(Lifetime(n, s, e))
            beside_returned.append(key in kept)
    returned = frozenset(owner[k] for k in everything if k in owner)
    returned_by = tuple(frozenset(owner[k] for k in keys if k in owner) for keys in out_keys)
    owned = tuple(
        isinstance(o, Node)
        and len(keys) == 1
        and everything.count(next(iter(keys))) == 1
        and not keys & inputs
        and is_whole(o)
        for o, keys in zip(outputs, out_keys, strict=True)
    )
    unpooled = [(n, op) for key, n, op in plain if key not in kept and n]
    ops = tuple(dict.fromkeys(op for _, op in unpooled))
    found = _inplace(steps, storages, owner, ends)
    inplace = tuple((result, operand) for result, operand, _ in found)
    over = tuple(node for _, _, node in found)
    unpooled_bytes = sum(n for n, _ in unpooled)
    sizes = {key: starts[i][0] for key, i in owner.items()}
    sizes.update((key, plain[i][1]) for key, i in plain_owner.items())
    # A pointwise result takes no bytes of its own where it can be written over an operand:
    # one that dies there (``inplace``), or one read again later, whose later readers a plan
    # can serve by computing it again (``recompute``), so that it dies there too.
    returned_lives = {owner[k] for k in kept if k in owner}
    could = _inplace(steps, storages, owner, ends, may_die=set(range(len(starts))) - returned_lives)
    over_bytes = {starts[result][1]: starts[result][0] for result, _, _ in could}
    floor, floor_at = _floor(nodes, storages, sizes, kept, measured_scratch, over_bytes)
    return Analysis(
        steps,
        lifetimes,
        returned,
        returned_by,
        owned,
        inplace,
        over,
        unpooled_bytes,
        ops,
        tuple(beside),
        tuple(scratch),
        tuple(beside_returned),
        floor,
        "" if floor_at is None else f"{op_name(floor_at.target)}{where(floor_at)}",
        sequences,
    )


def _floor(
    nodes: list[Node],
    storages: dict[Node, set[StorageWeakRef]],
    sizes: dict[StorageWeakRef, int],
    kept: set[StorageWeakRef],
    scratch: dict[int, int],
    over_bytes: dict[int, int],
) -> tuple[int, Node | None]:
    """The most bytes one op needs live, and the op (``Analysis.floor``): its operands,
    results and measured scratch, beside what outlives the call made before it (the
    gradients), less a result it can write over an operand (``over_bytes``, by position).
    Storages that were there before the call (parameters, inputs) have no size here: they
    are not the step's own bytes.

    Nothing else is alive at the op in every plan. A value made before it and read after it
    can be computed again for its later readers, the backward's too: GPT-2's decomposed GELU
    backward computes two of its products again where they are read, from values alive
    there, rather than keep them across the products between: counted as alive, they made
    a floor of 33.6 MB on its graph as traced, above the 32.9 MB its least memory measured."""
    made: set[StorageWeakRef] = set()  # storages that outlive the call, made so far
    made_bytes = best = 0
    at = None
    for i, node in enumerate(nodes):
        if node.op != "call_function":
            continue
        used = set(storages[node]).union(*(storages[u] for u in node.all_input_nodes))
        need = made_bytes + sum(sizes.get(k, 0) for k in used - made) + scratch.get(i, 0)
        need -= over_bytes.get(i, 0)
        if need > best:
            best, at = need, node
        for key in storages[node] & kept - made:
            made.add(key)
            made_bytes += sizes.get(key, 0)
    return best, at


def measured_scratch(node: Node) -> int:
    """The scratch ``node``'s kernel works in while it runs, as measured (``kernel_memory``:
    once per configuration, then kept), for the ops ``analyse`` measures (those run as eager
    runs them, without an out= form, and batch norms); 0 where it is not measured."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, OpOverload):
        return 0
    results = [r for r in node_results(node) if isinstance(r, torch.Tensor)]
    if not results:
        return 0
    if target not in BATCH_NORMS and rule_for(target, results[0].device.type).kind is not (
        Kind.PLAIN
    ):
        return 0
    found = _measured(node, results)
    return found.scratch if found is not None else 0


def _measured(node: Node, results: list[torch.Tensor]) -> KernelMemory | None:
    # A CPU kernel's own scratch and real result sizes, measured once per configuration
    # (``kernel_memory``); None where it is not measured, and then ``_scratch`` models it.
    def val(arg: object) -> object:
        return arg.meta.get("val") if isinstance(arg, Node) else arg

    args, kwargs = pytree.tree_map(val, (list(node.args), dict(node.kwargs)))
    found = kernel_memory(node.target, args, kwargs, results)
    return found if found is not None and len(found.results) == len(results) else None


def _scratch(node: Node, results: list[torch.Tensor]) -> int:
    # Where a kernel's scratch is not measured (no router; another device): kernels without
    # an out= form (oneDNN's convolutions, their backward) allocate working copies while they
    # run, a convolution's about its input in oneDNN's blocked layout, its backward's about
    # its input plus its results. So: the biggest tensor argument plus the results, an upper
    # bound for reduction kernels, which need none. Pointwise kernels and random fills write
    # their results directly (``kernel_memory`` does not measure them for that reason).
    target = node.target
    if isinstance(target, OpOverload) and {
        torch.Tag.pointwise,
        torch.Tag.nondeterministic_seeded,
    } & set(target.tags):
        return 0
    inputs = [n.meta.get("val") for n in node.all_input_nodes]
    biggest = max((extent(t) for t in inputs if isinstance(t, torch.Tensor)), default=0)
    return biggest + sum(extent(r) for r in results)


def _inplace(
    steps: list[NodeRun],
    storages: dict[Node, set[StorageWeakRef]],
    owner: dict[StorageWeakRef, int],
    ends: list[int],
    may_die: set[int] | frozenset[int] = frozenset(),
) -> list[tuple[int, int, Node]]:
    # A pointwise kernel reads element k of its operands before it writes element k of its
    # result, so writing over an operand with the very same layout is what ``add_`` does.
    # Without this, a backward chain (max_pool2d_backward -> threshold_backward) needs a
    # buffer for the dying operand and another for the result at the same moment.
    # ``may_die``: lifetimes taken as dying at every op that reads them (the floor's).
    pairs: list[tuple[int, int, Node]] = []
    used: set[int] = set()
    for step in steps:
        target = step.node.target
        if step.rule.kind is not Kind.OUT or len(step.buffers) != 1 or step.buffers[0] is None:
            continue
        if not isinstance(target, OpOverload) or torch.Tag.pointwise not in target.tags:
            continue
        result = step.buffers[0]
        operands = [a for a in step.node.args if isinstance(a, Node)]
        for operand in operands:
            keys = storages[operand]
            life = owner.get(next(iter(keys))) if len(keys) == 1 else None
            dies = ends[life] == step.index if life is not None else False
            if life is None or life in used or not (dies or life in may_die):
                continue
            # Every operand on that storage must be exactly the result's layout: a partial
            # overlap (a transposed view of it) would be read after being overwritten.
            same = [o for o in operands if storages[o] == keys]
            if all(value_layout(o) == _layout_of(result) for o in same):
                pairs.append((step.lifetimes[0], life, operand))
                if dies:  # (one taken as dying serves each of its readers so)
                    used.add(life)
                break
    return pairs


def value_layout(node: Node) -> tuple[object, ...]:
    """The shape, strides, dtype and storage offset of ``node``'s value (``()`` for one that
    is not a tensor): a pointwise result may be written over an operand of its very layout."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return ()
    return (tuple(val.shape), tuple(val.stride()), val.dtype, val.storage_offset())


def _layout_of(buffer: Buffer) -> tuple[object, ...]:
    return (buffer.size, buffer.stride, buffer.dtype, 0)


def where(node: Node) -> str:
    """Where the model's code made ``node``: '; at model.py:12, in forward: y = x[mask]'."""
    frames = re.findall(
        r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)', node.meta.get("stack_trace") or ""
    )
    if not frames:
        return ""
    filename, line, function, code = frames[-1]
    return f"; at {filename}:{line}, in {function}: {code.strip()}"


def fake_mode(graph: Graph) -> Any | None:
    """The fake-tensor mode of a traced graph's values (``None`` for a graph without any)."""
    for n in graph.nodes:
        mode = getattr(n.meta.get("val"), "fake_mode", None)
        if mode is not None:
            return mode
    return None


def fresh_fake(like: object, mode: Any) -> object:
    """A fake tensor with ``like``'s layout on a storage of its own (``like`` itself when it
    is not a tensor): the value of a node a graph transform adds."""
    if not isinstance(like, torch.Tensor):
        return like
    with mode:
        return torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device=like.device)


def graph_outputs(output: Node) -> list[object]:
    """The values the graph's ``output`` node returns, as a list."""
    (flat,) = output.args
    return list(flat) if isinstance(flat, (list, tuple)) else [flat]


def is_whole(node: Node) -> bool:
    """Whether ``node``'s value covers its whole storage (so keeping it keeps no hidden
    extra bytes alive, and a caller may own it)."""
    val = node.meta.get("val")
    return (
        isinstance(val, torch.Tensor)
        and val.storage_offset() == 0
        and extent(val) == val.untyped_storage().nbytes()
    )


def _rule(node: Node, device: torch.device, *, all_fresh: bool) -> OpRule:
    target = node.target
    if target is operator.getitem:
        return _ALIAS
    if size_arithmetic(node):
        return _PLAIN  # a graph traced with symbolic sizes computes them from its inputs'
    if not isinstance(target, OpOverload):
        raise SharedMemError(
            f"sharedmem: the pooled executor cannot run {op_name(target)} (graph node "
            f"{node.name!r}): only ATen operators are supported"
        )
    rule = rule_for(target, device.type)
    if rule.kind in (Kind.PLAIN, Kind.ALIAS):
        return rule
    if target in BATCH_NORMS and _mixed_dtypes(node):
        return _PLAIN
    if rule.adapt is not None and rule.adapt(node.args, node.kwargs) is None:
        return _PLAIN
    results = node_results(node)
    if not all_fresh or node.kwargs.get("pin_memory"):
        return _PLAIN
    if not all(_poolable(r, device) for r in results):
        return _PLAIN
    if rule.kind is Kind.OUT and not _writes_through_strides(target) and not _contiguous(results):
        return _PLAIN  # eager's own allocation, in the layout its kernel really writes
    if rule.kind is not Kind.OUT and _buffer(results[0]) is None:  # type: ignore[arg-type]
        return _PLAIN  # a zero-byte factory or copy: nothing to pool
    return rule


def op_sequence(gm: GraphModule) -> tuple[object, ...]:
    """The ops a graph runs, in order, without the size arithmetic of a symbolic trace: two
    traces of one step that run the same ops compute the same bits (at their sizes)."""
    return tuple(
        n.target
        for n in gm.graph.nodes
        if n.op == "call_function" and n.target is not operator.getitem and not size_arithmetic(n)
    )


# Ops that read a tensor's sizes and nothing else (torch 2.11's symbolic trace records
# ``aten.size`` where later ones record ``sym_size`` for each dimension).
_SIZE_READS = frozenset(
    (aten.sym_size.int, aten.sym_numel.default, aten.size.default, aten.sym_stride.int)
)


def size_arithmetic(node: Node) -> bool:
    """Whether ``node`` computes a size (``sym_size``, ``8 * s0``): a number from numbers
    and the sizes of tensors, in a graph traced with symbolic sizes."""
    if node.target in _SIZE_READS:
        return True
    numbers = (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)
    return (
        callable(node.target)
        and not isinstance(node.target, OpOverload)
        and isinstance(node.meta.get("val"), numbers)
        and all(isinstance(n.meta.get("val"), numbers) for n in node.all_input_nodes)
    )


# Batch norm on a low-precision input with float32 parameters (autocast): the CPU kernel keeps
# its statistics (and the parameters' gradients) in float32, while the traced (meta) kernel
# says the input's dtype, so a pool buffer in the traced dtype is refused by the out= kernel.
# Such calls run as eager does; everything else about them is unchanged.
BATCH_NORMS: frozenset[OpOverload] = frozenset(
    getattr(aten, name).default
    for name in (
        "_native_batch_norm_legit_functional",
        "_native_batch_norm_legit",
        "_native_batch_norm_legit_no_training",
        "native_batch_norm",
        "native_batch_norm_backward",
    )
)


def _mixed_dtypes(node: Node) -> bool:
    dtypes = {
        arg.meta["val"].dtype
        for arg in node.args
        if isinstance(arg, Node) and isinstance(arg.meta.get("val"), torch.Tensor)
    }
    return len(dtypes) > 1


def _writes_through_strides(op: OpOverload) -> bool:
    # Pointwise ops and reductions run on TensorIterator, which writes through ``out``'s own
    # strides. Other out= kernels may assume ``out`` is contiguous: the softmax family
    # (``_softmax``, ``_log_softmax`` and their backwards, on CPU) writes its result row-major
    # whatever strides ``out`` has. Where the trace's layout for such an op is not contiguous
    # (``_log_softmax_backward_data`` of a transposed gradient: the fake kernel follows the
    # gradient's strides, the real one writes contiguously) a pool view in the traced layout
    # would be read back transposed.
    return torch.Tag.pointwise in op.tags or torch.Tag.reduction in op.tags


def _contiguous(results: list[object]) -> bool:
    return all(isinstance(r, torch.Tensor) and r.is_contiguous() for r in results)


def storage_key(t: torch.Tensor) -> StorageWeakRef:
    """Hashable and equal for tensors on one storage: views and in-place results share it."""
    return StorageWeakRef(t.untyped_storage())  # type: ignore[no-untyped-call]


def _poolable(result: object, device: torch.device) -> bool:
    # Fresh, dense, on the pool's device: a pool view can stand in for it exactly.
    return (
        isinstance(result, torch.Tensor)
        and result.device == device
        and result.storage_offset() == 0
        and extent(result) == result.untyped_storage().nbytes()
    )


def _buffer(result: torch.Tensor) -> Buffer | None:
    nbytes = extent(result)
    if nbytes == 0:
        return None
    return Buffer(
        size=tuple(result.shape),
        stride=tuple(result.stride()),
        dtype=result.dtype,
        nbytes=nbytes,
    )
