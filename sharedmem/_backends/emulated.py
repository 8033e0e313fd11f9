"""The emulated device: host memory that behaves like a device, so the whole host/device
state machine runs and is tested where there is no GPU.

Its blocks are separate mappings (the host backends' classes), so it is a second memory space;
every copy to or from it is explicit and counted. Asynchronous copies (``push_async`` /
``pull_async``) really are asynchronous: they run on one copy-engine thread, in order, as
copies on a CUDA stream do, and the memory waits on their fences before touching either
buffer. That way CI exercises the fence logic for real.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ._base import Backend, Fence
from .host import PageableBackend, ReservedBackend

__all__ = ["EmulatedPageable", "EmulatedReserved"]

_engine: ThreadPoolExecutor | None = None
_engine_lock = threading.Lock()


def _copy_engine() -> ThreadPoolExecutor:
    # One worker: copies run one after another in submission order, like a CUDA stream.
    global _engine
    with _engine_lock:
        if _engine is None:
            _engine = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sharedmem-copy")
        return _engine


# Fork: the copy-engine thread does not exist in a child, so a copy still queued at the fork
# would never finish there, and a fence waiting on it would hang for ever. Before a fork the
# engine is drained (every copy submitted so far completes, so every fence a child inherits is
# already done) and its lock is held, so no copy is submitted half-way through; the child starts
# a fresh engine on its first asynchronous copy.
def _drain_before_fork() -> None:
    _engine_lock.acquire()
    if _engine is not None:
        _engine.submit(int).result()  # one worker, in order: every earlier copy is done


def _after_fork_in_parent() -> None:
    _engine_lock.release()


def _after_fork_in_child() -> None:
    global _engine, _engine_lock
    _engine = None  # its thread is the parent's; the executor object is left unused
    _engine_lock = threading.Lock()


if hasattr(os, "register_at_fork"):  # POSIX only; Windows has no fork
    os.register_at_fork(
        before=_drain_before_fork,
        after_in_parent=_after_fork_in_parent,
        after_in_child=_after_fork_in_child,
    )


class _FutureFence:
    """A copy running on the copy-engine thread."""

    __slots__ = ("_future",)

    def __init__(self, future: Future[torch.Tensor]) -> None:
        self._future = future

    def wait_host(self) -> None:
        self._future.result()

    def wait_device(self) -> None:
        # The emulated device is the CPU: ordering device work means waiting.
        self._future.result()


class _CopyEngine(Backend):
    """Copies between host and emulated device: inline, or on the copy-engine thread."""

    @property
    def memory_name(self) -> str:
        return "emulated"  # its blocks are cpu tensors, but errors name the device users chose

    def _copy(
        self,
        dst: torch.Tensor,
        src: torch.Tensor,
        *,
        to_device: bool,
        stream: object,
        asynchronous: bool,
    ) -> Fence | None:
        if not asynchronous:
            dst.copy_(src)
            return None
        return _FutureFence(_copy_engine().submit(dst.copy_, src))


class EmulatedReserved(_CopyEngine, ReservedBackend):
    """Emulated device memory in a reserved range: grows in place, like CUDA VMM."""


class EmulatedPageable(_CopyEngine, PageableBackend):
    """Emulated device memory that moves when it grows, like a plain allocator."""
