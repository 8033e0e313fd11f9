"""Capture on PyTorch's frontend: a ``torch.compile`` backend whose graphs run eagerly, op by
op, with their allocations served from a pool's arena (``backend``)."""

from __future__ import annotations

from .backend import PoolBackend, compile_backend

__all__ = ["PoolBackend", "compile_backend"]
