"""The model set of the step-memory benchmark: real architectures at small sizes (CPU).

Vision models are written here (the registry's torchvision for this torch is a CUDA build
that does not import on the CPU torch): a ResNet-style CNN with basic blocks and batch norm,
a depthwise MobileNet-style CNN. Then an MLP and a ``nn.TransformerEncoder``, and, where the
``transformers`` package is installed, GPT-2, BERT and Llama built from their configs (two
layers, width 128), with their own code.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

Data = Callable[[int], tuple[torch.Tensor, torch.Tensor]]
Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Case = tuple[str, Callable[[], nn.Module], Data, Loss]


class Block(nn.Module):
    """A ResNet basic block."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.skip = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.skip(x))


def resnet() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
        Block(32, 32, 1), Block(32, 64, 2), Block(64, 128, 2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10),
    )  # fmt: skip


def mobilenet() -> nn.Module:
    def separable(cin: int, cout: int, stride: int) -> list[nn.Module]:
        return [
            nn.Conv2d(cin, cin, 3, stride, 1, groups=cin, bias=False), nn.BatchNorm2d(cin),
            nn.ReLU6(), nn.Conv2d(cin, cout, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU6(),
        ]  # fmt: skip

    return nn.Sequential(
        nn.Conv2d(3, 32, 3, 2, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU6(),
        *separable(32, 64, 1), *separable(64, 128, 2), *separable(128, 128, 1),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10),
    )  # fmt: skip


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1000, 128)
        layer = nn.TransformerEncoderLayer(128, 4, 256, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(128, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)).mean(1))


def _images(size: int) -> Data:
    return lambda b: (torch.randn(b, 3, size, size), torch.randint(0, 10, (b,)))


def _tokens(classes: int, per_token: bool) -> Data:
    def data(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (b, 64) if per_token else (b,)
        return torch.randint(0, 1000, (b, 64)), torch.randint(0, classes, shape)

    return data


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class Logits(nn.Module):
    """A transformers model called on token ids, returning its logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.model(input_ids=ids).logits
        return logits


def _transformers_cases() -> list[Case]:
    """The transformers models, or none, with one line on stderr saying why, where the
    package is missing or cannot import its models here (a torchvision built for another
    torch makes ``transformers.GPT2LMHeadModel`` fail to import)."""
    try:
        import transformers

        for name in ("GPT2LMHeadModel", "BertForSequenceClassification", "LlamaForCausalLM"):
            getattr(transformers, name)  # the models import lazily: import them now
    except Exception as error:  # any import failure: leave the models out, never crash
        first = (str(error).splitlines() or [""])[0]
        print(
            f"step_models: skipping GPT-2, BERT and Llama: transformers cannot import them "
            f"({type(error).__name__}: {first})",
            file=sys.stderr,
        )
        return []
    logging.getLogger("transformers").setLevel(logging.ERROR)
    size = {"vocab_size": 1000}

    def gpt2() -> nn.Module:
        config = transformers.GPT2Config(
            n_layer=2, n_embd=128, n_head=4, n_positions=128, attn_pdrop=0.0, resid_pdrop=0.0,
            embd_pdrop=0.0, **size,
        )  # fmt: skip
        return Logits(transformers.GPT2LMHeadModel(config))

    def bert() -> nn.Module:
        config = transformers.BertConfig(
            num_hidden_layers=2, hidden_size=128, num_attention_heads=4, intermediate_size=256,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=10, **size,
        )  # fmt: skip
        return Logits(transformers.BertForSequenceClassification(config))

    def llama() -> nn.Module:
        config = transformers.LlamaConfig(
            num_hidden_layers=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=4,
            intermediate_size=256, max_position_embeddings=128, **size,
        )  # fmt: skip
        return Logits(transformers.LlamaForCausalLM(config))

    return [
        ("gpt2", gpt2, _tokens(1000, per_token=True), _lm_loss),
        ("bert", bert, _tokens(10, per_token=False), F.cross_entropy),
        ("llama", llama, _tokens(1000, per_token=True), _lm_loss),
    ]


CASES: list[Case] = [
    ("resnet", resnet, _images(32), F.cross_entropy),
    ("mobilenet", mobilenet, _images(64), F.cross_entropy),
    ("mlp", mlp, lambda b: (torch.randn(b, 784), torch.randint(0, 10, (b,))), F.cross_entropy),
    ("transformer", Encoder, _tokens(10, per_token=False), F.cross_entropy),
    *_transformers_cases(),
]
