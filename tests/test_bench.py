"""python -m sharedmem bench: every applicable row is printed, and the JSON says the same."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import suite  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", "emulated"])
def test_bench_quick_prints_every_row_and_the_json_matches(device: str, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "sharedmem",
            "bench",
            "--quick",
            "--device",
            device,
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode in (0, 1), done.stderr  # 1 would mean a target was missed
    payload = json.loads(out.read_text())
    titles = [s["title"] for s in payload["sections"]]
    expected = [title for title, _, where in suite.SUITE if where == "all"]
    assert titles == expected  # every section that applies here, none that does not
    assert payload["meta"]["device"] == device and payload["meta"]["torch"]
    for section in payload["sections"]:
        assert section["rows"], section["title"]
        assert section["title"] in done.stdout
        for row in section["rows"]:
            assert row["name"] in done.stdout  # the printed table has every figure
            if row["ratio"] is not None:
                assert f"{row['ratio']:.3f}" in done.stdout
    names = " ".join(r["name"] for s in payload["sections"] for r in s["rows"])
    for figure in (
        "pool.tensor 1 KiB",
        "pool.tensor 64 MiB",
        "eval adds",
        "growths after",
        "bytes copied",
        "verified ops a minute",
    ):
        assert figure in names
    progress = [line for line in done.stdout.splitlines() if line.startswith("bench: [")]
    assert len(progress) == len(expected)
    missed = sum(r["ok"] is False for s in payload["sections"] for r in s["rows"])
    assert done.returncode == (1 if missed else 0)


def test_cuda_rows_are_kept_from_the_cuda_benchmark_records() -> None:
    records = [
        {
            "bench": "bandwidth",
            "direction": "h2d",
            "backend": "vmm",
            "bytes": 1 << 24,
            "ours_gbps": 40.0,
            "torch_gbps": 45.0,
            "ratio": 40 / 45,
        },
        {
            "bench": "view",
            "backend": "vmm",
            "bytes": 1 << 26,
            "ours_s": 1e-6,
            "torch_s": 2e-6,
            "ratio": 0.5,
        },
        {
            "bench": "growth",
            "backend": "vmm",
            "bytes": 1 << 26,
            "grown_to": 1 << 27,
            "copied_bytes": 0,
            "peak_over_new": 1.0,
        },
    ]
    rows = suite._cuda_rows(records)
    assert [r["ok"] for r in rows] == [True, True, True, True]
    assert rows[0]["ratio"] == pytest.approx(40 / 45)
