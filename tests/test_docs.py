"""The documentation runs: the Python blocks of the README and of every page of docs/, and
every docstring example."""

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


PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [
    pytest.param(block, id=f"{page.relative_to(ROOT)}-{index}")
    for page in PAGES
    for index, block in enumerate(python_blocks(page))
]


@pytest.mark.parametrize("block", BLOCKS)
def test_python_blocks_of_the_readme_and_the_docs_run(
    block: str, request: pytest.FixtureRequest
) -> None:
    exec(compile(block, request.node.callspec.id, "exec"), {})


def test_every_docs_page_is_in_the_site_navigation() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    missing = [p.name for p in (ROOT / "docs").glob("*.md") if f": {p.name}" not in nav]
    assert missing == []


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
