"""Judging the errors an operation raises: an injected failure must surface as the right
error, a limit refusal must be justified by the numbers it carries, and a refused growth must
leave the memory's capacities as they were. Anything else the pool raises is a failure."""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import nullcontext
from typing import TypeVar

from .._errors import OutOfMemoryError, SharedMemError
from .._pool import BufferPool
from .._synced import SyncedMemory
from ._checks import StressFailure
from ._faults import FaultInjector
from ._ops import Op

__all__ = ["Caps", "Judge", "caps"]

T = TypeVar("T")
Caps = tuple[int, int]


def caps(memory: SyncedMemory) -> Caps:
    return memory.host_capacity, memory.device_capacity


class Judge:
    """Runs calls with their operation's fault armed, and judges what they raise.

    Attributes:
        faults: injected failures that surfaced as they should.
        refusals: growths the limit refused, rightly.
    """

    def __init__(self, injector: FaultInjector, pool: BufferPool) -> None:
        self.injector = injector
        self.pool = pool
        self.faults = 0
        self.refusals = 0
        self._lock = threading.Lock()  # workers share one judge

    def guard(
        self, op: Op, memory: SyncedMemory | None, call: Callable[[], T]
    ) -> tuple[bool, T | None]:
        """Run ``call`` with the op's fault armed; an error it raises must be one we expect.

        Returns ``(True, result)``, or ``(False, None)`` when it was rightly refused. The
        memory's own (re-entrant) lock is held from the capacities before to the check after,
        so that a reader in another thread cannot grow the memory in between.
        """
        injector = self.injector
        fired = injector.fired_here()
        with nullcontext() if memory is None else memory._lock:
            before = (0, 0) if memory is None else caps(memory)
            try:
                if op.fault is None:
                    result = call()
                else:
                    with injector.armed(*op.fault):
                        result = call()
            except SharedMemError as error:  # OutOfMemoryError included
                self.refused(memory, before, error, injector.fired_here() - fired)
                return False, None
        if injector.fired_here() != fired:
            raise StressFailure(
                "fault", f"an injected {injector.last_here()} failure was swallowed"
            )
        return True, result

    def refused(
        self, memory: SyncedMemory | None, before: Caps, error: SharedMemError, injected: int
    ) -> None:
        """An operation raised ``error``: it must be the injected fault, or a justified limit
        refusal; a refused growth must have left the memory's capacities as they were."""
        oom = error if isinstance(error, OutOfMemoryError) else None
        if injected > 1:
            raise StressFailure("fault", f"{injected} faults fired in one operation, armed one")
        if injected:
            kind = self.injector.last_here()
            # Allocation, growth and shrink fail as the allocator would (no limit involved);
            # a copy fails as a device error that no freeing of memory can fix.
            if (oom is None) != (kind == "copy") or (oom is not None and oom.limit is not None):
                raise StressFailure(
                    "fault",
                    f"an injected {kind} failure surfaced as {type(error).__name__}: {error}",
                )
            with self._lock:
                self.faults += 1
            growth = kind in ("allocate", "grow")
        else:
            if oom is None:
                raise StressFailure("error", f"unexpected {type(error).__name__}: {error}")
            if oom.limit is None:
                raise error  # the allocator itself ran out: the machine, not the pool
            old = before[1] if memory is not None else 0  # the limited side's capacity
            # A growth that moves holds the old block and the new one at once while it copies.
            limited = self.pool._accel or self.pool._host
            side = None if memory is None else memory._device
            block = None if side is None else side.block
            moves = block is not None and limited.will_move(block, oom.requested)
            freed = 0 if moves else old
            if (
                oom.limit != self.pool.limit
                or oom.requested <= old
                or oom.reserved - freed + oom.requested <= oom.limit
            ):
                raise StressFailure(
                    "limit",
                    f"a growth within the limit was refused (old capacity {old:,}): {error}",
                )
            with self._lock:
                self.refusals += 1
            growth = True
        if memory is not None and growth and caps(memory) != before:
            raise StressFailure(
                "capacity",
                f"a refused growth changed capacities from {before} to {caps(memory)}",
            )
