"""Measuring side by side: interleaved rounds, medians, ratios against a PyTorch baseline.

Every benchmark in this folder times its case and the PyTorch baseline in the same process,
alternating which goes first in each round, and reports the median over many rounds, so that
drift (turbo, another process) hits both alike. Results are ``Row`` dicts that the report
printer and ``--json`` share; ``script_main`` is the command line every script shares.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import io
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol, TypedDict

import torch

import sharedmem as sm
from sharedmem._cli.bench import TIMING_TOLERANCE

# torch.profiler (the peak-memory figures) starts Kineto, whose log prints two "USDT ...
# profiler_start/stop" lines on stderr per profiled step at any level below 6 (its
# highest severity is 5): the benchmarks read the profiler's results, never its log. Kineto
# reads this when the profiler first starts, so setting it before any benchmark runs is enough;
# set KINETO_LOG_LEVEL yourself to see the log.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

# The test suite's run of ``bench --quick`` (SHAREDMEM_BENCH_SMOKE=1): every section and every
# code path, but each timing one call of each case after one warm-up call, and where a section
# measures several models the same way, only its smallest (``smoke_models``), so its figures
# are evidence of nothing (the JSON and the summary line say so). Inherited by the processes a
# benchmark starts.
SMOKE = os.environ.get("SHAREDMEM_BENCH_SMOKE", "") == "1"

__all__ = [
    "TIMING_TOLERANCE",
    "Progress",
    "Row",
    "cheapest_empty",
    "child_json",
    "environment",
    "growth_rows",
    "interleaved",
    "is_timing",
    "missed",
    "print_rows",
    "row",
    "row_cells",
    "script_main",
    "smoke_models",
    "write_json",
]


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
    ratio = None if not baseline else value / baseline
    return Row(
        name=name, value=value, baseline=baseline, ratio=ratio, unit=unit, target=target, ok=ok
    )


def growth_rows(label: str, copied: float, peak: float, capacity: float, stable: bool) -> list[Row]:
    """What a growth cost: bytes copied, and the peak of reserved bytes over the new capacity.

    One definition for every device and backend. A stable-address backend maps more memory
    behind the same addresses, so nothing is copied and the old and new blocks never coexist:
    the peak is the new capacity. A moving backend allocates, copies and frees (old + new).
    """
    return [
        row(
            f"{label}: bytes copied",
            copied,
            "bytes",
            target="== 0 (stable address)" if stable else "moving backend: copies",
            ok=copied == 0 if stable else None,
        ),
        row(
            f"{label}: peak / new capacity",
            peak,
            "bytes",
            baseline=capacity,
            target="<= 1.00x (stable address)" if stable else "moving backend: old + new",
            ok=peak <= capacity if stable else None,
        ),
    ]


def cheapest_empty(shape: tuple[int, ...], device: str) -> Callable[[], torch.Tensor]:
    """``torch.empty`` of float32 in the cheapest spelling a careful user writes, so that a
    baseline is not slowed in our favour: the sizes as separate ints (a tuple costs about 40%
    more at 1 KiB), no dtype, no device argument on CPU, and on CUDA a prebuilt
    ``torch.device`` (a string is parsed again on every call)."""
    if not device.startswith("cuda"):
        return lambda: torch.empty(*shape)
    where = torch.device(device)
    return lambda: torch.empty(*shape, device=where)


class Progress:
    """Progress lines for long runs, on stderr so that the table on stdout stays clean.

    ``say`` prints at once (a section or a case starts); ``tick`` prints only when nothing was
    said for ``every`` seconds, so a loop can tick every round without flooding the terminal
    and no stretch of a run stays silent for long.
    """

    def __init__(
        self,
        prefix: str = "bench",
        *,
        write: Callable[[str], None] | None = None,
        every: float = 3.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.prefix, self.every, self.clock = prefix, every, clock
        self.write = write if write is not None else _to_stderr
        self.start = self.last = clock()

    @classmethod
    def quiet(cls) -> Progress:
        """A progress that says nothing: the default of ``run()`` called from code."""
        return cls(write=lambda line: None)

    def say(self, line: str) -> None:
        self.last = self.clock()
        self.write(f"{self.prefix}: {line} ({self.last - self.start:.0f} s)")

    def tick(self, line: str) -> None:
        if self.clock() - self.last >= self.every:
            self.say(line)

    def stream(self) -> io.StringIO:
        """A text stream for code that reports on a stream (the stress runner's ``err``)."""
        return _ProgressStream(self)


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class _ProgressStream(io.StringIO):
    """Forwards what the stress runner writes: its one-line status as ticks, the rest as is.

    It answers ``isatty()`` with True so that the runner reports its status every second,
    as ``"\\r" + line`` (``Progress.tick`` thins that out); anything else it writes (a
    failure, the shrinking) is said in full.
    """

    def __init__(self, progress: Progress) -> None:
        super().__init__()
        self.progress = progress

    def isatty(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if text.startswith("\r") and "\n" not in text:
            self.progress.tick(text[1:].strip())
        else:
            for line in text.splitlines():
                if line.strip():
                    self.progress.say(line.strip())
        return len(text)


def arena_held(pool: sm.BufferPool) -> int:
    """Arena bytes tensors hold now (kept from earlier calls): each tensor's whole 64-byte
    units, as the planner fences them (``_aligned``: every arena address is on that grid, so
    the rest of a held tensor's last unit is no other allocation's either)."""
    from sharedmem._routing import native
    from sharedmem._routing.plan import _aligned

    router = native()
    base = pool.arenas.base("act.0")
    if router is None or base is None or not hasattr(router, "live_ranges"):
        return 0  # no router, no arena, or a router that keeps nothing past a call
    return sum(high - low for low, high in _aligned(router.live_ranges(base)))


def smoke_models(names: tuple[str, ...], smallest: str) -> tuple[str, ...]:
    """``names``, or only ``smallest`` of them in the test suite's smoke run (``SMOKE``)."""
    assert smallest in names, (smallest, names)
    return (smallest,) if SMOKE else names


def interleaved(
    cases: dict[str, Callable[[], object]],
    *,
    rounds: int = 30,
    number: int = 200,
    progress: Progress | None = None,
    label: str = "",
) -> dict[str, float]:
    """Median seconds per call of each case, over ``rounds`` rounds of ``number`` calls.

    The order of the cases alternates from round to round; the garbage collector is off while
    a round runs. ``progress`` hears (``tick``) after every round.
    """
    if SMOKE:
        rounds, number = 1, 1
    samples: dict[str, list[float]] = {name: [] for name in cases}
    names = list(cases)
    for case in cases.values():  # warm-up: caches, allocator, first-touch
        for _ in range(min(number, 20)):
            case()
    if progress is not None:
        progress.tick(f"{label}: warmed up")
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
        if progress is not None:
            progress.tick(f"{label}: round {index + 1}/{rounds}")
    return {name: statistics.median(values) for name, values in samples.items()}


_TARGET = re.compile(r"^(<=|>=|==|<|>)\s*(\d[\d,]*(?:\.\d+)?)")
_COMPARE: dict[str, Callable[[float, float], bool]] = {
    "<=": lambda a, b: a <= b,
    "<": lambda a, b: a < b,
    ">=": lambda a, b: a >= b,
    ">": lambda a, b: a > b,
    "==": lambda a, b: a == b,
}


def _bound(r: Row) -> tuple[str, float] | None:
    """The comparison a target states (``"<= 1.05x eager"`` -> ``("<=", 1.05)``), held against
    the row's ratio where it has one, else its value; ``None`` for a target said in words."""
    found = _TARGET.match(r["target"])
    return None if found is None else (found[1], float(found[2].replace(",", "")))


def _measure(r: Row) -> float:
    return r["value"] if r["ratio"] is None else r["ratio"]


def is_timing(r: Row) -> bool:
    """Whether a row measures speed (a time, a rate, a ratio of times): what noise moves."""
    return r["unit"] in ("s", "ms", "us") or "/" in r["unit"] or "time" in r["name"].lower()


def missed(r: Row, tolerance: float = 0.0) -> bool:
    """Whether ``r`` missed its target by more than ``tolerance`` (a fraction of its bound,
    for timing figures only): what ``bench --check`` fails on."""
    if r["ok"] is not False:
        return False
    bound = _bound(r)
    if bound is None or not is_timing(r) or bound[0] == "==":
        return True
    op, limit = bound
    slack = limit * tolerance if op in ("<=", "<") else -limit * tolerance
    return not _COMPARE[op](_measure(r), limit + slack)


def _digits(r: Row, least: int) -> int | None:
    """More decimals than ``least`` where the printed figure would contradict its verdict
    (0.8523 printed as 0.85 beside "<= 0.85x MISSED"); ``None`` where ``least`` will do."""
    bound = _bound(r)
    if bound is None or r["ok"] is None:
        return None
    op, limit = bound
    for digits in range(least, 9):
        if _COMPARE[op](round(_measure(r), digits), limit) == r["ok"]:
            return None if digits == least else digits
    return None


def row_cells(r: Row, tolerance: float = TIMING_TOLERANCE) -> tuple[str, str, str, str, str]:
    """The printed cells of a row: figure, value, baseline, ratio, target and verdict (a timing
    target missed by less than ``tolerance`` says so: ``bench --check`` lets it pass)."""
    value = _fmt(r["value"], r["unit"])
    if r["ratio"] is None:  # the value is what the target judges
        value = _fmt(r["value"], r["unit"], _digits(r, _default_digits(r["value"], r["unit"])))
    base = "" if r["baseline"] is None else _fmt(r["baseline"], r["unit"])
    ratio = "" if r["ratio"] is None else f"{r['ratio']:.{_digits(r, 3) or 3}f}"
    verdict = {True: "met", False: "MISSED", None: ""}[r["ok"]]
    if r["ok"] is False and not missed(r, tolerance):
        verdict = f"MISSED (within the {tolerance:.0%} timing tolerance)"
    return r["name"], value, base, ratio, f"{r['target']} {verdict}".strip()


def print_rows(title: str, rows: Iterable[Row], tolerance: float = TIMING_TOLERANCE) -> None:
    """A table: figure, value, baseline, ratio, target, verdict."""
    rows = list(rows)
    print(title)
    width = max([len(r["name"]) for r in rows] + [6])
    print(f"  {'figure':<{width}}  {'value':>14}  {'baseline':>14}  {'ratio':>7}  target")
    for r in rows:
        name, value, base, ratio, target = row_cells(r, tolerance)
        print(f"  {name:<{width}}  {value:>14}  {base:>14}  {ratio:>7}  {target}".rstrip())


def _default_digits(value: float, unit: str) -> int:
    whole = unit == "bytes" or (unit == "" and float(value).is_integer())
    return 0 if whole or abs(value) >= 1000 else 2  # large rates read better whole


def _fmt(value: float, unit: str, digits: int | None = None) -> str:
    """``value`` for the table; ``digits`` (decimals) where the verdict needs more."""
    if unit == "s":
        for scale, suffix in ((1e-6, "us"), (1e-3, "ms"), (1.0, "s")):
            if value < scale * 1000:
                return f"{value / scale:.2f} {suffix}"
    if digits is None and (unit == "bytes" or (unit == "" and float(value).is_integer())):
        return f"{int(value):,}"
    if digits is None:
        digits = _default_digits(value, unit)
    return f"{value:,.{digits}f} {unit}".strip()


def _cpu_name() -> str:
    try:  # Linux names the model here; platform.processor() is often empty there
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: str, quick: bool) -> dict[str, object]:
    """What a figure depends on, for the JSON and the summary line: a quick run's figures and
    a full run's are not comparable, nor are two machines'."""
    cuda = device.startswith("cuda") and torch.cuda.is_available()
    return {
        "date": datetime.date.today().isoformat(),
        "device": device,
        "device_name": torch.cuda.get_device_name(device) if cuda else _cpu_name(),
        "quick": quick,
        "sharedmem": sm.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        **({"smoke": True} if SMOKE else {}),
    }


def write_json(path: str | Path, rows: Iterable[Row], **meta: object) -> None:
    Path(path).write_text(json.dumps({"meta": meta, "rows": list(rows)}, indent=2) + "\n")


class Run(Protocol):
    def __call__(self, quick: bool, device: str, progress: Progress | None = None) -> list[Row]:
        """Every figure of one benchmark on ``device``."""
        ...


def child_json(args: list[str], what: str, **env: str) -> dict[str, Any]:
    """Run ``python ARGS`` in a fresh process (this checkout first on its path, ``env`` added)
    and return the JSON object its last line of output prints: a figure of the process's own
    memory must not count another's. A failure exits naming ``what``, with its error output."""
    root = Path(__file__).resolve().parent.parent
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
    done = subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=path, **env),
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"{what} failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def script_main(
    doc: str | None,
    run: Run,
    title: str,
    argv: list[str] | None = None,
    *,
    device: str = "cpu",
    draw: Callable[[Path], None] | None = None,
) -> list[Row]:
    """The command line of every script here: ``[--quick] [--device D] [--json PATH]``, and
    ``[--png PATH]`` for a script that draws its figures (``draw``, called after the run).

    ``title`` may name ``{device}``. A CUDA device on a machine without a usable GPU skips the
    run with a line saying so (exit 0): the scripts stay runnable in CI everywhere.
    """
    summary = (doc or "").strip().splitlines()[0]
    parser = argparse.ArgumentParser(description=summary)
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    parser.add_argument("--device", default=device, help="cpu, emulated, cuda or cuda:N")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    if draw is not None:
        parser.add_argument("--png", metavar="PATH", help="also draw the figures")
    args = parser.parse_args(argv)
    name = Path(sys.argv[0]).stem if argv is None else parser.prog
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"{name}: skipped: no CUDA GPU (torch.cuda.is_available() is False)")
        if args.json:
            write_json(args.json, [], skipped="no CUDA GPU", **environment(args.device, args.quick))
        return []
    try:
        where = sm.SyncedMemory(device=args.device).device  # checked, "cuda" -> "cuda:N"
    except (sm.SharedMemError, ValueError, TypeError) as error:
        parser.error(str(error))
    rows = run(args.quick, where, Progress(name))
    print_rows(title.format(device=where), rows)
    if args.json:
        write_json(args.json, rows, **environment(where, args.quick))
    if draw is not None and args.png and rows:
        draw(Path(args.png))
    return rows
