"""The error hierarchy: one base class, and an out-of-memory error that says what to do; and
the quiet in which torch's own log of a failure we say in one line is left out."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["OutOfMemoryError", "SharedMemError", "quiet_fake_tensor_failures"]


class SharedMemError(RuntimeError):
    """Base class of every error sharedmem raises on its own account.

    Bad arguments raise plain ``ValueError`` / ``TypeError`` (with a message starting
    ``sharedmem:``) so that ordinary argument checking keeps working as users expect.
    """


class OutOfMemoryError(SharedMemError, MemoryError):
    """A growth was refused: by a pool's limit, or because the allocator had no memory.

    Nothing is lost when this is raised: every buffer keeps its content and capacity.

    Attributes:
        requested: bytes the refused growth asked for (the new capacity of the side).
        reserved: bytes reserved on that device when the growth was refused.
        limit: the pool's cap on reserved device bytes, or ``None`` when the allocator
            itself ran out.
        device: the device string (``"cpu"``, ``"emulated"``, ``"cuda:0"`` ...).
        process: ``"rank R of N"`` when raised under an initialized ``torch.distributed``
            process group (every rank has its own pool), else ``""``.
    """

    def __init__(
        self,
        requested: int,
        reserved: int,
        limit: int | None,
        device: str,
        detail: str = "",
        process: str | None = None,
        summary: str = "",
    ) -> None:
        self.requested = requested
        self.reserved = reserved
        self.limit = limit
        self.device = device
        self.detail = detail
        # Under torch.distributed every rank has its own pool: say which one ran out.
        self.process = _process() if process is None else process
        # A refusal made before anything ran (a budget too small for one example) says so
        # itself: ``summary`` replaces the growth's wording.
        self.summary = summary
        super().__init__(self._message())

    def _message(self) -> str:
        if self.summary:
            return "\n".join(part for part in (self.summary, self.detail) if part)
        where = f"{self.device} ({self.process})" if self.process else self.device
        if self.limit is None:
            head = (
                f"sharedmem: out of memory on {where}: could not grow to "
                f"{self.requested:,} bytes with {self.reserved:,} bytes already reserved"
            )
        else:
            head = (
                f"sharedmem: out of memory on {where}: growing to {self.requested:,} bytes "
                f"would pass the limit of {self.limit:,} bytes ({self.reserved:,} reserved)"
            )
        if self.limit is None:  # the allocator ran out: pool or not, give memory back
            fix = (
                "Nothing was lost. To go on: give memory back (trim() or release() on a pool, "
                "shrink_to_fit() or release() on memories you no longer need) or ask for fewer "
                "bytes (a smaller batch or shape)."
            )
        else:
            fix = (
                "Nothing was lost. To go on: raise the pool's limit with set_limit(), give "
                "memory back with pool.trim() or release(), or use a smaller batch."
            )
        return "\n".join(part for part in (head, self.detail, fix) if part)

    def __reduce__(
        self,
    ) -> tuple[type[OutOfMemoryError], tuple[int, int, int | None, str, str, str, str]]:
        # MemoryError pickles only ``args``; keep every field so errors cross processes intact.
        fields = (self.requested, self.reserved, self.limit, self.device, self.detail)
        return (type(self), (*fields, self.process, self.summary))


def _process() -> str:
    """``rank R of N`` under an initialized ``torch.distributed`` process group, else ``""``."""
    import torch.distributed as dist  # the floor imports no torch at module level

    if not (dist.is_available() and dist.is_initialized()):
        return ""
    return f"rank {dist.get_rank()} of {dist.get_world_size()}"


@contextmanager
def quiet_fake_tensor_failures() -> Iterator[None]:
    """Inside the block, drop what torch logs, in this thread, about an op that failed on
    fake tensors (``failed while attempting to run meta for aten.mm``, and its traceback: 25
    lines): the error itself still propagates, and sharedmem says it in one line. Other
    threads, and every other logger, log as before; the filter goes in ``finally``."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    me = threading.get_ident()

    def keep(record: logging.LogRecord) -> bool:
        return record.thread != me or record.levelno < logging.ERROR

    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)
