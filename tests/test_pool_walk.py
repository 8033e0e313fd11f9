"""A random walk over the pool's public API, checked against a reference model after every step.

The model knows, per name, the shape and dtype last asked for and which memory the name uses;
per memory, its logical size and its bytes (those ever written, below the largest size written;
``trim`` keeps the bytes below the current size, ``release`` drops them all). Both fast paths,
retyping through ``blob()``, ``share_data``, ``trim`` and ``release`` are mixed at random, on
one name or several, so that a cache that outlives what it depends on (a view of the wrong
typing, of a memory left behind, of freed bytes) shows as a mismatch. The seed is printed on
failure (conftest).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

import sharedmem as sm

NAMES = ("a", "b")
# Few shapes and dtypes, most of one byte count: retyping a name without changing its bytes
# (no growth, so no new stamp on the memory) is what trips a stale cache.
DTYPES = (torch.int64, torch.float64, torch.int32)
SHAPES = ((4,), (2, 2), (8,), (16,))


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
        memory = self.names[name].memory
        memory.data[: len(content)] = content

    def trim(self) -> None:
        for memory in {id(e.memory): e.memory for e in self.names.values()}.values():
            del memory.data[memory.size :]

    def release(self) -> None:
        for entry in self.names.values():
            entry.memory.data.clear()


def _write(view: torch.Tensor, rng: np.random.Generator) -> bytes:
    content = rng.integers(0, 256, view.numel() * view.element_size(), dtype=np.uint8)
    view.view(-1).view(torch.uint8).copy_(torch.from_numpy(content))
    return content.tobytes()


def _check(pool: sm.BufferPool, model: PoolModel, step: int, op: str) -> None:
    assert sorted(pool.names()) == sorted(model.names), (step, op)
    for name, entry in model.names.items():
        blob = pool.blob(name)
        where = f"step {step} ({op}), name {name!r}"
        assert tuple(blob.shape) == entry.shape and blob.dtype is entry.dtype, where
        entry.memory.size = entry.nbytes  # a read types the memory as this blob, like any view
        known = min(entry.nbytes, len(entry.memory.data))
        got = blob.host_data().reshape(-1).view(torch.uint8)[:known].numpy().tobytes()
        assert got == bytes(entry.memory.data[:known]), where


@pytest.mark.parametrize(
    ("device", "backend"),
    [("cpu", None), ("emulated", None), ("emulated", "pageable"), ("cpu", "pageable")],
)
def test_random_pool_operations_agree_with_the_model(
    device: str, backend: str | None, rng: np.random.Generator
) -> None:
    pool = sm.BufferPool(device, backend=backend)
    model = PoolModel()
    for step in range(1500):
        op = str(
            rng.choice(
                ["tensor", "host_tensor", "blob", "share", "trim", "release"],
                p=[0.35, 0.35, 0.12, 0.06, 0.06, 0.06],
            )
        )
        name = str(rng.choice(NAMES))
        shape = SHAPES[int(rng.integers(len(SHAPES)))]
        dtype = DTYPES[int(rng.integers(len(DTYPES)))]
        if op in ("tensor", "host_tensor"):
            view = getattr(pool, op)(name, shape, dtype)
            assert view.shape == shape and view.dtype is dtype, (step, op)
            model.retype(name, shape, dtype)
            model.write(name, _write(view, rng))
        elif op == "blob":
            pool.blob(name, shape, dtype)
            model.retype(name, shape, dtype)
        elif op == "share":
            other = str(rng.choice(NAMES))
            pool.blob(name).share_data(pool.blob(other))
            model.name(name).memory = model.name(other).memory
        elif op == "trim":
            pool.trim()
            model.trim()
        else:
            pool.release()
            model.release()
        _check(pool, model, step, op)


def test_the_fast_path_retypes_after_the_other_path_changed_the_type() -> None:
    # The shortest walk the random one found: the cached host view came back float64-typed.
    pool = sm.BufferPool("cpu")
    pool.host_tensor("x", (4,), torch.int64).copy_(torch.arange(4))
    pool.tensor("x", (4,), torch.float64)
    again = pool.host_tensor("x", (4,), torch.int64)
    assert again.dtype is torch.int64 and pool.blob("x").dtype is torch.int64
    assert pool.blob("x").host_data().tolist() == [0, 1, 2, 3]
    assert "int64" in pool.report()
    pool.blob("x", dtype=torch.float64)  # retyped through blob(): same byte count
    assert pool.tensor("x", (4,), torch.int64).dtype is torch.int64
    assert pool.blob("x").dtype is torch.int64
    pool.blob("x").reshape(2, 2)  # and a reshape by hand
    assert pool.host_tensor("x", (4,), torch.int64).shape == (4,)
    assert pool.blob("x").shape == (4,)


def test_the_report_high_water_is_the_largest_size_any_view_had() -> None:
    pool = sm.BufferPool("cpu")
    pool.tensor("x", (10,))
    pool.blob("x").reshape(1000).mutable_data()  # grown outside tensor()/host_tensor()
    pool.tensor("x", (10,))
    assert pool.blob("x").data_memory.peak_size == 4000
    assert pool.stats()["high_water_bytes"] == 4000
    row = next(line for line in pool.report().splitlines() if line.startswith("x "))
    assert "4,000" in row
