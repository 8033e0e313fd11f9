"""Graph analysis: lifetimes follow every alias, and outputs are told apart."""

from __future__ import annotations

import sys
from collections.abc import Callable

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from sharedmem._executor.graph import analyse
from sharedmem._executor.ops import Kind, rule_for

CPU = torch.device("cpu")


def lifetime_by_op(fn, *args):  # type: ignore[no-untyped-def]
    gm = make_fx(fn, tracing_mode="fake")(*args)
    analysis = analyse(gm, CPU)
    found = {}
    for step in analysis.steps:
        for life in step.lifetimes:
            if life >= 0:
                found[step.node.name] = analysis.lifetimes[life]
    return gm, analysis, found


def test_a_view_keeps_its_base_alive_until_the_view_is_read() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        a = x * 2  # pooled
        v = a.view(-1)  # a view of it
        b = x + 1
        c = b * 3
        return v.sum() + c.sum()

    gm, _, found = lifetime_by_op(fn, torch.randn(4, 4))
    names = [n.name for n in gm.graph.nodes]
    last_read_of_view = max(
        names.index(u.name) for n in gm.graph.nodes if n.name == "view" for u in n.users
    )
    assert found["mul"].end == last_read_of_view


def test_in_place_ops_extend_the_lifetime_and_pointwise_results_may_overwrite() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        a = x * 2
        a.add_(1)  # in place on a pooled intermediate
        b = a.exp()  # pointwise, a dies here: may write over a
        return b.sum()

    gm, analysis, found = lifetime_by_op(fn, torch.randn(8))
    steps = {s.node.name: s for s in analysis.steps}
    assert steps["add_"].rule.kind is Kind.ALIAS
    names = [n.name for n in gm.graph.nodes]
    assert found["mul"].end == names.index("exp")
    exp, mul = steps["exp"].lifetimes[0], steps["mul"].lifetimes[0]
    assert (exp, mul) in analysis.inplace


def test_outputs_are_returned_and_owned_when_whole_and_unshared() -> None:
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a = x * 2
        return a, a[0], x.view(-1)

    _, analysis, _ = lifetime_by_op(fn, torch.randn(3, 3))
    assert len(analysis.returned) == 1
    assert analysis.owned == (False, False, False)  # a and a[0] share; x is an input

    def whole(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    _, analysis, _ = lifetime_by_op(whole, torch.randn(3))
    assert analysis.owned == (True,)


def test_strided_results_are_pooled_only_where_the_kernel_writes_through_strides() -> None:
    aten = torch.ops.aten

    def fn(g: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        gt = g.t()  # column-major
        # The traced layout of this backward follows gt (column-major), but its CPU out=
        # kernel writes row-major whatever out's strides: it must allocate as eager does.
        grad = aten._log_softmax_backward_data(gt, out, 0, torch.float32)
        return grad, gt * 2, gt.sum(1, keepdim=True), out.softmax(0)

    x = torch.randn(4, 4)
    _, analysis, _ = lifetime_by_op(fn, x, x)
    kinds = {s.node.target: s.rule.kind for s in analysis.steps}
    assert kinds[aten._log_softmax_backward_data.default] is Kind.PLAIN
    assert kinds[aten.mul.Tensor] is Kind.OUT  # pointwise: TensorIterator honours strides
    assert kinds[aten.sum.dim_IntList] is Kind.OUT  # a reduction, likewise
    assert kinds[aten._softmax.default] is Kind.OUT  # a contiguous result: any kernel fits


def test_pointwise_and_reduction_out_kernels_write_through_any_strides() -> None:
    # What the rule above relies on, for the out= kernels of common ops of both kinds.
    aten = torch.ops.aten
    x, y = torch.randn(3, 4, 5, dtype=torch.float64), torch.randn(3, 4, 5, dtype=torch.float64)
    cases = [
        (aten.mul.Tensor, (x, y)),
        (aten.where.self, (x > 0, x, y)),
        (aten.threshold_backward.default, (x, y, 0.0)),
        (aten.sum.dim_IntList, (x, [1], False)),
        (aten.amax.default, (x, [2], True)),
        (aten.max.dim, (x, 1, True)),
    ]
    for op, args in cases:
        rule = rule_for(op, "cpu")
        assert rule.kind is Kind.OUT and rule.out_op is not None, op
        result = op(*args)
        expected = list(result) if isinstance(result, tuple) else [result]
        outs = []
        for e in expected:
            backwards = list(range(e.dim()))[::-1]
            out = torch.empty([e.shape[d] for d in backwards], dtype=e.dtype).permute(backwards)
            assert not out.is_contiguous()  # same shape, strides in the opposite order
            outs.append(out)
        rule.out_op(*args, **dict(zip(rule.out_names, outs, strict=True)))
        for out, e in zip(outs, expected, strict=True):
            assert torch.equal(out, e), op


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = torch.nn.GRU(4, 6, num_layers=2, batch_first=True)
        self.head = torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x.tanh())
        return _helper(self.head(out))


def _helper(y: torch.Tensor) -> torch.Tensor:
    return y.softmax(-1) * 2


def test_node_stacks_walked_from_the_frames_are_the_ones_torch_symbolizes() -> None:
    # trace.py takes each node's stack trace by walking Python's frames (_WalkedStack), not
    # by torch's capture of the whole stack: every node of a joint forward+backward trace
    # (a module in a module, a GRU, a helper function) has the same stack_trace either way.
    from sharedmem._executor.trace import _frames_walked

    model = torch.nn.Sequential(_Block(), torch.nn.Linear(3, 2)).double()
    names = [name for name, _ in model.named_parameters()]

    def step(x: torch.Tensor, *weights: torch.Tensor) -> list[torch.Tensor]:
        out = torch.func.functional_call(model, dict(zip(names, weights, strict=True)), (x,))
        loss = out.square().mean()
        return [loss, *torch.autograd.grad(loss, weights)]

    def stacks() -> list[tuple[str, object]]:
        x = torch.randn(2, 5, 4, dtype=torch.float64)
        weights = [p.detach().requires_grad_() for p in model.parameters()]
        gm = make_fx(step, tracing_mode="fake", record_stack_traces=True)(x, *weights)
        return [(n.name, n.meta.get("stack_trace")) for n in gm.graph.nodes]

    symbolized = stacks()
    with _frames_walked():
        walked = stacks()
    assert walked == symbolized
    named = [trace for _, trace in symbolized if trace]
    assert len(named) > 20 and any("_helper" in trace for trace in named)  # type: ignore[operator]


def test_a_torch_without_stack_trace_anchors_gets_every_frame_to_filter_its_own_way(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # torch 2.11 (a GPU image's) keeps no _STACK_TRACE_ANCHORS: reading it failed every trace.
    from sharedmem._executor import trace

    def frames(only_forward: bool) -> list[tuple[str, str]]:
        summary = trace._WalkedStack(sys._getframe(), only_forward).summary()
        return [(f.filename, f.name) for f in summary][:-1]  # not ``frames`` itself

    everything = frames(only_forward=False)
    if hasattr(trace.fx_proxy, "_STACK_TRACE_ANCHORS"):  # torch 2.12 and later
        assert len(frames(only_forward=True)) < len(everything)
    monkeypatch.delattr(trace.fx_proxy, "_STACK_TRACE_ANCHORS", raising=False)
    assert frames(only_forward=True) == everything


class _Residual(torch.nn.Module):
    """Pre-norm residual MLP blocks, as a transformer's: x + fc2(gelu(fc1(norm(x))))."""

    def __init__(self, width: int = 16, blocks: int = 3) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.LayerNorm(width),
                torch.nn.Linear(width, 8 * width),
                torch.nn.GELU(),
                torch.nn.Linear(8 * width, width),
            )
            for _ in range(blocks)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def test_the_floor_is_the_steps_whatever_each_plan_computes_again() -> None:
    # The floor is a property of the step: every plan of it, whatever it computes again, has
    # the same floor, and none measures below it. (A plan's own graph can have a higher one,
    # or a lower: its recomputations run beside the gradients made by then, and they let a
    # result be written over a value that now dies there.)
    import sharedmem as sm
    from sharedmem.testing import allocator_peak

    torch.manual_seed(0)
    model, x = _Residual(width=64, blocks=4), torch.randn(32, 10, 64)
    floors, summaries, recomputed = set(), set(), []
    for policy in (sm.Recompute.OFF, sm.Recompute.within(1.35), sm.Recompute.MOST):
        model.zero_grad(set_to_none=True)  # each step as traced the same: gradients made
        pool = sm.BufferPool("cpu")
        step = sm.pooled_train_step(
            model, lambda out, _: out.square().mean(), pool=pool, recompute=policy
        )
        floor = step.memory_plan(x, x).floor
        step(x, x)

        def call(step: Callable[..., object] = step) -> None:
            model.zero_grad(set_to_none=True)
            step(x, x)

        measured = allocator_peak(call) + pool.stats()["reserved_bytes"]
        assert 0 < floor <= measured, (policy, floor, measured)
        floors.add(floor)
        summaries.add(step.plan_summary().floor)  # (its kernels measured as a call's are)
        recomputed.append(step.plan_summary().recomputed)
    assert len(floors) == 1 and len(summaries) == 1, (floors, summaries)
    assert recomputed[0] < recomputed[2], recomputed  # plans that differ


def test_the_floor_counts_a_result_written_over_an_operand_read_again_later_once() -> None:
    # ``exp`` reads ``y``, which ``sum`` reads again later: a plan can compute ``y`` again
    # for that reader, so that it dies at ``exp`` and the result is written over it. The
    # floor counts one buffer there, not two (no plan can need less than that).
    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        return y.exp().sum() + y.sum()

    _, analysis, _ = lifetime_by_op(fn, torch.randn(256, 256))
    size = 256 * 256 * 4
    assert size <= analysis.floor < 2 * size, analysis.floor


def test_the_floor_counts_a_result_written_over_its_dying_operand_once() -> None:
    # ``exp`` writes its result over ``y``, which dies there (``Analysis.inplace``): the op
    # needs one buffer of their size, not two, and no plan goes below what the floor says.
    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        return y.exp().sum()

    _, analysis, _ = lifetime_by_op(fn, torch.randn(256, 256))
    size = 256 * 256 * 4
    assert analysis.inplace  # the pair the planner shares a buffer for
    assert size <= analysis.floor < 2 * size, analysis.floor
