"""The reference model of the invariant (DESIGN §3): numpy byte arrays, independent of the
pool's code. Torch appears only as the dtype a blob is given (the model needs its itemsize).

Per memory: its logical ``size``, the last value written to each byte, and how far the writes
reach (``written``, the largest size ever written). The model keeps the size itself, from the
calls that set it (a blob's reshape sets both of its memories, an accessor the memory it
reads), and never takes it from the memory: the executor checks after every operation that
the memory's size is the model's, and a shrink drops what lies beyond the model's size, so a
memory whose size drifted is caught, not followed.

A write intent over ``size`` bytes reaches ``size`` even where the caller writes fewer: the
memory keeps every byte of a view it handed out for writing, so the model adopts the bytes it
had not seen from that view, and from then on holds the memory to them. ``shrink_to_fit``
drops what lies beyond the size; ``release`` drops everything. Blobs that share a memory share
one ``MemoryModel``.

The model knows nothing of sides, heads, blocks or capacities: it says what any read must
return, and the executor holds the pool to that.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["BlobModel", "MemoryModel", "PoolModel"]


class MemoryModel:
    """The bytes one memory must keep (``buf[:written]``) and its logical ``size``."""

    __slots__ = ("buf", "max_bytes", "size", "written")

    def __init__(self, max_bytes: int) -> None:
        # The buffer grows with what the memory holds (see ``_room``): a run over thousands of
        # buffers that stay small costs what they hold, in memory and in address space.
        self.buf = np.empty(0, dtype=np.uint8)
        self.max_bytes = max_bytes
        self.size = 0  # a blob is created with shape (0,)
        self.written = 0

    @property
    def content(self) -> np.ndarray:
        return self.buf[: self.written]

    def _room(self, n: int) -> None:
        """Make ``buf`` at least ``n`` bytes long, keeping what was written."""
        if n > len(self.buf):
            # Doubling keeps the copies amortised O(1); the cap is only an economy.
            new = np.empty(max(n, min(2 * len(self.buf), self.max_bytes)), dtype=np.uint8)
            new[: self.written] = self.buf[: self.written]
            self.buf = new

    def adopt(self, view: np.ndarray) -> None:
        """A write intent over ``view`` (the whole logical size): keep what it holds beyond
        ``written``, which nothing wrote but which the memory must now keep."""
        n = len(view)
        if n > self.written:
            self._room(n)
            self.buf[self.written : n] = view[self.written :]
            self.written = n

    def write(self, start: int, data: np.ndarray) -> None:
        self._room(start + len(data))  # within the adopted view: never grows in practice
        self.buf[start : start + len(data)] = data

    def truncate(self) -> None:
        """``shrink_to_fit``: what lies beyond the model's size is dropped."""
        self.written = min(self.written, self.size)

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
        """``astype`` and ``reshape``: both memories take the blob's new size (shared ones too:
        a reshape sets the size of the memories the blob uses now)."""
        self.shape, self.dtype = shape, dtype
        self.nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        self.data.size = self.grad.size = self.nbytes

    def access(self, grad: bool) -> MemoryModel:
        """An accessor of the blob: it sets the memory's size to the blob's, then reads or
        writes (the size changes even when the access then fails)."""
        memory = self.grad if grad else self.data
        memory.size = self.nbytes
        return memory


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
        """``blob`` uses ``other``'s data (or gradient) memory from now on; the memory keeps
        its size until the blob next sets it."""
        mine, theirs = self.blobs[blob], self.blobs[other]
        if grad:
            mine.grad = theirs.grad
        else:
            mine.data = theirs.data
