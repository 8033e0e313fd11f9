"""White-box checks: a memory's raw blocks against the model, and the pool's ledger.

These look behind the accessors without syncing, growing or copying anything, so they can run
right after a failure: whatever a failed operation left behind is what they see. They read
private state of ``SyncedMemory`` on purpose; that state is what the invariant is made of.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .._backends import round_up
from .._pool import BufferPool
from .._synced import Head, SyncedMemory
from ._model import MemoryModel

__all__ = [
    "StressFailure",
    "check_memory",
    "check_pool",
    "check_size",
    "compare",
    "read_back",
    "round_up",
    "to_numpy",
]


class StressFailure(Exception):
    """The pool broke a promise the model holds it to.

    Attributes:
        category: what kind of promise (``"mismatch"`` for bytes, ``"capacity"``, ``"fault"``
            ...); a shrunk sequence must fail in the same category.
    """

    def __init__(self, category: str, message: str) -> None:
        super().__init__(message)
        self.category = category


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """The bytes of a 1-D uint8 tensor as numpy: a view on the host, a copy from a GPU."""
    return tensor.numpy() if tensor.device.type == "cpu" else tensor.cpu().numpy()


def compare(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Raise a mismatch naming the first differing byte unless ``got`` equals ``want``."""
    if got.tobytes() != want.tobytes():  # the fastest exact comparison numpy offers
        bad = np.flatnonzero(got != want)
        raise StressFailure(
            "mismatch",
            f"{what}: {len(bad):,} of {len(want):,} bytes differ from the model, first at byte "
            f"{bad[0]:,} (read {got[bad[0]]}, expected {want[bad[0]]})",
        )


def check_size(memory: SyncedMemory, model: MemoryModel) -> None:
    """The memory's logical size is the one the calls so far set (the model's)."""
    with memory._lock:
        if memory.size != model.size:
            raise StressFailure(
                "size",
                f"{memory.name!r} has size {memory.size:,}, but the calls so far set it to "
                f"{model.size:,}",
            )


def check_memory(memory: SyncedMemory, model: MemoryModel) -> None:
    """What holds between any two operations, checked on the raw blocks.

    The size is the model's, every side holds the newest value of every byte below its
    ``valid`` mark, the head side(s) hold all of them, and the memory has not forgotten a byte
    the model still knows.
    """
    with memory._lock:
        check_size(memory, model)
        written = model.written
        if memory._written < written:
            raise StressFailure(
                "state", f"{memory.name!r} keeps {memory._written:,} bytes, the model {written:,}"
            )
        sides = memory._sides()
        for side in sides:
            if side.valid > side.capacity:
                raise StressFailure(
                    "state", f"{memory.name!r}: valid mark {side.valid:,} > {side.capacity:,}"
                )
            known = min(side.valid, written)
            # A side with a copy in flight (push_async, pull_async) is left alone: waiting
            # for it here would keep the next access from ever meeting a copy in flight.
            if known and side.fence is None:
                assert side.block is not None
                where = "host" if side is memory._host else "device"
                what = f"the {where} block of {memory.name!r}, in the bytes it claims"
                compare(to_numpy(side.block.tensor[:known]), model.buf[:known], what)
        holders = {
            Head.UNINITIALIZED: (),
            Head.AT_HOST: (memory._host,),
            Head.AT_DEVICE: (memory._device,),
            Head.SYNCED: sides,
        }[memory.head]
        if memory._written and not holders:
            raise StressFailure(
                "state", f"{memory.name!r} holds bytes but its head is {memory.head}"
            )
        for side in holders:
            if side.valid < memory._written:
                raise StressFailure(
                    "state",
                    f"{memory.name!r}: head {memory.head.name} but a head side holds only "
                    f"{side.valid:,} of {memory._written:,} bytes",
                )


def check_pool(pool: BufferPool, memories: Sequence[SyncedMemory], limit: int | None) -> None:
    """The pool's figures are the sums of its memories' capacities, within the limit."""
    stats = pool.stats()
    host = sum(m.host_capacity for m in memories)
    device = sum(m.device_capacity for m in memories)
    single = pool.device == "cpu"
    want = (host, host if single else device)
    got = (stats["host_reserved_bytes"], stats["device_reserved_bytes"])
    if got != want:
        raise StressFailure(
            "ledger", f"the pool counts (host, device) = {got} reserved, its memories hold {want}"
        )
    if limit is not None and got[1] > limit:
        raise StressFailure("limit", f"{got[1]:,} device bytes reserved, past the limit {limit:,}")


def read_back(pairs: Sequence[tuple[SyncedMemory, MemoryModel]]) -> None:
    """Read every byte each model knows from both sides of its memory, through the accessors
    (which sync and may grow a side), and put each size back as the model has it."""
    for memory, model in pairs:
        memory.set_size(max(model.size, model.written))
        for side, read in (("host", memory.host_data), ("device", memory.device_data)):
            got = to_numpy(read()[: model.written])
            compare(got, model.content, f"final {side} read of {memory.name!r}")
        memory.set_size(model.size)
