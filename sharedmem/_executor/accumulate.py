"""Gradients added into ``p.grad`` inside the graph, right where each becomes final.

With gradients already present (gradient accumulation), a train graph that returned its
fresh gradients would hold all of them at its end, next to the ``p.grad`` they are then added
into: every gradient twice. Eager's ``AccumulateGrad`` adds each one as soon as backward has
made it and frees it. ``accumulating`` gives the graph the same shape: the existing gradients
become graph inputs, ``p.grad.add_(g)`` runs right after the op that makes ``g`` final, and
the graph returns ``None`` in its place, so ``g`` is an ordinary short-lived intermediate that
planning may put in a pool buffer shared with activations that died before it.

The add is the one eager runs (``variable_grad += new_grad``), so the sums are bit for bit the
same. As in eager, a call that fails part way through leaves the gradients it had already
added in ``p.grad``.
"""

from __future__ import annotations

import contextlib
import copy
from collections import Counter
from collections.abc import Sequence

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false as is_dense
from torch._prims_common import make_contiguous_strides_for
from torch.fx import Graph, GraphModule, Node
from torch.multiprocessing.reductions import StorageWeakRef

from .distributed import grad_taps
from .graph import fake_mode, fresh_fake, graph_outputs, is_whole, node_results, storage_key

__all__ = ["accumulating", "obeys_layout", "relayout", "summed_in_place"]


def accumulating(
    gm: GraphModule, grads: Sequence[torch.Tensor | None], first_data: int
) -> GraphModule:
    """A copy of the train graph ``gm`` that adds its gradients into existing ones.

    Args:
        gm: a traced train graph, ``loss, *grads, *stored = f(*params, *buffers, *data)``.
        grads: per parameter, its present ``p.grad`` (``None``: the graph returns that
            gradient as before). They give the new placeholders' layouts.
        first_data: the position of the first data placeholder; the new placeholders, one
            per present gradient (used or not), go right before it, so the call passes
            ``*params, *buffers, *present grads, *data``.
    """
    graph = Graph()
    copies: dict[Node, Node] = {}
    copied = graph.graph_copy(gm.graph, copies)  # the output's value; no output node yet
    outputs = list(copied) if isinstance(copied, (list, tuple)) else [copied]
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    mode = fake_mode(graph)
    taps = {copies[node]: pairs for node, pairs in grad_taps(gm.graph, 1, len(grads)).items()}
    inputs: dict[int, Node] = {}
    # Before the first data placeholder (or, with no data tensors, after the last one).
    anchor = placeholders[first_data] if first_data < len(placeholders) else placeholders[-1].next
    with graph.inserting_before(anchor):
        for k, grad in enumerate(grads):
            if grad is None:
                continue
            node = graph.placeholder(f"grad_{k}")
            node.meta["val"] = fresh_fake(grad, mode)
            inputs[k] = node
    for final, pairs in taps.items():
        for k, at in pairs:
            if k not in inputs:
                continue
            with graph.inserting_after(final):
                add = graph.call_function(torch.ops.aten.add_.Tensor, (inputs[k], outputs[at]))
            add.meta["val"] = inputs[k].meta["val"]
            outputs[at] = None
    graph.output(outputs)
    return GraphModule(gm, graph)


def relayout(gm: GraphModule, params: Sequence[torch.Tensor], fresh: Sequence[bool]) -> GraphModule:
    """``gm`` with each fresh gradient that ``p.grad`` could not keep as it is (see
    ``obeys_layout``) copied into its parameter's layout right where it becomes final.

    Eager's ``AccumulateGrad`` makes that copy as soon as backward has made the gradient and
    frees the original; copied after the call instead, every such original would still be
    alive next to every other gradient at the step's end (on ConvNeXt-T, 4.7 MB over eager's
    peak for one downsampling convolution). The copy is eager's own
    (``new_empty_strided(...).copy_(grad)``), so the gradient is the same bit for bit.

    Args:
        gm: a traced train graph, ``loss, *grads, *stored = f(...)``.
        params: the parameters, in the graph's gradient order.
        fresh: per parameter, whether its gradient becomes ``p.grad`` (``False`` where it is
            added into an existing one, which keeps that one's layout).
    """
    returned = graph_outputs(list(gm.graph.nodes)[-1])
    # A gradient returned twice, or a part of a storage (one result of an op whose results
    # share one: the LSTM's bias gradients), is no storage the step could hand over as it
    # is either: copied after the call, it sat beside the arena (LSTM LM: 8 KB over eager's
    # peak every step), where eager's AccumulateGrad clones it as the backward makes it.
    times = Counter(value for value in returned[1 : 1 + len(params)] if isinstance(value, Node))
    wrong = {
        k
        for k, (p, new) in enumerate(zip(params, fresh, strict=True))
        if new
        and isinstance(value := returned[1 + k], Node)
        and isinstance(grad := value.meta.get("val"), torch.Tensor)
        and (not obeys_layout(grad, p) or times[value] > 1 or not is_whole(value))
    }
    if not wrong:
        return gm
    graph = Graph()
    copies: dict[Node, Node] = {}
    copied = graph.graph_copy(gm.graph, copies)
    outputs = list(copied) if isinstance(copied, (list, tuple)) else [copied]
    mode = fake_mode(graph)
    for final, pairs in grad_taps(gm.graph, 1, len(params)).items():
        for k, at in pairs:
            if k not in wrong:
                continue
            p = params[k]
            # Eager's layout: the parameter's where it is dense, else contiguous (its clone).
            dense = p.is_contiguous() or is_dense(p)
            stride = list(p.stride() if dense else make_contiguous_strides_for(p.shape))
            with graph.inserting_after(copies[final]):
                empty = graph.call_function(
                    torch.ops.aten.empty_strided.default,
                    (list(p.shape), stride),
                    {"dtype": p.dtype, "device": p.device},
                )
            with graph.inserting_after(empty):
                copy = graph.call_function(torch.ops.aten.copy_.default, (empty, outputs[at]))
            with mode or contextlib.nullcontext():
                empty.meta["val"] = torch.empty_strided(
                    p.shape, stride, dtype=p.dtype, device=p.device
                )
            copy.meta["val"] = empty.meta["val"]
            outputs[at] = empty
    graph.output(outputs)
    return GraphModule(gm, graph)


def obeys_layout(grad: torch.Tensor, param: torch.Tensor) -> bool:
    """Whether autograd's ``AccumulateGrad`` would keep ``grad`` as ``param.grad`` as it is
    (``obeys_layout_contract``): for a dense parameter, the same strides wherever a dimension
    has more than one element (a size-1 dimension's stride says nothing about the layout,
    and convolution's backward often gives another one there); otherwise, contiguous."""
    if grad.shape != param.shape:
        return False
    if not (param.is_contiguous() or is_dense(param)):
        return grad.is_contiguous()
    return all(
        (g == p) if size != 1 else g != 0
        for size, g, p in zip(grad.shape, grad.stride(), param.stride(), strict=True)
    )


def summed_in_place(gm: GraphModule, n_grads: int) -> GraphModule:
    """``gm`` with each gradient that sums several contributions summed in place, as eager's
    autograd engine sums them.

    A parameter used more than once in forward (a tied embedding and output layer) gets one
    gradient from each use. The engine adds them up in the parameter's input buffer in place,
    into a contribution nothing else holds (``InputBuffer::accumulate``), while the traced
    graph adds them out of place: at the end of T5's backward its shared embedding's gradient
    (512 KB) was live three times, and every default-loop call 92,920 B over eager's peak. Here
    each out-of-place ``add`` that makes a returned gradient (and each ``add`` that feeds such
    a sum alone) adds into one of its operands instead, where that operand is a value of the
    graph's own that only this add reads, with the sum's shape, dtype and strides. IEEE
    addition commutes, so ``a.add_(b)`` is ``a + b`` bit for bit.

    Args:
        gm: a traced train graph, ``loss, *grads, *stored = f(...)``.
        n_grads: the number of gradients it returns after the loss.
    """
    nodes = list(gm.graph.nodes)
    owners = Counter(_storages(nodes))
    into: dict[str, int] = {}  # the add's name -> which operand it adds into
    frontier = [v for v in graph_outputs(nodes[-1])[1 : 1 + n_grads] if isinstance(v, Node)]
    while frontier:
        node = frontier.pop()
        if node.name in into or not _out_of_place_sum(node):
            continue
        for k, operand in enumerate(node.args[:2]):
            if isinstance(operand, Node) and _sole_owner(operand, node, owners):
                into[node.name] = k
                frontier.append(operand)  # itself a sum of contributions, maybe
                break
    if not into:
        return gm
    graph = copy.deepcopy(gm.graph)
    for node in list(graph.nodes):
        if node.name not in into:
            continue
        k = into[node.name]
        target, other = node.args[k], node.args[1 - k]
        assert isinstance(target, Node)
        with graph.inserting_after(node):
            summed = graph.call_function(torch.ops.aten.add_.Tensor, (target, other))
        summed.meta = {**node.meta, "val": target.meta["val"]}
        node.replace_all_uses_with(summed)
        graph.erase_node(node)
    return GraphModule(gm, graph)


def _out_of_place_sum(node: Node) -> bool:
    return bool(
        node.op == "call_function"
        and node.target is torch.ops.aten.add.Tensor
        and len(node.args) == 2
        and node.kwargs.get("alpha", 1) == 1
        and isinstance(node.meta.get("val"), torch.Tensor)
    )


def _sole_owner(operand: Node, add: Node, owners: Counter[StorageWeakRef]) -> bool:
    """Whether ``add`` may write its sum into ``operand``: a value the graph made (no input,
    no view), read by nothing else, the only value on its storage, laid out as the sum."""
    if operand.op != "call_function" or len(operand.users) != 1:
        return False
    val, summed = operand.meta.get("val"), add.meta["val"]
    return (
        isinstance(val, torch.Tensor)
        and is_whole(operand)
        and owners[storage_key(val)] == 1
        and val.dtype == summed.dtype
        and val.shape == summed.shape
        and val.stride() == summed.stride()
    )


def _storages(nodes: Sequence[Node]) -> Sequence[StorageWeakRef]:
    """The storage of every tensor value of ``nodes`` (a node's results each), repeated per
    value: views and in-place results share their base's."""
    return [
        storage_key(v) for node in nodes for v in node_results(node) if isinstance(v, torch.Tensor)
    ]
