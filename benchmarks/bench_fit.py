"""What fitting a batch to a budget costs in time: a pooled step in chunks against the same
work done without chunking, side by side (interleaved medians).

Per model, on its own pools:

- **one chunk**: ``sm.pooled_train_step(..., chunks=1)`` against the plain pooled step on the
  same batch (target: within 1.02x; a fitted step adds a signature and a lookup);
- **N chunks**: ``chunks=N`` on a batch of ``B`` against ``N`` plain pooled steps on batches
  of ``B / N`` (the first on empty gradients, the rest adding into them: the same work;
  target: within 1.1x).

Models: torchvision's ResNet-18 (batch 16 at 64x64) and a GPT-2 from its config (two layers,
width 128, batch 8, sequence 64) where those zoos are installed, and the hand-written MLP
of ``step_models`` everywhere. Gradients are set to ``None`` before each step, as
``zero_grad()`` does.

    python benchmarks/bench_fit.py [--quick] [--json PATH]
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Progress, Row, interleaved, row, script_main
from step_models import mlp

import sharedmem as sm

__all__ = ["run"]

CHUNKS = 4
Built = tuple[nn.Module, torch.Tensor, torch.Tensor, Callable[..., torch.Tensor]]


def _mlp() -> Built:
    return mlp(), torch.randn(512, 784), torch.randint(0, 10, (512,)), F.cross_entropy


def _resnet18() -> Built:
    import zoo  # defines torchvision's two C op schemas the CPU torch lacks

    zoo._define_torchvision_ops()
    from torchvision.models import resnet18

    x, y = torch.randn(16, 3, 64, 64), torch.randint(0, 10, (16,))
    return resnet18(num_classes=10), x, y, F.cross_entropy


def _gpt2() -> Built:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000, n_positions=64)
    model = GPT2LMHeadModel(config)
    model.config.use_cache = False
    ids = torch.randint(0, 1000, (8, 64))

    def loss(out: object, labels: torch.Tensor) -> torch.Tensor:
        logits = out.logits  # type: ignore[attr-defined]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))

    return model, ids, torch.roll(ids, -1, 1), loss


MODELS: dict[str, Callable[[], Built]] = {"mlp": _mlp, "resnet18": _resnet18, "gpt2": _gpt2}


def _cases(built: Built) -> dict[str, Callable[[], object]]:
    model, x, y, loss_fn = built
    model.train()
    plain = sm.pooled_train_step(model, loss_fn, pool=sm.BufferPool("cpu"))
    one = sm.pooled_train_step(model, loss_fn, pool=sm.BufferPool("cpu"), chunks=1)
    chunked = sm.pooled_train_step(model, loss_fn, pool=sm.BufferPool("cpu"), chunks=CHUNKS)
    small = sm.pooled_train_step(model, loss_fn, pool=sm.BufferPool("cpu"))
    parts = list(zip(x.chunk(CHUNKS), y.chunk(CHUNKS), strict=True))

    def fresh(step: Callable[[torch.Tensor, torch.Tensor], object]) -> Callable[[], object]:
        def call() -> object:
            model.zero_grad(set_to_none=True)
            return step(x, y)

        return call

    def small_steps() -> None:
        model.zero_grad(set_to_none=True)
        for px, py in parts:
            small(px, py)

    return {
        "plain": fresh(plain),
        "one chunk": fresh(one),
        "chunked": fresh(chunked),
        "small steps": small_steps,
    }


def run(quick: bool = False, device: str = "cpu", progress: Progress | None = None) -> list[Row]:
    """Both ratios per model (CPU: the pooled step's chunks run where its pool is)."""
    if device != "cpu":
        return [row("fitting", 0, "", target="CPU only: skipped")]
    rows: list[Row] = []
    names = ["mlp"] if quick else list(MODELS)
    for name in names:
        try:
            torch.manual_seed(0)
            built = MODELS[name]()
        except ImportError as missing:  # an optional zoo: skip it with the reason
            if progress is not None:
                progress.say(f"bench_fit: {name} skipped ({missing})")
            continue
        cases = _cases(built)
        times = interleaved(
            cases, rounds=5 if quick else 21, number=1, progress=progress, label=name
        )
        for label, case, baseline, most in (
            ("one chunk / plain step", "one chunk", "plain", 1.02),
            (f"{CHUNKS} chunks / {CHUNKS} steps of a {CHUNKS}th", "chunked", "small steps", 1.1),
        ):
            rows.append(
                row(
                    f"{name}: {label}",
                    times[case],
                    "s",
                    baseline=times[baseline],
                    target=f"<= {most}x",
                    ok=times[case] <= most * times[baseline],
                )
            )
    return rows


if __name__ == "__main__":
    script_main(__doc__, run, "fitting a batch in chunks, time on {device}")
