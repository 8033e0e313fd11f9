"""Graph analysis: lifetimes follow every alias, and outputs are told apart."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from sharedmem._executor.graph import analyse
from sharedmem._executor.ops import Kind

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
