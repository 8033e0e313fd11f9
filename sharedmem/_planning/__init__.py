"""Planning: knowing a step's memory before running it (``estimate``), built on the
executor's trace and plan. Modules: ``live`` (counting live bytes under fake tensors),
``estimate`` (the estimate and its report), ``storages`` (counting a real loop's storages by
what they are), ``track`` and ``track_report`` (the per-phase tracker and its report),
``budget`` (what a budget means), ``chunking`` (the ``Chunks`` record; splitting a batch,
weighting its losses), ``fit`` (steps fitted to a budget), ``arguments`` (what a factory's
``budget=``, ``chunks=`` and ``recompute=`` mean together, and the keywords they replaced)
and ``steps`` (the public factories)."""

from __future__ import annotations

from .chunking import Chunks
from .estimate import CATEGORIES, MemoryEstimate, estimate
from .steps import fit_eager_step, fit_step, pooled_forward, pooled_train_step
from .track import MemoryTracker, PhaseMemory, track_memory

__all__ = [
    "CATEGORIES",
    "Chunks",
    "MemoryEstimate",
    "MemoryTracker",
    "PhaseMemory",
    "estimate",
    "fit_eager_step",
    "fit_step",
    "pooled_forward",
    "pooled_train_step",
    "track_memory",
]
