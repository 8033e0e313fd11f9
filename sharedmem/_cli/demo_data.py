"""What every part of the demo shares: its settings, its synthetic data and its MLP's first
weights (the per-net and shared-pool runs of ``demo``, the run in chunks of ``demo_fit``, the
distributed run of ``demo_distributed``)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, fields

import torch

__all__ = ["DemoConfig", "SyntheticData", "initial_weights"]


@dataclass(frozen=True)
class DemoConfig:
    device: str = "cpu"
    steps: int = 150
    train_batch: int = 256
    eval_batch: int = 250
    features: int = 512
    hidden: int = 1024
    classes: int = 10
    lr: float = 0.05
    eval_every: int = 30
    seed: int = 0

    def __post_init__(self) -> None:
        # Zero steps or an empty batch used to fail deep inside the loop (KeyError, division
        # by zero); say what is wrong up front instead.
        for field in fields(self):
            value = getattr(self, field.name)
            if field.type != "int" or field.name == "seed":
                continue
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(
                    f"sharedmem: DemoConfig.{field.name} must be an int, got "
                    f"{type(value).__name__} ({value!r}); pass a whole number >= 1"
                )
            if value < 1:
                raise ValueError(
                    f"sharedmem: DemoConfig.{field.name} must be >= 1, got {value}; pass a "
                    "whole number >= 1"
                )
        if not self.lr > 0:  # NaN fails too
            raise ValueError(f"sharedmem: DemoConfig.lr must be > 0, got {self.lr!r}")


class SyntheticData:
    """Ten Gaussian clusters in ``features`` dimensions: learnable, and free to generate."""

    def __init__(self, config: DemoConfig) -> None:
        self.generator = torch.Generator().manual_seed(config.seed)
        self.centers = torch.randn(config.classes, config.features, generator=self.generator)
        self.config = config

    def batch(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        labels = torch.randint(0, self.config.classes, (size,), generator=self.generator)
        noise = torch.randn(size, self.config.features, generator=self.generator) * 5.0
        # Scaled to unit variance per feature (centers 1, noise 25): with He initialisation
        # the first logits are then of order one, so the first loss is near ln(classes).
        return (self.centers[labels] + noise) / 26.0**0.5, labels


def initial_weights(config: DemoConfig) -> list[torch.Tensor]:
    """The MLP's weights before training, each ``(fan_in, fan_out)`` (biases start at zero)."""
    generator = torch.Generator().manual_seed(config.seed + 1)
    sizes = [config.features, config.hidden, config.hidden, config.classes]
    weights = []
    for fan_in, fan_out in itertools.pairwise(sizes):
        weight = torch.randn(fan_in, fan_out, generator=generator) * (2.0 / fan_in) ** 0.5
        if fan_out == config.classes:  # small last layer: start near the uniform guess
            weight *= 0.1
        weights.append(weight)
    return weights
