"""Capability flags, skip marks, a printed seed for every randomized test, and state
resets."""

from __future__ import annotations

import collections
import gc
import importlib.util
import os
import random
import re
import signal
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

import sharedmem as sm
from sharedmem._routing import Recording

HAS_CUDA = torch.cuda.is_available()
# Without a GPU, tests marked ``cuda`` run against the CUDA stand-in (tests/cudasim), which
# needs cuda-python's modules for its enums and structs. SHAREDMEM_CUDASIM=0 turns it off.
SIMULATED_CUDA = (
    not HAS_CUDA
    and os.environ.get("SHAREDMEM_CUDASIM", "1") != "0"
    and importlib.util.find_spec("cuda.bindings") is not None
)
requires_cuda = pytest.mark.skipif(
    not (HAS_CUDA or SIMULATED_CUDA), reason="no usable CUDA GPU (nor the stand-in) here"
)
requires_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a real CUDA GPU")


def _cuda_marks(backend: str) -> list[pytest.MarkDecorator]:
    """Skip marks for a CUDA backend: no GPU, or this backend cannot run on this one (a
    cuda-python runtime newer than the driver, a device without virtual memory management)."""
    if not HAS_CUDA:
        return [requires_cuda]  # the stand-in runs every backend
    from sharedmem._backends.cuda import usable_backends

    if backend in usable_backends(0):
        return []
    return [pytest.mark.skip(reason=f"the {backend!r} CUDA backend cannot run on this GPU")]


# Devices every generic test runs on: CI has cpu, emulated and cuda on the stand-in; a GPU
# machine runs cuda on the GPU.
DEVICES = [
    "cpu",
    "emulated",
    pytest.param("cuda", marks=[pytest.mark.cuda, requires_cuda]),
]
# For tests that run PyTorch's own CUDA code (models, CUDA tensors): the stand-in's "device"
# tensors are host tensors, so these need a GPU.
GPU_DEVICES = [
    "cpu",
    "emulated",
    pytest.param("cuda", marks=[pytest.mark.cuda, requires_gpu]),
]
# Host/device pairs (the ones with a separate device side), with every backend of each.
TWO_SIDED = [
    pytest.param(("emulated", "reserved"), id="emulated-reserved"),
    pytest.param(("emulated", "pageable"), id="emulated-pageable"),
    *(
        pytest.param(("cuda", b), id=f"cuda-{b}", marks=[pytest.mark.cuda, *_cuda_marks(b)])
        for b in ("vmm", "cudart", "torch")
    ),
]
ALL_PLACEMENTS = [
    pytest.param(("cpu", "reserved"), id="cpu-reserved"),
    pytest.param(("cpu", "pageable"), id="cpu-pageable"),
    *TWO_SIDED,
]

_EXAMPLES = int(os.environ.get("SHAREDMEM_HYPOTHESIS_EXAMPLES", "100"))
settings.register_profile(
    "sharedmem",
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    max_examples=_EXAMPLES,
)
settings.load_profile("sharedmem")
# The state machines (tests/test_stress.py, tests/test_invariant.py: 40 steps an example, on
# each of seven placements, a pool's every byte checked after each step) run half as many
# examples: 2,000 random steps a placement a run, drawn from a new seed every run (at 100,
# 5 % of the whole suite's time).
STATEFUL_EXAMPLES = max(1, _EXAMPLES // 2)

_SEED = int(os.environ.get("SHAREDMEM_SEED", random.SystemRandom().randrange(2**31)))
# pytest-xdist's workers are started after this module is loaded, with this environment: every
# worker draws from the seed the header prints.
os.environ["SHAREDMEM_SEED"] = str(_SEED)
# After a test's timeout, this long for it to stop before its worker is ended with every
# thread's stack (a hang in native code never sees the timeout's exception).
_TIMEOUT_GRACE_S = 30.0


def pytest_report_header() -> str:
    return f"sharedmem: random seed {_SEED} (rerun with SHAREDMEM_SEED={_SEED})"


def seed_of(nodeid: str) -> int:
    """The seed of the test ``nodeid`` in this run: the ``seed`` fixture's value."""
    return (_SEED + zlib.crc32(nodeid.encode())) % 2**31


class TimedOut(BaseException):
    """A test ran past its timeout. A ``BaseException``, so that neither the code under test
    nor hypothesis (which would shrink, running the hung test again with no timeout left)
    takes it for the test's own failure; pytest reports it as the test's failure."""


def _timeout_message(item: pytest.Item, seconds: float) -> str:
    return (
        f"sharedmem: {item.nodeid} ran past its timeout of {seconds:g} s (its seed "
        f"{seed_of(item.nodeid)}; rerun with SHAREDMEM_SEED={_SEED}). A test that needs "
        "longer says so with @pytest.mark.timeout(SECONDS)"
    )


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> bool | None:
    """pytest-timeout's timer, failing the test with its seed and case: SIGALRM raises
    ``TimedOut`` in the test; a test still running ``_TIMEOUT_GRACE_S`` later (stuck where
    Python cannot interrupt it) gets pytest-timeout's own end (every thread's stack, then the
    process exits; xdist names the test that its worker crashed in, and starts another)."""
    if settings.method != "signal" or threading.current_thread() is not threading.main_thread():
        return None  # pytest-timeout's own thread method

    def expire(signum: int, frame: Any) -> None:
        raise TimedOut(_timeout_message(item, settings.timeout))

    def last_resort() -> None:
        print(_timeout_message(item, settings.timeout) + "; it did not stop: ending the worker")
        import pytest_timeout

        pytest_timeout.timeout_timer(item, settings)

    backstop = threading.Timer(settings.timeout + _TIMEOUT_GRACE_S, last_resort)
    backstop.daemon = True

    def cancel() -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        backstop.cancel()

    item.cancel_timeout = cancel  # type: ignore[attr-defined]  # pytest-timeout's cancel calls it
    signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, settings.timeout)
    backstop.start()
    return True


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """One line per skip reason (``-ra`` would print one line per skipped test: dozens of the
    same "no usable CUDA GPU" on a CPU machine)."""
    reasons: collections.Counter[str] = collections.Counter()
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = getattr(report, "longrepr", None)
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        reasons[reason.removeprefix("Skipped: ")] += 1
    if reasons:
        terminalreporter.write_sep("-", "skipped, by reason")
        for reason, count in reasons.most_common():
            terminalreporter.write_line(f"{count:>5}  {reason}")


# The longest tests' durations, and what a slow-tier test missing from it is taken to last.
DURATIONS = Path(__file__).with_name("durations.txt")
_SLOW_TIER_S = 30.0


def _plain(nodeid: str) -> str:
    """``nodeid`` without the ``@group`` pytest-xdist adds to a test of an xdist_group."""
    return re.sub(r"@[\w.-]+$", "", nodeid)


def known_durations(path: Path = DURATIONS) -> dict[str, float]:
    """Seconds per test id of ``durations.txt`` (lines as ``pytest --durations`` prints them:
    ``12.34s call     tests/test_x.py::test_y``; a setup and a call of one test add up)."""
    seconds: dict[str, float] = collections.defaultdict(float)
    for line in path.read_text().splitlines():
        found = re.fullmatch(r"\s*([\d.]+)s\s+(?:setup|call|teardown)\s+(\S.*?)\s*", line)
        if found:
            seconds[_plain(found[2])] += float(found[1])
    return dict(seconds)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest tests first (durations.txt; the slow tier's unlisted ones as 30 s; an xdist
    group by its tests' sum), each file's order kept otherwise: pytest-xdist hands tests out
    in this order, so the long runs
    start while the short ones fill in beside them, instead of one of them (the recurrent
    models of test_zoo, the last file) running alone at the end."""
    known = known_durations()

    def seconds(item: pytest.Item) -> float:
        default = _SLOW_TIER_S if item.get_closest_marker("slow") else 0.0
        return known.get(_plain(item.nodeid), default)

    # An xdist group moves as one, in the order pytest gave it: its tests share fixtures of a
    # wider scope (the spawned ranks of each world size), which pytest orders its tests to set
    # up once; sorting them one by one set the ranks up again for each test (50 s of one
    # worker's time in the distributed group).
    def unit(item: pytest.Item) -> str:
        mark = item.get_closest_marker("xdist_group")
        if mark is None:
            return item.nodeid
        return "@" + str(mark.args[0] if mark.args else mark.kwargs.get("name", ""))

    totals: dict[str, float] = {}
    first: dict[str, int] = {}
    for index, item in enumerate(items):
        totals[unit(item)] = totals.get(unit(item), 0.0) + seconds(item)
        first.setdefault(unit(item), index)

    # Within a file, the tests of one set of spawned ranks together (pytest left a test of
    # four ranks between tests of two, which spawned each world twice).
    def world(item: pytest.Item) -> int:
        callspec = getattr(item, "callspec", None)
        return int(callspec.params.get("ranks", 0)) if callspec is not None else 0

    files: dict[str, int] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], len(files))
    items.sort(
        key=lambda item: (
            -totals[unit(item)],
            first[unit(item)],
            files[item.nodeid.split("::")[0]],
            world(item),
        )
    )


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection loaded (torch, the tracing stack, every test module) stays for the whole
    run: frozen out of the garbage collector's passes, so that a full collection (the CUDA
    stand-in's teardown runs two per test) walks the objects of the test that just ran, not
    the whole process's (a tenth of a second each, hundreds of times)."""
    gc.collect()
    gc.freeze()


def pytest_configure(config: pytest.Config) -> None:
    # One seed drives hypothesis and every hand-written randomized test of the run.
    if config.getoption("hypothesis_seed", None) is None:
        config.option.hypothesis_seed = _SEED
    _share_the_cores()


def _share_the_cores() -> None:
    """In an xdist worker, PyTorch's intra-op threads are the cores divided by the workers
    (and so in the processes tests start): each worker otherwise runs one thread per core,
    and on a 2-core machine 2 workers x 2 threads spin against each other for a quarter of
    the CPU time. Every comparison a test makes is within its own process, at one thread
    count; ``SHAREDMEM_TEST_THREADS`` chooses another."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers < 1:
        return
    threads = int(
        os.environ.get("SHAREDMEM_TEST_THREADS", max(1, (os.cpu_count() or 1) // workers))
    )
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> Iterator[int]:
    """A per-test seed derived from the run's seed; printed when the test fails."""
    value = seed_of(request.node.nodeid)
    yield value
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        node = request.node.nodeid
        print(f"\nsharedmem: {node} failed with seed {value} (SHAREDMEM_SEED={_SEED})")


@pytest.fixture
def rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)


@pytest.fixture(autouse=True)
def _reset_torch_rng() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _cuda_stand_in(request: pytest.FixtureRequest, seed: int) -> Iterator[Any]:
    """Tests marked ``cuda`` run on the CUDA stand-in where there is no GPU, with queued work
    run early where the test's seed says (the seed is printed when the test fails); after
    each, every byte it handed out must be back (no leaked reservation, handle or
    registration) and no device may have faulted."""
    if not (SIMULATED_CUDA and request.node.get_closest_marker("cuda")):
        yield None
        return
    from cudasim import SimulatedCuda

    with SimulatedCuda(seed=seed) as cuda:
        yield cuda
    # The stand-in's teardown collected every cycle of the test: what is alive now stays out
    # of later collections, as collection's objects do (pytest_collection_finish). Without
    # this, each of the two full collections of every later CUDA test walked all that the
    # worker's earlier tests keep (traced graphs, caches): 0.7 s a test, 125 CPU s a run.
    gc.freeze()
    report = getattr(request.node, "rep_call", None)
    if report is None or report.passed:  # a failed test's traceback still holds its memories
        assert cuda.leaks() == [], cuda.leaks()
        assert cuda.faults == [], cuda.faults


@pytest.fixture
def cuda_sim(_cuda_stand_in: Any) -> Any:
    """The stand-in of a test marked ``cuda`` (skips on a real GPU, where there is none)."""
    if _cuda_stand_in is None:
        pytest.skip("runs on the CUDA stand-in only")
    return _cuda_stand_in


def make_memory(placement: tuple[str, str], nbytes: int = 0) -> sm.SyncedMemory:
    device, backend = placement
    return sm.SyncedMemory(nbytes, device=device, backend=backend)


def storage_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the storage under ``tensor``, what ``torch.save`` or ``deepcopy`` reads."""
    return int(tensor.untyped_storage().nbytes())


@st.composite
def recordings(draw: st.DrawFn, most: int = 40) -> Recording:
    """A random allocation sequence of 1 to ``most`` allocations (0 to 5,000 bytes each),
    frees interleaved at random, some alive at the end (they outlive the step)."""
    n = draw(st.integers(1, most))
    events: list[tuple[str, int]] = []
    alive: list[int] = []
    sizes: list[int] = []
    for i in range(n):
        sizes.append(draw(st.integers(0, 5000)))
        events.append(("alloc", i))
        alive.append(i)
        while alive and draw(st.booleans()):
            events.append(("free", alive.pop(draw(st.integers(0, len(alive) - 1)))))
    for i in alive:
        if draw(st.booleans()):
            events.append(("free", i))
    alloc_at, free_at = [0] * n, [-1] * n
    for tick, (kind, i) in enumerate(events):
        (alloc_at if kind == "alloc" else free_at)[i] = tick
    return Recording(sizes, alloc_at, free_at)
