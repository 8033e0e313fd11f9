"""How a step calls a model and finds its loss: the conventions of the ecosystem, in one place.

``inputs`` is what a user hands a step (``step(inputs, targets)``, ``fwd(inputs)``,
``sm.estimate(model, inputs)``): a ``tuple`` is unpacked into positional arguments (as
``torch.jit.trace`` and ``torch.onnx.export`` take example inputs), a mapping into keyword
arguments (as transformers' ``Trainer`` calls a model), anything else is the one argument; a
model that takes one tuple or dict is given ``(batch,)``. Without a ``loss_fn`` the loss is
the model's own: ``out.loss``, ``out["loss"]``, or the output itself when it is a scalar.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["OwnLoss", "call_model", "check_targets", "model_arguments", "plain_mapping"]


def model_arguments(inputs: object) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The positional and keyword arguments ``inputs`` stands for."""
    if type(inputs) is tuple:  # a plain tuple; a named tuple (PackedSequence) is one argument
        return inputs, {}
    if isinstance(inputs, Mapping):
        if not all(isinstance(key, str) for key in inputs):
            raise TypeError(
                "sharedmem: a mapping of inputs is passed as keyword arguments, so its keys "
                f"must be strings; got {sorted(map(repr, inputs))[:3]}. Give a model that "
                "takes one dict its inputs as (batch,)"
            )
        return (), dict(inputs)
    return (inputs,), {}


def call_model(model: Any, inputs: object) -> Any:
    """``model(*inputs)``, ``model(**inputs)`` or ``model(inputs)`` (see the module)."""
    args, kwargs = model_arguments(inputs)
    return model(*args, **kwargs)


def plain_mapping(inputs: object) -> object:
    """A mapping that is not a ``dict`` (transformers' ``BatchEncoding``) as a ``dict``, so
    pytree can take it apart; anything else as it is."""
    if isinstance(inputs, Mapping) and not isinstance(inputs, dict):
        return dict(inputs)
    return inputs


def check_targets(own_loss: bool, targets: object) -> object:
    """``targets``, refused where a step's loss is the model's own (they would be ignored)."""
    if own_loss and targets is not None:
        raise ValueError(
            "sharedmem: targets were given to a step made without loss_fn, whose loss is the "
            "model's own: pass them among the inputs (labels=...), or give loss_fn"
        )
    return targets


class OwnLoss:
    """The model's own loss, for a step made without ``loss_fn``: ``out.loss``,
    ``out["loss"]``, or the output itself when it is a scalar tensor.

    ``reduction`` is what chunking assumes: a model's loss is a mean (transformers' are).
    """

    reduction = "mean"

    def __call__(self, output: Any, targets: Any = None) -> torch.Tensor:
        loss = _find_loss(output)
        if loss is None:
            what = (
                f"a tensor of shape {tuple(output.shape)}"
                if isinstance(output, torch.Tensor)
                else f"a {type(output).__name__} without a loss"
            )
            raise TypeError(
                f"sharedmem: without loss_fn the loss is the model's own (out.loss, "
                f'out["loss"], or a scalar output), but the model returned {what}; pass '
                "loss_fn=..., or the labels the model computes its loss from (labels=...)"
            )
        return loss

    def __repr__(self) -> str:
        return "the model's own loss"


def _find_loss(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output if output.dim() == 0 else None
    found = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    return found if isinstance(found, torch.Tensor) and found.dim() == 0 else None
