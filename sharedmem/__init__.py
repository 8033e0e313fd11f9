"""sharedmem: a capacity-aware shared-buffer memory pool for PyTorch.

A buffer is a grow-only block of bytes with a host side and a device side, each tracking its
own physical capacity. Its logical size is a cheap number any view may change; a side is
allocated or grown only when an access needs more than it has, and nothing is freed unless
asked. See README.md for a tour.
"""

from __future__ import annotations

from ._backends import backend_names
from ._blob import Blob
from ._compile import compile_backend
from ._devices import available_devices
from ._errors import OutOfMemoryError, SharedMemError
from ._executor.fsdp import prepare_fsdp
from ._executor.policy import Recompute
from ._offload import save_on_pool
from ._planning import (
    Chunks,
    MemoryEstimate,
    MemoryTracker,
    PhaseMemory,
    estimate,
    fit_eager_step,
    fit_step,
    pooled_forward,
    pooled_train_step,
    track_memory,
)
from ._pool import BufferPool
from ._routing import install_cuda_router
from ._synced import Head, SyncedMemory

__version__ = "0.1.0"

__all__ = [
    "Blob",
    "BufferPool",
    "Chunks",
    "Head",
    "MemoryEstimate",
    "MemoryTracker",
    "OutOfMemoryError",
    "PhaseMemory",
    "Recompute",
    "SharedMemError",
    "SyncedMemory",
    "__version__",
    "available_devices",
    "backend_names",
    "compile_backend",
    "estimate",
    "fit_eager_step",
    "fit_step",
    "install_cuda_router",
    "pooled_forward",
    "pooled_train_step",
    "prepare_fsdp",
    "save_on_pool",
    "track_memory",
]
