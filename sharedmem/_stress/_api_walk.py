"""A random walk over the pool's public API, checked against a reference model after every step
(``python -m sharedmem stress --api``, and the test suite).

The byte-level runner checks the invariant of each memory; this walk checks what the pool keeps
per *name*: the shape and dtype last asked for and the memory the name uses, and per memory its
bytes (those ever written below the largest size written; ``trim`` keeps the bytes below the
current size, ``release`` drops them all). Both fast paths, retyping through ``blob()``,
``share_data``, ``trim`` and ``release`` are mixed at random over few names, shapes and dtypes of
one byte count, so that a cached view that outlives what it depends on (a view of the old
typing, of a memory left behind, of freed bytes) shows as a mismatch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from .._pool import BufferPool

__all__ = ["ApiWalkResult", "PoolModel", "walk_pool_api"]

NAMES = ("a", "b")
# Few shapes and dtypes, most of one byte count: retyping a name without changing its bytes
# (no growth, so no new stamp on the memory) is what trips a stale cache.
DTYPES = (torch.int64, torch.float64, torch.int32)
SHAPES = ((4,), (2, 2), (8,), (16,))
OPS = ("tensor", "host_tensor", "blob", "share", "trim", "release")
WEIGHTS = (0.35, 0.35, 0.12, 0.06, 0.06, 0.06)


@dataclass
class MemoryModel:
    size: int = 0
    data: bytearray = field(default_factory=bytearray)  # every byte written, in order


@dataclass
class NameModel:
    shape: tuple[int, ...]
    dtype: torch.dtype
    memory: MemoryModel

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


class PoolModel:
    """What a pool should hold, name by name and memory by memory."""

    def __init__(self) -> None:
        self.names: dict[str, NameModel] = {}

    def name(self, name: str) -> NameModel:
        if name not in self.names:
            self.names[name] = NameModel((0,), torch.float32, MemoryModel())
        return self.names[name]

    def retype(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> NameModel:
        entry = self.name(name)
        entry.shape, entry.dtype = shape, dtype
        entry.memory.size = entry.nbytes
        return entry

    def write(self, name: str, content: bytes) -> None:
        self.names[name].memory.data[: len(content)] = content

    def trim(self) -> None:
        for memory in {id(e.memory): e.memory for e in self.names.values()}.values():
            del memory.data[memory.size :]

    def release(self) -> None:
        for entry in self.names.values():
            entry.memory.data.clear()


@dataclass
class ApiWalkResult:
    ops: int = 0
    mismatch: str | None = None  # where and what, for the first mismatch
    log: list[str] = field(default_factory=list)  # the operations up to it, as calls


def _write(view: torch.Tensor, rng: np.random.Generator) -> bytes:
    content = rng.integers(0, 256, view.numel() * view.element_size(), dtype=np.uint8)
    view.view(-1).view(torch.uint8).copy_(torch.from_numpy(content))
    return content.tobytes()


def _check(pool: BufferPool, model: PoolModel) -> str | None:
    if sorted(pool.names()) != sorted(model.names):
        return f"names {sorted(pool.names())}, the model has {sorted(model.names)}"
    for name, entry in model.names.items():
        blob = pool.blob(name)
        if tuple(blob.shape) != entry.shape or blob.dtype is not entry.dtype:
            return (
                f"{name!r} is {tuple(blob.shape)} {blob.dtype}, the model says {entry.shape} "
                f"{entry.dtype}"
            )
        entry.memory.size = entry.nbytes  # a read types the memory as this blob, like any view
        known = min(entry.nbytes, len(entry.memory.data))
        got = blob.host_data().reshape(-1).view(torch.uint8)[:known].numpy().tobytes()
        if got != bytes(entry.memory.data[:known]):
            return f"{name!r}: its bytes differ from the last ones written"
    return None


def walk_pool_api(
    pool: BufferPool,
    seed: int,
    ops: int | None,
    seconds: float | None = None,
    progress: Callable[[int], None] | None = None,
) -> ApiWalkResult:
    """Run random pool operations on ``pool`` and the model, checking after each one.

    Stops after ``ops`` operations or ``seconds``, whichever comes first, or at the first
    mismatch. The same seed makes the same walk.
    """
    rng = np.random.default_rng(seed)
    model = PoolModel()
    result = ApiWalkResult()
    deadline = None if seconds is None else time.monotonic() + seconds
    while (ops is None or result.ops < ops) and (deadline is None or time.monotonic() < deadline):
        op = str(rng.choice(OPS, p=WEIGHTS))
        name = str(rng.choice(NAMES))
        shape = SHAPES[int(rng.integers(len(SHAPES)))]
        dtype = DTYPES[int(rng.integers(len(DTYPES)))]
        kind = str(dtype).removeprefix("torch.")
        if op in ("tensor", "host_tensor"):
            result.log.append(f"pool.{op}({name!r}, {shape}, torch.{kind})")
            view = getattr(pool, op)(name, shape, dtype)
            model.retype(name, shape, dtype)
            if view.shape != shape or view.dtype is not dtype:
                result.mismatch = f"the view is {tuple(view.shape)} {view.dtype}"
                break
            model.write(name, _write(view, rng))
        elif op == "blob":
            result.log.append(f"pool.blob({name!r}, {shape}, torch.{kind})")
            pool.blob(name, shape, dtype)
            model.retype(name, shape, dtype)
        elif op == "share":
            other = str(rng.choice(NAMES))
            result.log.append(f"pool.blob({name!r}).share_data(pool.blob({other!r}))")
            pool.blob(name).share_data(pool.blob(other))
            model.name(name).memory = model.name(other).memory
        else:
            result.log.append(f"pool.{op}()")
            getattr(pool, op)()
            getattr(model, op)()
        mismatch = _check(pool, model)
        result.ops += 1
        if mismatch is not None:
            result.mismatch = f"after op {result.ops} ({result.log[-1]}): {mismatch}"
            break
        if progress is not None and result.ops % 1000 == 0:
            progress(result.ops)
    return result
