"""Real models built from their configs, never from downloaded weights: the model sweep.

Each entry of ``zoo()`` is a ``Model``: a name, the zoo it comes from, and ``build()`` that
returns ``(model, inputs, targets, loss_fn)`` at a small batch and resolution, so one CPU train
step takes well under a second. ``inputs`` follows the calling convention of
``sm.pooled_train_step``: a tuple is unpacked into positional arguments, a dict into keyword
arguments, anything else is the one argument. ``targets`` and ``loss_fn`` are ``None`` where
the model computes its own loss (a transformers model given ``labels``).

The zoos are optional: torchvision, timm and transformers are imported on demand, and a zoo
that fails to import (not installed, or built for another torch) is left out with one line
in ``skipped()`` saying why; it never raises. The recurrent models need only torch.

    python benchmarks/zoo.py          # list the models this environment can build
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["Built", "Model", "skipped", "zoo"]

Built = tuple[nn.Module, Any, Any, Callable[..., torch.Tensor] | None]


@dataclass(frozen=True)
class Model:
    """One zoo model: ``build()`` gives ``(model, inputs, targets, loss_fn)``."""

    name: str
    zoo: str
    build: Callable[[], Built]


_SKIPPED: dict[str, str] = {}
_NMS_SCHEMA = "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"


def skipped() -> dict[str, str]:
    """The zoos left out, each with why (call after ``zoo()``)."""
    return dict(_SKIPPED)


def _define_torchvision_ops() -> None:
    """Declare torchvision's two C++ op schemas its Python imports register fakes for, where
    its own C++ library cannot load.

    A torchvision built for another torch cannot load its C++ ops; its Python package then
    fails at import when it registers fake kernels for ``nms``/``qnms``. Declaring the schemas
    first lets the model code import; no model here calls them. Where the library does load
    (a torchvision built for this torch, as on a GPU image), it is loaded here and nothing is
    declared: its own registration of a schema declared already would abort the process.
    """
    spec = importlib.util.find_spec("torchvision")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    library = next((lib for folder in folders for lib in Path(folder).glob("_C*.so")), None)
    if library is not None:
        try:
            torch.ops.load_library(str(library))  # what torchvision's import does first
            return
        except (OSError, RuntimeError):  # built for another torch: declare the schemas
            pass
    for name in ("nms", "qnms"):
        # Already defined (by torchvision's own C++ or an earlier call): nothing to do.
        with contextlib.suppress(RuntimeError):
            torch.library.define(f"torchvision::{name}", _NMS_SCHEMA)


def _images(batch: int, size: int, classes: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch, 3, size, size), torch.randint(0, classes, (batch,))


def _torchvision() -> list[Model]:
    _define_torchvision_ops()
    from torchvision import models as tv

    def image(factory: Callable[..., nn.Module], size: int, **kw: Any) -> Callable[[], Built]:
        def build() -> Built:
            x, y = _images(2, size)
            return factory(num_classes=10, **kw), x, y, F.cross_entropy

        return build

    vit = image(
        tv.VisionTransformer, 32, image_size=32, patch_size=8, num_layers=2, num_heads=4,
        hidden_dim=128, mlp_dim=256,
    )  # fmt: skip
    return [
        Model("tv_resnet18", "torchvision", image(tv.resnet18, 32)),
        Model("tv_resnet50", "torchvision", image(tv.resnet50, 32)),
        Model("tv_mobilenet_v3_small", "torchvision", image(tv.mobilenet_v3_small, 32)),
        Model("tv_efficientnet_b0", "torchvision", image(tv.efficientnet_b0, 32)),
        Model("tv_densenet121", "torchvision", image(tv.densenet121, 32)),
        Model("tv_regnet_y_400mf", "torchvision", image(tv.regnet_y_400mf, 32)),
        Model("tv_vit_b_16", "torchvision", vit),  # ViT-B/16's code, a small config
        Model("tv_convnext_tiny", "torchvision", image(tv.convnext_tiny, 32)),
        Model("tv_swin_t", "torchvision", image(tv.swin_t, 32)),
    ]


def _timm() -> list[Model]:
    _define_torchvision_ops()  # timm imports torchvision where it is installed
    import timm

    create = timm.create_model  # fails here, not in a build, where timm cannot load

    def image(name: str, size: int, **kw: Any) -> Callable[[], Built]:
        def build() -> Built:
            x, y = _images(2, size)
            model = create(name, pretrained=False, num_classes=10, **kw)
            return model, x, y, F.cross_entropy

        return build

    return [
        Model(
            "timm_vit_tiny_patch16_224",
            "timm",
            image("vit_tiny_patch16_224", 64, img_size=64),
        ),
        Model("timm_convnext_atto", "timm", image("convnext_atto", 64)),
        Model("timm_efficientformerv2_s0", "timm", image("efficientformerv2_s0", 64, img_size=64)),
    ]


_VOCAB = 1000
_SEQ = 32
_BATCH = 2


def _tokens(batch: int = _BATCH, seq: int = _SEQ) -> torch.Tensor:
    return torch.randint(0, _VOCAB, (batch, seq))


def _transformers() -> list[Model]:
    _define_torchvision_ops()  # transformers imports torchvision where it is installed
    import transformers

    # The models import lazily: import them now, so a zoo that cannot is skipped as a whole.
    for name in (
        "GPT2LMHeadModel", "BertForSequenceClassification", "LlamaForCausalLM",
        "T5ForConditionalGeneration", "DistilBertForSequenceClassification", "Qwen2ForCausalLM",
    ):  # fmt: skip
        getattr(transformers, name)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    no_dropout = {"attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0}
    bert_like = {
        "num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4,
        "intermediate_size": 256, "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0, "vocab_size": _VOCAB, "max_position_embeddings": 64,
    }  # fmt: skip
    decoder = {
        "num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 256, "max_position_embeddings": 64,
        "vocab_size": _VOCAB, "use_cache": False,
    }  # fmt: skip

    def causal(model: nn.Module) -> Built:
        ids = _tokens()
        # The model's own loss: labels are the ids, shifted inside the model.
        return model, {"input_ids": ids, "labels": ids}, None, None

    def gpt2() -> Built:
        config = transformers.GPT2Config(
            n_layer=2, n_embd=128, n_head=4, n_positions=64, vocab_size=_VOCAB, use_cache=False,
            **no_dropout,
        )  # fmt: skip
        return causal(transformers.GPT2LMHeadModel(config))

    def llama() -> Built:
        return causal(transformers.LlamaForCausalLM(transformers.LlamaConfig(**decoder)))

    def qwen2() -> Built:
        return causal(transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**decoder)))

    def bert() -> Built:
        config = transformers.BertConfig(num_labels=10, **bert_like)
        model = transformers.BertForSequenceClassification(config)
        ids = _tokens()
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        return model, inputs, torch.randint(0, 10, (_BATCH,)), _logits_loss

    def distilbert() -> Built:
        config = transformers.DistilBertConfig(
            n_layers=2, dim=128, n_heads=4, hidden_dim=256, dropout=0.0, attention_dropout=0.0,
            vocab_size=_VOCAB, max_position_embeddings=64, num_labels=10,
        )  # fmt: skip
        model = transformers.DistilBertForSequenceClassification(config)
        ids = _tokens()
        labels = torch.randint(0, 10, (_BATCH,))
        return model, {"input_ids": ids, "labels": labels}, None, None

    def t5() -> Built:
        config = transformers.T5Config(
            num_layers=2, num_decoder_layers=2, d_model=128, d_ff=256, num_heads=4, d_kv=32,
            vocab_size=_VOCAB, dropout_rate=0.0, use_cache=False, decoder_start_token_id=0,
            pad_token_id=0,
        )  # fmt: skip
        model = transformers.T5ForConditionalGeneration(config)
        ids = _tokens()
        return model, {"input_ids": ids, "labels": _tokens(seq=_SEQ // 2)}, None, None

    return [
        Model("hf_gpt2", "transformers", gpt2),
        Model("hf_bert", "transformers", bert),
        Model("hf_llama", "transformers", llama),
        Model("hf_t5", "transformers", t5),
        Model("hf_distilbert", "transformers", distilbert),
        Model("hf_qwen2", "transformers", qwen2),
    ]


def _logits_loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
    """Cross entropy on a transformers output's logits."""
    return F.cross_entropy(out.logits, targets)


class RecurrentLM(nn.Module):
    """A language model on ``nn.LSTM`` or ``nn.GRU``: embedding, two layers, a vocabulary head."""

    def __init__(self, cell: type[nn.LSTM] | type[nn.GRU], dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(_VOCAB, 64)
        self.rnn = cell(64, 128, num_layers=2, batch_first=True, dropout=dropout)
        self.head = nn.Linear(128, _VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embed(ids))
        logits: torch.Tensor = self.head(out)
        return logits


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _recurrent() -> list[Model]:
    def build(cell: type[nn.LSTM] | type[nn.GRU]) -> Callable[[], Built]:
        def run() -> Built:
            ids = _tokens(4, _SEQ)
            return RecurrentLM(cell), ids, torch.roll(ids, -1, 1), _lm_loss

        return run

    return [
        Model("lstm_lm", "torch", build(nn.LSTM)),
        Model("gru_lm", "torch", build(nn.GRU)),
    ]


_ZOOS: dict[str, Callable[[], list[Model]]] = {
    "torchvision": _torchvision,
    "timm": _timm,
    "transformers": _transformers,
    "torch": _recurrent,
}


def zoo(names: tuple[str, ...] | None = None) -> list[Model]:
    """Every model the installed zoos can build (``names``: only these zoos).

    A zoo whose import fails is left out; ``skipped()`` says why.
    """
    models: list[Model] = []
    for zoo_name, entries in _ZOOS.items():
        if names is not None and zoo_name not in names:
            continue
        try:
            models.extend(entries())
        except Exception as error:  # not installed, or built for another torch: leave it out
            first = (str(error).splitlines() or [""])[0]
            _SKIPPED[zoo_name] = f"{type(error).__name__}: {first}"
    return models


if __name__ == "__main__":
    for entry in zoo():
        print(f"{entry.zoo:13} {entry.name}")
    for zoo_name, why in skipped().items():
        print(f"skipped {zoo_name}: {why}")
