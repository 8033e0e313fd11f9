"""What a memory budget means in bytes, and what a step needs of it.

A budget covers what a step holds beyond what existed before it (parameters, inputs and
optimizer state are already there): the pool's buffers, what runs beside the pool, and the
gradients. ``"free"`` is what the device can give at the start of the batch: on CUDA its free
memory plus what PyTorch's caching allocator holds unused, plus what the pool already holds
(the step reuses that); on ``cpu`` and ``emulated`` the machine's available memory plus the
pool's. A pool with a limit caps its own buffers on top of any budget.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._devices import machine_available_bytes
from .._pool import BufferPool
from .._pool.report import human_bytes
from .._validate import SIZE_SPELLING, check_bytes

__all__ = [
    "ChunkNeed",
    "Need",
    "budget_bytes",
    "check_budget",
    "machine_available_bytes",
    "parse_bytes",
]

FREE = "free"


class ChunkNeed(NamedTuple):
    """What one chunk shape needs: bytes beside the pool by part, and the size each pool
    buffer would be grown to."""

    beside: dict[str, int]
    slots: dict[str, int]


class Need(NamedTuple):
    """What one choice of chunks needs: its peak beyond what existed before the step, what
    the pool would hold (0 without a pool), and the parts, biggest first, for messages."""

    total: int
    pool: int
    parts: dict[str, int]

    def fits(self, budget: int, limit: int | None) -> bool:
        return self.total <= budget and (limit is None or self.pool <= limit)

    def describe(self) -> str:
        parts = sorted(self.parts.items(), key=lambda item: -item[1])
        return ", ".join(f"{name} {human_bytes(n)}" for name, n in parts if n)


def parse_bytes(value: object, what: str = "budget") -> int:
    """Bytes from an int >= 0 or a size such as ``"8G"``: the spelling every size takes
    (``check_bytes``), a pool's ``limit=`` as well.

    >>> parse_bytes("8G"), parse_bytes("1_000"), parse_bytes(4096)
    (8589934592, 1000, 4096)
    """
    return check_bytes(value, what)


def check_budget(budget: object, chunks: object) -> int | str | None:
    """The budget in bytes (or ``"free"``, or ``None``); refuse one that is neither bytes, a
    size (``"8G"``) nor ``"free"``, a chunk count below 1, or both."""
    if budget not in (None, FREE):
        try:
            budget = parse_bytes(budget)
        except (TypeError, ValueError):
            raise ValueError(
                f"sharedmem: budget must be bytes ({SIZE_SPELLING}) or 'free', got {budget!r}"
            ) from None
    if chunks is not None:
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"sharedmem: chunks must be an int >= 1, got {chunks!r}")
        if budget is not None:
            raise ValueError(
                "sharedmem: give a budget (chunks chosen to fit it) or a fixed number of "
                "chunks, not both"
            )
    return budget


def budget_bytes(budget: int | str, device: torch.device, pool: BufferPool | None) -> int:
    """``budget`` in bytes for a step on ``device`` whose buffers live in ``pool``."""
    if isinstance(budget, int):
        return budget
    held = 0 if pool is None else pool.stats()["device_reserved_bytes"]
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        try:
            cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        except RuntimeError:  # the CUDA router replaced the caching allocator: nothing cached
            cached = 0
        return int(free) + int(cached) + held
    return machine_available_bytes() + held
