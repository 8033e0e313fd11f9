"""The reference model of the invariant (DESIGN §3), in numpy and nothing else.

Per memory: the last value written to each byte and how far the writes reach (``written``, the
largest size ever written). A write intent over ``size`` bytes reaches ``size`` even where the
caller writes fewer: the memory keeps every byte of a view it handed out for writing, so the
model adopts the bytes it had not seen from that view, and from then on holds the memory to
them. ``shrink_to_fit`` drops what lies beyond the size; ``release`` drops everything. Blobs
that share a memory share one ``MemoryModel``. The logical size is only a number the caller
sets: the model takes it from the memory where a shrink needs it, and the executor checks after
every access that the memory's size is the blob's.

The model knows nothing of sides, heads, blocks or capacities: it says what any read must
return, and the executor holds the pool to that.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["BlobModel", "MemoryModel", "PoolModel"]


class MemoryModel:
    """The bytes one memory must keep: ``buf[:written]``."""

    __slots__ = ("buf", "written")

    def __init__(self, max_bytes: int) -> None:
        # np.empty does not touch its pages: a model of a small memory costs what it holds.
        self.buf = np.empty(max_bytes, dtype=np.uint8)
        self.written = 0

    @property
    def content(self) -> np.ndarray:
        return self.buf[: self.written]

    def adopt(self, view: np.ndarray) -> None:
        """A write intent over ``view`` (the whole logical size): keep what it holds beyond
        ``written``, which nothing wrote but which the memory must now keep."""
        n = len(view)
        if n > self.written:
            self.buf[self.written : n] = view[self.written :]
            self.written = n

    def write(self, start: int, data: np.ndarray) -> None:
        self.buf[start : start + len(data)] = data

    def truncate(self, size: int) -> None:
        """``shrink_to_fit`` at ``size``: what lies beyond it is dropped."""
        self.written = min(self.written, size)

    def release(self) -> None:
        self.written = 0


class BlobModel:
    """A blob's shape and dtype, and the models of its data and gradient memories."""

    __slots__ = ("data", "dtype", "grad", "nbytes", "shape")

    def __init__(self, max_bytes: int) -> None:
        self.shape: tuple[int, ...] = (0,)
        self.dtype = torch.uint8
        self.nbytes = 0
        self.data = MemoryModel(max_bytes)
        self.grad = MemoryModel(max_bytes)

    def memory(self, grad: bool) -> MemoryModel:
        return self.grad if grad else self.data

    def reshape(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.shape, self.dtype = shape, dtype
        self.nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize


class PoolModel:
    """Every blob of a pool, by index into the round's table of names."""

    def __init__(self, count: int, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.blobs = [BlobModel(max_bytes) for _ in range(count)]

    def memories(self) -> list[MemoryModel]:
        """Each memory model once (shared ones appear under several blobs)."""
        seen: dict[int, MemoryModel] = {}
        for blob in self.blobs:
            seen.setdefault(id(blob.data), blob.data)
            seen.setdefault(id(blob.grad), blob.grad)
        return list(seen.values())

    def users(self, memory: MemoryModel) -> int:
        """How many blob slots (data or grad) use ``memory``."""
        return sum((b.data is memory) + (b.grad is memory) for b in self.blobs)

    def share(self, blob: int, other: int, grad: bool) -> None:
        """``blob`` uses ``other``'s data (or gradient) memory from now on."""
        mine, theirs = self.blobs[blob], self.blobs[other]
        if grad:
            mine.grad = theirs.grad
        else:
            mine.data = theirs.data
