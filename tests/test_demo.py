"""The main job: the demo trains, shares the pool between nets, and prints what it claims."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import HAS_CUDA

import sharedmem as sm
from sharedmem._cli import main
from sharedmem._cli.demo import DemoConfig, run_demo


@pytest.mark.parametrize("device", ["cpu", "emulated"])
def test_demo_shares_the_pool_and_learns(device: str, capsys: pytest.CaptureFixture[str]) -> None:
    result = run_demo(DemoConfig(device=device, steps=40, eval_every=20))
    train_bytes, eval_bytes = result["shared_bytes"]
    per_net_train, per_net_eval = result["per_net_bytes"]
    assert eval_bytes <= 0.05 * train_bytes  # DESIGN §7: eval adds at most 5%
    assert per_net_eval > 0.3 * per_net_train  # without sharing the eval net costs a lot
    assert result["saving"] > 0.25
    assert result["losses"][-1] < result["losses"][0]
    assert result["losses"] == result["per_net_losses"]  # allocation does not change the maths
    out = capsys.readouterr().out
    assert "per-net allocation" in out and "one shared pool" in out and "saving:" in out
    assert "BufferPool on " in out and "train loss" in out
    assert isinstance(result["pool"], sm.BufferPool)


def test_python_m_sharedmem_demo_runs() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "sharedmem", "demo", "--steps", "20", "--device", "emulated"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "eval adds" in done.stdout and "done in" in done.stdout


def test_cli_without_a_command_says_how_to_use_it() -> None:
    done = subprocess.run([sys.executable, "-m", "sharedmem"], capture_output=True, text=True)
    assert done.returncode == 2 and "usage: sharedmem" in done.stderr


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "0"], "--steps must be >= 1, got 0"),
        (["--steps", "-3"], "--steps must be >= 1, got -3"),
        (["--train-batch", "0"], "--train-batch must be >= 1, got 0"),
        (["--eval-batch", "0"], "--eval-batch must be >= 1, got 0"),
        (["--device", "tpu"], "sharedmem: unknown device 'tpu'"),
        pytest.param(
            ["--device", "cuda"],
            "sharedmem: device 'cuda' is not usable here",
            marks=pytest.mark.skipif(HAS_CUDA, reason="checks the no-GPU path"),
        ),
    ],
)
def test_demo_refuses_bad_arguments_before_any_work(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["demo", *argv])
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and message in err and "Traceback" not in err
    assert out == ""  # refused before the demo printed anything


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("steps", 0, ValueError),
        ("train_batch", -1, ValueError),
        ("eval_batch", 0, ValueError),
        ("eval_every", 0, ValueError),
        ("steps", 2.5, TypeError),
        ("hidden", True, TypeError),
        ("lr", 0.0, ValueError),
    ],
)
def test_demo_config_says_what_is_wrong(field: str, value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match=rf"^sharedmem: DemoConfig\.{field} must be"):
        DemoConfig(**{field: value})  # type: ignore[arg-type]


def test_demo_reports_progress_after_every_step() -> None:
    heard: list[str] = []
    run_demo(DemoConfig(steps=3, eval_every=3), verbose=False, progress=heard.append)
    assert heard == [
        *(f"per-net allocation, step {k}/3" for k in (1, 2, 3)),
        *(f"one shared pool, step {k}/3" for k in (1, 2, 3)),
    ]
