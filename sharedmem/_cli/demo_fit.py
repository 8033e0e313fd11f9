"""The demo's third part: the same MLP, as an ``nn.Module`` through a pooled train step, under
half the memory its unchunked step needs.

The MLP of the first two parts, with the same initial weights, data and learning rate, is
trained twice side by side by ``sm.pooled_train_step``: once as it is, once with a ``budget=``
(and a pool ``limit``) of half what the unchunked step holds beyond its parameters and
inputs (``sm.estimate``'s ``step_peak_pooled``). That step splits every batch into the fewest
chunks that fit, weighting each chunk's mean loss by its share, so its loss curve is the
unchunked one up to the rounding of a mean taken in parts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._errors import OutOfMemoryError
from .._planning.estimate import estimate
from .._planning.steps import pooled_train_step
from .._pool import BufferPool
from .._pool.report import human_bytes
from .demo_data import DemoConfig, SyntheticData, initial_weights

__all__ = ["BATCH_FACTOR", "STEPS", "run_fit_demo"]

# The first two parts' batch is small beside the MLP's weights (its gradients are most of a
# step), so this part trains at a batch where activations are most of it, for fewer steps.
BATCH_FACTOR = 8
STEPS = 20


def _module(config: DemoConfig, device: str) -> nn.Sequential:
    layers: list[nn.Module] = []
    for weight in initial_weights(config):
        fan_in, fan_out = weight.shape
        linear = nn.Linear(fan_in, fan_out)
        with torch.no_grad():
            linear.weight.copy_(weight.t())
            linear.bias.zero_()
        layers += [linear, nn.ReLU()]
    return nn.Sequential(*layers[:-1]).to(device)


def run_fit_demo(
    config: DemoConfig, say: Callable[[str], None], progress: Callable[[int], None]
) -> dict[str, Any] | None:
    """Train the MLP twice side by side, unchunked and under half the unchunked step's own
    peak; returns both loss curves, the chunks and the memory figures."""
    device = "cpu" if config.device == "emulated" else config.device  # the modules' device
    batch, steps = config.train_batch * BATCH_FACTOR, min(config.steps, STEPS)
    loss_fn = nn.functional.cross_entropy
    plain, chunked = _module(config, device), _module(config, device)
    data = SyntheticData(config)
    x, y = (t.to(device) for t in data.batch(batch))
    unchunked = estimate(plain, x, y, loss_fn=loss_fn, device=device).step_peak_pooled
    reached = _reachable_budget(config.device, chunked, loss_fn, x, y, unchunked)
    if reached is None:
        say(
            f"  skipped: at batch {batch} no budget below the unchunked step's need "
            f"({human_bytes(unchunked)}) can be met in chunks (the gradients, which chunks "
            "cannot shrink, are most of the step); a smaller --train-batch shows it"
        )
        return None
    budget, pool, fitted = reached
    steps_of = {
        "unchunked": (pooled_train_step(plain, loss_fn, pool=BufferPool(config.device)), plain),
        "chunked": (fitted, chunked),
    }
    optimizers = {
        k: torch.optim.SGD(m.parameters(), lr=config.lr) for k, (_, m) in steps_of.items()
    }
    say(
        f"  batch {batch}, {steps} steps, twice side by side: the unchunked step needs "
        f"{human_bytes(unchunked)} beyond the parameters and inputs; the other runs under a "
        f"budget (and a pool limit) of {_share(budget, unchunked)}, {human_bytes(budget)}"
    )
    losses: dict[str, list[float]] = {"unchunked": [], "chunked": []}
    most = 0
    for index in range(steps):
        if index:
            x, y = (t.to(device) for t in data.batch(batch))
        for name, (step, model) in steps_of.items():
            model.zero_grad(set_to_none=True)
            losses[name].append(float(step(x, y)))
            optimizers[name].step()
        most = max(most, pool.stats()["device_reserved_bytes"])
        progress(index + 1)
    chunked.zero_grad(set_to_none=True)  # the chunks of a call as the loop makes it
    chunks = fitted.chunks_for(x, y)
    say(
        f"  {chunks} chunks per step (the pool held at most {human_bytes(most)}); train loss "
        f"{losses['chunked'][0]:.4f} -> {losses['chunked'][-1]:.4f} in chunks, "
        f"{losses['unchunked'][0]:.4f} -> {losses['unchunked'][-1]:.4f} unchunked"
    )
    return {
        "losses": losses["chunked"],
        "unchunked_losses": losses["unchunked"],
        "chunks": chunks,
        "budget": budget,
        "unchunked": unchunked,
        "pool_most": most,
    }


# The budgets the third part tries, as shares of the unchunked step's need: half where a
# chunked step can meet it; where gradients are most of the step (a large batch of a wide
# MLP), chunks cannot shrink them, and a larger share is the least that runs.
_SHARES = ((1, 2), (2, 3), (3, 4), (7, 8))


def _reachable_budget(
    device: str,
    model: nn.Module,
    loss_fn: Callable[..., torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    unchunked: int,
) -> tuple[int, BufferPool, Any] | None:
    """The smallest budget of ``_SHARES`` that a chunked step can meet (chosen by planning,
    nothing run), its pool and its step; ``None`` where none can be."""
    for numerator, denominator in _SHARES:
        budget = unchunked * numerator // denominator
        pool = BufferPool(device, limit=budget)
        step = pooled_train_step(model, loss_fn, pool=pool, budget=budget)
        try:
            step.chunks_for(x, y)
        except OutOfMemoryError:
            continue
        return budget, pool, step
    return None


def _share(budget: int, whole: int) -> str:
    """``budget`` as the share of ``whole`` the demo chose, in words."""
    for numerator, denominator in _SHARES:
        if budget == whole * numerator // denominator:
            return (
                "half that"
                if (numerator, denominator) == (1, 2)
                else (
                    f"{numerator}/{denominator} of that (half cannot be met: the gradients are "
                    "most of the step)"
                )
            )
    return "that"
