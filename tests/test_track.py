"""sm.track_memory: an eager loop's memory per phase, checked against the allocator's events.

The reference is the profiler's memory timeline (``profile_memory=True``; CREATE and DESTROY
in order, which count an op's own allocations too): at each phase boundary the loop allocates
a marker the tracker does not see (its dispatch mode is switched off for it), of an odd size no
tensor of the loop has, and the running sum of the timeline just before a marker is what the
allocator held there.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch
from conftest import HAS_CUDA, requires_gpu
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import _disable_current_modes

import sharedmem as sm
from sharedmem.testing import memory_timeline

F = nn.functional.cross_entropy
MARK = 100_001  # markers are MARK + 2k bytes: odd, so no float or int64 tensor has the size


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 10),
    )


class Recurrent(nn.Module):
    """A GRU over a sequence, classified from its last state (the composite GRU op runs as
    one op per time step under a dispatch mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.gru = nn.GRU(16, 32, batch_first=True)
        self.head = nn.Linear(32, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        states, _ = self.gru(self.embed(tokens))
        return self.head(states[:, -1])  # type: ignore[no-any-return]


def batch(model: nn.Module, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    if device != "cpu":
        x, y = batch(model)
        return x.to(device), y.to(device)
    if isinstance(model, Recurrent):
        x = torch.randint(0, 50, (8, 12))
    elif isinstance(model[0], nn.Conv2d):
        x = torch.randn(8, 3, 8, 8)
    else:
        x = torch.randn(32, 64)
    return x, torch.randint(0, 10, (x.shape[0],))


def params_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def marker(k: int) -> None:
    with _disable_current_modes():  # the allocator sees it, the tracker does not
        torch.empty(MARK + 2 * k, dtype=torch.uint8)


def allocator_at_markers(prof: profile) -> tuple[list[int], list[int]]:
    """The running sum of the timeline at each marker, and its highest value between each
    marker and the next (the markers' own bytes left out)."""
    live, at, peaks = 0, [], []
    for size in memory_timeline(prof):  # the profiler's memory timeline's events, in order
        if abs(size) >= MARK and size % 2:
            if size > 0:
                peaks.append(live)
                at.append(live)
            continue
        live += size
        if peaks:
            peaks[-1] = max(peaks[-1], live)
    return at, peaks[:-1]


def train(
    model: nn.Module,
    opt: torch.optim.Optimizer | None,
    steps: int,
    mark: Callable[[], None],
    device: str = "cpu",
) -> None:
    """An ordinary loop, with a marker after each phase (a marker is no phase's work)."""
    for _ in range(steps):
        x, y = batch(model, device)
        mark()
        if opt is not None:
            opt.zero_grad()
            mark()
        out = model(x)
        mark()
        loss = F(out, y)
        mark()
        loss.backward()
        mark()
        if opt is not None:
            opt.step()
            mark()
        del out, loss  # as the next batch is loaded: no result is dropped at a phase's edge


# -- the totals are the allocator's ---------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "optimizer"),
    [(mlp, "adam"), (mlp, "momentum"), (mlp, "none"), (cnn, "adam"), (Recurrent, "adam")],
)
def test_totals_are_the_allocators_at_every_boundary_and_so_are_peaks_without_scratch(
    make: Callable[[], nn.Module], optimizer: str
) -> None:
    torch.manual_seed(0)
    counter = iter(range(1000))
    with profile(
        activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
    ) as prof:
        model = make()  # made inside the profile: every byte after it is an event
        opt = {
            "adam": lambda: torch.optim.Adam(model.parameters()),
            "momentum": lambda: torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            "none": lambda: None,
        }[optimizer]()
        with sm.track_memory(model, opt) as t:
            marker(next(counter))
            # Two steps: the first makes the optimizer's state, the second is every later one
            # (a third repeated the second's boundaries and was a third of this test's time).
            train(model, opt, 2, lambda: marker(next(counter)))
            marker(next(counter))  # train's return dropped its last batch and results
    allocator, allocator_peaks = allocator_at_markers(prof)
    phases = t.phases
    names = ["other", "zero_grad", "forward", "loss", "backward", "step"]
    if opt is None:
        names = [n for n in names if n not in ("zero_grad", "step")]
    assert [p.name for p in phases] == [*(names * 2), "other"]
    start = phases[0].before_total
    tracked = [start] + [p.live_total for p in phases]
    assert [n - start for n in tracked] == [n - allocator[0] for n in allocator]
    for previous, phase in itertools.pairwise(phases):
        assert phase.before == previous.live  # phases follow each other, nothing between
    # Peaks: an op's own scratch (a convolution's, the scalars an optimizer wraps in tensors)
    # is the allocator's alone; where there is none, the peaks are the same.
    for phase, peak in zip(phases, allocator_peaks, strict=True):
        assert phase.peak_total >= max(phase.before_total, phase.live_total)
        assert phase.peak_total - start <= peak - allocator[0], phase.name
        if phase.name != "step" and make is not cnn:
            assert phase.peak_total - start == peak - allocator[0], phase.name


@pytest.mark.cuda
@requires_gpu
def test_totals_are_cuda_memory_allocated_at_every_phase_boundary() -> None:
    torch.manual_seed(0)
    model = Recurrent().cuda()
    opt = torch.optim.Adam(model.parameters())
    train(model, opt, 1, lambda: None, "cuda")  # cuBLAS's workspace, kept by the allocator
    allocated: list[int] = []

    def mark() -> None:
        allocated.append(torch.cuda.memory_allocated())

    with sm.track_memory(model, opt) as t:
        mark()
        train(model, opt, 2, mark, "cuda")
        mark()
    phases = t.phases
    assert t.device == "cuda:0" and len(phases) == len(allocated) - 1
    start = phases[0].before_total
    assert [p.live_total - start for p in phases] == [n - allocated[0] for n in allocated[1:]]
    assert all(p.live_total % 512 == 0 for p in phases)  # the caching allocator's blocks


def test_the_device_counted_is_the_models_or_the_one_asked_for() -> None:
    model = mlp()
    totals = {}
    for device in (None, "cpu", "emulated"):
        torch.manual_seed(0)
        with sm.track_memory(model, device=device) as t:
            x, y = batch(model)
            loss = F(model(x), y)
        totals[device] = [p.live_total for p in t.phases]
        assert t.device == (device or "cpu")
    # Plain tensors beside an emulated pool are CPU tensors: the same bytes are counted.
    assert totals[None] == totals["cpu"] == totals["emulated"] and totals["cpu"][-1] > 0
    assert loss.requires_grad
    with pytest.raises(ValueError, match=r"^sharedmem: unknown device 'tpu'"):
        sm.track_memory(model, device="tpu")
    if not HAS_CUDA:
        with pytest.raises(sm.SharedMemError, match=r"^sharedmem: device 'cuda' is not usable"):
            sm.track_memory(model, device="cuda")


# -- what each tensor is ----------------------------------------------------------------------


def test_adams_state_appears_with_the_first_step_and_grads_with_backward() -> None:
    model = mlp()
    opt = torch.optim.Adam(model.parameters())
    with sm.track_memory(model, opt) as t:
        train(model, opt, 2, lambda: None)
    params, n = params_bytes(model), len(list(model.parameters()))
    phases = t.phases
    by_phase = {(p.step, p.name): p for p in phases}
    for phase in phases:
        assert phase.live["parameters"] == phase.before["parameters"] == params
    # Before the first step there is no state; it makes two moments and a step count each.
    state = 2 * params + 4 * n
    first = by_phase[(0, "step")]
    assert first.before["optimizer_state"] == 0 and first.live["optimizer_state"] == state
    assert all(p.live["optimizer_state"] == 0 for p in phases if p.step == 0 and p is not first)
    assert all(p.live["optimizer_state"] == state for p in phases if p.step == 1)
    # Gradients: none until backward makes them; zero_grad (set_to_none) gives them back.
    assert by_phase[(0, "loss")].live["gradients"] == 0
    assert by_phase[(0, "backward")].live["gradients"] == params
    assert by_phase[(1, "zero_grad")].live["gradients"] == 0
    zero_grad = by_phase[(1, "zero_grad")]
    assert zero_grad.live_total == zero_grad.before_total - params
    assert by_phase[(1, "backward")].live["gradients"] == params
    assert by_phase[(1, "step")].live_total == first.live_total  # a later step adds nothing


def test_gradients_kept_by_zero_grad_without_set_to_none_stay_gradients() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with sm.track_memory(model, opt) as t:
        for _ in range(2):
            x, y = batch(model)
            opt.zero_grad(set_to_none=False)
            F(model(x), y).backward()
            opt.step()
    second = [p for p in t.phases if p.step == 1]
    assert all(p.live["gradients"] == params_bytes(model) for p in second)


def test_saved_tensors_are_activations_until_backward_frees_them() -> None:
    torch.manual_seed(3)
    model = mlp()
    x, y = batch(model)
    est = sm.estimate(model, x, y, loss_fn=F)  # counts what autograd saves, on fake tensors
    with sm.track_memory(model) as t:
        F(model(x), y).backward()
    forward, loss, backward = (p for p in t.phases if p.name in ("forward", "loss", "backward"))
    assert forward.before["activations"] == 0 < forward.live["activations"]
    # What the forward and the loss saved is all alive when backward starts.
    assert loss.live["activations"] == est.train_bytes["activations"]
    assert backward.peak["activations"] < backward.before["activations"]
    assert backward.live["activations"] == 0
    # Beyond the saved tensors, backward holds the gradients and what flows between ops.
    assert backward.peak["temporaries"] > backward.before["temporaries"]


def test_inputs_are_what_the_model_and_the_loss_read_even_when_made_before() -> None:
    model = mlp()
    x, y = batch(model)  # made before tracking: counted from their first use
    with sm.track_memory(model) as t:
        scale = torch.ones(10)
        F(model(x) * scale, y).backward()
    phases = {p.name: p for p in t.phases[:4]}
    # Made before the forward and read by the loss: an input (a weight of the loss) all along;
    # x, made before tracking began, is counted from its first use: the forward's start.
    assert phases["other"].live["inputs"] == scale.nbytes + x.nbytes
    assert phases["forward"].live["inputs"] == x.nbytes + scale.nbytes
    assert phases["loss"].live["inputs"] == x.nbytes + y.nbytes + scale.nbytes


def test_a_batch_made_in_the_loop_is_an_input_from_when_it_was_made() -> None:
    model = mlp()
    with sm.track_memory(model) as t:
        x, y = batch(model)
        F(model(x), y).backward()
    made = t.phases[0]
    assert made.name == "other" and made.live["inputs"] == x.nbytes + y.nbytes
    assert made.live["temporaries"] == 0


def test_someone_elses_saved_tensor_hooks_are_left_alone() -> None:
    model = mlp()
    x, y = batch(model)
    packed: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), sm.track_memory(model) as t:
        F(model(x), y).backward()
    assert packed  # their hooks saw every saved tensor
    assert all(p.live["activations"] == p.peak["activations"] == 0 for p in t.phases)


# -- phases ------------------------------------------------------------------------------------


def test_phases_marked_by_hand_and_found_phases_inside_them() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with sm.track_memory(model, opt) as t:
        with t.phase("data"):
            x, y = batch(model)
        with t.phase("train"):
            out = model(x)
            F(out, y).backward()
        opt.step()
        with t.phase("outer"), t.phase("inner"):
            torch.ones(3)
    names = [p.name for p in t.phases]
    # A phase inside another splits it: the outer one is recorded before and after.
    assert names == ["data", "train", "forward", "train", "backward", "train", "step", "outer",
                     "inner", "outer"]  # fmt: skip
    assert t.phases[0].live["inputs"] == x.nbytes + y.nbytes
    assert all(p.step == (1 if p.name in ("outer", "inner") else 0) for p in t.phases)


def test_accumulated_backward_passes_are_one_step() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with sm.track_memory(model, opt) as t:
        for _ in range(2):
            for _ in range(3):
                x, y = batch(model)
                F(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    backwards = [p.step for p in t.phases if p.name == "backward"]
    assert backwards == [0, 0, 0, 1, 1, 1]
    assert [p.step for p in t.phases if p.name == "zero_grad"] == [1, 2]


def test_torch_autograd_grad_is_a_backward_and_an_error_closes_the_open_phases() -> None:
    model = mlp()
    with pytest.raises(ZeroDivisionError), sm.track_memory(model) as t:
        x, y = batch(model)
        grads = torch.autograd.grad(F(model(x), y), list(model.parameters()))
        with t.phase("broken"):
            1 / 0  # noqa: B018
    # The loss and its graph are dropped as grad returns: between phases ("other").
    names = ["other", "forward", "loss", "backward", "other", "broken"]
    assert [p.name for p in t.phases] == names
    assert torch.autograd.backward.__name__ == "backward"
    assert "zero_grad" not in vars(model)  # everything put back
    assert len(grads) == 4


# -- the report --------------------------------------------------------------------------------


def test_the_report_answers_where_the_memory_went() -> None:
    model = mlp()
    opt = torch.optim.Adam(model.parameters())
    with sm.track_memory(model, opt) as t:
        train(model, opt, 4, lambda: None)
    report = t.report()
    assert report.startswith("memory by phase on cpu")
    for words in ("live at each phase's end", "at each phase's peak", "forward: keeps",
                  "loss:", "backward: peaked", "optimizer step: the first left",
                  "(2.00x the parameters)", "phases of steps 2..2 not shown"):  # fmt: skip
        assert words in report, words
    lines = report.splitlines()
    assert sum(line.strip().startswith("3 ") for line in lines) == 2 * 6  # the last step shown
    assert not any(line.strip().startswith("2 ") for line in lines)


# -- arguments, nesting, re-entry ---------------------------------------------------------------


def test_bad_arguments_nesting_and_reentry_are_refused() -> None:
    model = mlp()
    with pytest.raises(TypeError, match=r"^sharedmem: model must be a torch.nn.Module"):
        sm.track_memory("model")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^sharedmem: optimizer must be a torch.optim"):
        sm.track_memory(model, "adam")  # type: ignore[arg-type]
    tracker = sm.track_memory(model)
    early = r"^sharedmem: phase\(\) marks a phase"
    with pytest.raises(sm.SharedMemError, match=early), tracker.phase("early"):
        pass
    with tracker as t:
        bad_name = r"^sharedmem: a phase's name must be"
        with pytest.raises(ValueError, match=bad_name), t.phase(""):
            pass
        nested = r"^sharedmem: track_memory is already"
        with pytest.raises(sm.SharedMemError, match=nested), sm.track_memory(model):
            pass
        model(torch.randn(2, 64))
    again = r"^sharedmem: a tracker records one run"
    with pytest.raises(sm.SharedMemError, match=again), tracker:
        pass
    assert [p.name for p in tracker.phases] == ["other", "forward", "other"]  # made, dropped
    with sm.track_memory(model) as again:  # a new tracker after the first is done
        model(torch.randn(2, 64))
    assert [p.name for p in again.phases] == ["other", "forward", "other"]
