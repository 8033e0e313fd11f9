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
    tested = {"host_staging"}
    assert {p.stem for p in EXAMPLES.glob("*.py")} == tested


@pytest.mark.parametrize(
    "device", ["cpu", "emulated", pytest.param("cuda", marks=[pytest.mark.cuda, requires_cuda])]
)
def test_host_staging_stops_growing_after_warmup(
    device: str, capsys: pytest.CaptureFixture[str]
) -> None:
    stats = load("host_staging").main(["--device", device, "--steps", "40"])
    assert stats["grows_in_second_half"] == 0
    assert stats["num_grows"] < 40
    assert "staged 40 batches" in capsys.readouterr().out
    if device != "cpu":
        assert stats["host_to_device_bytes"] > 0
