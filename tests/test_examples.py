"""Every script in examples/ runs, and shows what it claims."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
from conftest import requires_cuda

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_every_example_has_a_test() -> None:
    tested = {
        "accumulate_in_less_memory",
        "host_staging",
        "pooled_training",
        "train_eval_shared",
        "variable_length",
        "where_memory_goes",
    }
    assert {p.stem for p in EXAMPLES.glob("*.py")} == tested


@pytest.mark.parametrize(
    "device", ["cpu", "emulated", pytest.param("cuda", marks=[pytest.mark.cuda, requires_cuda])]
)
def test_host_staging_overlaps_and_grows_only_for_a_new_longest_batch(
    device: str, capsys: pytest.CaptureFixture[str]
) -> None:
    stats = load("host_staging").main(["--device", device, "--steps", "40"])
    assert stats["verified_batches"] == 40  # the device read what the host wrote, every batch
    # Batch k + 1 was prepared on the host after batch k's push started, before its read.
    assert stats["overlapped_batches"] == 39
    # Every growth is counted (the host side's too), and only a new longest batch grows.
    assert stats["grows_counted"] == stats["num_grows"] > 0
    assert stats["grows_on_other_batches"] == 0
    sides = 1 if device == "cpu" else 2
    assert stats["num_grows"] <= sides * stats["new_longest_batches"] < 40
    assert "staged 40 batches" in capsys.readouterr().out
    if device != "cpu":
        assert stats["host_to_device_bytes"] > 0


@pytest.mark.parametrize("device", ["cpu", "emulated"])
def test_train_eval_shared_evaluates_in_bfloat16_on_the_train_buffers(device: str) -> None:
    result = load("train_eval_shared").main(["--device", device, "--steps", "50"])
    assert result["eval_bytes"] == 0 < result["train_bytes"]
    assert result["last_loss"] < result["first_loss"]


@pytest.mark.parametrize("device", ["cpu", "emulated"])
def test_variable_length_stops_growing_at_the_high_water_marks(device: str) -> None:
    result = load("variable_length").main(["--device", device, "--batches", "60"])
    assert result["grows_after_warmup"] == 0
    high_water = result["high_water_bytes"]
    assert high_water <= result["reserved_bytes"] <= 1.05 * high_water
    assert result["allocated_by_torch"] > 10 * result["reserved_bytes"]


@pytest.mark.parametrize("device", ["cpu", "emulated"])
def test_pooled_training_learns_and_evaluates_on_the_train_buffers(
    device: str, capsys: pytest.CaptureFixture[str]
) -> None:
    result = load("pooled_training").main(["--device", device, "--steps", "40", "--batch", "32"])
    assert result["last_loss"] < 0.5 * result["first_loss"]
    assert result["eval_accuracy"] > 0.5
    assert result["eval_added_bytes"] <= 0.05 * result["train_bytes"]
    assert result["grows_after_warmup"] == 0
    assert result["saving"] >= 0.3
    out = capsys.readouterr().out
    assert "BufferPool on" in out and "liveness plan for train step" in out


def test_where_memory_goes_explains_each_phase_and_agrees_with_the_estimate(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Sequences of 6, not the example's 12: what is checked holds at any length, and the
    # estimate's planning grows faster than the length (a third of the CPU time).
    result = load("where_memory_goes").main(["--steps", "3", "--length", "6"])
    out = capsys.readouterr().out
    assert "live at each phase's end" in out and "the estimate (made before running)" in out
    est, tracked = result["estimate"], result["tracked"]
    # The loop holds its output through backward, as the estimate assumes: the same peak.
    assert result["tracked_peak"] == est.train_peak_eager
    for key in ("parameters", "gradients", "optimizer_state", "inputs", "activations"):
        assert tracked[key] == est.train_bytes[key], key
    names = [p.name for p in result["phases"] if p.step == 0]
    assert names == ["other", "zero_grad", "forward", "loss", "backward", "step"]
    assert result["last_loss"] < result["first_loss"]


def test_accumulating_micro_batches_needs_less_memory_than_eager_for_the_same_gradients(
    capsys: pytest.CaptureFixture[str],
) -> None:
    result = load("accumulate_in_less_memory").main(["--micro-batches", "3", "--batch", "8"])
    assert result["same_gradients"] is True
    for eager, pooled in result["peaks"]:  # type: ignore[attr-defined]
        assert pooled < 0.95 * eager, (eager, pooled)
    first, adding = result["summaries"]  # type: ignore[misc]
    assert first.recomputed > 0 and "adding into existing gradients" in str(adding)
    assert "bit for bit equal to eager's: True" in capsys.readouterr().out
