"""Fault injection: a backend adaptor that fails the k-th allocation, growth, shrink or copy.

``FaultInjector`` is a pool adaptor (``BufferPool(adaptors=[injector])``): it wraps each side's
real backend in a ``FaultyBackend`` that asks the injector before every event. The wrapper sits
inside the pool's accounting and limit, exactly where a real allocator failure would come from,
so an injected failure travels the same path as a real one.

What a failure raises:

* allocation, growth, shrink: ``OutOfMemoryError`` with ``limit=None``, as a real allocator
  that ran out does (a shrink counts because on a moving backend it allocates the smaller
  block and copies);
* copy (``upload`` / ``download``): ``SharedMemError``. A failed copy is a device fault, not a
  shortage of memory, so it must not look like one a caller could fix by freeing memory. The
  wrapper copies the first half of the bytes before it raises, as a copy that dies midway
  would: the state machine must not trust any of them.

Freeing never fails: every layer above relies on that, as allocators do.

Two ways to say which event fails: counted over the injector's life (``allocate=3`` fails the
third allocation, ``every=True`` every third), or armed per thread for a block of code
(``with injector.armed("copy", 1):``), which is what the stress runner records with each
operation so that a replay injects the same fault.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .._backends import Backend, Block, Fence
from .._errors import OutOfMemoryError, SharedMemError
from .._pool.adaptors import BackendAdaptor

__all__ = ["FAULT_KINDS", "CorruptingBackend", "Fault", "FaultInjector", "FaultyBackend"]

FAULT_KINDS = ("allocate", "grow", "shrink", "copy")


@dataclass(frozen=True)
class Fault:
    """One injected failure: its kind, its ordinal among events of that kind, and its bytes."""

    kind: str
    ordinal: int
    nbytes: int


class _Armed(threading.local):
    """Per thread: the fault armed for the current block of code, and its event count."""

    def __init__(self) -> None:
        self.kind: str | None = None
        self.target = 0
        self.seen = 0
        self.fired = 0  # faults injected in this thread, ever
        self.last = ""  # the kind of the last one


class FaultInjector:
    """Fails chosen backend events of the pools it is given to as an adaptor.

    Args:
        allocate, grow, shrink, copy: fail the k-th event of that kind (1-based, counted over
            every backend this injector wraps); ``None``: never.
        every: fail every k-th event instead of only the k-th.
        device: the device string put in the errors (default: the backend's torch device).

    Example::

        >>> import sharedmem as sm
        >>> from sharedmem.testing import FaultInjector
        >>> faults = FaultInjector(grow=1)
        >>> pool = sm.BufferPool("cpu", adaptors=[faults])
        >>> pool.host_tensor("x", (1024,)).fill_(1.0).sum().item()
        1024.0
        >>> try:
        ...     pool.host_tensor("x", (4096,))
        ... except sm.OutOfMemoryError:
        ...     print("refused; still", pool.blob("x").host_data()[:1024].sum().item())
        refused; still 1024.0
    """

    def __init__(
        self,
        *,
        allocate: int | None = None,
        grow: int | None = None,
        shrink: int | None = None,
        copy: int | None = None,
        every: bool = False,
        device: str | None = None,
    ) -> None:
        plan = {"allocate": allocate, "grow": grow, "shrink": shrink, "copy": copy}
        for kind, k in plan.items():
            if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
                raise ValueError(f"sharedmem: {kind}= must be an integer >= 1 or None, got {k!r}")
        self.plan = plan
        self.every = every
        self.device = device
        self.counts = dict.fromkeys(FAULT_KINDS, 0)  # events seen, per kind
        self.fired: list[Fault] = []  # every injected failure, in order
        self._lock = threading.Lock()
        self._armed = _Armed()

    def __call__(self, upstream: Backend) -> Backend:
        """Wrap ``upstream`` (this is what makes the injector a pool adaptor)."""
        return FaultyBackend(upstream, self)

    @contextmanager
    def armed(self, kind: str, k: int) -> Iterator[None]:
        """Inside the block, fail the ``k``-th ``kind`` event of the calling thread."""
        if kind not in FAULT_KINDS:
            raise ValueError(f"sharedmem: fault kind must be one of {FAULT_KINDS}, got {kind!r}")
        armed = self._armed
        if armed.kind is not None:
            raise RuntimeError("sharedmem: FaultInjector.armed() does not nest")
        armed.kind, armed.target, armed.seen = kind, k, 0
        try:
            yield
        finally:
            armed.kind = None

    def fired_here(self) -> int:
        """Faults injected so far in the calling thread."""
        return self._armed.fired

    def last_here(self) -> str:
        """The kind of the last fault injected in the calling thread (``""``: none yet)."""
        return self._armed.last

    def _should_fail(self, kind: str) -> int:
        """Count one ``kind`` event; its ordinal if it must fail, else 0."""
        armed = self._armed
        with self._lock:
            self.counts[kind] += 1
            count = self.counts[kind]
        if armed.kind == kind:
            armed.seen += 1
            if armed.seen == armed.target:
                return armed.seen
        k = self.plan[kind]
        if k is not None and (count % k == 0 if self.every else count == k):
            return count
        return 0

    def _fire(self, kind: str, nbytes: int) -> int:
        """Count the event; record and return its ordinal if it must fail, else 0."""
        ordinal = self._should_fail(kind)
        if ordinal:
            self.fired.append(Fault(kind, ordinal, nbytes))
            self._armed.fired += 1
            self._armed.last = kind
        return ordinal


class FaultyBackend(BackendAdaptor):
    """A real backend that asks its ``FaultInjector`` before each allocation, growth, shrink
    and copy, and fails the ones it is told to."""

    def __init__(self, upstream: Backend, injector: FaultInjector) -> None:
        super().__init__(upstream)
        self.injector = injector
        self.live = 0  # bytes this wrapper's blocks hold: the ``reserved`` of its errors

    def _refuse(self, kind: str, nbytes: int) -> None:
        ordinal = self.injector._fire(kind, nbytes)
        if ordinal:
            device = self.injector.device or self.device
            detail = ""  # empty: the pool's limit adaptor adds the buffer and biggest buffers
            raise OutOfMemoryError(nbytes, self.live, None, device, detail)

    def _allocate(self, nbytes: int) -> Block:
        self._refuse("allocate", nbytes)
        block = super()._allocate(nbytes)
        self.live += block.capacity
        return block

    def _grow(self, block: Block, nbytes: int, keep: int) -> tuple[Block, int]:
        self._refuse("grow", nbytes)
        new, copied = super()._grow(block, nbytes, keep)
        self.live += new.capacity - block.capacity
        return new, copied

    def _shrink(self, block: Block, nbytes: int, keep: int) -> tuple[Block, int]:
        self._refuse("shrink", nbytes)
        new, copied = super()._shrink(block, nbytes, keep)
        self.live += new.capacity - block.capacity
        return new, copied

    def _free(self, block: Block) -> None:
        super()._free(block)
        self.live -= block.capacity

    def _copy(
        self,
        dst: torch.Tensor,
        src: torch.Tensor,
        *,
        to_device: bool,
        stream: object,
        asynchronous: bool,
    ) -> Fence | None:
        # Both directions come through here (``Backend.upload`` and ``download`` call it).
        n = dst.numel()
        ordinal = self.injector._fire("copy", n)
        if ordinal:
            half = n // 2
            dst[:half].copy_(src[:half])  # a copy that died midway leaves a torn prefix
            direction = "host to device" if to_device else "device to host"
            raise SharedMemError(
                f"sharedmem: injected fault: copy #{ordinal} ({direction}, {n:,} bytes) failed "
                "halfway. It was injected by a FaultInjector for testing; nothing was lost, and "
                "the next access copies again. Remove the injector to stop these failures."
            )
        return super()._copy(
            dst, src, to_device=to_device, stream=stream, asynchronous=asynchronous
        )


class CorruptingBackend(BackendAdaptor):
    """A deliberately broken backend: flips one bit in every ``every``-th copy between the
    sides and every ``every``-th growth that keeps bytes.

    It exists to prove that the stress runner catches a corruption and shrinks it
    (``python -m sharedmem stress --self-check``); nothing else should use it.
    """

    def __init__(self, upstream: Backend, every: int = 3) -> None:
        super().__init__(upstream)
        self.every = every
        self.copies = 0
        self.grows = 0

    @staticmethod
    def _flip(tensor: torch.Tensor, index: int) -> None:
        tensor[index : index + 1].bitwise_xor_(1)

    def _grow(self, block: Block, nbytes: int, keep: int) -> tuple[Block, int]:
        new, copied = super()._grow(block, nbytes, keep)
        if keep:
            self.grows += 1
            if self.grows % self.every == 0:
                self._flip(new.tensor, keep // 2)
        return new, copied

    def _copy(
        self,
        dst: torch.Tensor,
        src: torch.Tensor,
        *,
        to_device: bool,
        stream: object,
        asynchronous: bool,
    ) -> Fence | None:
        fence = super()._copy(
            dst, src, to_device=to_device, stream=stream, asynchronous=asynchronous
        )
        if fence is not None:
            fence.wait_host()  # the copy must land before its bytes are spoiled
        self.copies += 1
        if dst.numel() and self.copies % self.every == 0:
            self._flip(dst, dst.numel() // 2)
        return None
