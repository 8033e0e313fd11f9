"""What a step's tensors hold, counted on fake tensors: the helpers the estimate and its
sharded (FSDP2) figures share."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from .live import LiveBytes

__all__ = ["faker", "nbytes", "optimizer_bytes", "tensors"]


def nbytes(tensors: Iterator[torch.Tensor], rounding: Callable[[int], int]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()  # one Python object per storage: tied weights count once
        seen.setdefault(id(storage), rounding(storage.nbytes()))
    return sum(seen.values())


def tensors(tree: object) -> Iterator[torch.Tensor]:
    return (v for v in pytree.tree_leaves(tree) if isinstance(v, torch.Tensor))


def faker(fake: FakeTensorMode) -> Callable[[object], object]:
    def convert(value: object) -> object:
        return fake.from_tensor(value) if isinstance(value, torch.Tensor) else value

    return convert


def optimizer_bytes(
    optimizer: torch.optim.Optimizer,
    model: nn.Module,
    state: Mapping[str, torch.Tensor],
    grads: tuple[torch.Tensor | None, ...],
    rounding: Callable[[int], int],
) -> tuple[int, int]:
    """The state a copy of ``optimizer`` keeps after a step, and the temporaries of a step."""
    by_id = {id(p): state[name] for name, p in model.named_parameters()}
    trainable = [state[name] for name, p in model.named_parameters() if p.requires_grad]
    for p, g in zip(trainable, grads, strict=False):
        p.grad = g
    groups = [
        {
            **{k: v for k, v in group.items() if k != "params"},
            "params": [by_id[id(p)] for p in group["params"] if id(p) in by_id],
        }
        for group in optimizer.param_groups
    ]
    kind: Any = type(optimizer)  # a concrete optimizer: its groups carry every hyperparameter
    twin = kind(groups)
    live = LiveBytes(rounding, [*state.values(), *(g for g in grads if g is not None)])
    with live, torch.no_grad():
        twin.step()  # the first step makes the state
        state_bytes = live.live
        live.reset_peak()
        twin.step()  # a steady step: what it holds on top of the state for a moment
        temporaries = live.peak - live.live
    return state_bytes, temporaries
