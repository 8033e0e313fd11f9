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

from collections.abc import Sequence

import torch
from torch.fx import Graph, GraphModule, Node

from .distributed import grad_taps
from .graph import fake_mode, fresh_fake

__all__ = ["accumulating"]


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
