"""A random walk over the pool's public API against a reference model of each name's shape,
dtype and bytes (``sharedmem._stress._api_walk``, also ``python -m sharedmem stress --api``);
the seed is printed on failure (conftest). And the shortest walks it found, as plain tests."""

from __future__ import annotations

import pytest
import torch

import sharedmem as sm
from sharedmem._stress._api_walk import walk_pool_api


@pytest.mark.parametrize(
    ("device", "backend"),
    [("cpu", None), ("emulated", None), ("emulated", "pageable"), ("cpu", "pageable")],
)
def test_random_pool_operations_agree_with_the_model(
    device: str, backend: str | None, seed: int
) -> None:
    pool = sm.BufferPool(device, backend=backend)
    result = walk_pool_api(pool, seed, ops=1500)
    assert result.mismatch is None, result.mismatch + "\n" + "\n".join(result.log[-12:])
    assert result.ops == 1500


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
