"""The main job: the demo trains, shares the pool between nets, and prints what it claims."""

from __future__ import annotations

import subprocess
import sys

import pytest

import sharedmem as sm
from sharedmem._demo import DemoConfig, run_demo


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
