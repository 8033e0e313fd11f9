"""Runs operations on a real pool and on the reference model, and checks that they agree.

Every operation is checked as it runs: the bytes a read returns against the model, the size of
every view, the head after a write, the capacities after a shrink or a release, and every error
(judged in ``_judge``: an injected failure must surface as the right error, a limit refusal
must be justified by the numbers it carries, a refused growth must leave capacities as they
were). After every operation, failed or not, the logical sizes of the blob's memories are
compared with the sizes the model says the calls set, and the raw blocks of the memory it
touched with the model's bytes (see ``_checks``), so a broken state is caught by the operation
that broke it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .._backends import Backend
from .._blob import Blob
from .._pool import BufferPool
from .._synced import Head, SyncedMemory
from ._checks import (
    StressFailure,
    check_memory,
    check_pool,
    check_size,
    compare,
    read_back,
    round_up,
    to_numpy,
)
from ._faults import FaultInjector
from ._judge import Judge, caps
from ._model import MemoryModel, PoolModel
from ._ops import Op

__all__ = ["OpRunner", "RoundSpec"]

_ACCESS: dict[tuple[bool, str, bool], Callable[[Blob], torch.Tensor]] = {
    (False, "device", False): Blob.data,
    (False, "host", False): Blob.host_data,
    (True, "device", False): Blob.grad,
    (True, "host", False): Blob.host_grad,
    (False, "device", True): Blob.mutable_data,
    (False, "host", True): Blob.mutable_host_data,
    (True, "device", True): Blob.mutable_grad,
    (True, "host", True): Blob.mutable_host_grad,
}


@dataclass(frozen=True)
class RoundSpec:
    """What a fresh pool of one round is made of; a replay builds the same one."""

    device: str
    backend: str
    names: tuple[str, ...]
    max_bytes: int
    limit: int | None = None


def _as_bytes(view: torch.Tensor) -> torch.Tensor:
    return view.reshape(-1).view(torch.uint8)


class OpRunner:
    """A pool and its model, driven through the same operations.

    Args:
        spec: the pool to build and the blobs it holds.
        noise: random bytes that writes copy from (an operation names an offset into them).
        adaptors: more backend adaptors, inside the fault injector (the tests' deliberately
            broken backends).
    """

    def __init__(
        self,
        spec: RoundSpec,
        noise: np.ndarray,
        adaptors: Sequence[Callable[[Backend], Backend]] = (),
    ) -> None:
        self.spec = spec
        self.noise = noise
        self.injector = FaultInjector(device=spec.device)
        self.pool = BufferPool(
            spec.device,
            backend=spec.backend,
            limit=spec.limit,
            adaptors=[*adaptors, self.injector],
        )
        self.two_sided = self.pool.device != "cpu"
        self.blobs = [self.pool.blob(name, (0,), torch.uint8) for name in spec.names]
        self.model = PoolModel(len(spec.names), spec.max_bytes)
        self.judge = Judge(self.injector, self.pool)
        self._handlers: dict[str, Callable[[Op], None]] = {
            "reshape": self._reshape,
            "write": self._write,
            "tensor": self._tensor,
            "read": self._read,
            "share": self._share,
            "shrink": self._shrink,
            "release": self._release,
            "release_side": self._release_side,
            "push": self._push_pull,
            "pull": self._push_pull,
            "trim": self._trim,
            "pool_release": self._pool_release,
            "limit": self._limit,
        }

    @property
    def faults(self) -> int:
        """Injected failures that surfaced as they should."""
        return self.judge.faults

    @property
    def refusals(self) -> int:
        """Growths the limit refused, rightly."""
        return self.judge.refusals

    def execute(self, op: Op) -> None:
        """Run ``op`` on the pool and the model; raise ``StressFailure`` where they differ.

        Then the raw blocks and the size of the memory it touched (of every memory, for the
        whole-pool operations) are compared with the model, and the size of the blob's other
        memory too, so a broken state is caught where it starts.
        """
        self._handlers[op.kind](op)
        if op.kind in ("trim", "pool_release"):
            for memory, mm in self.pairs():
                check_memory(memory, mm)
            return
        blob, model = self.blobs[op.blob], self.model.blobs[op.blob]
        if op.grad:
            check_memory(blob.grad_memory, model.grad)
            check_size(blob.data_memory, model.data)
        else:
            check_memory(blob.data_memory, model.data)
            check_size(blob.grad_memory, model.grad)

    # ---- helpers -------------------------------------------------------------------------

    def _pair(self, op: Op) -> tuple[SyncedMemory, MemoryModel]:
        blob = self.blobs[op.blob]
        memory = blob.grad_memory if op.grad else blob.data_memory
        return memory, self.model.blobs[op.blob].memory(op.grad)

    def pairs(self) -> list[tuple[SyncedMemory, MemoryModel]]:
        """Every memory once, with its model; checks that sharing agrees on both sides."""
        seen: dict[int, tuple[SyncedMemory, MemoryModel]] = {}
        for blob, model in zip(self.blobs, self.model.blobs, strict=True):
            for memory, mm in ((blob.data_memory, model.data), (blob.grad_memory, model.grad)):
                known = seen.setdefault(id(mm), (memory, mm))
                if known[0] is not memory:
                    raise StressFailure(
                        "sharing", f"blobs the model says share a memory do not: {blob!r}"
                    )
        if len({id(memory) for memory, _ in seen.values()}) != len(seen):
            raise StressFailure("sharing", "blobs share a memory the model says they do not")
        return list(seen.values())

    def _check_view(self, view: torch.Tensor, memory: SyncedMemory, nbytes: int) -> torch.Tensor:
        raw = _as_bytes(view)
        if raw.numel() != nbytes or memory.size != nbytes:
            raise StressFailure(
                "size",
                f"a view of a {nbytes:,}-byte blob holds {raw.numel():,} bytes, "
                f"memory size {memory.size:,}",
            )
        return raw

    # ---- operations ------------------------------------------------------------------------

    def _reshape(self, op: Op) -> None:
        blob, model = self.blobs[op.blob], self.model.blobs[op.blob]
        data, grad = blob.data_memory, blob.grad_memory
        before = caps(data) + caps(grad)
        blob.astype(op.dtype).reshape(op.shape)
        model.reshape(op.shape, op.dtype)  # the sizes of both memories: checked after the op
        if blob.nbytes != model.nbytes:
            raise StressFailure("size", f"reshape to {op.shape} made {blob.nbytes:,} bytes")
        if caps(data) + caps(grad) != before:
            raise StressFailure("capacity", "reshape changed a capacity: it must be O(1)")

    def _write(self, op: Op) -> None:
        blob, model = self.blobs[op.blob], self.model.blobs[op.blob]
        memory, mm = self._pair(op)[0], model.access(op.grad)
        access = _ACCESS[op.grad, op.side, True]
        _, view = self.judge.guard(op, memory, lambda: access(blob))
        if view is None:
            return
        self._write_through(op, memory, mm, view, model.nbytes)

    def _tensor(self, op: Op) -> None:
        blob, model = self.blobs[op.blob], self.model.blobs[op.blob]
        memory = blob.data_memory
        before = model.data.size, model.grad.size
        name = self.spec.names[op.blob]
        get = self.pool.host_tensor if op.side == "host" else self.pool.tensor
        ok, view = self.judge.guard(op, memory, lambda: get(name, model.shape, model.dtype))
        # The hot path serves a cached view (sizes untouched), or applies shape and dtype to
        # the blob (both memories take its size) and accesses the data; a refused request
        # puts the sizes back. So a size is the one before or the blob's, and the data's is
        # the blob's once a view was served; the two differ only for a memory shared with a
        # blob of another size. Anything else is a drift the model does not follow.
        nbytes = model.nbytes
        self._settle_size(memory, model.data, (nbytes,) if ok else (before[0], nbytes))
        self._settle_size(blob.grad_memory, model.grad, (before[1], nbytes))
        if view is None:
            return
        self._write_through(op, memory, model.data, view, nbytes)

    @staticmethod
    def _settle_size(memory: SyncedMemory, mm: MemoryModel, legal: tuple[int, ...]) -> None:
        """The model takes the memory's size where a call may legally leave any of ``legal``."""
        got = memory.size
        if got not in legal:
            raise StressFailure(
                "size",
                f"{memory.name!r} has size {got:,} after pool.tensor; the calls so far allow "
                f"only {' or '.join(f'{n:,}' for n in sorted(set(legal)))}",
            )
        mm.size = got

    def _write_through(
        self, op: Op, memory: SyncedMemory, mm: MemoryModel, view: torch.Tensor, nbytes: int
    ) -> None:
        raw = self._check_view(view, memory, nbytes)
        head = Head.AT_HOST if op.side == "host" else Head.AT_DEVICE
        if not self.two_sided:
            head = Head.SYNCED  # one memory: both sides always hold the newest bytes
        if memory.head is not head:
            raise StressFailure("state", f"after a write intent the head is {memory.head.name}")
        mm.adopt(to_numpy(raw))  # the write intent covers the whole view
        start, stop = min(op.start, nbytes), min(op.stop, nbytes)
        if stop > start:
            data = self.noise[op.offset : op.offset + stop - start]
            if raw.device.type == "cpu":
                raw.numpy()[start:stop] = data  # numpy on the view itself: no copy, no torch
            else:
                raw[start:stop].copy_(torch.from_numpy(data))
            mm.write(start, data)

    def _read(self, op: Op) -> None:
        blob, model = self.blobs[op.blob], self.model.blobs[op.blob]
        memory, mm = self._pair(op)[0], model.access(op.grad)
        access = _ACCESS[op.grad, op.side, False]
        _, view = self.judge.guard(op, memory, lambda: access(blob))
        if view is None:
            return
        raw = self._check_view(view, memory, model.nbytes)
        known = min(model.nbytes, mm.written)
        compare(to_numpy(raw[:known]), mm.buf[:known], f"{op.side} read of {memory.name!r}")

    def _share(self, op: Op) -> None:
        mine, theirs = self.blobs[op.blob], self.blobs[op.other]
        old, old_model = self._pair(op)
        if self.model.users(old_model) == 1:
            # Its last user leaves it: give its bytes back, or the pool's ledger would keep
            # counting a memory no blob can reach (the pool does not free it by itself).
            old.release()
        if op.grad:
            mine.share_grad(theirs)
        else:
            mine.share_data(theirs)
        self.model.share(op.blob, op.other, op.grad)
        now = mine.grad_memory if op.grad else mine.data_memory
        if now is not (theirs.grad_memory if op.grad else theirs.data_memory):
            raise StressFailure("sharing", "share did not make the blobs use one memory")

    def _shrink(self, op: Op) -> None:
        memory, mm = self._pair(op)
        # At the model's size: a memory whose size drifted drops bytes the model keeps.
        size, before, reserved = mm.size, caps(memory), memory.reserved_bytes
        ok, freed = self.judge.guard(op, memory, memory.shrink_to_fit)
        mm.truncate()  # dropped as asked, even where it failed midway
        if ok:
            placement = memory.placement
            grains = (placement.host.granularity, placement.device_backend.granularity)
            want = tuple(min(c, round_up(size, g)) for c, g in zip(before, grains, strict=True))
            if caps(memory) != want or freed != reserved - memory.reserved_bytes:
                raise StressFailure(
                    "capacity",
                    f"shrink_to_fit at size {size:,} took capacities {before} to "
                    f"{caps(memory)} (want {want}), returned {freed:,}",
                )

    def _release(self, op: Op) -> None:
        memory, mm = self._pair(op)
        reserved = memory.reserved_bytes
        freed = memory.release()
        mm.release()
        if freed != reserved or caps(memory) != (0, 0) or memory.head is not Head.UNINITIALIZED:
            raise StressFailure("capacity", f"release returned {freed:,} of {reserved:,}")

    def _release_side(self, op: Op) -> None:
        memory, _ = self._pair(op)
        before = caps(memory)
        call = memory.release_host if op.side == "host" else memory.release_device
        ok, _ = self.judge.guard(op, memory, call)
        if ok and self.two_sided and caps(memory)[op.side == "device"] != 0:
            raise StressFailure("capacity", f"release_{op.side} left {caps(memory)}")
        if ok and not self.two_sided and caps(memory) != before:
            raise StressFailure("capacity", f"release_{op.side} on cpu freed memory")

    def _push_pull(self, op: Op) -> None:
        memory, _ = self._pair(op)
        call = memory.push_async if op.kind == "push" else memory.pull_async
        self.judge.guard(op, memory, call)

    def _trim(self, op: Op) -> None:
        pairs = self.pairs()
        reserved = self.pool._ledger.total
        ok, freed = self.judge.guard(op, None, self.pool.trim)
        for _, mm in pairs:
            mm.truncate()  # at the model's sizes, as in ``_shrink``
        if ok and freed != reserved - self.pool._ledger.total:
            raise StressFailure("ledger", f"trim returned {freed:,} but the ledger says otherwise")

    def _pool_release(self, op: Op) -> None:
        pairs = self.pairs()
        reserved = self.pool._ledger.total
        freed = self.pool.release()
        for _, mm in pairs:
            mm.release()
        if freed != reserved or self.pool._ledger.total != 0:
            raise StressFailure(
                "ledger",
                f"pool.release() freed {freed:,} of {reserved:,}; "
                f"{self.pool._ledger.total:,} still reserved",
            )

    def _limit(self, op: Op) -> None:
        old = self.pool.limit
        # Anything more than what is reserved now must be refused.
        self.pool.set_limit(self.pool._ledger.device_reserved)
        try:
            self._reshape(op)
            memory, _ = self._pair(op)
            before = caps(memory)
            self._write(op)
            if caps(memory)[1] > before[1]:
                raise StressFailure(
                    "limit", f"the limited side grew past the limit: {before} -> {caps(memory)}"
                )
        finally:
            self.pool.set_limit(old)

    # ---- whole-pool checks -------------------------------------------------------------------

    def check(self) -> None:
        """Compare every memory's raw blocks with the model, and the ledger with the blocks."""
        pairs = self.pairs()
        for memory, mm in pairs:
            check_memory(memory, mm)
        check_pool(self.pool, [memory for memory, _ in pairs], self.spec.limit)

    def sweep(self) -> None:
        """Check, then read every byte the model knows from both sides (nothing armed, and no
        limit: reading a side may grow it)."""
        self.check()
        limit = self.pool.limit
        self.pool.set_limit(None)
        try:
            read_back(self.pairs())
        finally:
            self.pool.set_limit(limit)
        pairs = self.pairs()
        for memory, mm in pairs:
            check_memory(memory, mm)
        check_pool(self.pool, [memory for memory, _ in pairs], None)
