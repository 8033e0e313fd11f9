"""The pooled graph executor: models traced to ATen graphs whose activations live in a pool.

``trace`` turns a module into a graph (the joint forward+backward, or the forward), ``graph``
decides how each op runs and when each result dies, ``plan`` places results in pool buffers,
``codegen`` compiles the graph to one straight-line function, and ``step`` is the public face.
"""

from __future__ import annotations

from .step import PooledForward, PooledTrainStep

__all__ = ["PooledForward", "PooledTrainStep"]
