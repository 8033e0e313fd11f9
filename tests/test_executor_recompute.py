"""Values computed again in backward: the same bits as eager, statistics updated once, and
less memory than keeping them.

A pooled train step recomputes cheap values (pointwise ops, batch norm in training mode,
layer norm) that would otherwise sit idle across the step's busiest node, from inputs alive
there anyway; these tests hold it to eager's results bit for bit on the models where it
happens, and show what it saves.
"""

from __future__ import annotations

import copy
import functools
import itertools
import operator
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import sharedmem as sm
from sharedmem._executor.codegen import mutates
from sharedmem._executor.cost import FLOPS_PER_BYTE, RANDOM_FLOPS_PER_ELEMENT, graph_cost, op_cost
from sharedmem._executor.recompute import recompute
from sharedmem.testing import allocator_peak


class Block(nn.Module):
    """A ResNet basic block: conv, batch norm, ReLU, and a residual add."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + x)


class InplaceBlock(nn.Module):
    """torchvision's basic block: ReLU(inplace=True) after each batch norm, ``out += x``."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x
        return self.relu(out)


def inplace_resnet() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
        InplaceBlock(16), InplaceBlock(16), InplaceBlock(16),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
    )  # fmt: skip


def resnet() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        Block(16), Block(16), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
    )  # fmt: skip


def encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    return nn.Sequential(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
                         nn.Flatten(), nn.Linear(32 * 16, 10))  # fmt: skip


def test_recomputed_steps_equal_eager_bit_for_bit_and_update_statistics_once() -> None:
    for make, shape in (
        (resnet, (8, 3, 16, 16)),
        (inplace_resnet, (8, 3, 16, 16)),
        (encoder, (8, 16, 32)),
    ):
        torch.manual_seed(0)
        eager = make()
        pooled = copy.deepcopy(eager)
        opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
        opt_p = torch.optim.SGD(pooled.parameters(), lr=0.1)
        step = sm.pooled_train_step(pooled, F.cross_entropy, pool=sm.BufferPool("cpu"))
        for i in range(3):
            x, y = torch.randn(shape), torch.randint(0, 10, (shape[0],))
            for opt in (opt_e, opt_p):
                opt.zero_grad(set_to_none=i != 1)  # the second step adds into zeros
            loss_e = F.cross_entropy(eager(x), y)
            loss_e.backward()
            loss_p = step(x, y)
            assert torch.equal(loss_e.detach(), loss_p), (make.__name__, i)
            for (name, p), q in zip(eager.named_parameters(), pooled.parameters(), strict=True):
                assert torch.equal(p.grad, q.grad), (make.__name__, i, name)
            opt_e.step()
            opt_p.step()
        for (name, a), b in zip(
            eager.state_dict().items(), pooled.state_dict().values(), strict=True
        ):
            assert torch.equal(a, b), (make.__name__, name)  # running stats, num_batches_tracked
        assert all(s.recomputed > 0 for s in step.plan_summaries()), make.__name__
        assert "recomputed in backward" in str(step.plan_summary())


def test_recomputing_lowers_the_peak_below_eagers() -> None:
    torch.manual_seed(0)
    eager = resnet()
    pooled = copy.deepcopy(eager)
    x, y = torch.randn(16, 3, 16, 16), torch.randint(0, 10, (16,))
    peaks = {}
    for plan in ("liveness", "per_node"):
        pool = sm.BufferPool("cpu")
        step = sm.pooled_train_step(pooled, F.cross_entropy, pool=pool, plan=plan)
        pooled.zero_grad(set_to_none=True)
        step(x, y)
        pooled.zero_grad(set_to_none=True)
        peaks[plan] = allocator_peak(functools.partial(step, x, y))
        peaks[plan] += pool.stats()["reserved_bytes"]
        assert (step.plan_summary().recomputed > 0) == (plan == "liveness")
    eager.zero_grad(set_to_none=True)
    want = allocator_peak(lambda: F.cross_entropy(eager(x), y).backward())
    # Each ReLU output after a batch norm is no longer kept from the forward to the backward.
    assert peaks["liveness"] <= 0.9 * want, (peaks, want)


def _traced_resnet(batch: int = 16) -> torch.fx.GraphModule:
    step = sm.pooled_train_step(resnet(), F.cross_entropy, pool=sm.BufferPool("cpu"))
    x, y = torch.randn(batch, 3, 16, 16), torch.randint(0, 10, (batch,))
    step.memory_plan(x, y)  # traces, runs nothing
    (traced,) = step._traced.values()
    return traced.gm


def test_the_cost_model_counts_a_convolutions_flops_and_anything_elses_bytes() -> None:
    gm = _traced_resnet(batch=4)
    convolutions = [n for n in gm.graph.nodes if n.target is torch.ops.aten.convolution.default]
    first = convolutions[0]  # 3 -> 16 channels, 3x3, on 4 x 16 x 16: 2 flops per multiply-add
    assert op_cost(first) == 2 * (4 * 16 * 16 * 16) * (3 * 3 * 3)
    relu = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.relu.default)
    moved = 2 * relu.meta["val"].numel() * 4  # float32 in, float32 out
    assert op_cost(relu) == moved * FLOPS_PER_BYTE
    backward = next(
        n for n in gm.graph.nodes if n.target is torch.ops.aten.convolution_backward.default
    )
    assert op_cost(backward) > 0 and graph_cost(gm.graph) > op_cost(backward)


def test_heavy_recomputation_stays_within_its_allowance_and_more_allowance_saves_more() -> None:
    gm = _traced_resnet()
    _, cheap = recompute(gm)
    peaks = []
    for allowance in (0.02, 0.1, 0.35, True):
        out, count = recompute(gm, heavy=allowance)
        assert count >= cheap  # the default's recomputation comes first, always
        cost = out.meta["recompute_cost"]
        if allowance is not True:
            assert 0 <= cost <= allowance, (allowance, cost)
        step = sm.pooled_train_step(
            resnet(),
            F.cross_entropy,
            pool=sm.BufferPool("cpu"),
            recompute=sm.Recompute.adding(allowance),
        )
        x, y = torch.randn(16, 3, 16, 16), torch.randint(0, 10, (16,))
        plan = step.memory_plan(x, y)
        peaks.append(plan.pooled_bytes + plan.beside_peak)
    assert peaks == sorted(peaks, reverse=True) and peaks[-1] < peaks[0], peaks


def test_values_written_in_place_are_recomputed_with_their_writes_bit_for_bit() -> None:
    # torchvision's CNNs apply ReLU in place to each batch norm's output (and add residuals
    # in place): the value backward reads is the storage after those writes, recomputed by
    # running the batch norm again and replaying the writes on its new output.
    x, y = torch.randn(16, 3, 16, 16), torch.randint(0, 10, (16,))
    torch.manual_seed(0)
    eager = inplace_resnet()
    F.cross_entropy(eager(x), y).backward()
    for heavy in (False, True):
        torch.manual_seed(0)
        model = inplace_resnet()
        step = sm.pooled_train_step(
            model, F.cross_entropy, pool=sm.BufferPool("cpu"), recompute=sm.Recompute.adding(heavy)
        )
        step.memory_plan(x, y)  # traces, runs nothing
        (traced,) = step._traced.values()
        graph = recompute(traced.gm, heavy=heavy)[0].graph
        relus = [n for n in graph.nodes if n.target is torch.ops.aten.relu_.default]
        # Seven in the model; more in the graph: writes replayed on recomputed values.
        assert len(relus) > 7, "no in-place write was replayed"
        assert torch.equal(step(x, y), F.cross_entropy(eager(x), y).detach())
        for (name, p), q in zip(eager.named_parameters(), model.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), (heavy, name)
        eager.zero_grad(set_to_none=True)
        F.cross_entropy(eager(x), y).backward()


class SelfAdd(nn.Module):
    """A value written in place with itself (``h.add_(h)``), read again at the very end of
    backward (the first product's gradient), under three wider layers."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)
        self.layers = nn.Sequential(
            *(nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16)) for _ in range(3))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h.add_(h)
        return self.layers(h * self.b(x))


def test_a_write_that_reads_its_own_target_is_replayed_on_the_recomputed_value() -> None:
    # Replayed on the value computed again, ``h.add_(h)`` must read that value as replayed so
    # far, not the forward's ``h`` after its write (issue 34: that computed 3h, not 2h).
    torch.manual_seed(0)
    eager = SelfAdd()
    model = copy.deepcopy(eager)
    x, y = torch.randn(32, 16), torch.randn(32, 16)
    F.mse_loss(eager(x), y).backward()
    step = sm.pooled_train_step(
        model, F.mse_loss, pool=sm.BufferPool("cpu"), recompute=sm.Recompute.MOST
    )
    step.memory_plan(x, y)
    (traced,) = step._traced.values()
    graph = recompute(traced.gm, heavy=True)[0].graph
    adds = [n for n in graph.nodes if n.target is torch.ops.aten.add_.Tensor]
    assert len(adds) >= 2, "h.add_(h) was not replayed"  # (on each copy made of ``h``)
    assert all(n.args[0] is n.args[1] for n in adds)  # each on its own value
    assert torch.equal(step(x, y), F.mse_loss(eager(x), y).detach())
    for (name, p), q in zip(eager.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


def test_the_recomputation_search_takes_at_most_its_steps() -> None:
    gm = _traced_resnet()
    _, unbounded = recompute(gm, heavy=True)
    assert unbounded > 3
    assert recompute(gm, heavy=True, steps=0) == (gm, 0)
    for steps in (1, 3, unbounded):
        assert 0 < recompute(gm, heavy=True, steps=steps)[1] <= steps


def test_the_search_aims_at_the_node_a_kernels_scratch_makes_the_busiest() -> None:
    # oneDNN's convolutions work in scratch the graph does not show (ConvNeXt-T: 38.7 MB at
    # stage 4's depthwise convolution backward). Counted (``scratch``), the search aims at
    # the node where it makes the peak (ConvNeXt-T's least memory: 1.26x its floor without,
    # 1.09x with). Here the forward convolutions in turn are given scratch (the values kept
    # for backward are idle across them): at each, the plan is at or below the plan made
    # without it, as the scratch counts, and at some it is lower.
    from sharedmem._executor.recompute import _Index

    gm = _traced_resnet()
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    loss = next(
        k for k, n in enumerate(nodes) if n.target is torch.ops.aten.nll_loss_forward.default
    )
    work = _Index(gm.graph).peak  # the busiest node wherever it is
    blind, _ = recompute(gm, heavy=True)
    lower = 0
    convolutions = [n for n in nodes[:loss] if n.target is torch.ops.aten.convolution.default]
    for aimed in convolutions[1:]:  # each stays in every plan (a recomputation adds a copy)

        def scratch(node: torch.fx.Node, aimed: torch.fx.Node = aimed) -> int:
            return work if node.name == aimed.name else 0  # the copy's nodes keep their names

        index = _Index(gm.graph, scratch=scratch)
        assert index.nodes[index.busiest] is aimed
        seeing, _ = recompute(gm, heavy=True, scratch=scratch)
        peaks = (
            _Index(seeing.graph, scratch=scratch).peak,
            _Index(blind.graph, scratch=scratch).peak,
        )
        assert peaks[0] <= peaks[1], (aimed.name, peaks)
        lower += peaks[0] < peaks[1]
    assert lower > 0


class Attention(nn.Module):
    """GPT-2's attention: one matrix product makes q, k and v (split), then SDPA."""

    def __init__(self, width: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(y.transpose(1, 2).reshape(batch, length, width))


def test_heavy_recomputation_takes_attention_and_split_values_again_bit_for_bit() -> None:
    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*(Attention() for _ in range(4)), nn.Flatten(), nn.Linear(32 * 16, 10))

    x, y = torch.randn(8, 16, 32), torch.randint(0, 10, (8,))
    eager = make()
    F.cross_entropy(eager(x), y).backward()
    model = make()
    step = sm.pooled_train_step(
        model, F.cross_entropy, pool=sm.BufferPool("cpu"), recompute=sm.Recompute.MOST
    )
    step.memory_plan(x, y)
    (traced,) = step._traced.values()
    graph = recompute(traced.gm, heavy=True)[0].graph
    attention = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    forward = [n for n in traced.gm.graph.nodes if n.target is attention]
    again = [n for n in graph.nodes if n.target is attention]
    assert len(again) > len(forward) == 4  # some attention computed again in backward
    assert torch.equal(step(x, y), F.cross_entropy(eager(x), y).detach())
    for (name, p), q in zip(eager.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


class UnbindAttention(Attention):
    """timm's ViT attention: q, k and v are pieces of one ``unbind`` of the qkv product, and no
    causal mask."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        qkv = self.qkv(self.norm(x)).reshape(batch, length, 3, self.heads, -1)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v)
        return x + self.out(y.transpose(1, 2).reshape(batch, length, width))


class TokenViT(nn.Module):
    """``UnbindAttention`` blocks after a class token concatenated before the tokens, as a
    ViT's patch embedding does."""

    def __init__(self, blocks: int = 4, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.token = nn.Parameter(torch.randn(1, 1, width))
        self.blocks = nn.Sequential(*(UnbindAttention(width) for _ in range(blocks)))
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(x)
        tokens = torch.cat([self.token.expand(x.shape[0], -1, -1), tokens], dim=1)
        return self.head(self.blocks(tokens)[:, 0])


def test_heavy_recomputation_takes_values_through_an_unbind_and_a_cat_bit_for_bit() -> None:
    # timm's ViT-tiny kept every block's attention output from the forward (12 x 2.4 MB):
    # its inputs q, k, v are pieces of an ``unbind``, and the chain stopped there. Now a
    # chain takes the pieces again of the qkv product computed again, and a concatenation
    # (the class token before the patches) is computed again too.
    from sharedmem._executor.recompute import _chain, _Index

    aten = torch.ops.aten

    def make() -> nn.Module:
        torch.manual_seed(0)
        return TokenViT()

    x, y = torch.randn(8, 15, 8), torch.randint(0, 10, (8,))
    eager, model = make(), make()
    F.cross_entropy(eager(x), y).backward()
    step = sm.pooled_train_step(
        model, F.cross_entropy, pool=sm.BufferPool("cpu"), recompute=sm.Recompute.MOST
    )
    step.memory_plan(x, y)
    (traced,) = step._traced.values()
    # The first block's attention output can be had again at the step's end, where nothing
    # of the forward is alive: through the pieces of its qkv product, from the block's input
    # computed again from the concatenation. (The later blocks' are further than
    # ``MAX_CHAIN_HEAVY`` from the step's inputs.)
    index = _Index(traced.gm.graph)
    end = len(index.nodes) - 1
    attention = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    outputs = [n for n in index.nodes if n.target is operator.getitem and n.args[1] == 0
               and n.args[0].target is attention]  # fmt: skip
    assert len(outputs) == 4
    chain = _chain(index, outputs[0], end, 0, heavy=True)
    assert chain is not None and chain[-1] is outputs[0]
    assert {n.target for n in chain} >= {aten.addmm.default, aten.cat.default}, chain
    graph = recompute(traced.gm, heavy=True)[0].graph
    assert sum(n.target is attention for n in graph.nodes) > 4  # some computed again
    assert torch.equal(step(x, y), F.cross_entropy(eager(x), y).detach())
    for (name, p), q in zip(eager.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


def test_a_value_is_recomputed_for_the_readers_after_the_busiest_node() -> None:
    # A value read long before the busiest node and again right after it (a depthwise
    # convolution's output, read by the next layer norm and by its own backward) is idle
    # across that node: it is computed again at its first reader after it, whichever of its
    # gaps is the longest (``spanning``: the search that gives as much time as lowers the
    # peak). Here each forward convolution in turn is made the busiest node.
    from sharedmem._executor.recompute import _candidate, _Index, _value

    gm = _traced_resnet()
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    loss = next(
        k for k, n in enumerate(nodes) if n.target is torch.ops.aten.nll_loss_forward.default
    )
    not_longest = 0
    for aimed in (n for n in nodes[:loss] if n.target is torch.ops.aten.convolution.default):
        index = _Index(gm.graph, scratch=lambda n, aimed=aimed: 10**9 if n is aimed else 0)
        for node in gm.graph.nodes:
            value = _value(node, heavy=True)
            if value is None:
                continue
            found = _candidate(index, value, heavy=True, spanning=True)
            if found is None:
                continue
            points = [index.position[value]]
            points += [index.position[r] for r in index.readers(index.key[value])]
            before = points[points.index(found.at) - 1]
            assert before < index.busiest < found.at, value.name
            assert found.at == min(p for p in points if p > index.busiest), value.name
            gaps = [b - a for a, b in itertools.pairwise(points)]
            not_longest += found.at - before < max(gaps)
    assert not_longest > 0


class DropoutBlock(nn.Module):
    """A transformer block as trained: dropout on the attention weights and on both branches."""

    def __init__(self, width: int = 32, heads: int = 4, p: float = 0.1, causal: bool = False):
        super().__init__()
        self.heads, self.p, self.causal = heads, p, causal
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-1, -2) / 8
        if self.causal:  # made in the forward, as GPT-2's is: nothing alive makes it again
            scores = scores + torch.full((length, length), float("-inf")).triu(1)
        weights = F.dropout(scores.softmax(-1), self.p, self.training)
        y = (weights @ v).transpose(1, 2).reshape(batch, length, width)
        x = x + F.dropout(self.proj(y), self.p, self.training)
        return x + F.dropout(self.mlp(self.norm2(x)), self.p, self.training)


def _heavy_blocks(causal: bool) -> tuple[nn.Module, Any, torch.Tensor, torch.Tensor, Any, Any]:
    """Three ``DropoutBlock``s, eager and as a pooled step giving time for memory: the
    eager model, the step, a batch, and the step's traced graph and that graph recomputed."""

    def make() -> nn.Module:
        torch.manual_seed(0)
        blocks = [DropoutBlock(causal=causal) for _ in range(3)]
        return nn.Sequential(*blocks, nn.Flatten(), nn.Linear(32 * 32, 10))

    x, y = torch.randn(8, 32, 32), torch.randint(0, 10, (8,))
    eager, step, traced = _heavy_step(make, x, y)
    return eager, step, x, y, traced.graph, recompute(traced, heavy=True)[0].graph


def _heavy_step(
    make: Any, x: torch.Tensor, y: torch.Tensor
) -> tuple[nn.Module, Any, torch.fx.GraphModule]:
    """``make()``'s model eager, and as a pooled step giving time for memory with its graph
    as traced for ``x``, ``y``."""
    eager, model = make(), make()
    step = sm.pooled_train_step(
        model, F.cross_entropy, pool=sm.BufferPool("cpu"), recompute=sm.Recompute.MOST
    )
    step.memory_plan(x, y)
    (traced,) = step._traced.values()
    return eager, step, traced.gm


def _assert_steps_as_eager(eager: nn.Module, step: Any, x: Any, y: Any, seeds: int) -> None:
    # Per seed: the loss, every gradient and the generator after the step, bit for bit.
    for seed in range(seeds):
        torch.manual_seed(seed)
        eager.zero_grad(set_to_none=True)
        expected = F.cross_entropy(eager(x), y)
        expected.backward()
        after_eager = torch.get_rng_state()
        torch.manual_seed(seed)
        step.model.zero_grad(set_to_none=True)
        assert torch.equal(step(x, y), expected.detach()), seed
        assert torch.equal(torch.get_rng_state(), after_eager), seed
        pairs = zip(eager.named_parameters(), step.model.parameters(), strict=True)
        for (name, p), q in pairs:
            assert torch.equal(p.grad, q.grad), (seed, name)


def test_dropout_is_recomputed_from_the_saved_generator_state_bit_for_bit() -> None:
    # Dropout's noise (four bytes an element on CPU) is drawn again in backward from the
    # generator state saved right before the forward's draw: the same masks, the same
    # gradients, and the generator ends where eager's does, so every later draw is eager's.
    eager, step, x, y, _, graph = _heavy_blocks(causal=False)
    replays = [n for n in graph.nodes if str(n.target).startswith("sharedmem.replay_bernoulli")]
    assert replays, "no dropout was drawn again"
    _assert_steps_as_eager(eager, step, x, y, seeds=3)


def test_masked_attention_weights_are_recomputed_with_their_mask_kept_bit_for_bit() -> None:
    # A softmax's result (every head's weights, four bytes an element) is read by its own
    # backward: giving time for memory, it is computed again there from its scores, which
    # are computed again from q and k; the causal mask added to them, made in the forward
    # from ops no chain computes again, is kept (a fraction of the weights) instead.
    eager, step, x, y, traced, graph = _heavy_blocks(causal=True)
    softmax = torch.ops.aten._softmax.default
    before = sum(n.target is softmax for n in traced.nodes)
    assert sum(n.target is softmax for n in graph.nodes) > before == 3
    _assert_steps_as_eager(eager, step, x, y, seeds=2)


class TanhGeluMLP(nn.Module):
    """GPT-2's MLP: its tanh GELU written out, five pointwise ops over a matrix product."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc, self.proj = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(self.norm(x))
        h = 0.5 * h * (1.0 + torch.tanh(0.7978845608 * (h + 0.044715 * torch.pow(h, 3.0))))
        return x + self.proj(h)


def _unread(graph: torch.fx.Graph) -> set[str]:
    """The ops whose results nothing reads and whose running changes nothing else: no
    in-place write, no draw from a generator."""
    seeded = torch.Tag.nondeterministic_seeded
    return {
        n.name
        for n in graph.nodes
        if n.op == "call_function"
        and not n.users
        and not mutates(n)
        and seeded not in getattr(n.target, "tags", ())
    }


def test_a_value_whose_readers_are_all_computed_again_for_is_not_run() -> None:
    # A value all of whose readers read a copy computed again (a copy of a copy, or a
    # backward value recomputed for every reader) would still run, for nothing: time, and
    # its bytes for an op. GPT-2's least memory ran such matrix products and GELU pieces
    # (31.6 MB measured, 27.6 MB without them), ConvNeXt-T's five matrix products of up to
    # 25 MB. The plan runs no op the graph as traced did not that nothing reads.
    def make() -> nn.Module:
        torch.manual_seed(0)
        blocks = [nn.Sequential(Attention(), TanhGeluMLP()) for _ in range(3)]
        return nn.Sequential(*blocks, nn.Flatten(), nn.Linear(32 * 16, 10))

    x, y = torch.randn(8, 16, 32), torch.randint(0, 10, (8,))
    eager, step, traced = _heavy_step(make, x, y)
    planned, count = recompute(traced, heavy=True)
    assert count > 0
    assert _unread(planned.graph) <= _unread(traced.graph)
    _assert_steps_as_eager(eager, step, x, y, seeds=1)
    # Nor in the dropout blocks, where noise is drawn again (that every draw stays, the
    # generator ending where eager's does, is the dropout test's).
    _, _, _, _, traced_graph, graph = _heavy_blocks(causal=True)
    assert _unread(graph) <= _unread(traced_graph)


def test_the_cost_model_prices_a_cpu_draw_by_its_elements() -> None:
    # A CPU's random numbers are compute-bound: pricing a draw by its bytes would make
    # replaying dropout look as cheap as a ReLU.
    step = sm.pooled_train_step(DropoutBlock(), lambda out, _: out.sum(), pool=sm.BufferPool("cpu"))
    x = torch.randn(4, 16, 32)
    step.memory_plan(x, x)
    (traced,) = step._traced.values()
    draws = [n for n in traced.gm.graph.nodes if n.target is torch.ops.aten.bernoulli_.float]
    assert len(draws) == 3
    for draw in draws:
        assert op_cost(draw) == draw.meta["val"].numel() * RANDOM_FLOPS_PER_ELEMENT
