"""Copies of the objects themselves: copy.copy, copy.deepcopy and pickle.

A copy is either independent (its own memory, the same bytes) or refused with a ``sharedmem:``
message that says what to do; never two objects that silently share one memory, and never
Python's own "cannot pickle '_thread.RLock'".
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

import sharedmem as sm


@pytest.mark.parametrize("device", ["cpu", "emulated"])
def test_a_shallow_copy_of_a_memory_is_refused_and_a_deep_one_is_independent(device: str) -> None:
    memory = sm.SyncedMemory(16, device=device)
    memory.mutable_device_data().copy_(torch.arange(16, dtype=torch.uint8))
    with pytest.raises(TypeError, match=r"^sharedmem: a SyncedMemory cannot be shallow-copied"):
        copy.copy(memory)
    for clone in (copy.deepcopy(memory), pickle.loads(pickle.dumps(memory))):
        assert clone.size == 16 and clone.device == device
        assert clone.host_data().tolist() == list(range(16))
        clone.release()  # the original keeps its bytes
        clone.mutable_host_data().fill_(0)
    assert memory.device_data().tolist() == list(range(16))


def test_a_copied_memory_keeps_bytes_past_a_smaller_size_only_below_the_size() -> None:
    memory = sm.SyncedMemory(8)
    memory.mutable_host_data().fill_(5)
    memory.set_size(4)
    clone = copy.deepcopy(memory)
    assert clone.size == 4 and clone.host_data().tolist() == [5, 5, 5, 5]


@pytest.mark.parametrize("device", ["cpu", "emulated"])
def test_blobs_deep_copy_and_pickle_with_their_content(device: str) -> None:
    a = sm.Blob((2, 3), torch.float32, device=device)
    a.mutable_data().copy_(torch.arange(6.0).reshape(2, 3))
    a.mutable_grad().fill_(0.5)
    b = sm.Blob((3,), torch.float32, device=device)
    b.share_data(a)
    pair = pickle.loads(pickle.dumps((a, b)))
    for clone in (copy.deepcopy(a), pair[0]):
        assert clone.shape == (2, 3) and clone.dtype is torch.float32 and clone.device == device
        assert torch.equal(clone.data(), torch.arange(6.0).reshape(2, 3))
        assert bool((clone.grad() == 0.5).all())
        assert clone.data_memory is not a.data_memory
    assert pair[1].data_memory is pair[0].data_memory  # shared memory stays shared
    pair[0].mutable_data().fill_(9)
    assert a.data()[0, 0].item() == 0.0  # the original is untouched


def test_deepcopy_of_a_model_with_a_blob_attribute() -> None:
    model = nn.Linear(2, 2)
    model.scratch = sm.Blob((4,), torch.float32)  # type: ignore[assignment]
    model.scratch.mutable_data().fill_(3.0)  # type: ignore[operator]
    twin = copy.deepcopy(model)
    assert torch.equal(twin.scratch.data(), torch.full((4,), 3.0))  # type: ignore[operator]
    assert twin.scratch.data_memory is not model.scratch.data_memory  # type: ignore[union-attr]


def test_a_pool_memory_copies_as_a_plain_memory() -> None:
    pool = sm.BufferPool("emulated", limit=1 << 20)
    pool.tensor("x", (4,)).fill_(1.5)
    clone = copy.deepcopy(pool.blob("x"))
    assert torch.equal(clone.data(), torch.full((4,), 1.5))
    clone.reshape(1 << 20).mutable_data()  # outside the pool: its limit does not apply
    assert pool.stats()["device_reserved_bytes"] < 1 << 20


@pytest.mark.parametrize("how", [copy.copy, copy.deepcopy, pickle.dumps])
def test_a_pool_refuses_to_be_copied_and_says_what_to_do(how: object) -> None:
    pool = sm.BufferPool("cpu")
    pool.tensor("x", (4,))
    with pytest.raises(TypeError, match=r"^sharedmem: a BufferPool cannot be pickled or copied"):
        how(pool)  # type: ignore[operator]
    assert pool.names() == ["x"]
