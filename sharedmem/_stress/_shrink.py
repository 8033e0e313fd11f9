"""Shrinking a failing sequence of operations: delta debugging on whole operations.

A candidate still fails when a replay on a fresh pool fails in the same category (a byte
mismatch stays a byte mismatch; it does not wander off into another bug). Removal goes from
large chunks to single operations and keeps every removal that still fails; a replay that
fails early cuts the operations after the failure. Last, injected faults the failure does not
need are dropped from the operations that carry them.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ._checks import StressFailure
from ._ops import Op

__all__ = ["Replay", "Shrunk", "shrink"]

# A replay runs the operations on a fresh pool and returns (index of the failing operation,
# the failure), or None when everything held.
Replay = Callable[[Sequence[Op]], "tuple[int, StressFailure] | None"]


@dataclass
class Shrunk:
    ops: list[Op]
    failure: StressFailure
    replays: int
    complete: bool  # False: the time ran out before no single removal could be made


def shrink(ops: Sequence[Op], replay: Replay, category: str, seconds: float) -> Shrunk | None:
    """The shortest sequence found that still fails in ``category``; None if ``ops`` do not."""
    deadline = time.monotonic() + seconds
    replays = 0
    failure: StressFailure | None = None

    def fails(candidate: list[Op]) -> list[Op] | None:
        nonlocal replays, failure
        replays += 1
        got = replay(candidate)
        if got is None or got[1].category != category:
            return None
        failure = got[1]
        return candidate[: got[0] + 1]  # what follows the failure does not matter

    best = fails(list(ops))
    if best is None:
        return None
    complete = False
    chunk = max(1, len(best) // 2)
    while time.monotonic() < deadline:
        removed, i = False, 0
        while i < len(best) and time.monotonic() < deadline:
            smaller = fails(best[:i] + best[i + chunk :])
            if smaller is not None:
                best, removed = smaller, True
            else:
                i += chunk
        if chunk == 1 and not removed:
            complete = time.monotonic() < deadline
            break
        chunk = max(1, chunk // 2)
    for i, op in enumerate(best):
        if op.fault is not None and time.monotonic() < deadline:
            simpler = fails([*best[:i], dataclasses.replace(op, fault=None), *best[i + 1 :]])
            if simpler is not None and len(simpler) == len(best):
                best = simpler
    assert failure is not None
    # The failure of the last successful candidate is the one to show: replay it once more.
    final = replay(best)
    replays += 1
    return Shrunk(best, final[1] if final is not None else failure, replays, complete)
