"""Copies of the objects themselves (``copy.copy``, ``copy.deepcopy``, ``pickle``) of a
SyncedMemory: an independent memory with the same bytes, or a clear refusal.

Only the memory's public API is used, so the state machine stays in ``_synced``; this module
imports nothing of it at run time (the class to rebuild travels in the pickle).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ._backends import backend_names
from ._side import Head

if TYPE_CHECKING:
    from ._synced import SyncedMemory

__all__ = ["reduce_memory", "refuse_shallow_copy"]


def refuse_shallow_copy(memory: SyncedMemory) -> SyncedMemory:
    # A shallow copy would share both sides: release() of one would empty the other while it
    # still claims to hold the bytes.
    raise TypeError(
        "sharedmem: a SyncedMemory cannot be shallow-copied (the copy would share its memory); "
        "use copy.deepcopy(memory) for an independent memory with the same bytes"
    )


def reduce_memory(memory: SyncedMemory) -> tuple[object, tuple[object, ...]]:
    """Pickle and deepcopy: an independent memory on the same device, with the bytes below
    the current size (a pool's accounting does not travel: the copy is a plain memory)."""
    with memory.lock:
        written = memory.head is not Head.UNINITIALIZED and memory.size > 0
        content = memory.host_data().clone() if written else torch.zeros(0, dtype=torch.uint8)
    backend = memory.placement.device_backend.kind
    return (_rebuild, (type(memory), memory.size, memory.device, backend, memory.name, content))


def _rebuild(
    kind: type[SyncedMemory], size: int, device: str, backend: str, name: str, content: torch.Tensor
) -> SyncedMemory:
    # The default backend where the pickled one does not exist here (vmm on another GPU, say).
    chosen = backend if backend in backend_names(device) else None
    memory = kind(size, device=device, backend=chosen, name=name)
    if content.numel():
        memory.mutable_host_data().copy_(content)
    return memory
