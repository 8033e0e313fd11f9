"""The main job: the demo trains, shares the pool between nets, and prints what it claims."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import HAS_CUDA

import sharedmem as sm
from sharedmem._cli import main
from sharedmem._cli.demo import DemoConfig, demo_verdict, run_demo


@pytest.mark.slow  # the whole demo: 20 steps of each part (the third's most, and as many
# as a run needs to count as learning: demo_verdict; 40 of the first two added only replays)
@pytest.mark.timeout(900)  # about 35 CPU s for the CPU run: past 300 s on a busy machine
# On the emulated device, 4 steps (an evaluation after the 2nd and the 4th): what its pool
# does differently (a host and a device side, staged batches, the budget's chunks on it) is
# all in every step, and its third part, at 8 times the batch, was most of the tier's time;
# learning over 20 steps is the CPU run's.
@pytest.mark.parametrize(("device", "steps"), [("cpu", 20), ("emulated", 4)])
def test_demo_shares_the_pool_and_learns(
    device: str, steps: int, capsys: pytest.CaptureFixture[str]
) -> None:
    result = run_demo(DemoConfig(device=device, steps=steps, eval_every=steps // 2))
    train_bytes, eval_bytes = result["shared_bytes"]
    per_net_train, per_net_eval = result["per_net_bytes"]
    assert eval_bytes <= 0.05 * train_bytes  # DESIGN §7: eval adds at most 5%
    assert per_net_eval > 0.3 * per_net_train  # without sharing the eval net costs a lot
    assert result["saving"] > 0.25
    if steps >= 20:  # long enough to learn (a short run may go either way on noisy batches)
        assert result["losses"][-1] < result["losses"][0]
    # Allocation does not change the maths: equal up to rounding (a kernel may take another
    # path for another buffer address).
    assert result["losses"] == pytest.approx(result["per_net_losses"], rel=1e-4)
    out = capsys.readouterr().out
    assert "per-net allocation" in out and "one shared pool" in out and "saving:" in out
    assert "BufferPool on " in out and "train loss" in out
    assert isinstance(result["pool"], sm.BufferPool)
    # The third part: under half the unchunked step's own peak the batch runs in chunks, on
    # the unchunked run's loss curve up to the rounding of a mean taken in parts.
    fit = result["fit"]
    assert fit["chunks"] > 1 and fit["budget"] <= fit["unchunked"] // 2
    assert fit["pool_most"] <= fit["budget"]
    assert fit["losses"] == pytest.approx(fit["unchunked_losses"], rel=1e-3)
    assert demo_verdict(fit["losses"], fit["unchunked_losses"], tolerance=1e-3) is None
    assert "[3/3]" in out and "chunks per step" in out


def test_a_batch_whose_gradients_are_most_of_its_step_ends_well(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # At --train-batch 64 the third part's MLP step is mostly gradients, which chunks cannot
    # shrink: half its need cannot be met, and 7/8 only by recomputation. The demo runs the
    # least share that a plan meets, or says that none does, and ends well (it ended in an
    # OutOfMemoryError from the budget's planning, and then from asking for the chunks of a
    # call that adds into the gradients the loop had just made).
    assert main(["demo", "--train-batch", "64", "--steps", "1"]) == 0
    out = capsys.readouterr()
    ran = "7/8 of that (half cannot be met" in out.out and "chunks per step" in out.out
    assert ran or "skipped: at batch 512 no budget below" in out.out, out.out
    assert "Traceback" not in out.err and "sharedmem: demo failed" not in out.err


def test_the_first_loss_is_near_a_uniform_guess_and_short_runs_succeed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # He-initialised layers on unit-variance inputs with a small last layer: the first loss is
    # about ln(10) = 2.30, not a dozen; one step and three steps are runs like any other.
    result = run_demo(DemoConfig(steps=1), verbose=False, fit=False)  # the first part's loss
    assert abs(result["losses"][0] - 2.3026) < 0.1
    assert main(["demo", "--steps", "1"]) == 0  # more steps: test_demo_shares_the_pool_and_learns
    assert "sharedmem: demo failed" not in capsys.readouterr().err


def test_a_failed_demo_says_why() -> None:
    assert demo_verdict([2.3, 1.0], [2.3, 1.0]) is None
    assert "differ" in (demo_verdict([2.3, 1.0], [2.3, 1.1]) or "")
    assert "not finite" in (demo_verdict([2.3, float("nan")], [2.3, float("nan")]) or "")
    rising = [2.0 + step / 100 for step in range(20)]
    assert "did not go down (2.0000 -> 2.1900)" in (demo_verdict(rising, rising) or "")
    assert demo_verdict(rising[:3], rising[:3]) is None  # too short to judge learning


def test_a_run_that_fails_its_verdict_exits_1_with_the_reason(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    cli = importlib.import_module("sharedmem._cli.main")  # the package's main is the function

    def diverged(config: DemoConfig, plot: str | None = None) -> dict[str, object]:
        return {"losses": [2.3, float("inf")], "per_net_losses": [2.3, float("inf")]}

    monkeypatch.setattr(cli, "run_demo", diverged)
    assert main(["demo"]) == 1
    assert "sharedmem: demo failed: a loss is not finite" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["demo", "--plot"], ["bench", "--json"]])
def test_an_output_path_that_cannot_be_written_is_refused_before_the_run(
    command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for path, why in (("/nonexistent/x.out", "does not exist"), (str(tmp_path), "is a folder")):
        with pytest.raises(SystemExit) as exit_:
            main([*command, path])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and why in err and "sharedmem: " in err


def test_demo_help_explains_every_option_with_its_default(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for option in ("--train-batch", "--eval-batch", "--seed", "--steps", "--device", "--plot"):
        assert option in out
    assert "(default: 256)" in out and "(default: 250)" in out and "(default: 150)" in out


def test_python_m_sharedmem_demo_runs() -> None:
    # A short run (1 step: the third part trains at 8 times the batch, 2 CPU s a step); a
    # whole run, learning included, is test_demo_shares_the_pool_and_learns's.
    done = subprocess.run(
        [sys.executable, "-m", "sharedmem", "demo", "--steps", "1", "--device", "emulated"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "eval adds" in done.stdout and "done in" in done.stdout


def test_distributed_demo_runs_on_two_ranks_and_prints_their_memory(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The documented command, on loopback gloo ranks: per-rank and total memory, and the
    # losses equal eager DDP's (the demo's own verdict, exit 0).
    command = ["-m", "sharedmem", "demo", "--distributed", "--steps", "4", "--train-batch", "64"]
    command += ["--eval-batch", "50"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    done = subprocess.run(
        [*torchrun, "2", *command],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert "distributed demo: 2 ranks (gloo)" in done.stdout
    rows = [
        line.split() for line in done.stdout.splitlines() if line.strip().startswith(("0 ", "1 "))
    ]
    assert [row[0] for row in rows] == ["0", "1"] and all(row[-2:] == ["0", "B"] for row in rows)
    assert "total over 2 ranks" in done.stdout and "evaluation added 0 B" in done.stdout
    # Without torchrun there is no rank to be: one line saying how to launch it, exit 2 (here,
    # not in a process of its own: a refusal before any work).
    monkeypatch.delenv("RANK", raising=False)
    assert main(command[2:]) == 2
    said = capsys.readouterr().err
    assert said.startswith("sharedmem: demo --distributed") and said.count("\n") == 1
    assert "torchrun --standalone --nproc-per-node 2" in said


def test_distributed_fsdp_demo_matches_eager_fsdp2_on_two_ranks(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # FSDP2 inside pool.step() beside eager FSDP2: every loss equal (the demo's verdict, exit
    # 0), each rank's peak against eager's, and a clean end (torchrun reports no failure).
    command = ["-m", "sharedmem", "demo", "--distributed", "--fsdp", "--steps", "4"]
    command += ["--train-batch", "64"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    done = subprocess.run([*torchrun, "2", *command], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "distributed demo (FSDP2): 2 ranks (gloo)" in done.stdout
    rows = [
        line.split() for line in done.stdout.splitlines() if line.strip().startswith(("0 ", "1 "))
    ]
    assert [row[0] for row in rows] == ["0", "1"] and all(row[-1] == "equal" for row in rows)
    # Without --distributed there are no ranks to shard over: one line, exit 2.
    assert main(["demo", "--fsdp"]) == 2
    assert "add --distributed" in capsys.readouterr().err


def test_cli_without_a_command_says_how_to_use_it(capsys: pytest.CaptureFixture[str]) -> None:
    # In this process: `python -m sharedmem` itself is test_python_m_sharedmem_demo_runs's.
    with pytest.raises(SystemExit) as exit_:
        main([])
    assert exit_.value.code == 2 and "usage: sharedmem" in capsys.readouterr().err


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
    run_demo(DemoConfig(steps=2, eval_every=2), verbose=False, progress=heard.append)
    assert heard == [
        *(f"per-net allocation, step {k}/2" for k in (1, 2)),
        *(f"one shared pool, step {k}/2" for k in (1, 2)),
        *(f"under half the memory, step {k}/2" for k in (1, 2)),
    ]
