"""A lower bound on any plan's peak where the step's floor undercounts: GPT-2's tanh GELU.

DESIGN §7 asks the least-memory setting to come within 2% of the step's floor
(``plan_summary().floor``): the most bytes one op needs at once (its operands and results, a
pointwise result written over an operand that dies there counted once) beside the gradients
made before it. A region of pointwise ops on tensors of one size needs more at once than any
one of its ops: transformers' GPT-2 computes its tanh GELU as 9 pointwise ops forward and 12
backward, each on a tensor the MLP's width (4 MB at batch 4, sequence 256, width 1,024).

For each such region (found around each ``tanh_backward``), this searches every schedule of
its ops, with any recomputation, for the fewest of its tensors alive at once (``fewest_alive``):
its inputs from outside the region free (they are smaller), each value the region hands on
read once while it is alive, a pointwise result written over an operand that dies there, as
the executor places it. The bound adds, once the region's backward has begun, the gradients
made before the region's first backward op, as the floor counts them; nothing else is counted
(the gradient that flows past the block, the values kept for other blocks), so no plan that
runs the traced ops goes below it.

Regions with an in-place write are refused: the search takes each op to make a new value.

    python benchmarks/floor_bound.py [--quick] [--json PATH]   # --quick: GPT-2 without dropout
"""

from __future__ import annotations

import heapq
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch
from torch.fx import GraphModule, Node
from torch.multiprocessing.reductions import StorageWeakRef

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Progress, Row, row, script_main

import sharedmem as sm
from sharedmem._executor.codegen import mutates
from sharedmem._executor.graph import graph_outputs, storage_key

__all__ = ["Region", "fewest_alive", "regions", "run"]


class Region(NamedTuple):
    """Ops of one size: per op, the region's values it reads (by op) and whether it is
    pointwise; the ops whose values are read outside the region; the bytes of each value;
    the ops that run in the backward."""

    reads: dict[str, tuple[str, ...]]
    pointwise: dict[str, bool]
    handed_on: frozenset[str]
    nbytes: int
    backward: frozenset[str]


def fewest_alive(region: Region, after_backward: int = 0) -> int:
    """The least peak of any schedule of ``region``'s ops (each run as often as wanted):
    ``nbytes`` per value alive, plus ``after_backward`` bytes once a backward op has run.
    Every handed-on value is alive at some moment (read there); a pointwise op may write its
    result over an operand that dies there. A bottleneck search over the sets of values
    alive (a few thousand on a GELU's 21 ops)."""
    names = sorted(region.reads)
    bit = {n: 1 << i for i, n in enumerate(names)}
    goal = sum(1 << i for i, n in enumerate(names) if n in region.handed_on)

    def cost(alive: int, begun: bool) -> int:
        return bin(alive).count("1") * region.nbytes + (after_backward if begun else 0)

    start = (0, 0, False)  # (alive, handed on so far, backward begun)
    best = {start: 0}
    queue = [(0, start)]
    while queue:
        peak, state = heapq.heappop(queue)
        alive, seen, begun = state
        if peak > best.get(state, peak):
            continue
        if seen == goal:
            return peak
        moves: list[tuple[int, tuple[int, int, bool]]] = []
        for n in names:
            if alive & bit[n]:
                moves.append((peak, (alive & ~bit[n], seen, begun)))
        for n in names:
            args = region.reads[n]
            if alive & bit[n] or any(not alive & bit[a] for a in args):
                continue
            now = begun or n in region.backward
            made = seen | (bit[n] & goal)
            grown = alive | bit[n]
            moves.append((max(peak, cost(grown, now)), (grown, made, now)))
            if region.pointwise[n]:  # written over an operand that dies here: its bytes
                for a in set(args):
                    moves.append((max(peak, cost(alive, now)), (grown & ~bit[a], made, now)))
        for p, s in moves:
            if p < best.get(s, p + 1):
                best[s] = p
                heapq.heappush(queue, (p, s))
    raise ValueError("sharedmem: the region's handed-on values cannot all be computed")


def _nbytes(node: Node) -> int:
    val = node.meta.get("val")
    return val.untyped_storage().nbytes() if isinstance(val, torch.Tensor) else 0


def regions(gm: GraphModule, seeds: Sequence[Node]) -> list[tuple[Node, Region, int]]:
    """For each seed, the region of ops around it whose results are new tensors of its size
    (views followed to the op that made their storage), and the traced position of the
    region's first backward op: the first after the step's first returned value (its loss)."""
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    maker: dict[object, Node] = {}
    for n in nodes:
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):
            maker.setdefault(storage_key(val), n)
    loss = min(position[maker[k]] for k in _returned(nodes) if k in maker)

    def made_by(n: Node) -> Node | None:
        val = n.meta.get("val")
        return maker.get(storage_key(val)) if isinstance(val, torch.Tensor) else None

    found = []
    for seed in seeds:
        size = _nbytes(seed)

        def member(n: Node | None, size: int = size) -> bool:
            return n is not None and n.op == "call_function" and _nbytes(n) == size

        ops: set[Node] = set()
        todo = [seed]
        while todo:
            n = todo.pop()
            if n in ops:
                continue
            ops.add(n)
            near = [made_by(a) for a in n.all_input_nodes] + [made_by(u) for u in _readers(n)]
            todo += [m for m in near if member(m) and m not in ops]
        reads = {
            n.name: tuple(
                sorted(
                    {m.name for a in n.all_input_nodes if (m := made_by(a)) in ops and m is not n}
                )
            )
            for n in ops
        }
        pointwise = {n.name: torch.Tag.pointwise in getattr(n.target, "tags", ()) for n in ops}
        handed_on = frozenset(
            n.name
            for n in ops
            if any(made_by(u) not in ops for u in _readers(n) if u.op != "output")
        )
        backward = frozenset(n.name for n in ops if position[n] > loss)
        start = min((position[n] for n in ops if n.name in backward), default=len(nodes))
        found.append((seed, Region(reads, pointwise, handed_on, size, backward), start))
    return found


def _readers(n: Node) -> list[Node]:
    """The nodes that read ``n``'s value, through views of it."""
    found, todo = [], list(n.users)
    while todo:
        u = todo.pop()
        val = u.meta.get("val")
        if isinstance(val, torch.Tensor) and _nbytes(u) == _nbytes(n) and _aliases(u, n):
            if mutates(u):
                raise ValueError(f"sharedmem: {u.name} writes {n.name} in place: not bounded here")
            todo += list(u.users)  # a view of it: its readers read it
        else:
            found.append(u)
    return found


def _aliases(u: Node, n: Node) -> bool:
    a, b = u.meta.get("val"), n.meta.get("val")
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and (storage_key(a) == storage_key(b))
    )


def _made_before(gm: GraphModule) -> list[int]:
    """Per traced position, the bytes of what the step returns (its gradients) made before
    it, as the floor counts them."""
    nodes = list(gm.graph.nodes)
    outs = _returned(nodes)
    made: set[object] = set()
    total, before = 0, []
    for n in nodes:
        before.append(total)
        val = n.meta.get("val")
        if n.op == "call_function" and isinstance(val, torch.Tensor):
            key = storage_key(val)
            if key in outs and key not in made:
                made.add(key)
                total += val.untyped_storage().nbytes()
    return before


def _returned(nodes: list[Node]) -> set[StorageWeakRef]:
    """The storages of what the step returns (its loss, its gradients)."""
    return {storage_key(o.meta["val"]) for o in graph_outputs(nodes[-1]) if isinstance(o, Node)}


def run(quick: bool = False, device: str = "cpu", progress: Progress | None = None) -> list[Row]:
    """Per configuration (GPT-2, and with dropout unless ``quick``): each GELU's bound and
    the step's, against the step's floor."""
    progress = progress or Progress.quiet()
    rows: list[Row] = []
    for name in ("gpt2",) if quick else ("gpt2", "gpt2_dropout"):
        rows += _bounds(name, progress)
    return rows


def _bounds(name: str, progress: Progress) -> list[Row]:
    import bench_pareto

    try:
        model, x, y, loss_fn = bench_pareto.MODELS[name]()
    except ImportError as e:
        return [row(f"{name}: the GELUs' bound", 0, "", target=f"not built: {e}", ok=None)]
    progress.say(f"floor bound: tracing {name} ...")
    step = sm.pooled_train_step(
        model, loss_fn, pool=sm.BufferPool("cpu"), recompute=sm.Recompute.MOST
    )
    step.memory_plan(x, y)  # traces the step, and keeps the trace for its first call
    (traced,) = step._traced.values()  # the graph as traced, before recomputation
    gm = traced.gm
    model.zero_grad(set_to_none=True)
    step(x, y)
    floor = step.plan_summary().floor  # as bench_pareto's "least memory against its floor"
    seeds = [n for n in gm.graph.nodes if n.target is torch.ops.aten.tanh_backward.default]
    made = _made_before(gm)
    rows, bound = [], 0
    for seed, region, start in regions(gm, seeds):
        ops = len(region.reads)
        progress.say(f"floor bound: {name}, the region around {seed.name} ({ops} ops) ...")
        least = fewest_alive(region, made[start])
        bound = max(bound, least)
        label = f"{name}: least peak of the tanh GELU around {seed.name} ({ops} ops)"
        rows.append(row(label, least, "B", baseline=floor))
    rows.append(
        row(
            f"{name}: no plan below (the GELUs' bound, against the step's floor)",
            bound,
            "B",
            baseline=floor,
            target="a floor within 2% is reachable only at or below 1.02x",
            ok=None,
        )
    )
    return rows


if __name__ == "__main__":
    script_main(__doc__, run, "what no plan goes below on {device}")
