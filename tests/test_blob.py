"""Blob: typed views of a virtual shape, O(1) reshape, sharing memories across shapes."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICES, HAS_CUDA

import sharedmem as sm


@pytest.mark.parametrize("device", DEVICES)
def test_views_have_the_shape_dtype_and_device(device: str) -> None:
    b = sm.Blob((2, 3), torch.float64, device=device)
    assert (b.shape, b.dtype, b.numel(), b.nbytes) == (torch.Size([2, 3]), torch.float64, 6, 48)
    for view in (b.mutable_data(), b.data(), b.mutable_grad(), b.grad()):
        assert view.shape == (2, 3) and view.dtype == torch.float64
        # On the CUDA stand-in, device views are host tensors at the simulated address.
        assert view.device.type == ("cuda" if device == "cuda" and HAS_CUDA else "cpu")
    for view in (b.host_data(), b.mutable_host_data(), b.host_grad(), b.mutable_host_grad()):
        assert view.shape == (2, 3) and view.device.type == "cpu"


@pytest.mark.parametrize("device", DEVICES)
def test_data_and_grad_are_separate_and_sync_both_ways(device: str) -> None:
    b = sm.Blob((4,), torch.float32, device=device)
    b.mutable_data().copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    b.mutable_grad().fill_(-1.0)
    assert b.host_data().tolist() == [1.0, 2.0, 3.0, 4.0]
    assert b.host_grad().tolist() == [-1.0] * 4
    b.mutable_host_data()[0] = 10.0
    assert b.data().cpu().tolist() == [10.0, 2.0, 3.0, 4.0]
    assert b.data_memory is not b.grad_memory


def test_reshape_is_o1_and_grows_on_the_next_access() -> None:
    b = sm.Blob((10,), torch.float32, device="emulated")
    b.mutable_data().fill_(1.0)
    capacity = b.data_memory.device_capacity
    assert b.reshape(100_000) is b  # returns the blob
    assert b.data_memory.size == 400_000 and b.data_memory.device_capacity == capacity
    grown = b.data()
    assert b.data_memory.device_capacity >= 400_000
    assert grown[:10].tolist() == [1.0] * 10  # growth kept the old elements
    assert b.reshape((5, 2)).shape == (5, 2)
    assert b.reshape(torch.Size([2, 5])).shape == (2, 5)
    assert b.reshape([3]).shape == (3,)
    assert b.reshape().shape == () and b.numel() == 1


@pytest.mark.parametrize("device", DEVICES)
def test_share_data_with_a_smaller_blob_then_reshape_larger(device: str) -> None:
    # Caffe issue 5439: capacity was tracked per blob, so a blob that took a smaller blob's
    # memory believed it still had its own larger capacity and wrote past the end.
    big = sm.Blob((1000,), torch.float32, device=device)
    big.mutable_data().fill_(1.0)
    small = sm.Blob((10,), torch.float32, device=device)
    small.mutable_data().copy_(torch.arange(10, dtype=torch.float32))
    big.share_data(small)
    assert big.data_memory is small.data_memory
    big.reshape(5000)
    view = big.mutable_data()  # the shared memory grows; nothing is written out of bounds
    assert view.shape == (5000,)
    assert small.data_memory.device_capacity >= 5000 * 4
    assert view[:10].cpu().tolist() == list(range(10))
    view[10:].fill_(7.0)
    assert small.host_data().tolist() == list(range(10))  # its own bytes, seen through its shape


def test_sharing_blobs_may_have_different_dtypes() -> None:
    a = sm.Blob((4,), torch.int32, device="emulated")
    a.mutable_data().copy_(torch.tensor([1, 2, 3, 4], dtype=torch.int32))
    b = sm.Blob((16,), torch.uint8, device="emulated")
    b.share_data(a)
    assert b.host_data()[:4].tolist() == [1, 0, 0, 0]  # little-endian bytes of the int32 1
    b.astype(torch.int16).reshape(8)
    assert b.data().tolist() == [1, 0, 2, 0, 3, 0, 4, 0]


def test_share_grad_uses_the_other_gradient() -> None:
    a = sm.Blob((3,), device="emulated")
    b = sm.Blob((3,), device="emulated")
    b.share_grad(a)
    a.mutable_grad().fill_(2.5)
    assert b.grad().tolist() == [2.5] * 3
    assert b.data_memory is not a.data_memory


def test_share_refuses_other_devices_and_non_blobs() -> None:
    a = sm.Blob((3,), device="cpu")
    b = sm.Blob((3,), device="emulated")
    with pytest.raises(ValueError, match=r"^sharedmem: share_data needs blobs on one device"):
        a.share_data(b)
    for other in (torch.zeros(3), None, object()):
        kind = type(other).__name__
        for verb in ("share_data", "share_grad"):
            with pytest.raises(TypeError, match=rf"^sharedmem: {verb} takes a Blob, got {kind}"):
                getattr(a, verb)(other)
    assert a.data_memory.device == "cpu" and a.shape == (3,)


def test_empty_and_scalar_shapes() -> None:
    empty = sm.Blob((0, 5), device="emulated")
    assert empty.mutable_data().shape == (0, 5) and empty.data_memory.device_capacity == 0
    scalar = sm.Blob((), torch.float64, device="emulated")
    scalar.mutable_data().fill_(3.0)
    assert scalar.host_data().item() == 3.0


def test_repr_names_shape_dtype_device() -> None:
    assert repr(sm.Blob((2, 3), device="emulated")) == (
        "Blob(shape=(2, 3), dtype=torch.float32, device='emulated')"
    )
