"""How ops run in the executor: native out= forms, rewrites, and what stays unpooled."""

from __future__ import annotations

import torch

from sharedmem._executor.ops import Kind, fill_value, rule_for

aten = torch.ops.aten


def test_ops_with_a_native_out_form_write_into_the_pool() -> None:
    rule = rule_for(aten.mm.default, "cpu")
    assert rule.kind is Kind.OUT and rule.out_op is aten.mm.out and rule.out_names == ("out",)
    rule = rule_for(aten.max_pool2d_with_indices.default, "cpu")
    assert rule.out_names == ("out", "indices")
    rule = rule_for(aten.threshold_backward.default, "cpu")
    assert rule.out_op is aten.threshold_backward.grad_input


def test_generated_out_forms_are_not_used() -> None:
    # convolution.out computes convolution and copies: pooling it would only add a copy.
    assert rule_for(aten.convolution.default, "cpu").kind is Kind.PLAIN
    assert rule_for(aten.convolution_backward.default, "cpu").kind is Kind.PLAIN
    # stack.out is a real composite (of cat.out), not a generated wrapper.
    assert rule_for(aten.stack.default, "cpu").kind is Kind.OUT


def test_views_and_in_place_ops_run_as_they_are() -> None:
    for op in (aten.view.default, aten.t.default, aten.add_.Tensor, aten._unsafe_view.default):
        assert rule_for(op, "cpu").kind is Kind.ALIAS


def test_rewrites_run_the_kernel_eager_runs() -> None:
    rule = rule_for(aten.relu.default, "cpu")
    assert rule.kind is Kind.OUT and rule.out_op is aten.clamp_min.out
    assert rule.adapt is not None
    x = torch.randn(5)
    args, kwargs = rule.adapt([x], {})  # type: ignore[misc]
    out = torch.empty(5)
    assert torch.equal(aten.clamp_min.out(*args, **kwargs, out=out), torch.relu(x))
    assert rule.adapt([x], {"extra": 1}) is None  # not the expected call: stays unpooled


def test_reduced_losses_whose_out_form_uses_out_as_scratch_stay_unpooled() -> None:
    rule = rule_for(aten.mse_loss.default, "cpu")
    assert rule.adapt is not None
    assert rule.adapt([1, 2], {}) is None  # mean (the default): writes past a 0-dim out
    assert rule.adapt([1, 2, 0], {}) == ([1, 2, 0], {})  # unreduced: exactly its result


def test_factories_become_pool_views() -> None:
    assert rule_for(aten.empty_like.default, "cpu").kind is Kind.EMPTY
    assert rule_for(aten.ones_like.default, "cpu").kind is Kind.FILL
    assert fill_value(aten.full.default, [[2], 3.5], {}) == 3.5
    assert fill_value(aten.new_full.default, [None, [2], 7], {}) == 7
    assert rule_for(aten.clone.default, "cpu").kind is Kind.COPY
