"""``torch.compile`` with the pool as its backend: Dynamo and AOTAutograd capture, the pool's
arena serves the graphs' allocations, and every result is eager's bit for bit, whatever the
user changes between calls (Dynamo guards it and compiles again)."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

import sharedmem as sm
from sharedmem._compile import compile_backend
from sharedmem._compile.backend import Span
from sharedmem.testing import allocator_peak

Loss = Callable[[nn.Module, torch.Tensor], torch.Tensor]


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    """Each test compiles from scratch: Dynamo's caches are per code object, process-wide."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Block(nn.Module):
    """A pre-norm transformer block with dropout in the attention and the MLP."""

    def __init__(self, d: int = 32, p: float = 0.1) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 4, dropout=p, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Dropout(p), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


def _mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4)
    )


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
        nn.Conv2d(8, 8, 3, stride=2), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
    )  # fmt: skip


def _square_mean(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = model(x).square().mean()
    return out


def _train_side_by_side(
    model: nn.Module,
    inputs: list[torch.Tensor],
    *,
    pool: sm.BufferPool | None = None,
    twin: nn.Module | None = None,
    loss: Loss = _square_mean,
    span: Span = "step",
) -> None:
    """Train ``model`` eagerly and ``twin`` (by default a copy) compiled on the pool's
    backend, a few SGD steps on ``inputs``, the same generator seed before each; every loss,
    gradient, parameter and buffer must be equal, bit for bit."""
    pool = sm.BufferPool("cpu") if pool is None else pool
    twin = twin if twin is not None else copy.deepcopy(model)
    compiled = torch.compile(twin, backend=compile_backend(pool, span=span))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, twin)]
    # Gradients present at every step's start (zeroed in place): nothing but the loss
    # outlives a step, and the arena serves what the step allocates (with gradients made
    # anew, a small model's plan may serve nothing, to keep its peak at eager's).
    for p in (*model.parameters(), *twin.parameters()):
        p.grad = torch.zeros_like(p)
    for i, x in enumerate(inputs):
        losses = []
        for m, opt in zip((model, compiled), optimizers, strict=True):
            opt.zero_grad(set_to_none=False)
            torch.manual_seed(100 + i)
            value = loss(m, x)
            value.backward()
            losses.append(value.detach())
            opt.step()
        assert torch.equal(losses[0], losses[1]), (i, losses)
        for (name, a), b in zip(model.named_parameters(), twin.parameters(), strict=True):
            assert a.grad is not None and b.grad is not None
            assert torch.equal(a.grad, b.grad), (i, name)
        for (name, a), b in zip(model.named_buffers(), twin.buffers(), strict=True):
            assert torch.equal(a, b), (i, name)


# ---- training equals eager, with the pool serving ----------------------------------------


@pytest.mark.parametrize("span", ["step", "graph"])
@pytest.mark.parametrize(
    ("build", "shape"),
    [(_mlp, (8, 16)), (_cnn, (4, 3, 12, 12)), (Block, (2, 10, 32))],
    ids=["mlp", "cnn-batchnorm", "transformer-dropout"],
)
def test_training_equals_eager_and_the_arena_serves(
    build: Callable[[], nn.Module], shape: tuple[int, ...], span: Span
) -> None:
    torch.manual_seed(0)
    pool = sm.BufferPool("cpu")
    _train_side_by_side(build(), [torch.randn(shape) for _ in range(4)], pool=pool, span=span)
    stats = pool.stats()
    # Four steps: one routed call each (a step's span), or two (its forward and backward
    # graphs). Each call is recorded or replayed: the first of each route records, and a
    # replay that meets another sequence (oneDNN's convolutions allocate differently on
    # their first call) is recorded once more. A step's span is open while its graphs
    # compile: that call is not the steady sequence, and the second records it (``compiling``).
    calls, routes, compiled = (4, 1, 1) if span == "step" else (8, 2, 0)
    assert stats["recorded_calls"] + stats["replayed_calls"] == calls
    assert stats["recorded_calls"] - stats.get("diverged_calls", 0) == routes + compiled
    assert stats["replayed_calls"] >= calls - 2 * routes - 1
    assert stats["arena_served_bytes"] > 0
    assert "act.0" in pool.names()


def test_blocks_compiled_apart_replay_from_the_second_step() -> None:
    # Each block its own torch.compile (as torchtitan compiles a model): the first step's
    # span is open while the later blocks compile, and while AOTAutograd compiles each
    # backward graph at the first backward pass. What compiling allocates is set aside,
    # PyTorch's: recorded with the step, the second step left the plan made from the
    # first (served by PyTorch beside an arena reserved for the whole step), the third
    # recorded again, and only the fourth replayed. And the step that compiled is not taken
    # as the steady sequence (a compiled region's first call makes more than compiling
    # does: ResNet-18's, 20 scalars no later call makes): the second step records it.
    torch.manual_seed(0)
    pool = sm.BufferPool("cpu")
    model = nn.Sequential(_mlp(), nn.Tanh(), nn.Linear(4, 16), _mlp())
    twin = copy.deepcopy(model)
    backend = compile_backend(pool)
    torch._dynamo.reset()  # clears Dynamo's callbacks: the backend installs its own again
    for i in (0, 3):
        twin[i] = torch.compile(twin[i], backend=backend)
    for step in range(4):
        x = torch.randn(8, 16)
        losses = []
        for m in (model, twin):
            m.zero_grad()
            loss = _square_mean(m, x)
            loss.backward()
            losses.append(loss.detach())
        assert torch.equal(*losses), step
        for (name, a), b in zip(model.named_parameters(), twin.parameters(), strict=True):
            assert a.grad is not None and b.grad is not None
            assert torch.equal(a.grad, b.grad), (step, name)
    stats = pool.stats()
    assert len(backend.graphs) == 4  # two blocks, each a forward and a backward graph
    counts = {k: stats.get(k, 0) for k in ("recorded_calls", "replayed_calls", "diverged_calls")}
    assert counts == {"recorded_calls": 2, "replayed_calls": 2, "diverged_calls": 0}, stats
    assert stats["arena_served_bytes"] > 0


@pytest.mark.parametrize(
    "partition", ["default", sm.Recompute.MOST], ids=["default", "recompute-most"]
)
def test_other_partitions_equal_eager(partition: str | sm.Recompute) -> None:
    torch.manual_seed(0)
    pool = sm.BufferPool("cpu")
    model = Block()
    twin = copy.deepcopy(model)
    backend = compile_backend(pool, partition=partition)  # type: ignore[arg-type]
    compiled = torch.compile(twin, backend=backend)
    for i in range(3):
        x = torch.randn(2, 10, 32)
        torch.manual_seed(i)
        model(x).square().mean().backward()
        torch.manual_seed(i)
        compiled(x).square().mean().backward()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad)
    assert [g.kind for g in backend.graphs] == ["forward", "backward"]
    assert pool.stats()["arena_served_bytes"] > 0


# ---- never stale: what eager would see, Dynamo sees ---------------------------------------


class Scaled(nn.Module):
    """A module whose forward reads a float attribute and a Python flag."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.2)
        self.scale = 1.0
        self.shift = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.lin(x)) * self.scale
        return h + 1 if self.shift else h


def test_changed_attributes_and_a_later_hook_are_honoured() -> None:
    # Dynamo guards module hooks only with this flag off (its default skips them, "unsafe"
    # by its own comment: a hook added after the first compile would be ignored).
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=False):
        _changed_attributes_and_a_later_hook()


def _changed_attributes_and_a_later_hook() -> None:
    torch.manual_seed(0)
    pool = sm.BufferPool("cpu")
    model = Scaled()
    twin = copy.deepcopy(model)
    backend = compile_backend(pool)
    compiled = torch.compile(twin, backend=backend)
    seen: dict[str, list[torch.Tensor]] = {"eager": [], "compiled": []}

    def check(step: int) -> None:
        x = torch.randn(4, 8)
        outs = []
        for m, run in ((model, model), (twin, compiled)):
            m.zero_grad()
            torch.manual_seed(step)
            out = run(x)
            out.square().sum().backward()
            outs.append(out.detach())
        assert torch.equal(outs[0], outs[1]), step
        for a, b in zip(model.parameters(), twin.parameters(), strict=True):
            assert a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad)

    check(0)
    for m in (model, twin):
        m.drop.p = 0.7
    check(1)
    for m in (model, twin):
        m.scale = 3.0
        m.shift = True
    check(2)
    for key, m in (("eager", model), ("compiled", twin)):
        store = seen[key]
        m.lin.register_forward_hook(lambda _m, _i, out, store=store: store.append(out))
    check(3)
    # The hook ran on every call, with real tensors equal to eager's, not traced values.
    assert len(seen["eager"]) == len(seen["compiled"]) == 1
    kept = seen["compiled"][0]
    assert type(kept) is torch.Tensor and not isinstance(kept, torch._subclasses.FakeTensor)
    assert torch.equal(kept, seen["eager"][0])
    assert kept.tolist() == seen["eager"][0].tolist()
    # Each change compiled the region again: forward and backward graphs four times over.
    assert len(backend.graphs) == 8


def test_a_loss_weight_and_train_eval_are_honoured() -> None:
    torch.manual_seed(0)
    model = Block()
    twin = copy.deepcopy(model)
    settings = {"weight": 1.0}  # a KL weight or a curriculum value a schedule changes

    def train_step(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = m(x).square().mean() * settings["weight"]
        return out

    backend = compile_backend(sm.BufferPool("cpu"))
    compiled = torch.compile(train_step, backend=backend)
    for i, (weight, training) in enumerate([(1.0, True), (3.0, True), (3.0, False), (0.5, True)]):
        settings["weight"] = weight
        x = torch.randn(2, 10, 32)
        losses = []
        for m, run in ((model, train_step), (twin, compiled)):
            m.train(training)
            m.zero_grad()
            torch.manual_seed(i)
            loss = run(m, x)
            loss.backward()
            losses.append(loss.detach())
        assert torch.equal(losses[0], losses[1]), (i, losses)
        for a, b in zip(model.parameters(), twin.parameters(), strict=True):
            assert a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad), i
    assert len(backend.graphs) == 2 * 3  # weight 3.0, eval, weight 0.5: compiled again each


def test_a_failed_backward_leaves_the_next_steps_served() -> None:
    torch.manual_seed(0)
    pool = sm.BufferPool("cpu")
    model = Block(p=0.0)
    backend = compile_backend(pool)
    compiled = torch.compile(model, backend=backend)
    fail = [False]

    def maybe_fail(grad: torch.Tensor) -> torch.Tensor:
        if fail[0]:
            raise RuntimeError("a hook failed")
        return grad

    model.ln1.weight.register_hook(maybe_fail)
    eager = copy.deepcopy(model)  # no hooks: the same steps, eagerly
    for i in range(6):
        fail[0] = i == 2
        x = torch.randn(2, 10, 32)
        for m, run in ((eager, eager), (model, compiled)):
            m.zero_grad()
            loss = run(x).square().mean()
            if fail[0] and m is model:
                with pytest.raises(RuntimeError, match="a hook failed"):
                    loss.backward()
            else:
                loss.backward()
        if not fail[0]:
            for a, b in zip(eager.parameters(), model.parameters(), strict=True):
                assert a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad)
        # The step's span closed with its backward pass (the failed one's, with the next).
        assert getattr(backend._steps._open, "scope", None) is None or fail[0], i
    assert pool.stats()["replayed_calls"] >= 2


def test_each_gradient_state_keeps_its_own_plan() -> None:
    # PyTorch's default loop (gradients ``None``: the engine allocates them), then steps that
    # add into gradients present (accumulation), then the default loop again: the two states
    # allocate differently, so each is a route of its own. Before, one route served both: the
    # default loop's step after accumulation left the plan made with gradients present (its
    # new gradients served beside the arena, and flagged as escaped), above its own peak.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 4))  # fmt: skip
    twin = copy.deepcopy(model)
    pool = sm.BufferPool("cpu")
    compiled = torch.compile(twin, backend=compile_backend(pool))
    x = torch.randn(32, 64)
    peaks = []
    for state in ("none", "none", "none", "present", "present", "none", "none"):
        for m, run in ((model, model), (twin, compiled)):
            if state == "none":
                m.zero_grad(set_to_none=True)
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # no value of the step is said to escape
                if m is twin and state == "none":  # nothing of the pool's held at its start
                    before = pool.stats().get("diverged_calls", 0)
                    peak = allocator_peak(lambda: run(x).square().mean().backward())  # noqa: B023
                    peaks.append(peak + pool.stats()["reserved_bytes"])
                    if len(peaks) > 1:  # the first two record, every later one replays
                        assert pool.stats().get("diverged_calls", 0) == before, peaks
                else:
                    run(x).square().mean().backward()
        for a, b in zip(model.parameters(), twin.parameters(), strict=True):
            assert a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad)
    assert peaks[3] == peaks[4] == peaks[2], peaks  # back in its state, at its own peak


def test_a_parameter_gradient_hook_is_called() -> None:
    torch.manual_seed(0)
    model = _mlp()
    twin = copy.deepcopy(model)
    calls: list[str] = []
    for key, m in (("eager", model), ("compiled", twin)):
        m[0].weight.register_hook(lambda g, key=key: calls.append(key) or g * 2)
        m[2].bias.register_post_accumulate_grad_hook(lambda p, key=key: calls.append(key))
    _train_side_by_side(model, [torch.randn(8, 16) for _ in range(2)], twin=twin)
    assert calls.count("eager") == calls.count("compiled") == 4


def test_no_grad_computes_no_gradient() -> None:
    torch.manual_seed(0)
    pool = sm.BufferPool("cpu")
    model = Block()
    backend = compile_backend(pool)
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(2, 10, 32)
    model.eval()
    expected = model(x)
    for _ in range(3):
        with torch.no_grad():
            out = compiled(x)
        assert torch.equal(out, expected)
        assert not out.requires_grad
        with pytest.raises(RuntimeError, match="does not require grad"):
            out.sum().backward()  # as eager raises
    assert all(p.grad is None for p in model.parameters())
    assert [g.kind for g in backend.graphs] == ["inference"]
    assert pool.stats()["replayed_calls"] == 2


# ---- one capture for every length ---------------------------------------------------------


def test_dynamic_lengths_compile_once_and_equal_eager() -> None:
    torch.manual_seed(0)
    pool = sm.BufferPool("cpu")
    model = Block(p=0.0)
    twin = copy.deepcopy(model)
    backend = compile_backend(pool)
    compiled = torch.compile(twin, backend=backend, dynamic=True)
    lengths = [5, 9, 5, 17, 9, 12]
    for i, n in enumerate(lengths):
        x = torch.randn(2, n, 32)
        model.zero_grad()
        twin.zero_grad()
        torch.manual_seed(i)
        loss = model(x).square().mean()
        loss.backward()
        torch.manual_seed(i)
        loss2 = compiled(x).square().mean()
        loss2.backward()
        assert torch.equal(loss, loss2), n
        for a, b in zip(model.parameters(), twin.parameters(), strict=True):
            assert a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad), n
    # One forward and one backward graph for every length; a route (recording, then plan)
    # per length.
    assert [g.kind for g in backend.graphs] == ["forward", "backward"]
    assert backend.stats()["routes"] == len(set(lengths))
    assert pool.stats()["replayed_calls"] == len(lengths) - len(set(lengths))


# ---- arguments ----------------------------------------------------------------------------


def test_bad_arguments_say_what_to_do() -> None:
    with pytest.raises(TypeError, match=r"^sharedmem: .*BufferPool"):
        compile_backend("cpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^sharedmem: partition must be one of"):
        compile_backend(sm.BufferPool("cpu"), partition="knapsack")  # type: ignore[arg-type]
