"""What an op of a traced graph costs in time, modelled: how recomputation is chosen.

A convolution or a matrix product is compute-bound: its time is its multiply-adds (two flops
each). Every other op (pointwise, norms, reductions, copies) is memory-bound: its time is the
bytes it reads and writes. One constant puts both on the same scale: ``FLOPS_PER_BYTE``, the
flops a device does in the time it moves one byte (its "machine balance"). Measured on this
project's 2-core CPU a float32 matmul runs about 8 flops per byte of a large copy; an H100
does about 20 (TF32 against HBM). The model is coarse on purpose: it ranks candidates (which
value is cheapest to compute again per byte it frees), and it gives the time a plan adds as a
fraction of the step's own modelled time, which is how a plan's cost is reported and how a
stated slowdown limits it. Views cost nothing.
"""

from __future__ import annotations

import math
import operator

import torch
from torch._ops import OpOverload
from torch.fx import Graph, Node

from .ops import EMPTY_FACTORIES

__all__ = [
    "FLOPS_PER_BYTE",
    "OP_CALL_FLOPS",
    "RANDOM_FLOPS_PER_ELEMENT",
    "call_cost",
    "graph_cost",
    "op_cost",
]

FLOPS_PER_BYTE = 8.0
# A CPU's random numbers are compute-bound: ``bernoulli_`` (dropout's draw) takes about 10 ns
# an element on this project's 2-core CPU, where a matmul does about 95 GFLOP/s. A GPU's
# Philox draws are memory-bound like any pointwise op.
RANDOM_FLOPS_PER_ELEMENT = 1000.0
# What calling one op costs whatever its size (dispatch from the generated code, the kernel's
# launch): about 3 us on this CPU. It is what running a batch in chunks adds, per op per chunk.
OP_CALL_FLOPS = 3e5

aten = torch.ops.aten


def op_cost(node: Node) -> float:
    """``node``'s modelled time, in flops (memory traffic converted at ``FLOPS_PER_BYTE``)."""
    target = node.target
    if node.op != "call_function" or target is operator.getitem:
        return 0.0
    if not isinstance(target, OpOverload):
        return 0.0
    flops = _flops(node, target)
    if flops is not None:
        return flops
    if target in EMPTY_FACTORIES:
        return 0.0  # allocates, computes nothing
    val = node.meta.get("val")
    drawn = torch.Tag.nondeterministic_seeded in target.tags
    if drawn and isinstance(val, torch.Tensor) and val.device.type == "cpu":
        return val.numel() * RANDOM_FLOPS_PER_ELEMENT
    schema = target._schema
    if len(schema.returns) == 1 and schema.returns[0].alias_info is not None:
        return 0.0  # a view (or an in-place op's returned alias, counted by its write)
    moved = sum(_nbytes(n.meta.get("val")) for n in node.all_input_nodes)
    return (moved + _nbytes(node.meta.get("val"))) * FLOPS_PER_BYTE


def graph_cost(graph: Graph) -> float:
    """The modelled time of every op of ``graph``, in flops."""
    return sum(op_cost(n) for n in graph.nodes)


def call_cost(graph: Graph) -> float:
    """The modelled time of one call of ``graph``: its ops' work and a fixed cost per op."""
    calls = sum(1 for n in graph.nodes if n.op == "call_function")
    return graph_cost(graph) + calls * OP_CALL_FLOPS


def _flops(node: Node, target: OpOverload) -> float | None:
    val = node.meta.get("val")
    args = [a.meta.get("val") if isinstance(a, Node) else a for a in node.args]
    if target is aten.convolution.default and isinstance(val, torch.Tensor):
        weight = args[1]
        assert isinstance(weight, torch.Tensor)
        return 2.0 * val.numel() * math.prod(weight.shape[1:])
    if target is aten.convolution_backward.default:
        grad, weight, mask = args[0], args[2], args[-1]
        assert isinstance(grad, torch.Tensor) and isinstance(weight, torch.Tensor)
        per_gradient = 2.0 * grad.numel() * math.prod(weight.shape[1:])
        wanted = list(mask)[:2] if isinstance(mask, (list, tuple)) else [True, True]
        return per_gradient * sum(bool(w) for w in wanted)
    if target is aten._scaled_dot_product_flash_attention_for_cpu.default:
        query, key = args[0], args[1]  # (batch, heads, length, dim): two products per pair
        assert isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor)
        return 4.0 * query.numel() * key.shape[-2]
    if target in (aten.mm.default, aten.addmm.default, aten.bmm.default):
        left = args[1] if target is aten.addmm.default else args[0]
        assert isinstance(left, torch.Tensor) and isinstance(val, torch.Tensor)
        return 2.0 * val.numel() * left.shape[-1]
    return None


def _nbytes(val: object) -> int:
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    if isinstance(val, (list, tuple)):
        return sum(_nbytes(v) for v in val)
    return 0
