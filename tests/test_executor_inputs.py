"""Inputs and outputs as the ecosystem writes them: a tuple is positional arguments, a dict
keyword arguments, anything else the one argument; without a loss_fn the loss is the model's
own; outputs a graph cannot hold are refused before running, saying what to pass instead."""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import sharedmem as sm


class TwoInputs(nn.Module):
    """``model(x, mask=None, scale=1.0)``: a positional input, an optional keyword one."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        out: torch.Tensor = self.fc(x)
        return out if mask is None else out * mask


class OneTuple(nn.Module):
    """A model whose one argument is a tuple: it is given ``(batch,)``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        out: torch.Tensor = self.fc(pair[0]) * pair[1]
        return out


class OwnLoss(nn.Module):
    """Computes its loss when given labels, as transformers models do; ``kind`` is where the
    loss comes back (a dict, an attribute, the scalar itself)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.fc = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        logits = self.fc(x)
        if labels is None:
            return {"logits": logits}
        loss = nn.functional.cross_entropy(logits, labels)
        if self.kind == "scalar":
            return loss
        if self.kind == "dict":
            return {"loss": loss, "logits": logits}
        return collections.namedtuple("Output", "loss logits")(loss, logits)


class Encoding(collections.UserDict[str, Any]):
    """A mapping that is not a dict, as a tokenizer's ``BatchEncoding``."""


def _twins(make: Callable[[], nn.Module]) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    eager, pooled = make(), make()
    pooled.load_state_dict(eager.state_dict())
    return eager, pooled


def _same_grads(eager: nn.Module, pooled: nn.Module) -> None:
    for a, b in zip(eager.parameters(), pooled.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad)


x, m = torch.randn(4, 6), torch.rand(4, 3)
CALLS = {
    "one tensor": (TwoInputs, x, lambda model: model(x)),
    "tuple as positional": (TwoInputs, (x, m), lambda model: model(x, m)),
    "dict as keywords": (TwoInputs, {"x": x, "mask": m}, lambda model: model(x=x, mask=m)),
    "mapping as keywords": (TwoInputs, Encoding(x=x, mask=m), lambda model: model(x=x, mask=m)),
    "one tuple given as (batch,)": (OneTuple, ((x, m),), lambda model: model((x, m))),
}


@pytest.mark.parametrize("name", list(CALLS))
@pytest.mark.parametrize("runner", ["pooled", "chunked", "fit_step"])
def test_train_steps_call_the_model_as_the_inputs_say(name: str, runner: str) -> None:
    make, inputs, call = CALLS[name]
    eager, pooled = _twins(make)
    y = torch.randn(4, 3)
    loss_fn = nn.functional.mse_loss
    if runner == "fit_step":
        step: Any = sm.fit_step(pooled, loss_fn, chunks=1)
    else:
        chunks = 2 if runner == "chunked" else None
        step = sm.pooled_train_step(pooled, loss_fn, pool=sm.BufferPool("cpu"), chunks=chunks)
    loss = step(inputs, y)
    expected = loss_fn(call(eager), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-6, atol=0)
    if runner == "pooled":
        assert torch.equal(loss, expected.detach())
        _same_grads(eager, pooled)


@pytest.mark.parametrize("name", list(CALLS))
def test_forward_and_estimate_call_the_model_as_the_inputs_say(name: str) -> None:
    make, inputs, call = CALLS[name]
    model = make().eval()
    fwd = sm.pooled_forward(model, pool=sm.BufferPool("cpu"))
    with torch.no_grad():
        assert torch.equal(fwd(inputs), call(model))
    est = sm.estimate(model, inputs)
    assert est.train_bytes["inputs"] > 0 and est.train_peak_pooled > 0


@pytest.mark.parametrize("kind", ["scalar", "dict", "attribute"])
@pytest.mark.parametrize("chunks", [None, 2])
def test_without_loss_fn_the_loss_is_the_models_own(kind: str, chunks: int | None) -> None:
    eager, pooled = _twins(lambda: OwnLoss(kind))
    labels = torch.tensor([0, 2, 1, 1])
    step = sm.pooled_train_step(pooled, pool=sm.BufferPool("cpu"), chunks=chunks)
    loss = step({"x": x, "labels": labels})
    out = eager(x, labels)
    expected = out if kind == "scalar" else out["loss"] if kind == "dict" else out.loss
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-6, atol=0)
    if chunks is None:
        assert torch.equal(loss, expected.detach())
        _same_grads(eager, pooled)
    third = OwnLoss(kind)
    third.load_state_dict(eager.state_dict())
    fitted = sm.fit_step(third, chunks=2)
    torch.testing.assert_close(fitted({"x": x, "labels": labels}), loss, rtol=1e-6, atol=0)
    assert sm.estimate(OwnLoss(kind), (x, labels)).train_bytes["gradients"] > 0


def test_a_step_without_loss_fn_says_what_it_needs() -> None:
    step = sm.pooled_train_step(OwnLoss("dict"), pool=sm.BufferPool("cpu"))
    with pytest.raises(ValueError, match=r"^sharedmem: targets were given .*labels=") as info:
        step(x, torch.tensor([0, 2, 1, 1]))
    with pytest.raises(TypeError, match=r"^sharedmem: without loss_fn .* returned a dict"):
        step(x)  # no labels: the model computes no loss
    with pytest.raises(ValueError, match=r"^sharedmem: targets were given"):
        sm.fit_step(OwnLoss("dict"), chunks=1)(x, torch.tensor([0, 2, 1, 1]))
    assert "loss_fn" in str(info.value)


class Cache:
    """Stands for a key/value cache object (transformers' ``DynamicCache``)."""

    def __init__(self, key: torch.Tensor) -> None:
        self.key = key


class Cached(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, use_cache: bool = True) -> dict[str, Any]:
        h = self.fc(x)
        return {"logits": h, "past_key_values": Cache(h) if use_cache else None}


def test_an_output_a_graph_cannot_hold_is_refused_before_running() -> None:
    model = Cached().eval()
    pool = sm.BufferPool("cpu")
    fwd = sm.pooled_forward(model, pool=pool)
    with pytest.raises(TypeError, match=r"^sharedmem: Cached returns a Cache.*use_cache=False"):
        fwd(x)
    assert pool.stats()["reserved_bytes"] == 0  # refused before running
    out = fwd({"x": x, "use_cache": False})
    with torch.no_grad():
        assert torch.equal(out["logits"], model(x)["logits"]) and out["past_key_values"] is None
    # A train step returns the loss only: the cache inside it is the model's own business.
    step = sm.pooled_train_step(model.train(), lambda out, y: out["logits"].sum(), pool=pool)
    assert step(x, None).dim() == 0


def test_a_transformers_model_trains_with_labels_and_no_wrapper() -> None:
    for name in ("nms", "qnms"):  # a torchvision built for another torch imports with these
        with contextlib.suppress(RuntimeError):
            torch.library.define(
                f"torchvision::{name}",
                "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
            )
    transformers = pytest.importorskip("transformers")
    try:
        config = transformers.GPT2Config(
            n_layer=1, n_embd=32, n_head=2, n_positions=16, vocab_size=50, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        make: Callable[[], nn.Module] = lambda: transformers.GPT2LMHeadModel(config)  # noqa: E731
        eager, pooled = _twins(make)
    except Exception as error:  # installed, but its models cannot import here
        pytest.skip(f"transformers cannot build GPT-2 here: {error}")
    ids = torch.randint(0, 50, (2, 8))
    step = sm.pooled_train_step(pooled, pool=sm.BufferPool("cpu"))
    loss = step({"input_ids": ids, "labels": ids})
    expected = eager(input_ids=ids, labels=ids).loss
    expected.backward()
    assert torch.equal(loss, expected.detach())
    _same_grads(eager, pooled)
    fwd = sm.pooled_forward(pooled.eval(), pool=sm.BufferPool("cpu"))
    with pytest.raises(TypeError, match="use_cache=False"):
        fwd({"input_ids": ids})  # GPT-2's default in evaluation returns its cache
    out = fwd({"input_ids": ids, "use_cache": False})
    with torch.no_grad():
        assert torch.equal(out.logits, eager.eval()(input_ids=ids, use_cache=False).logits)
