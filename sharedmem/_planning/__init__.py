"""Planning: knowing a step's memory before running it (``estimate``), built on the
executor's trace and plan. Modules: ``live`` (counting live bytes under fake tensors),
``estimate`` (the estimate and its report)."""

from __future__ import annotations

from .estimate import CATEGORIES, MemoryEstimate, estimate

__all__ = ["CATEGORIES", "MemoryEstimate", "estimate"]
