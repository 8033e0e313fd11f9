"""Activation offload (``save_on_pool``): tensors saved for backward go to pooled host buffers
and come back, prefetched, before backward needs them.

Modules: ``hooks`` (the public context manager), ``step`` (one forward/backward's saved
tensors), ``copies`` (the asynchronous copies and their fences), ``names`` (pool names for
saved tensors).
"""

from __future__ import annotations

from .hooks import save_on_pool

__all__ = ["save_on_pool"]
