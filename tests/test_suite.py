"""The test suite's own machinery: the order the longest tests start in."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import DURATIONS, known_durations

ROOT = Path(__file__).resolve().parent.parent


def test_every_test_the_durations_table_names_still_exists() -> None:
    # A renamed or deleted test would lose its place at the front silently.
    known = known_durations()
    assert len(known) >= 10, DURATIONS.read_text()
    for nodeid in known:
        path, _, name = nodeid.partition("::")
        function = re.sub(r"\[.*\]$", "", name).split("::")[-1]
        source = ROOT / path
        assert source.is_file(), nodeid
        assert re.search(rf"^(?:async )?def {re.escape(function)}\(", source.read_text(), re.M), (
            f"{nodeid}: no such test; refresh tests/durations.txt"
        )


def test_durations_add_a_tests_setup_and_call_and_drop_its_xdist_group(tmp_path: Path) -> None:
    table = tmp_path / "durations.txt"
    table.write_text(
        "# a comment\n"
        "25.80s setup    tests/test_a.py::test_x[4-ranks]@distributed\n"
        "1.20s call     tests/test_a.py::test_x[4-ranks]@distributed\n"
        "69.10s call     tests/test_b.py::test_y\n"
        "not a duration line\n"
    )
    assert known_durations(table) == pytest.approx(
        {"tests/test_a.py::test_x[4-ranks]": 27.0, "tests/test_b.py::test_y": 69.1}
    )
