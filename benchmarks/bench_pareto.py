"""Memory against time: the planner's train steps beside the ways PyTorch users trade time for
memory today, on three activation-heavy real models (issue 24's Pareto benchmark).

Each point is one way to run the same train step: its own peak (the most bytes the step holds
above what was live before it, new gradients and kernels' scratch included, plus a pooled
step's reserved pool bytes; the allocator's events, DESIGN §8) and its median time, in one
process, against eager's:

- **eager**: ``loss_fn(model(x), y).backward()``;
- **checkpoint**: ``torch.utils.checkpoint`` (non-reentrant) around every block: each of
  ResNet's basic blocks, GPT-2's layers (``gradient_checkpointing_enable``), ViT's blocks
  (timm's ``set_grad_checkpointing``);
- **compile b**: ``torch.compile`` with ``torch._functorch.config.activation_memory_budget``
  at b = 1.0, 0.5 and 0.1 (the partitioner's knapsack over the joint graph);
- **planner**: ``sm.pooled_train_step`` by default, with ``recompute=sm.Recompute.within(s)``
  for ``s`` in 1.05, 1.15 and
  1.35 (the least memory recomputation reaches within that modelled time), and with
  ``budget=`` half the default's own peak (recomputation where it reaches, else chunks).

Configurations (built from their configs, no weights): torchvision ResNet-18 at batch 32,
128x128; transformers GPT-2 with 4 layers, width 256, batch 4, sequence 256 (dropout 0, and
again with transformers' default dropout of 0.1: recomputation draws the masks again from the
saved generator state); timm ViT-tiny at batch 16, 224x224; transformers BERT at BERT-base's
sizes (12 layers, width 768, 12 heads, 3072 wide, its 30,522-token vocabulary; dropout 0; a
10-class head) at batch 2, sequence 512 (one step takes about 20 s on the 2-core CPU these
figures came from: batch 2 keeps a run within an hour); torchvision ConvNeXt-T at batch 16,
128x128 (checkpoint: each ``CNBlock``; its stochastic depth 0.1 kept). A zoo that is not
installed is skipped with a line saying so.

``SHAREDMEM_PARETO_ONLY=bert_base,convnext_tiny`` runs the configurations named (of
``MODELS``) alone; ``SHAREDMEM_PARETO_ROUNDS=N`` takes each time as the median of N calls
(default 7); ``SHAREDMEM_PARETO_NO_COMPILE=1`` leaves compile out. A budget the step
cannot hold (below its gradients) gives no point, with a line saying why. Beside each model's
rows: its least-memory point against that step's floor (the most bytes one op needs at once
beside the gradients made before it; DESIGN §7: within 2%), and, over two or more
configurations, the default's median peak against eager's (<= 0.70x).

A planner point is "met" where no checkpoint or compile point beats it on both memory and
time. ``--png`` draws the points (peak / eager against time / eager, one panel per model).
``--quick`` runs a small hand-written CNN without compile and with one max_slowdown point, the
least memory (only to exercise this script).

    python benchmarks/bench_pareto.py [--quick] [--json PATH] [--png PATH]
"""

from __future__ import annotations

import copy
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Progress, Row, row, script_main

import sharedmem as sm
from sharedmem.testing import allocator_peak

__all__ = ["Point", "all_rows", "draw", "points", "run"]

Loss = Callable[[object, torch.Tensor], torch.Tensor]
Built = tuple[nn.Module, torch.Tensor, torch.Tensor, Loss]
COMPILE_BUDGETS = (1.0, 0.5, 0.1)
SLOWDOWNS = (1.05, 1.15, 1.35)
LOWEST_TARGET = 0.35  # the lowest-memory planner point, as a fraction of eager's peak
DEFAULT_TARGET = 0.70  # the default's median peak over the configurations, against eager's
ROUNDS = 7  # each time is the median of this many interleaved calls
FLOOR_SLACK = 1.02  # the least-memory point, at most this over its step's floor
BERT_BATCH = 2  # BERT-base at sequence 512: a step of seconds on a 2-core CPU


@dataclass(frozen=True)
class Point:
    """One way to run a model's train step: its own peak and its median step time."""

    model: str
    method: str  # eager, checkpoint, compile, planner
    label: str
    peak: int
    seconds: float
    # A planner point's floor (``PlanSummary.floor``): the most bytes one op of its step needs
    # at once beside the gradients made before it; 0 for the others.
    floor: int = 0
    floor_op: str = ""


# ---- the models ---------------------------------------------------------------------------


def _resnet18() -> Built:
    import zoo  # defines torchvision's two C op schemas the CPU torch lacks

    zoo._define_torchvision_ops()
    from torchvision.models import resnet18

    x, y = torch.randn(32, 3, 128, 128), torch.randint(0, 10, (32,))
    return resnet18(num_classes=10), x, y, F.cross_entropy


def _gpt2(dropout: float = 0.0) -> Built:
    import zoo  # transformers imports torchvision where it is installed

    zoo._define_torchvision_ops()
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=4, n_embd=256, n_head=4, vocab_size=1000, n_positions=256,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    model.config.use_cache = False
    ids = torch.randint(0, 1000, (4, 256))
    return model, ids, torch.roll(ids, -1, 1), _lm_loss


def _lm_loss(out: object, labels: torch.Tensor) -> torch.Tensor:
    logits = out.logits  # type: ignore[attr-defined]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _vit_tiny() -> Built:
    import zoo  # timm imports torchvision where it is installed

    zoo._define_torchvision_ops()
    import timm

    model = timm.create_model("vit_tiny_patch16_224", num_classes=10)
    x, y = torch.randn(16, 3, 224, 224), torch.randint(0, 10, (16,))
    return model, x, y, F.cross_entropy


def _bert_base(batch: int = BERT_BATCH) -> Built:
    import zoo  # transformers imports torchvision where it is installed

    zoo._define_torchvision_ops()
    from transformers import BertConfig, BertForSequenceClassification

    # BERT-base's sizes (transformers' defaults: 12 layers, width 768, 12 heads, 3072 wide,
    # vocabulary 30,522), dropout 0 (the GPT-2 pair covers dropout), a 10-class head on the
    # pooled first token.
    config = BertConfig(
        num_labels=10, max_position_embeddings=512,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    model = BertForSequenceClassification(config)
    ids = torch.randint(0, config.vocab_size, (batch, 512))
    return model, ids, torch.randint(0, 10, (batch,)), _logits_loss


def _logits_loss(out: object, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits, labels)  # type: ignore[attr-defined]


def _convnext_tiny() -> Built:
    import zoo

    zoo._define_torchvision_ops()
    from torchvision.models import convnext_tiny

    # torchvision's own stochastic depth (0.1) stays: recomputation draws it again.
    x, y = torch.randn(16, 3, 128, 128), torch.randint(0, 10, (16,))
    return convnext_tiny(num_classes=10), x, y, F.cross_entropy


def _small_cnn() -> Built:
    # --quick only: exercises the script in seconds; its figures are evidence of nothing.
    layers: list[nn.Module] = [nn.Conv2d(3, 16, 3, padding=1)]
    for _ in range(4):
        layers += [_Block(16)]
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
    return model, torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,)), F.cross_entropy


class _Block(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.BatchNorm2d(channels), nn.ReLU(), nn.Conv2d(channels, channels, 3, padding=1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


MODELS: dict[str, Callable[[], Built]] = {
    "resnet18": _resnet18,
    "gpt2": _gpt2,
    "gpt2_dropout": functools.partial(_gpt2, 0.1),  # transformers' default dropout
    "vit_tiny": _vit_tiny,
    "bert_base": _bert_base,
    "convnext_tiny": _convnext_tiny,
}


class _Checkpointed(nn.Module):
    """``inner`` run under ``torch.utils.checkpoint`` (what users wrap their blocks in)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, x, use_reentrant=False)  # type: ignore[no-any-return]


# torchvision's ResNets and ConvNeXts, the quick CNN
_BLOCKS = ("BasicBlock", "Bottleneck", "CNBlock", "_Block")


def _checkpoint_every_block(model: nn.Module) -> nn.Module:
    """``model`` with every block under ``torch.utils.checkpoint``, as users write it."""
    if hasattr(model, "gradient_checkpointing_enable"):  # transformers
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif hasattr(model, "set_grad_checkpointing"):  # timm
        model.set_grad_checkpointing(True)
    else:
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if type(child).__name__ in _BLOCKS:
                    setattr(parent, name, _Checkpointed(child))
    return model


# ---- the points ---------------------------------------------------------------------------


@dataclass
class _Case:
    label: str
    method: str
    call: Callable[[], object]
    reserved: Callable[[], int]
    context: Callable[[], AbstractContextManager[object]]
    # Told the case's own peak once measured (the default's: the half budget is taken from
    # the figure in the table, not measured again later in the process, when other steps
    # have grown kernels' process-wide caches and a step's own peak reads lower).
    measured: Callable[[int], None] = lambda peak: None
    # What the step says of its choice (a budget's report: chunks, and why), or "".
    said: Callable[[], str] = lambda: ""
    # A planner step's floor and its op (``PlanSummary.floor``), or (0, "").
    floor: Callable[[], tuple[int, str]] = lambda: (0, "")
    # Drops the gradients a call made (between calls, untimed: eleven copies of a large
    # model's gradients need not stay live together).
    drop: Callable[[], None] = lambda: None


def _cases(built: Built, *, compile_too: bool, slowdowns: tuple[float, ...]) -> list[_Case]:
    model, x, y, loss_fn = built
    model.train()

    def eager_on(m: nn.Module) -> Callable[[], object]:
        def call() -> None:
            m.zero_grad(set_to_none=True)
            loss_fn(m(x), y).backward()  # type: ignore[no-untyped-call]

        return call

    def zero() -> int:
        return 0

    def dropping(m: nn.Module) -> Callable[[], None]:
        return functools.partial(m.zero_grad, set_to_none=True)

    cases = [_Case("eager", "eager", eager_on(model), zero, nullcontext, drop=dropping(model))]
    checkpointed = _checkpoint_every_block(copy.deepcopy(model))
    cases.append(
        _Case(
            "checkpoint every block",
            "checkpoint",
            eager_on(checkpointed),
            zero,
            nullcontext,
            drop=dropping(checkpointed),
        )
    )
    if compile_too:
        for budget in COMPILE_BUDGETS:
            compiled = torch.compile(copy.deepcopy(model))
            cases.append(
                _Case(
                    f"compile, budget {budget}",
                    "compile",
                    eager_on(compiled),  # type: ignore[arg-type]
                    zero,
                    lambda budget=budget: _memory_budget(budget),  # type: ignore[misc]
                    drop=dropping(compiled),  # type: ignore[arg-type]
                )
            )
    own_peak: list[int] = []

    def planner(label: str, **kw: object) -> _Case:
        copied = copy.deepcopy(model)
        pool = sm.BufferPool("cpu")
        step = sm.pooled_train_step(copied, loss_fn, pool=pool, **kw)  # type: ignore[arg-type]

        def call() -> object:
            copied.zero_grad(set_to_none=True)
            return step(x, y)

        def reserved() -> int:
            return int(pool.stats()["reserved_bytes"])

        def floor() -> tuple[int, str]:
            summary = step.plan_summary()
            return summary.floor, summary.floor_op

        said = step.report if "budget" in kw else (lambda: "")
        return _Case(
            label, "planner", call, reserved, nullcontext, said=said, floor=floor,
            drop=dropping(copied),
        )  # fmt: skip

    default = planner("planner, default")
    default.measured = own_peak.append
    cases.append(default)
    for slowdown in slowdowns:
        cases.append(
            planner(f"planner, max_slowdown {slowdown}", recompute=sm.Recompute.within(slowdown))
        )
    cases.append(planner("planner, least memory", recompute=sm.Recompute.MOST))

    def half_budget() -> _Case:
        if not own_peak:
            default.call()
            own_peak.append(allocator_peak(default.call) + default.reserved())
        return planner("planner, budget half the default's", budget=own_peak[0] // 2)

    cases.append(_Lazy("planner, budget half the default's", half_budget))  # type: ignore[arg-type]
    return cases


class _Lazy:
    """A case made when first needed (the half budget needs the default's measured peak)."""

    def __init__(self, label: str, make: Callable[[], _Case]) -> None:
        self.label, self.method, self._make = label, "planner", make
        self._case: _Case | None = None

    def _get(self) -> _Case:
        if self._case is None:
            self._case = self._make()
        return self._case

    def call(self) -> object:
        return self._get().call()

    def reserved(self) -> int:
        return self._get().reserved()

    def measured(self, peak: int) -> None:
        pass

    def said(self) -> str:
        return self._get().said()

    def floor(self) -> tuple[int, str]:
        return self._get().floor()

    def drop(self) -> None:
        self._get().drop()

    def context(self) -> AbstractContextManager[object]:
        return nullcontext()


@contextmanager
def _memory_budget(budget: float) -> Iterator[None]:
    import torch._functorch.config as functorch_config

    with functorch_config.patch(activation_memory_budget=budget):
        yield


def _measure(name: str, cases: list[_Case], rounds: int, progress: Progress | None) -> list[Point]:
    """Each case's own peak (after a first call: compiled, recorded, planned) and its median
    time over ``rounds`` calls, the cases interleaved round by round."""
    peaks: dict[str, int] = {}
    floors: dict[str, tuple[int, str]] = {}
    for case in list(cases):
        if progress is not None:
            progress.say(f"{name}: {case.label}: first call and peak")
        with case.context():
            try:
                case.call()  # compile, trace, record: not measured
            except sm.OutOfMemoryError as refused:  # a budget below the step's gradients
                cases.remove(case)
                if progress is not None:
                    progress.say(f"{name}: {case.label}: no point: {refused}")
                continue
            case.drop()
            case.call()
            case.drop()
            peaks[case.label] = allocator_peak(case.call) + case.reserved()
            case.drop()
            case.measured(peaks[case.label])
        floors[case.label] = case.floor()
        if progress is not None:  # the memory figures as they come (a long run may not end)
            floor, op = floors[case.label]
            at = f"; floor {floor:,} bytes at {op}" if floor else ""
            progress.say(f"{name}: {case.label}: peak {peaks[case.label]:,} bytes{at}")
        if progress is not None and (said := case.said()):
            progress.say(f"{name}: {case.label}: {said}")
    samples: dict[str, list[float]] = {case.label: [] for case in cases}
    for index in range(rounds):
        order = cases if index % 2 == 0 else cases[::-1]
        for case in order:
            with case.context():
                start = time.perf_counter()
                case.call()
                samples[case.label].append(time.perf_counter() - start)
                case.drop()
        if progress is not None:
            progress.tick(f"{name}: round {index + 1}/{rounds}")
    return [
        Point(
            name,
            case.method,
            case.label,
            peaks[case.label],
            statistics.median(samples[case.label]),
            *floors[case.label],
        )
        for case in cases
    ]


def _rows(points: list[Point]) -> list[Row]:
    eager = next(p for p in points if p.method == "eager")
    others = [p for p in points if p.method in ("checkpoint", "compile")]
    rows: list[Row] = []
    for p in points:
        if p.method != "planner":
            target, ok = "", None
        else:  # met: no checkpoint or compile point has both less memory and less time
            beaten = [o.label for o in others if o.peak < p.peak and o.seconds < p.seconds]
            target, ok = "not beaten on both", not beaten
        rows.append(
            row(f"{p.model}: {p.label}: peak", p.peak, "bytes", baseline=eager.peak,
                target=target, ok=ok)
        )  # fmt: skip
        rows.append(row(f"{p.model}: {p.label}: time", p.seconds, "s", baseline=eager.seconds))
    least = next((p for p in points if p.label == "planner, least memory"), None)
    if least is not None and least.floor:  # DESIGN §7: least memory within 2% of the floor
        rows.append(
            row(
                f"{eager.model}: least memory against its floor ({least.floor_op})",
                least.peak,
                "bytes",
                baseline=least.floor,
                target=f"<= {FLOOR_SLACK}x",
                ok=least.peak <= FLOOR_SLACK * least.floor,
            )
        )
    lowest = min((p for p in points if p.method == "planner"), key=lambda p: p.peak)
    rows.append(
        row(
            f"{eager.model}: lowest planner peak ({lowest.label})",
            lowest.peak,
            "bytes",
            baseline=eager.peak,
            target=f"<= {LOWEST_TARGET}x",
            ok=lowest.peak <= LOWEST_TARGET * eager.peak,
        )
    )
    return rows


def points(
    quick: bool = False,
    progress: Progress | None = None,
    *,
    only: tuple[str, ...] = (),
    rounds: int = ROUNDS,
) -> list[Point]:
    """Every point of every configuration this environment can build (or of those named in
    ``only``), each configuration in a process of its own (``--quick``: in this one), each
    time the median of ``rounds``."""
    if quick:
        return _model_points("small_cnn", quick=True, progress=progress)
    unknown = sorted(set(only) - set(MODELS))
    if unknown:
        raise ValueError(
            f"sharedmem: no Pareto configuration named {', '.join(unknown)}; name some of "
            f"{', '.join(MODELS)}"
        )
    found: list[Point] = []
    for name in only or MODELS:
        found += _in_own_process(name, progress is not None, rounds)
    return found


def _in_own_process(name: str, talk: bool, rounds: int = ROUNDS) -> list[Point]:
    # A step's own peak is what it allocates above what was there before it, and kernels
    # keep process-wide caches (oneDNN's scratchpad grows to the largest a model needed and
    # stays): measured after another model, a step's own peak reads lower than it is alone
    # (GPT-2's default by 1.2 MB after ResNet-18), and so does the half budget taken from it.
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as worker:
        found: list[Point] = worker.apply(_model_points, (name,), {"talk": talk, "rounds": rounds})
    return found


def _model_points(
    name: str,
    *,
    quick: bool = False,
    progress: Progress | None = None,
    talk: bool = False,
    rounds: int = ROUNDS,
) -> list[Point]:
    make = _small_cnn if quick else MODELS[name]
    if talk and progress is None:
        progress = Progress("bench_pareto")
    try:
        torch.manual_seed(0)
        built = make()
    except ImportError as missing:  # an optional zoo: skip it with the reason
        if progress is not None:
            progress.say(f"{name} skipped ({missing})")
        return []
    # --quick: the planner's least-memory point stands for its max_slowdown settings (one
    # recomputation search instead of four).
    compile_too = not quick and os.environ.get("SHAREDMEM_PARETO_NO_COMPILE", "") != "1"
    cases = _cases(built, compile_too=compile_too, slowdowns=() if quick else SLOWDOWNS)
    return _measure(name, cases, 3 if quick else rounds, progress)


_MEASURED: list[Point] = []  # the latest run's points, for --png


def run(quick: bool = False, device: str = "cpu", progress: Progress | None = None) -> list[Row]:
    """The rows of every configuration (CPU only: compile's CPU partitioner is the baseline
    measured here)."""
    if device != "cpu":
        return [row("pareto", 0, "", target="CPU only: skipped")]
    only = tuple(n for n in os.environ.get("SHAREDMEM_PARETO_ONLY", "").split(",") if n)
    rounds = int(os.environ.get("SHAREDMEM_PARETO_ROUNDS", ROUNDS))
    _MEASURED[:] = points(quick, progress, only=only, rounds=rounds)
    return all_rows(_MEASURED)


def all_rows(found: list[Point]) -> list[Row]:
    """The rows of every model among ``found``, model by model."""
    rows: list[Row] = []
    for name in dict.fromkeys(p.model for p in found):
        rows += _rows([p for p in found if p.model == name])
    names = dict.fromkeys(p.model for p in found)
    defaults = [r for r in (_default_ratio(found, name) for name in names) if r is not None]
    if len(defaults) > 1:  # DESIGN §7: the default's median peak over the set
        rows.append(
            row(
                f"median default peak / eager over {len(defaults)} configurations",
                statistics.median(defaults),
                "x",
                target=f"<= {DEFAULT_TARGET}x",
                ok=statistics.median(defaults) <= DEFAULT_TARGET,
            )
        )
    return rows


def _default_ratio(found: list[Point], name: str) -> float | None:
    mine = {p.label: p for p in found if p.model == name}
    if "eager" not in mine or "planner, default" not in mine:
        return None
    return mine["planner, default"].peak / mine["eager"].peak


def draw(found: list[Point], path: Path) -> None:
    """Peak / eager against time / eager, one panel per model, one marker per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(p.model for p in found))
    columns = min(2, len(names))
    rows = -(-len(names) // columns)
    figure, grid = plt.subplots(rows, columns, figsize=(5 * columns, 4.2 * rows), squeeze=False)
    axes = [list(grid.flat)]
    for spare in axes[0][len(names) :]:
        spare.set_visible(False)
    style = {"eager": ("k", "o"), "checkpoint": ("tab:orange", "s"),
             "compile": ("tab:purple", "^"), "planner": ("tab:blue", "D")}  # fmt: skip
    for ax, name in zip(axes[0], names, strict=False):
        mine = [p for p in found if p.model == name]
        eager = next(p for p in mine if p.method == "eager")
        for method, (colour, marker) in style.items():
            ps = [p for p in mine if p.method == method]
            if not ps:
                continue
            ax.scatter([p.seconds / eager.seconds for p in ps], [p.peak / eager.peak for p in ps],
                       c=colour, marker=marker, label=method, s=40)  # fmt: skip
            for p in ps:
                short = p.label.replace("planner, ", "").replace("compile, ", "")
                ax.annotate(short, (p.seconds / eager.seconds, p.peak / eager.peak),
                            fontsize=6, xytext=(3, 3), textcoords="offset points")  # fmt: skip
        ax.set_title(name)
        ax.set_xlabel("step time / eager")
        ax.set_ylabel("step's own peak / eager")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _draw_latest(path: Path) -> None:
    draw(_MEASURED, path)


if __name__ == "__main__":
    script_main(
        __doc__,
        run,
        "memory against time: the planner, checkpointing and compile ({device})",
        draw=_draw_latest,
    )
