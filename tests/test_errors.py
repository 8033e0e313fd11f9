"""Errors: the hierarchy, OutOfMemoryError's fields and pickling, and every bad argument."""

from __future__ import annotations

import logging
import pickle

import numpy as np
import pytest
import torch

import sharedmem as sm

F = torch.nn.functional


def test_out_of_memory_error_is_a_memory_error_with_its_numbers() -> None:
    err = sm.OutOfMemoryError(3_000_000, 1_000_000, 2_000_000, "emulated", "biggest: 'x'")
    assert isinstance(err, sm.SharedMemError) and isinstance(err, MemoryError)
    assert (err.requested, err.reserved, err.limit, err.device) == (
        3_000_000,
        1_000_000,
        2_000_000,
        "emulated",
    )
    text = str(err)
    assert text.startswith("sharedmem: out of memory on emulated")
    assert "3,000,000" in text and "2,000,000" in text and "biggest: 'x'" in text
    assert "set_limit" in text and "trim" in text  # says what to do


def test_out_of_memory_error_pickles_with_every_field() -> None:
    err = sm.OutOfMemoryError(10, 20, None, "cuda:1", "detail")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is sm.OutOfMemoryError
    assert (back.requested, back.reserved, back.limit, back.device, back.detail) == (
        10,
        20,
        None,
        "cuda:1",
        "detail",
    )
    assert str(back) == str(err)


BAD_SIZES = [
    (-1, ValueError, r"^sharedmem: nbytes must be >= 0, got -1$"),
    (1.5, TypeError, r"^sharedmem: nbytes must be an integer, got float \(1\.5\)$"),
    ("10", TypeError, r"^sharedmem: nbytes must be an integer, got str"),
    (True, TypeError, r"^sharedmem: nbytes must be an integer, got a bool"),
    (None, TypeError, r"^sharedmem: nbytes must be an integer, got NoneType"),
    (torch.tensor(True), TypeError, r"^sharedmem: nbytes must be an integer, got a bool"),
    (2**70, ValueError, r"^sharedmem: nbytes must be at most 4,611,686,018,427,387,904 bytes"),
]


@pytest.mark.parametrize(("value", "error", "message"), BAD_SIZES)
def test_bad_sizes(value: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        sm.SyncedMemory(value)  # type: ignore[arg-type]
    m = sm.SyncedMemory(8)
    with pytest.raises(error, match=message):
        m.set_size(value)  # type: ignore[arg-type]
    assert m.size == 8  # the refused call changed nothing


def test_numpy_integers_are_sizes() -> None:
    assert sm.SyncedMemory(np.int64(5)).size == 5


BAD_SHAPES = [
    ((2, -1), ValueError, r"^sharedmem: shape dimension 1 must be >= 0, got \(2, -1\)$"),
    ((2.0, 3), TypeError, r"^sharedmem: shape dimension 0 of \(2\.0, 3\) must be an integer"),
    ("23", TypeError, r"^sharedmem: shape must be a sequence of integers, got '23'$"),
    (2.5, TypeError, r"^sharedmem: shape must be an integer or a sequence of integers, got float"),
    ((None,), TypeError, r"^sharedmem: shape dimension 0 of \(None,\) must be an integer"),
    # Element counts past int64 would wrap around in torch.Size.numel() (2**62 * 4 -> 0).
    ((2**62, 4), ValueError, r"^sharedmem: shape \(4611686018427387904, 4\) has 18,446,"),
    ((2**63,), ValueError, r"^sharedmem: shape \(9223372036854775808,\) has"),
]


@pytest.mark.parametrize(("shape", "error", "message"), BAD_SHAPES)
def test_bad_shapes(shape: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        sm.Blob(shape)  # type: ignore[arg-type]
    b = sm.Blob((4,))
    with pytest.raises(error, match=message):
        b.reshape(shape)
    assert b.shape == (4,)


BAD_DTYPES = [
    ("float32", TypeError, r"^sharedmem: dtype must be a torch\.dtype such as torch\.float32"),
    (np.float32, TypeError, r"^sharedmem: dtype must be a torch\.dtype"),
    (torch.qint8, ValueError, r"^sharedmem: dtype torch\.qint8 is not supported"),
    (torch.uint4, ValueError, r"^sharedmem: dtype torch\.uint4 is not supported"),
]


@pytest.mark.parametrize(("dtype", "error", "message"), BAD_DTYPES)
def test_bad_dtypes(dtype: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        sm.Blob((2,), dtype)  # type: ignore[arg-type]
    b = sm.Blob((2,))
    with pytest.raises(error, match=message):
        b.astype(dtype)  # type: ignore[arg-type]
    assert b.dtype == torch.float32


BAD_DEVICES = [
    ("mps", ValueError, r"^sharedmem: unknown device 'mps'; use 'cpu', 'emulated', 'cuda'"),
    ("cuda:x", ValueError, r"^sharedmem: unknown device 'cuda:x'"),
    ("cpu:1", ValueError, r"^sharedmem: unknown device 'cpu:1'"),
    (torch.device("meta"), ValueError, r"^sharedmem: unknown device device\(type='meta'\)"),
    (0, TypeError, r"^sharedmem: device must be a str or torch\.device, got int"),
]


@pytest.mark.parametrize(("device", "error", "message"), BAD_DEVICES)
def test_bad_devices(device: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        sm.SyncedMemory(device=device)  # type: ignore[arg-type]
    with pytest.raises(error, match=message):
        sm.Blob((1,), device=device)  # type: ignore[arg-type]


def test_bad_backends() -> None:
    with pytest.raises(ValueError, match=r"^sharedmem: unknown backend 'vmm' for device 'cpu'; "):
        sm.SyncedMemory(device="cpu", backend="vmm")
    with pytest.raises(TypeError, match=r"^sharedmem: backend must be a str or None, got int"):
        sm.SyncedMemory(device="emulated", backend=3)  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:3", torch.device("cuda", 1)])
def test_cuda_without_a_gpu_names_the_devices_that_work(device: object) -> None:
    with pytest.raises(sm.SharedMemError, match=r"^sharedmem: device 'cuda.*' is not usable") as e:
        sm.SyncedMemory(device=device)  # type: ignore[arg-type]
    assert "Devices that work here: 'cpu', 'emulated'" in str(e.value)


def test_backend_names_answers_for_known_devices_and_refuses_others() -> None:
    assert sm.backend_names("cpu")[0] == "reserved"
    assert sm.backend_names(torch.device("cpu")) == sm.backend_names("cpu")
    assert sm.backend_names("cuda:3") == sm.backend_names("cuda")  # known, usable here or not
    with pytest.raises(ValueError, match=r"^sharedmem: unknown device 'gpu'; use one of 'cpu'"):
        sm.backend_names("gpu")
    with pytest.raises(TypeError, match=r"^sharedmem: device must be a str or torch\.device"):
        sm.backend_names(0)


@pytest.mark.parametrize("device", ["cpu", "emulated"])
def test_an_allocator_refusal_names_the_device_and_advice_that_fits_no_pool(device: str) -> None:
    blob = sm.Blob((1 << 60,), torch.uint8, device=device)  # more than any machine has
    with pytest.raises(sm.OutOfMemoryError) as caught:
        blob.mutable_data()
    text = str(caught.value)
    assert text.startswith(f"sharedmem: out of memory on {device}: could not grow to")
    assert "set_limit" not in text  # no pool, no limit to raise
    assert "release()" in text and "smaller batch" in text
    assert blob.data_memory.device_capacity == 0 and blob.data_memory.host_capacity == 0


def test_cpu_and_emulated_accept_torch_devices() -> None:
    assert sm.SyncedMemory(device=torch.device("cpu")).device == "cpu"
    assert sm.SyncedMemory(device=" emulated ").device == "emulated"


def test_a_view_too_big_for_any_buffer_is_refused_before_anything_changes() -> None:
    b = sm.Blob((4,), torch.float32)
    message = r"^sharedmem: a \(288230376151711744, 4\) torch.float64 view must be at most"
    with pytest.raises(ValueError, match=message):
        b.reshape(2**58, 4).astype(torch.float64)  # 2**60 elements of 8 bytes
    with pytest.raises(ValueError, match=r"must be at most"):
        sm.Blob((2**58, 4), torch.float64)
    with pytest.raises(ValueError, match=r"must be at most"):
        b.retype((2**59,), torch.complex128)
    assert b.shape == (2**58, 4) and b.dtype == torch.float32  # the reshape alone was fine
    assert b.data_memory.size == 2**62


# ---- a step given a loss or an input it cannot take ---------------------------------------


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))


class _OneArgLoss(torch.nn.Module):
    def forward(self, output: torch.Tensor) -> torch.Tensor:
        return output.sum()


@pytest.mark.parametrize(
    ("loss_fn", "given"),
    [
        (lambda out: out.sum(), r"1 required positional argument \(out\)"),
        (lambda out, y, w: out.sum(), r"3 required positional arguments \(out, y, w\)"),
        (_OneArgLoss(), r"1 required positional argument \(output\)"),
    ],
)
def test_a_loss_fn_of_the_wrong_arity_is_refused_before_tracing(
    loss_fn: object, given: str
) -> None:
    message = (
        rf"^sharedmem: loss_fn is called with two arguments, loss_fn\(output, targets\).*{given}"
    )
    pool = sm.BufferPool()
    with pytest.raises(TypeError, match=message):
        sm.pooled_train_step(_mlp(), loss_fn, pool=pool)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=message):
        sm.fit_eager_step(_mlp(), loss_fn, chunks=2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=message):
        sm.estimate(_mlp(), torch.randn(4, 16), torch.randn(4, 4), loss_fn=loss_fn)  # type: ignore[arg-type]
    assert len(pool) == 0  # nothing was traced or planned


def test_a_loss_fn_python_cannot_read_is_checked_by_its_call() -> None:
    # A builtin has no signature to read: its call at trace time says it was loss_fn's. An
    # error raised inside a loss_fn's own code passes as the loss_fn raised it.
    x, y = torch.randn(4, 16), torch.randn(4, 4)
    step = sm.pooled_train_step(_mlp(), torch.neg, pool=sm.BufferPool())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^sharedmem: loss_fn is called .*neg\(\) takes 1 "):
        step(x, y)

    def own(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        raise TypeError("the loss's own complaint")

    with pytest.raises(TypeError, match=r"^the loss's own complaint$"):
        sm.pooled_train_step(_mlp(), own, pool=sm.BufferPool())(x, y)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_an_input_the_model_cannot_take_is_one_line_naming_the_module() -> None:
    # Linear '2' takes width 8 where its predecessor gives 4: one sharedmem error naming the
    # module and the shapes given, and none of the fake-tensor log (about 25 lines) PyTorch
    # writes on its way: the filter drops it before any handler sees it.
    model = torch.nn.Sequential(torch.nn.Linear(16, 4), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    filters, seen = list(logger.filters), _Records()
    logger.addHandler(seen)
    x, y = torch.randn(4, 16), torch.randn(4, 4)
    try:
        for run, given in [
            (
                lambda: sm.pooled_train_step(model, F.mse_loss, pool=sm.BufferPool())(x, y),
                "targets",
            ),
            (lambda: sm.pooled_forward(model, pool=sm.BufferPool())(x), "inputs"),
        ]:
            with pytest.raises(sm.SharedMemError) as caught:
                run()
            text = str(caught.value)
            assert text.startswith("sharedmem: could not trace ") and "\n" not in text
            assert "in Linear '2'" in text and "4x16 float32" in text and given in text
            assert "Eager PyTorch fails there too" in text
        with pytest.raises(RuntimeError):  # the estimate runs the model as eager would
            sm.estimate(model, x, y, loss_fn=F.mse_loss)
        # The eager step fitted to a budget estimates its chunks the same way: one line too.
        eager = sm.fit_eager_step(model, F.mse_loss, budget="1G")
        with pytest.raises(sm.SharedMemError) as caught:
            eager(x, y)
        text = str(caught.value)
        assert text.startswith("sharedmem: fit_eager_step could not estimate a chunk of 4x16 ")
        assert "\n" not in text and "targets 4x4 float32" in text and "Eager PyTorch" in text
    finally:
        logger.removeHandler(seen)
    assert [r.getMessage() for r in seen.records if r.levelno >= logging.ERROR] == []
    assert logger.filters == filters  # the quiet ends with the trace
