"""The documentation runs: README's Python blocks and every docstring example."""

from __future__ import annotations

import doctest
import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import sharedmem

ROOT = Path(__file__).resolve().parent.parent


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.DOTALL)


@pytest.mark.parametrize("index", range(len(python_blocks(ROOT / "README.md"))))
def test_readme_python_blocks_run(index: int) -> None:
    exec(compile(python_blocks(ROOT / "README.md")[index], f"README.md block {index}", "exec"), {})


MODULES = sorted(
    m.name
    for m in pkgutil.walk_packages(sharedmem.__path__, "sharedmem.")
    if "cuda" not in m.name and m.name != "sharedmem.__main__"  # __main__ runs the CLI
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name: str) -> None:
    module = importlib.import_module(name)
    failures, _ = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert failures == 0
