"""The pool's memory timeline: off by default, one sample per closed phase, a PNG plot."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

import sharedmem as sm


def test_off_by_default() -> None:
    pool = sm.BufferPool("emulated")
    with pool.phase("train"):
        pool.tensor("x", (10,))
    assert pool.timeline == []
    with pytest.raises(sm.SharedMemError, match=r"^sharedmem: no timeline was recorded"):
        pool.plot_timeline("never.png")


def test_records_reserved_active_and_peak_per_closed_phase() -> None:
    pool = sm.BufferPool("emulated", timeline=True)
    for step in range(4):
        with pool.phase("train"):
            pool.tensor("act", (1024 * (step + 1),))  # grows every step
        with pool.phase("eval"):
            pool.tensor("act", (512,))
    samples = pool.timeline
    assert [s.phase for s in samples] == ["train", "eval"] * 4
    assert [s.index for s in samples] == list(range(8))
    train = [s for s in samples if s.phase == "train"]
    assert [s.device_reserved_bytes for s in train] == [4096 * (i + 1) for i in range(4)]
    assert all(s.peak_reserved_bytes >= s.reserved_bytes for s in samples)
    assert [s.active_bytes for s in samples if s.phase == "eval"] == [2048] * 4
    assert samples == sorted(samples, key=lambda s: s.seconds)
    pool.record_timeline(False)  # stops recording, keeps what was recorded
    with pool.phase("train"):
        pass
    assert pool.timeline == samples
    pool.record_timeline()  # starts afresh
    assert pool.timeline == []


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    pool = sm.BufferPool("cpu", timeline=True)
    for step in range(10):
        with pool.phase("train"):
            pool.tensor("act", (1000 * (step % 4 + 1),))
    path = pool.plot_timeline(tmp_path / "timeline.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_plotting_an_empty_timeline_says_what_to_do(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    pool = sm.BufferPool("cpu", timeline=True)
    with pytest.raises(sm.SharedMemError, match=r"run some steps inside pool\.phase"):
        pool.plot_timeline(tmp_path / "empty.png")


def test_demo_plot_option_writes_the_timeline(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from sharedmem._cli.demo import DemoConfig, run_demo

    target = tmp_path / "demo.png"
    # The timeline is the shared pool's (the second part), written before the third part:
    # two steps with an evaluation after each draw it.
    run_demo(DemoConfig(steps=2, eval_every=1), verbose=False, fit=False, plot=str(target))
    assert target.read_bytes()[:4] == b"\x89PNG"


def test_a_long_run_is_thinned_evenly_and_keeps_its_indices() -> None:
    from sharedmem._pool.timeline import Timeline

    timeline = Timeline(max_samples=8)
    figures = {"reserved_bytes": 0, "device_reserved_bytes": 0, "active_bytes": 0}
    for step in range(100):
        timeline.record("train", {**figures, "reserved_bytes": step}, step)
    samples = timeline.samples
    assert 4 <= len(samples) <= 8
    gaps = {b.index - a.index for a, b in itertools.pairwise(samples)}
    assert len(gaps) == 1  # evenly spaced
    assert all(s.reserved_bytes == s.index for s in samples)  # each keeps its own figures
