"""Measuring side by side: interleaved rounds, medians, ratios against a PyTorch baseline.

Every benchmark in this folder times its case and the PyTorch baseline in the same process,
alternating which goes first in each round, and reports the median over many rounds, so that
drift (turbo, another process) hits both alike. Results are ``Row`` dicts that the report
printer and ``--json`` share.
"""

from __future__ import annotations

import gc
import json
import statistics
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypedDict

__all__ = ["Row", "interleaved", "print_rows", "row", "write_json"]


class Row(TypedDict):
    """One measured figure, its baseline, and the target it is held to."""

    name: str
    value: float
    baseline: float | None
    ratio: float | None
    unit: str
    target: str
    ok: bool | None


def row(
    name: str,
    value: float,
    unit: str,
    *,
    baseline: float | None = None,
    target: str = "",
    ok: bool | None = None,
) -> Row:
    ratio = None if baseline in (None, 0) else value / baseline  # type: ignore[operator]
    return Row(
        name=name, value=value, baseline=baseline, ratio=ratio, unit=unit, target=target, ok=ok
    )


def interleaved(
    cases: dict[str, Callable[[], object]], *, rounds: int = 30, number: int = 200
) -> dict[str, float]:
    """Median seconds per call of each case, over ``rounds`` rounds of ``number`` calls.

    The order of the cases alternates from round to round; the garbage collector is off while
    a round runs.
    """
    samples: dict[str, list[float]] = {name: [] for name in cases}
    names = list(cases)
    for case in cases.values():  # warm-up: caches, allocator, first-touch
        for _ in range(min(number, 20)):
            case()
    for index in range(rounds):
        order = names if index % 2 == 0 else names[::-1]
        for name in order:
            call = cases[name]
            gc.disable()
            start = time.perf_counter_ns()
            for _ in range(number):
                call()
            elapsed = time.perf_counter_ns() - start
            gc.enable()
            samples[name].append(elapsed / number / 1e9)
    return {name: statistics.median(values) for name, values in samples.items()}


def print_rows(title: str, rows: Iterable[Row]) -> None:
    """A table: figure, value, baseline, ratio, target, verdict."""
    rows = list(rows)
    print(title)
    width = max([len(r["name"]) for r in rows] + [6])
    print(f"  {'figure':<{width}}  {'value':>14}  {'baseline':>14}  {'ratio':>7}  target")
    for r in rows:
        value = _fmt(r["value"], r["unit"])
        base = "" if r["baseline"] is None else _fmt(r["baseline"], r["unit"])
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.3f}"
        verdict = {True: "met", False: "MISSED", None: ""}[r["ok"]]
        print(
            f"  {r['name']:<{width}}  {value:>14}  {base:>14}  {ratio:>7}  {r['target']} {verdict}"
        )


def _fmt(value: float, unit: str) -> str:
    if unit == "s":
        for scale, suffix in ((1e-6, "us"), (1e-3, "ms"), (1.0, "s")):
            if value < scale * 1000:
                return f"{value / scale:.2f} {suffix}"
    if unit == "bytes" or (unit == "" and float(value).is_integer()):
        return f"{int(value):,}"
    if abs(value) >= 1000:  # large rates read better whole
        return f"{value:,.0f} {unit}".strip()
    return f"{value:,.2f} {unit}".strip()


def write_json(path: str | Path, rows: Iterable[Row], **meta: object) -> None:
    Path(path).write_text(json.dumps({"meta": meta, "rows": list(rows)}, indent=2) + "\n")
