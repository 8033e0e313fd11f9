"""BufferPool names, shapes and the fast path: one memory per name, the checks the fast path
shares with the slow path, what invalidates a cached view, and the lifetimes of views."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch
from conftest import DEVICES

import sharedmem as sm

MiB = 1 << 20


@pytest.mark.parametrize("device", DEVICES)
def test_a_name_is_one_memory_grown_to_the_larger_need(device: str) -> None:
    pool = sm.BufferPool(device)
    # Sized from the allocation granularity (2 MiB on a GPU with vmm), so that the float64
    # request needs more than the float32 one was given on every backend.
    unit = max(MiB, sm.SyncedMemory(device=device).placement.device_backend.granularity)
    rows = unit // 4096  # rows of 1024 float32: ``unit`` bytes (1 MiB on cpu and emulated)
    train = pool.tensor("fc1.out", (rows, 1024))
    evaluation = pool.tensor("fc1.out", (rows - 6, 1024), torch.float64)  # almost twice
    assert evaluation.dtype == torch.float64 and evaluation.shape == (rows - 6, 1024)
    assert len(pool) == 1 and "fc1.out" in pool and pool.names() == ["fc1.out"]
    memory = pool.blob("fc1.out").data_memory
    assert memory.device_capacity >= (rows - 6) * 1024 * 8 > unit
    assert pool.stats()["device_reserved_bytes"] == memory.device_capacity
    again = pool.tensor("fc1.out", (rows, 1024))
    assert pool.stats()["num_grows"] == 2  # first allocation, then the float64 growth
    if device != "cuda":  # stable addresses on cpu and emulated
        assert train.data_ptr() == evaluation.data_ptr() == again.data_ptr()


def test_steady_state_does_not_grow_and_hits_the_fast_path() -> None:
    pool = sm.BufferPool("emulated")
    shapes = [(64, 128), (32, 128), (64, 100), (1, 1)]
    for shape in shapes:  # warm-up: grows once to the largest
        pool.tensor("act", shape)
    grows = pool.stats()["num_grows"]
    for _ in range(50):
        for shape in shapes:
            view = pool.tensor("act", shape)
            assert view.shape == shape
    assert pool.stats()["num_grows"] == grows
    first, second = pool.tensor("act", (4, 4)), pool.tensor("act", (4, 4))
    assert first is not second and first.data_ptr() == second.data_ptr()
    first.t_()  # changing a view's metadata does not disturb the next call's view
    assert pool.tensor("act", (4, 4)).shape == (4, 4) and pool.tensor("act", (4, 8)).shape == (4, 8)


def test_anything_that_moves_storage_invalidates_the_fast_path() -> None:
    pool = sm.BufferPool("emulated", backend="pageable")  # growth moves
    small = pool.tensor("x", (10,))
    small.fill_(3.0)
    pool.tensor("x", (100_000,))  # grows: new storage
    view = pool.tensor("x", (10,))
    assert view.data_ptr() != small.data_ptr()
    assert view.tolist() == [3.0] * 10  # content moved with it
    pool.host_tensor("x", (10,)).fill_(4.0)  # the host becomes the head
    assert pool.tensor("x", (10,)).tolist() == [4.0] * 10  # the device view syncs again
    pool.trim()  # shrinks (moves again)
    assert pool.tensor("x", (10,)).tolist() == [4.0] * 10
    pool.blob("x").data_memory.release()
    after = pool.tensor("x", (10,))
    assert pool.blob("x").data_memory.device_capacity > 0 and after.shape == (10,)


def test_shapes_spelt_as_ints_lists_and_sizes_all_work() -> None:
    pool = sm.BufferPool("cpu")
    assert pool.tensor("a", 5).shape == (5,)
    assert pool.tensor("a", [2, 3]).shape == (2, 3)
    assert pool.tensor("a", torch.Size([3, 2])).shape == (3, 2)
    assert pool.tensor("a", (np.int64(6),)).shape == (6,)


@pytest.mark.parametrize(
    ("name", "error", "message"),
    [
        ("", ValueError, r"^sharedmem: buffer name must not be empty$"),
        (3, TypeError, r"^sharedmem: buffer name must be a str, got int$"),
        (None, TypeError, r"^sharedmem: buffer name must be a str, got NoneType$"),
    ],
)
def test_bad_names(name: object, error: type[Exception], message: str) -> None:
    pool = sm.BufferPool()
    with pytest.raises(error, match=message):
        pool.tensor(name, (1,))  # type: ignore[arg-type]
    with pytest.raises(error, match=message):
        pool.blob(name)  # type: ignore[arg-type]
    with pytest.raises(error, match=message.replace("buffer", "phase")), pool.phase(name):  # type: ignore[arg-type]
        pass
    with pytest.raises(error, match=message.replace("buffer", "counter")):
        pool.count(name, 1)  # type: ignore[arg-type]
    assert len(pool) == 0


def test_bad_shapes_and_dtypes_change_nothing() -> None:
    pool = sm.BufferPool()
    pool.tensor("x", (4,)).fill_(1.0)
    with pytest.raises(ValueError, match=r"^sharedmem: shape dimension 0 must be >= 0"):
        pool.tensor("x", (-4,))
    with pytest.raises(TypeError, match=r"^sharedmem: dtype must be a torch\.dtype"):
        pool.tensor("x", (4,), "float32")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^sharedmem: shape dimension 0 of \(1\.5,\)"):
        pool.host_tensor("y", (1.5,))  # type: ignore[arg-type]
    assert pool.tensor("x", (4,)).tolist() == [1.0] * 4


@pytest.mark.parametrize("device", DEVICES)
def test_the_fast_path_follows_a_name_to_the_memory_it_now_shares(device: str) -> None:
    # Regression (found by the stress runner): share_data switches a name to another memory
    # without changing either memory's stamp, and pool.tensor / host_tensor kept handing out
    # views of the memory the name had left, so writes went where no reader looked.
    pool = sm.BufferPool(device)
    pool.tensor("x", (4,), torch.uint8).fill_(1)
    pool.host_tensor("x", (4,), torch.uint8)
    y = pool.blob("y", (4,), torch.uint8)
    y.mutable_data().fill_(2)
    pool.blob("x").share_data(y)
    assert pool.tensor("x", (4,), torch.uint8).tolist() == [2, 2, 2, 2]
    pool.tensor("x", (4,), torch.uint8).fill_(3)
    assert y.data().tolist() == [3, 3, 3, 3]
    pool.host_tensor("x", (4,), torch.uint8).fill_(4)
    assert y.data().tolist() == [4, 4, 4, 4]


@pytest.mark.parametrize("device", ["cpu", "emulated"])
def test_views_outlive_the_pool_and_blobs_that_made_them(device: str) -> None:
    # Nothing is freed implicitly: a collected memory leaves the accounting, not its bytes.
    def forward(x: torch.Tensor) -> torch.Tensor:
        pool = sm.BufferPool(device)
        out = pool.tensor("out", tuple(x.shape))
        return torch.mul(x, 2, out=out)

    assert forward(torch.ones(3)).tolist() == [2.0] * 3
    a, b = sm.Blob((4,), device=device), sm.Blob((4,), device=device)
    view = b.mutable_data()
    view.fill_(5)
    b.share_data(a)  # b's old memory is nobody's now
    gc.collect()
    assert view.tolist() == [5.0] * 4


def test_release_and_trim_do_not_keep_old_blocks_alive_through_the_fast_path() -> None:
    pool = sm.BufferPool("emulated", backend="pageable")
    pool.tensor("x", (MiB,))  # a moving backend: the block goes with its last reference
    block = weakref.ref(pool.blob("x").data_memory._device.block.tensor)  # type: ignore[union-attr]
    assert pool.release() == 4 * MiB
    assert block() is None
    pool.tensor("x", (MiB,))
    pool.tensor("x", (10,))
    block = weakref.ref(pool.blob("x").data_memory._device.block.tensor)  # type: ignore[union-attr]
    assert pool.trim() > 0
    assert block() is None


def test_the_fast_path_checks_what_the_slow_path_checks() -> None:
    pool = sm.BufferPool("cpu")
    pool.tensor("a", (2, 3))
    pool.tensor("b", 1)
    with pytest.raises(TypeError, match=r"^sharedmem: shape dimension 0 of \(2\.0, 3\.0\)"):
        pool.tensor("a", (2.0, 3.0))  # equal to (2, 3), but no shape
    with pytest.raises(TypeError, match=r"^sharedmem: shape must be an integer"):
        pool.tensor("b", True)  # type: ignore[arg-type]
    for _ in range(2):  # an array is no shape, cached name or not (numpy ints in one are)
        with pytest.raises(TypeError, match=r"^sharedmem: shape must be an integer or a seq"):
            pool.tensor("a", np.array([2, 3]))  # type: ignore[arg-type]
    for bad in (["x"], {"x": 1}):
        with pytest.raises(TypeError, match=r"^sharedmem: buffer name must be a str"):
            pool.tensor(bad, (1,))  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"^sharedmem: buffer name must be a str"):
            pool.host_tensor(bad, (1,))  # type: ignore[arg-type]
        assert bad not in pool  # a name is a str: anything else is simply not in the pool


def test_a_rejected_call_creates_no_name_and_changes_no_buffer() -> None:
    pool = sm.BufferPool("cpu")
    for name, shape, dtype in (("n1", (-1,), torch.float32), ("n2", (2,), "float32")):
        with pytest.raises((TypeError, ValueError), match=r"^sharedmem: "):
            pool.tensor(name, shape, dtype)  # type: ignore[arg-type]
    assert pool.names() == [] and pool.stats()["num_buffers"] == 0
    pool.tensor("p", (4,))
    with pytest.raises(ValueError, match=r"^sharedmem: shape dimension 0 must be >= 0"):
        pool.tensor("p", (-1,), torch.float64)
    assert pool.blob("p").dtype == torch.float32 and pool.blob("p").shape == (4,)


def test_list_shapes_take_the_fast_path_too(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = sm.BufferPool("cpu")
    shape = [8, 16]
    pool.tensor("a", shape)
    slow: list[str] = []
    acquire = pool._acquire
    monkeypatch.setattr(pool, "_acquire", lambda *a: slow.append("x") or acquire(*a))
    for _ in range(5):
        assert pool.tensor("a", [8, 16]).shape == (8, 16)
    shape[0] = 4  # the caller's list changes: the pool kept its own copy
    assert pool.tensor("a", shape).shape == (4, 16)
    assert slow == ["x"]  # only the changed shape took the slow path


def test_a_moving_growth_outside_the_fast_path_drops_its_cached_views() -> None:
    # Otherwise the cache would keep the old block alive while the ledger says it is gone.
    pool = sm.BufferPool("emulated", backend="pageable")
    old = weakref.ref(pool.tensor("x", (10,)).untyped_storage())
    pool.blob("x").reshape(100_000).mutable_data()  # grows (moves) through the blob
    gc.collect()
    assert old() is None or old().data_ptr() == pool.tensor("x", (10,)).data_ptr()


def test_a_pool_buffer_shares_only_memory_of_its_own_pool() -> None:
    pool = sm.BufferPool("emulated", limit=MiB)
    outside = sm.Blob((10,), device="emulated")
    with pytest.raises(ValueError, match=r"^sharedmem: buffer 'x' of a BufferPool can only share"):
        pool.blob("x").share_data(outside)
    outside.share_data(pool.blob("x"))  # the other way round: the pool's memory, limited
    with pytest.raises(sm.OutOfMemoryError):
        outside.reshape(MiB).mutable_data()
    other = sm.BufferPool("emulated")
    with pytest.raises(ValueError, match=r"can only share memory of the same pool"):
        pool.blob("x").share_grad(other.blob("y"))


class _DeferredCopies:
    """A copy engine whose copies run only when someone waits for them: a copy in flight
    stays in flight until the memory settles it, whatever the threads' timing."""

    class Pending:
        def __init__(self, copy: object, args: tuple[object, ...]) -> None:
            self.copy, self.args, self.done = copy, args, False

        def result(self) -> None:
            if not self.done:
                self.done = True
                self.copy(*self.args)  # type: ignore[operator]

    def submit(self, copy: object, *args: object) -> _DeferredCopies.Pending:
        return self.Pending(copy, args)


@pytest.mark.parametrize("backend", ["reserved", "pageable"])
def test_the_fast_path_waits_for_copies_to_and_from_tensors_outside(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sharedmem._backends import emulated

    monkeypatch.setattr(emulated, "_copy_engine", _DeferredCopies)
    pool = sm.BufferPool("emulated", backend=backend)
    pool.host_tensor("x", (1024,), torch.uint8).fill_(1)
    memory = pool.blob("x").data_memory
    target = torch.zeros(1024, dtype=torch.uint8)
    fence = memory.upload_async(target)  # reads the host bytes
    pool.host_tensor("x", (1024,), torch.uint8).fill_(2)  # must wait for that read first
    assert fence is not None
    fence.wait_host()
    assert target.eq(1).all()
    memory.download_async(torch.full((1024,), 7, dtype=torch.uint8))  # writes the host bytes
    view = pool.host_tensor("x", (1024,), torch.uint8)
    assert view.eq(7).all()  # the copy landed before the view was handed out
    view.fill_(9)
    assert memory.host_data().eq(9).all() and memory.device_data().eq(9).all()


def test_a_shape_holding_something_mutable_is_compared_every_time() -> None:
    pool = sm.BufferPool("cpu")
    rows = torch.tensor(4)
    shape = (rows, 3)  # accepted like any index; but it can change in place
    assert pool.tensor("x", shape).shape == (4, 3)
    rows.fill_(8)
    assert pool.tensor("x", shape).shape == (8, 3)


def test_autograd_sees_a_saved_view_changed_through_a_view_taken_after_a_growth() -> None:
    pool = sm.BufferPool("cpu")
    weight = torch.ones(4, requires_grad=True)
    saved = pool.tensor("act", (4,))
    saved.fill_(2.0)
    loss = (saved * weight).sum()  # autograd saves the pool view
    pool.tensor("act", (MiB,))[:4].fill_(5.0)  # grows in place, then overwrites it
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_adaptors_wrap_both_sides_innermost_first() -> None:
    from sharedmem._backends import Backend, Block
    from sharedmem._pool.adaptors import BackendAdaptor

    calls: list[str] = []

    class Recording(BackendAdaptor):
        def __init__(self, upstream: Backend, tag: str) -> None:
            super().__init__(upstream)
            self.tag = tag

        def _allocate(self, nbytes: int) -> Block:
            calls.append(self.tag)
            return super()._allocate(nbytes)

    pool = sm.BufferPool(
        "emulated", adaptors=[lambda b: Recording(b, "inner"), lambda b: Recording(b, "outer")]
    )
    pool.host_tensor("x", (10,))
    pool.tensor("y", (10,))
    assert calls == ["outer", "inner", "outer", "inner"]
    assert pool.stats()["reserved_bytes"] == 2 * 4096  # accounted around the adaptors


def test_a_dropped_pool_frees_its_memory_without_waiting_for_the_collector() -> None:
    # Each block reserves a large address range; a pool kept alive by a reference cycle until
    # the next cyclic collection could exhaust the address space of a loop that makes pools.
    gc.disable()
    try:
        pool = sm.BufferPool("emulated", timeline=True)
        with pool.phase("train"):
            pool.tensor("x", (1000,))
        pool.set_limit(1 << 30)
        memory = weakref.ref(pool.blob("x").data_memory)
        del pool
        assert memory() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("backend", ["reserved", "pageable"])
def test_a_pool_says_its_granularity_and_whether_growth_keeps_addresses(backend: str) -> None:
    pool = sm.BufferPool("cpu", backend=backend)
    assert pool.stable_address == (backend == "reserved")
    a = pool.tensor("a", (1,), torch.uint8)
    capacity = pool.blob("a").data_memory.device_capacity
    assert capacity % pool.granularity == 0 and capacity >= 1
    address = a.data_ptr()
    pool.tensor("a", (10 * pool.granularity,), torch.uint8)
    assert (pool.tensor("a", (1,), torch.uint8).data_ptr() == address) == pool.stable_address
