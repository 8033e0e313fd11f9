"""sm.estimate: a step's memory before running it, checked against the allocator's own events.

The reference is the measurement of DESIGN §8: the peak of the running sum of the allocator's
events over one step (``torch.profiler`` with ``profile_memory=True``, its memory timeline in
order), plus what was live at the step's start (parameters, inputs, the optimizer's state after
a first step), for a step that starts with no ``.grad``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import sharedmem as sm
from sharedmem._cli import main
from sharedmem.testing import allocator_peak

F = nn.functional.cross_entropy
Optim = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
    )


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )


def batch(make: Callable[[], nn.Module]) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (64, 128) if make is mlp else (16, 3, 16, 16)
    return torch.randn(shape), torch.randint(0, 10, (shape[0],))


def live_at_start(model: nn.Module, tensors: list[torch.Tensor], opt: object) -> int:
    storages = {id(t.untyped_storage()): t for t in [*model.parameters(), *model.buffers()]}
    state = getattr(opt, "state", {})
    held = [v for s in state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return sum(t.untyped_storage().nbytes() for t in [*storages.values(), *tensors, *held])


OPTIMIZERS: dict[str, Optim] = {
    "none": lambda params: None,  # type: ignore[dict-item,return-value]
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1),
    "momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params),
}


@pytest.mark.parametrize("make", [mlp, cnn])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_the_eager_estimate_matches_the_allocator_within_5_percent(
    make: Callable[[], nn.Module], optimizer: str
) -> None:
    torch.manual_seed(0)
    model, (x, y) = make(), batch(make)
    opt = OPTIMIZERS[optimizer](list(model.parameters()))
    est = sm.estimate(model, x, y, loss_fn=F, optimizer=opt, measure_kernels=True)
    if opt is not None:  # the state exists after a first step, as the estimate assumes
        F(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def step() -> None:
        out = model(x)  # held through backward, as the estimate assumes
        loss = F(out, y)
        loss.backward()
        del loss, out
        if opt is not None:
            opt.step()

    measured = allocator_peak(step) + live_at_start(model, [x, y], opt)
    # Issue 25's bound: within 3%, never under by more than 1% (kernels' scratch measured).
    assert -0.01 * measured <= est.train_peak_eager - measured <= 0.03 * measured, (est, measured)
    model.zero_grad(set_to_none=True)
    model.eval()
    with torch.no_grad():
        evaluated = allocator_peak(lambda: model(x)) + live_at_start(model, [x], None)
    # Batch norm in eval mode on the CPU makes a scratch copy of its input that its fake
    # kernel does not: measured.
    assert -0.01 * evaluated <= est.eval_peak_eager - evaluated <= 0.03 * evaluated, (
        est,
        evaluated,
    )


@pytest.mark.parametrize("make", [mlp, cnn])
def test_the_pooled_estimate_is_the_plan_and_bounds_the_measured_peak(
    make: Callable[[], nn.Module],
) -> None:
    torch.manual_seed(1)
    model, (x, y) = make(), batch(make)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    est = sm.estimate(model, x, y, loss_fn=F, optimizer=opt, measure_kernels=True)
    pool = sm.BufferPool("cpu")
    step = sm.pooled_train_step(model, F, pool=pool)
    step(x, y)
    opt.step()
    opt.zero_grad(set_to_none=True)

    def pooled() -> None:
        del_loss = step(x, y)
        del del_loss
        opt.step()

    measured = allocator_peak(pooled) + live_at_start(model, [x, y], opt)
    measured += pool.stats()["reserved_bytes"]
    # The plan's timeline holds every byte of the step, kernels' own scratch measured: within
    # 2%, never under by more than 1%.
    assert -0.01 * measured <= est.train_peak_pooled - measured <= 0.02 * measured, (est, measured)


def deep_cnn() -> nn.Module:
    # Activations well above the weights: recomputing convolutions has something to free.
    layers: list[nn.Module] = [nn.Conv2d(3, 16, 3, padding=1)]
    for _ in range(5):
        layers += [nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1)]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))


def test_time_for_memory_is_what_a_step_with_that_slowdown_holds() -> None:
    torch.manual_seed(1)
    model = deep_cnn()
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
    est = sm.estimate(model, x, y, loss_fn=F, measure_kernels=True)
    assert est.time_for_memory, "recomputation frees nothing on an activation-heavy CNN?"
    peaks = [est.step_peak_pooled] + [peak for _, peak in est.time_for_memory]
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == len(peaks)
    cost, peak = est.time_for_memory[0]
    assert 0 < cost <= 0.35
    assert "time for memory" in est.report() and f"+{cost:.0%} time" in est.report()
    # The figure is the step's: a step given that slowdown holds it (new gradients
    # included, nothing else before it), measured by the allocator's events.
    pool = sm.BufferPool("cpu")
    step = sm.pooled_train_step(model, F, pool=pool, recompute=sm.Recompute.within(1.35))
    step(x, y)
    model.zero_grad(set_to_none=True)
    measured = allocator_peak(lambda: step(x, y)) + pool.stats()["reserved_bytes"]
    assert abs(peak - measured) <= 0.03 * measured, (peak, measured)


def test_categories_follow_the_optimizers_own_rules() -> None:
    model = mlp()
    x, y = batch(mlp)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    n = len(list(model.parameters()))
    figures = {}
    for name, make in OPTIMIZERS.items():
        est = sm.estimate(model, x, y, loss_fn=F, optimizer=make(list(model.parameters())))
        figures[name] = est.train_bytes
        assert est.train_bytes["parameters"] == params
        assert est.train_bytes["gradients"] == params
        assert est.train_bytes["inputs"] == x.nbytes + y.nbytes
        assert sum(est.train_bytes.values()) >= est.train_peak_eager  # the parts cover the peak
    assert figures["none"]["optimizer_state"] == figures["sgd"]["optimizer_state"] == 0
    assert figures["momentum"]["optimizer_state"] == params  # one momentum buffer
    assert figures["adamw"]["optimizer_state"] == 2 * params + 4 * n  # two moments, a step each


def test_module_activation_bytes_add_up_in_containers() -> None:
    model = nn.Sequential(nn.Sequential(nn.Linear(32, 64), nn.ReLU()), nn.Linear(64, 4))
    est = sm.estimate(model, torch.randn(16, 32), torch.randint(0, 4, (16,)), loss_fn=F)
    modules = est.module_activation_bytes
    # What the loss saves (outside the model) is an activation of no module.
    assert 0 < modules[""] <= est.train_bytes["activations"]
    assert modules["0"] == modules.get("0.0", 0) + modules.get("0.1", 0) > 0  # a container sums
    assert modules[""] == modules["0"] + modules.get("1", 0)


def test_nothing_is_allocated_or_changed_and_any_device_works() -> None:
    torch.manual_seed(2)
    model = cnn()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.eval()
    est_cpu = sm.estimate(model, *batch(cnn), loss_fn=F)
    est_cuda = sm.estimate(model, *batch(cnn), loss_fn=F, device="cuda")  # no GPU needed
    assert not model.training  # put back as it was
    assert all(p.grad is None for p in model.parameters())
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key  # running statistics untouched
    # CUDA figures are the fake run's in the caching allocator's 512-byte blocks (this CPU's
    # kernels' scratch is measured for "cpu" only).
    assert est_cuda.device == "cuda" and est_cuda.train_peak_eager % 512 == 0
    assert est_cuda.train_bytes["gradients"] >= est_cpu.train_bytes["gradients"]
    # A budget counts what the step holds beyond what exists before it, as a step's budget=
    # does (a device's memory counts everything: train_peak_pooled).
    assert est_cpu.fits(est_cpu.step_peak_pooled) and not est_cpu.fits(est_cpu.step_peak_pooled - 1)
    b = est_cpu.train_bytes
    static = b["parameters"] + b["inputs"] + b["optimizer_state"]
    assert est_cpu.step_peak_pooled == est_cpu.train_peak_pooled - static
    assert "train step peak" in est_cpu.report() and "activations" in est_cpu.report()


def test_a_frozen_model_has_no_gradients_and_no_optimizer_state() -> None:
    model = mlp().requires_grad_(False)
    x, y = batch(mlp)
    est = sm.estimate(model, x, y, loss_fn=F, optimizer=torch.optim.SGD([torch.zeros(1)], lr=1))
    assert est.train_bytes["gradients"] == 0 and est.train_bytes["activations"] == 0
    assert est.train_peak_eager >= est.train_bytes["parameters"] + est.train_bytes["inputs"]


def test_bad_arguments_say_what_is_wrong() -> None:
    model = mlp()
    x, y = batch(mlp)
    with pytest.raises(TypeError, match=r"^sharedmem: model must be a torch.nn.Module"):
        sm.estimate("model", x, y)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^sharedmem: unknown device 'tpu'"):
        sm.estimate(model, x, y, loss_fn=F, device="tpu")
    with pytest.raises(TypeError, match=r"^sharedmem: optimizer must be a torch.optim"):
        sm.estimate(model, x, y, loss_fn=F, optimizer="adam")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^sharedmem: budget must be bytes"):
        sm.estimate(model, x, y, loss_fn=F).fits(-1)


def test_the_command_prints_the_report_and_judges_a_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "estimate_models.py").write_text(
        "import torch\n"
        "def small():\n"
        "    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),\n"
        "        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 10))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    args = ["estimate", "estimate_models:small", "--input", "4x3x16x16", "--device", "cuda"]
    assert main([*args, "--budget", "1G"]) == 0
    out = capsys.readouterr().out
    assert "memory estimate on cuda" in out and "the pooled step fits" in out
    assert main([*args, "--budget", "1000"]) == 1
    assert "does NOT fit" in capsys.readouterr().out
    assert main([*args, "--memory", "1G"]) == 0
    assert "everything included): the pooled step fits" in capsys.readouterr().out
    assert main([*args, "--memory", "1000"]) == 1
    assert main(["estimate", "estimate_models:small", "--input", "4x5x16x16"]) == 2
    assert "cannot take an input of shape (4, 5, 16, 16)" in capsys.readouterr().err
    for bad, message in (
        ("nope_models:small", "cannot import 'nope_models'"),
        ("estimate_models", "PACKAGE.MODULE:FACTORY"),
    ):
        with pytest.raises(SystemExit) as exit_:
            main(["estimate", bad, "--input", "4x3x16x16"])
        assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_every_way_the_command_fails_is_one_line_that_names_the_fix(
    capsys: pytest.CaptureFixture[str],
) -> None:
    ok = ["estimate", "torch.nn:Linear", "--arg", "16", "--arg", "4", "--input", "8x16"]
    assert main([*ok, "--budget", "512M"]) == 0  # --arg reaches the factory, in order
    named = ["--arg", "in_features=16", "--arg", "out_features=4", "--input", "8x16"]
    assert main(["estimate", "torch.nn:Linear", *named]) == 0  # or by name
    capsys.readouterr()
    for argv, says in [
        (ok[:2] + ok[-2:], "--arg in_features=VALUE --arg out_features=VALUE"),
        ([*ok[:-1], "8x8"], "cannot take an input of shape (8, 8)"),
        ([*ok, "--device", "tpu"], "unknown device 'tpu'"),
        (["estimate", "torch:randn", "--arg", "3", "--input", "8"], "returned a Tensor, not an"),
        (["estimate", "torch.nn:Linear", "--arg", "16", "--arg", "-4", *ok[-2:]], "failed"),
    ]:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("sharedmem: ") and err.count("\n") == 1 and says in err, err
    for argv, says in [  # refused by argparse, before anything runs
        (["estimate", "nope_models:Net", *ok[-2:]], "cannot import 'nope_models'"),
        (["estimate", "torch.nn:Nope", *ok[-2:]], "has no callable 'Nope'"),
        ([*ok[:-1], "8by16"], "--input takes a shape like 8x3x224x224"),
        ([*ok, "--budget", "1.5G"], "--budget must be bytes: an int >= 0 or a size such as '8G'"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and says in err and "Traceback" not in err, err


def test_the_command_takes_several_inputs_keywords_and_the_models_own_loss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "estimate_inputs.py").write_text(
        "import torch\n"
        "class Tagger(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.emb, self.fc = torch.nn.Embedding(100, 8), torch.nn.Linear(8, 5)\n"
        "    def forward(self, ids, mask=None, labels=None):\n"
        "        out = self.fc(self.emb(ids) * (1 if mask is None else mask[..., None])).mean(1)\n"
        "        if labels is None:\n"
        "            return out\n"
        "        return {'loss': torch.nn.functional.cross_entropy(out, labels), 'logits': out}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    model = "estimate_inputs:Tagger"
    assert main(["estimate", model, "--input", "4x12:int64", "--input", "4x12"]) == 0
    assert "memory estimate" in capsys.readouterr().out
    keywords = ["--input", "ids=4x12:int64", "--input", "labels=4:int64", "--loss", "model"]
    assert main(["estimate", model, *keywords, "--budget", "1G"]) == 0
    assert "the pooled step fits" in capsys.readouterr().out
    assert main(["estimate", model, "--input", "ids=4x12:int64", "--input", "4x12"]) == 2
    assert "not both" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["estimate", model, "--input", "ids=4x12:int7"])
    assert exit_.value.code == 2 and "dtype is one of" in capsys.readouterr().err


# What fake kernels do not show, measured once per kernel configuration on this CPU: oneDNN's
# per-thread weight-gradient partial sums, an RNN's workspace saved for backward.


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(32, 64, num_layers=2, batch_first=True)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.rnn(x)[0][:, -1])
        return out


def wide_conv() -> nn.Module:
    # 256 channels at 2x2: the weight gradient's scratch is several times the weight (the
    # fake run alone is under by about 80%).
    return nn.Sequential(
        nn.Conv2d(3, 256, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(256, 256, 3, padding=1),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(256, 10),
    )


@pytest.mark.parametrize(
    ("make", "shape"), [(Recurrent, (4, 16, 32)), (wide_conv, (2, 3, 2, 2))], ids=["lstm", "conv"]
)
def test_kernel_scratch_and_workspaces_are_measured(
    make: Callable[[], nn.Module], shape: tuple[int, ...]
) -> None:
    torch.manual_seed(3)
    model, x = make(), torch.randn(shape)
    y = torch.randint(0, 10, (shape[0],))
    est = sm.estimate(model, x, y, loss_fn=F, measure_kernels=True)

    def step() -> None:
        out = model(x)
        F(out, y).backward()
        del out

    measured = allocator_peak(step) + live_at_start(model, [x, y], None)
    assert -0.01 * measured <= est.train_peak_eager - measured <= 0.03 * measured, (est, measured)
    model.zero_grad(set_to_none=True)
    pool = sm.BufferPool("cpu")
    pooled = sm.pooled_train_step(model, F, pool=pool)
    pooled(x, y)
    model.zero_grad(set_to_none=True)
    measured = allocator_peak(lambda: pooled(x, y)) + live_at_start(model, [x, y], None)
    measured += pool.stats()["reserved_bytes"]
    assert -0.01 * measured <= est.train_peak_pooled - measured <= 0.02 * measured, (est, measured)


def test_kernels_are_measured_only_where_asked_or_the_router_is_installed_already(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib

    native = importlib.import_module("sharedmem._routing.native")
    model, (x, y) = cnn(), batch(cnn)
    monkeypatch.setattr(native, "_loaded", [])  # as in a fresh process
    modelled = sm.estimate(model, x, y, loss_fn=F)
    assert not modelled.kernels_measured and native._loaded == []
    assert "scratch modelled" in modelled.report()
    monkeypatch.undo()
    measured = sm.estimate(model, x, y, loss_fn=F, measure_kernels=True)
    assert measured.kernels_measured and "scratch modelled" not in measured.report()
    assert sm.estimate(model, x, y, loss_fn=F).kernels_measured  # installed now: measured


def test_flash_attention_is_measured_where_its_dropout_draws_nothing() -> None:
    # Tagged as seeded, the CPU flash attention was never measured: its per-thread buffers
    # (8,448 B twice in a T5 step) were in no first call's plan. At dropout 0 it draws no
    # random numbers, so running it to measure it changes nothing eager then draws.
    from torch._subclasses.fake_tensor import FakeTensorMode

    from sharedmem._routing import kernels

    attention = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    with FakeTensorMode() as fake:
        q, k, v = (fake.from_tensor(torch.zeros(2, 4, 64, 32)) for _ in range(3))
        state = torch.get_rng_state()
        measured = kernels.kernel_memory(attention, (q, k, v), {})
        after = torch.get_rng_state()
        assert kernels.kernel_memory(attention, (q, k, v, 0.1), {}) is None  # it would draw
    assert torch.equal(after, state)
    assert measured is not None and measured.scratch > 0


def test_kernels_are_measured_once_per_configuration_and_random_ones_never(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from sharedmem._routing import kernels

    runs: list[object] = []
    measure = kernels._measure
    monkeypatch.setattr(kernels, "_measure", lambda *a: runs.append(a[1]) or measure(*a))
    conv = torch.ops.aten.convolution_backward.default
    with FakeTensorMode() as fake:
        grad, x, w = (fake.from_tensor(torch.zeros(s)) for s in [(2, 96, 2, 2), (2, 96, 2, 2),
                                                                  (96, 96, 3, 3)])  # fmt: skip
        args = (grad, x, w, [96], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, True])
        first = kernels.kernel_memory(conv, args, {})
        again = kernels.kernel_memory(conv, args, {})
        state = torch.get_rng_state()
        dropout = torch.ops.aten.native_dropout.default
        assert kernels.kernel_memory(dropout, (x, 0.5, True), {}) is None
        # A configuration too big for the machine (an estimate of a step that would not
        # run) is never run: modelled instead.
        monkeypatch.setattr(kernels, "machine_available_bytes", lambda: 4 * 1024)
        grad3, x3 = (fake.from_tensor(torch.zeros(3, 96, 2, 2)) for _ in range(2))
        big = (grad3, x3, *args[2:])
        assert kernels.kernel_memory(conv, big, {}) is None  # and not run: see ``runs``
    assert torch.equal(torch.get_rng_state(), state)  # the caller's generator untouched
    assert first is not None and first == again and runs == [conv]
    assert first.results == (2 * 96 * 4 * 4, 96 * 96 * 9 * 4, 96 * 4)  # the results' bytes
