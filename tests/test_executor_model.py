"""The pooled executor follows the model as eager PyTorch does: what it stores on itself, how
it is changed between calls, the modes it runs in, its inputs fed back from the pool, and
tracing that leaves no trace on it."""

from __future__ import annotations

import copy
import dataclasses
import threading
import warnings
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn

import sharedmem as sm

RTOL = 1e-10
D = torch.float64


@pytest.fixture(params=["cpu", "emulated"])
def pool(request: pytest.FixtureRequest) -> Iterator[sm.BufferPool]:
    yield sm.BufferPool(request.param)


def chain(depth: int, width: int = 8) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers).double()


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=1e-15)


def assert_same_grads(eager: nn.Module, pooled: nn.Module) -> None:
    for (name, a), b in zip(eager.named_parameters(), pooled.parameters(), strict=True):
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is not None:
            assert b.grad is not None
            torch.testing.assert_close(b.grad, a.grad, rtol=RTOL, atol=1e-15, msg=name)


# ---- inputs that are views into the pool ------------------------------------------------------


@pytest.mark.parametrize("depth", [2, 3, 4])
def test_a_pool_view_fed_back_in_is_read_before_it_is_overwritten(
    pool: sm.BufferPool, depth: int
) -> None:
    torch.manual_seed(depth)
    model = chain(depth).eval()
    fwd = sm.pooled_forward(model, pool=pool, outputs_in_pool=True)
    x = torch.randn(4, 8, dtype=D)
    with torch.no_grad():
        expected = model(model(x))
    close(fwd(fwd(x)).clone(), expected)
    close(fwd(fwd(x).detach()).clone(), expected)  # a detached view is still in the pool


def test_pool_view_features_feed_a_train_step_on_the_same_pool(pool: sm.BufferPool) -> None:
    torch.manual_seed(0)
    features = nn.Sequential(nn.Linear(8, 16), nn.ReLU()).double().eval()
    head = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)).double()
    eager_head = copy.deepcopy(head)
    extract = sm.pooled_forward(features, pool=pool, outputs_in_pool=True)
    step = sm.pooled_train_step(head, nn.MSELoss(), pool=pool)
    for b in (4, 4, 2):
        x, y = torch.randn(b, 8, dtype=D), torch.randn(b, 3, dtype=D)
        head.zero_grad()
        eager_head.zero_grad()
        f = extract(x)
        expected = nn.MSELoss()(eager_head(f.clone()), y)
        expected.backward()
        close(step(f, y), expected.detach())
        assert_same_grads(eager_head, head)


def test_a_strided_pool_view_input_keeps_its_layout() -> None:
    torch.manual_seed(1)
    pool = sm.BufferPool()
    first = sm.pooled_forward(chain(1, 6).eval(), pool=pool, outputs_in_pool=True)
    second_model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), chain(2, 6)).double().eval()
    second = sm.pooled_forward(second_model, pool=pool, outputs_in_pool=True)
    x = torch.randn(4, 6, dtype=D)
    view = first(x).t()  # (6, 4), not contiguous
    with torch.no_grad():
        expected = second_model(view.clone())
    close(second(view), expected)


# ---- what the forward stores on the module ----------------------------------------------------


class Averaging(nn.Module):
    """Rebinds a buffer and sets a new tensor attribute in its forward, as some models do."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("avg", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.training:
            self.avg = 0.9 * self.avg + 0.1 * h.detach().mean(0)
            self.last = h.detach()
        return h - self.avg


@pytest.mark.parametrize("outputs_in_pool", [False, True])
def test_tensors_the_forward_stores_are_written_back_as_in_eager(outputs_in_pool: bool) -> None:
    torch.manual_seed(2)
    pooled = Averaging().double()
    eager = copy.deepcopy(pooled)
    pool = sm.BufferPool()
    step = sm.pooled_train_step(pooled, nn.MSELoss(), pool=pool)
    fwd = sm.pooled_forward(pooled, pool=pool, outputs_in_pool=outputs_in_pool)
    for b in (5, 3, 5):
        x, y = torch.randn(b, 4, dtype=D), torch.randn(b, 4, dtype=D)
        expected = nn.MSELoss()(eager(x), y)
        close(step(x, y), expected.detach())
        close(pooled.avg, eager.avg)
        close(pooled.last, eager.last)
        with torch.no_grad():
            expected_out = eager(x)
        close(fwd(x), expected_out)
        avg = pooled.avg.clone()
        close(avg, eager.avg)
        step(x, y)  # the next call on the pool does not overwrite the stored tensors
        eager(x)
        assert not torch.equal(avg, pooled.avg)
        close(pooled.avg, eager.avg)
    assert "avg" in pooled._buffers and "last" not in pooled._buffers
    assert type(pooled.avg) is torch.Tensor and type(pooled.last) is torch.Tensor


def test_a_plain_tensor_attribute_changed_in_place_changes_once_per_call() -> None:
    class Counting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.calls = torch.zeros(())  # not a registered buffer
            self.mask = torch.ones(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls.add_(1)
            return self.fc(x) * self.mask

    model = Counting()
    fwd = sm.pooled_forward(model, pool=sm.BufferPool())
    x = torch.randn(2, 4)
    fwd(x)
    assert model.calls.item() == 1.0  # not also once more while tracing
    model.mask = torch.full((4,), 2.0)  # rebinding an attribute is seen
    with torch.no_grad():
        expected = model.fc(x) * 2
    torch.testing.assert_close(fwd(x), expected)
    assert model.calls.item() == 2.0


def test_a_forward_that_keeps_a_computed_tensor_in_a_container_is_refused_cleanly() -> None:
    class Caching(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.seen = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.seen += 1  # Python-side state: kept after a call, as in eager
            self.cache = {"h": self.fc(x)}  # a computed tensor in a container: refused
            return self.cache["h"]

    model = Caching()
    with pytest.raises(sm.SharedMemError, match="stores tensors it computed in 'cache'"):
        sm.pooled_forward(model, pool=sm.BufferPool())(torch.randn(2, 4))
    # The refused call leaves the model as it was: no fake tensor, no changed attribute.
    assert model.seen == 0 and not hasattr(model, "cache")
    assert all(type(p) is nn.Parameter for p in model.parameters())


def test_old_style_weight_norm_equals_eager_and_leaves_a_real_weight() -> None:
    def make() -> nn.Module:
        torch.manual_seed(3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.nn.utils.weight_norm is deprecated
            normed = nn.utils.weight_norm(nn.Linear(12, 12))
        return nn.Sequential(normed, nn.Tanh(), nn.Linear(12, 5)).double()

    eager, pooled = make(), make()
    step = sm.pooled_train_step(pooled, nn.MSELoss(), pool=sm.BufferPool())
    for b in (6, 3, 6):
        x, y = torch.randn(b, 12, dtype=D), torch.randn(b, 5, dtype=D)
        eager.zero_grad()
        pooled.zero_grad()
        expected = nn.MSELoss()(eager(x), y)
        expected.backward()
        close(step(x, y), expected.detach())
        assert_same_grads(eager, pooled)
        weight = pooled[0].weight
        assert type(weight) is torch.Tensor
        close(weight, eager[0].weight.detach())


# ---- a model changed between calls ------------------------------------------------------------


def test_a_replaced_added_or_removed_part_is_traced_anew(pool: sm.BufferPool) -> None:
    torch.manual_seed(4)
    pooled = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).double()
    fwd = sm.pooled_forward(pooled, pool=pool)
    step = sm.pooled_train_step(pooled, nn.MSELoss(), pool=pool)
    x, y = torch.randn(3, 4, dtype=D), torch.randn(3, 2, dtype=D)
    changes: list[Callable[[nn.Sequential], None]] = [
        lambda m: m.__setitem__(2, nn.Linear(8, 2).double()),  # same shapes, new tensors
        lambda m: m.__setitem__(1, nn.Tanh()),  # no tensors at all
        lambda m: m.append(nn.Linear(2, 2).double()),
        lambda m: setattr(m[0], "bias", None),
        lambda m: m[0].register_parameter("bias", nn.Parameter(torch.zeros(8, dtype=D))),
        lambda m: m.register_buffer("unused", torch.zeros(1)),
    ]
    for change in changes:
        fwd(x)
        step(x, y)
        change(pooled)
        with torch.no_grad():
            expected_out = pooled(x)
        close(fwd(x), expected_out)
        eager = copy.deepcopy(pooled)
        pooled.zero_grad(set_to_none=True)
        expected = nn.MSELoss()(eager(x), y)
        expected.backward()
        close(step(x, y), expected.detach())
        assert_same_grads(eager, pooled)


def test_a_cast_model_is_traced_anew_and_keeps_adding_into_its_gradients() -> None:
    # model.double() after a step: the parameters change dtype in place (and so do the
    # gradients they hold), which is a change of the model like any other.
    torch.manual_seed(5)
    pooled = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    eager = copy.deepcopy(pooled)
    pool = sm.BufferPool("cpu")
    step = sm.pooled_train_step(pooled, nn.MSELoss(), pool=pool)
    fwd = sm.pooled_forward(pooled, pool=pool)
    x, y = torch.randn(3, 4), torch.randn(3, 2)
    for cast in (lambda m: m, nn.Module.double, nn.Module.float):
        for m in (eager, pooled):
            cast(m)
        dtype = pooled[0].weight.dtype
        xs, ys = x.to(dtype), y.to(dtype)
        expected = nn.MSELoss()(eager(xs), ys)
        expected.backward()  # adds into the gradients of the steps before, as the step does
        loss = step(xs, ys)
        assert loss.dtype == dtype and torch.equal(loss, expected.detach())
        for a, b in zip(eager.parameters(), pooled.parameters(), strict=True):
            assert b.grad is not None and b.grad.dtype == dtype
            assert a.grad is not None and torch.equal(a.grad, b.grad)
        with torch.no_grad():
            assert torch.equal(fwd(xs), eager(xs))


def test_untied_weights_get_their_own_gradients() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4, bias=False)
            self.b = nn.Linear(4, 4, bias=False)
            self.b.weight = self.a.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.tanh(self.a(x)))

    torch.manual_seed(5)
    pooled = Tied().double()
    step = sm.pooled_train_step(pooled, nn.MSELoss(), pool=sm.BufferPool())
    x, y = torch.randn(3, 4, dtype=D), torch.randn(3, 4, dtype=D)
    step(x, y)
    pooled.b.weight = nn.Parameter(pooled.a.weight.detach().clone() * 2)
    eager = copy.deepcopy(pooled)
    pooled.zero_grad(set_to_none=True)
    expected = nn.MSELoss()(eager(x), y)
    expected.backward()
    close(step(x, y), expected.detach())
    assert_same_grads(eager, pooled)


def test_loading_new_values_does_not_trace_again() -> None:
    model = chain(2)
    fwd = sm.pooled_forward(model, pool=sm.BufferPool())
    x = torch.randn(3, 8, dtype=D)
    fwd(x)
    model.load_state_dict(chain(2).state_dict())
    with torch.no_grad():
        expected = model(x)
    close(fwd(x), expected)
    assert len(fwd.plan_summaries()) == 1


# ---- modes --------------------------------------------------------------------------------------


def test_autocast_is_part_of_the_signature() -> None:
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    eager = copy.deepcopy(model)
    pool = sm.BufferPool()
    fwd = sm.pooled_forward(model, pool=pool)
    step = sm.pooled_train_step(model, nn.MSELoss(), pool=pool)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    for autocast in (False, True, False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = fwd(x)
            with torch.no_grad():
                expected_out = eager(x)
            model.zero_grad()
            eager.zero_grad()
            loss = step(x, y)
            expected = nn.MSELoss()(eager(x), y)
        expected.backward()
        assert out.dtype == expected_out.dtype == (torch.bfloat16 if autocast else torch.float32)
        assert torch.equal(out, expected_out)
        assert loss.dtype == expected.dtype and torch.equal(loss, expected.detach())
        for a, b in zip(eager.parameters(), model.parameters(), strict=True):
            assert a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad)
    assert len(fwd.plan_summaries()) == 2 and len(step.plan_summaries()) == 2


def test_the_default_dtype_is_part_of_the_signature() -> None:
    class Offset(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.double() + torch.ones(x.shape[-1])  # a factory of the default dtype

    fwd = sm.pooled_forward(Offset(), pool=sm.BufferPool())
    x = torch.randn(2, 3)
    assert fwd(x).dtype == torch.float64
    default = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        expected = Offset()(x)
        torch.testing.assert_close(fwd(x), expected, rtol=0, atol=0)
    finally:
        torch.set_default_dtype(default)
    assert len(fwd.plan_summaries()) == 2


# ---- threads ------------------------------------------------------------------------------------


def test_two_threads_may_trace_at_once() -> None:
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            torch.manual_seed(seed)
            model = nn.Sequential(nn.Linear(10, 20), nn.Tanh(), nn.Linear(20, 3)).double()
            eager = copy.deepcopy(model)
            step = sm.pooled_train_step(model, nn.MSELoss(), pool=sm.BufferPool("emulated"))
            generator = torch.Generator().manual_seed(seed)
            for b in (3, 4, 5, 6):  # a trace per batch size
                x = torch.randn(b, 10, dtype=D, generator=generator)
                y = torch.randn(b, 3, dtype=D, generator=generator)
                model.zero_grad()
                eager.zero_grad()
                barrier.wait()
                loss = step(x, y)
                expected = nn.MSELoss()(eager(x), y)
                expected.backward()
                close(loss, expected.detach())
                assert_same_grads(eager, model)
        except BaseException as e:  # reported by the main thread
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=work, args=(seed,)) for seed in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


# ---- errors -------------------------------------------------------------------------------------


def test_reading_a_tensor_into_python_names_the_module_and_what_to_do() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, momentum=None))
    step = sm.pooled_train_step(model, nn.MSELoss(), pool=sm.BufferPool())
    with pytest.raises(sm.SharedMemError, match=r"BatchNorm1d '1'.*momentum=None.*momentum"):
        step(torch.randn(3, 4), torch.randn(3, 4))

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.gaussian_nll_loss(out, y, torch.ones_like(y))

    step = sm.pooled_train_step(nn.Linear(4, 4), loss_fn, pool=sm.BufferPool())
    with pytest.raises(sm.SharedMemError, match=r"_local_scalar_dense.*gaussian_nll_loss"):
        step(torch.randn(3, 4), torch.randn(3, 4))


def test_lazy_modules_must_be_initialized_first() -> None:
    model = nn.Sequential(nn.LazyLinear(4), nn.ReLU())
    fwd = sm.pooled_forward(model, pool=sm.BufferPool())
    x = torch.randn(2, 3)
    with pytest.raises(ValueError, match=r"sharedmem: .*'0\.weight'.* lazy .*eager forward"):
        fwd(x)
    with torch.no_grad():
        expected = model(x)  # initializes it
    torch.testing.assert_close(fwd(x), expected)


def test_errors_of_the_tracing_machinery_are_wrapped_and_the_models_own_are_not() -> None:
    class Internal(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return pytree.tree_unflatten([x], "not a spec")  # type: ignore[arg-type]

    fwd = sm.pooled_forward(Internal(), pool=sm.BufferPool())
    with pytest.raises(sm.SharedMemError, match=r"sharedmem: could not trace the forward of "):
        fwd(torch.randn(2))

    class Checking(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.dim() != 2:
                raise ValueError("expected a 2-d input")
            return x

    fwd = sm.pooled_forward(Checking(), pool=sm.BufferPool())
    with pytest.raises(ValueError, match=r"^expected a 2-d input$"):
        fwd(torch.randn(2))


def test_a_forward_that_creates_a_parameter_is_refused_naming_it() -> None:
    class Growing(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.scale = nn.Parameter(torch.ones(x.shape[-1]))
            return x * self.scale

    model = Growing()
    step = sm.pooled_train_step(model, nn.MSELoss(), pool=sm.BufferPool())
    with pytest.raises(sm.SharedMemError, match=r"sets parameter 'scale'.*before the first call"):
        step(torch.randn(2, 3), torch.randn(2, 3))
    assert "scale" not in model._parameters  # put back as it was


def test_a_loss_that_reads_the_parameters_gets_their_gradients() -> None:
    torch.manual_seed(7)
    pooled = chain(2, 4)
    eager = copy.deepcopy(pooled)

    def penalized(model: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            decay = sum(p.pow(2).sum() for p in model.parameters())
            return nn.functional.mse_loss(out, y) + 1e-2 * decay

        return loss_fn

    step = sm.pooled_train_step(pooled, penalized(pooled), pool=sm.BufferPool())
    x, y = torch.randn(3, 4, dtype=D), torch.randn(3, 4, dtype=D)
    expected = penalized(eager)(eager(x), y)
    expected.backward()
    close(step(x, y), expected.detach())
    assert_same_grads(eager, pooled)


def test_autocast_with_batch_norm_equals_eager() -> None:
    # The CPU kernel keeps batch-norm statistics in float32 under a bfloat16 input; the traced
    # kernel says bfloat16: those calls run as eager runs them.
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    eager = copy.deepcopy(model)
    pool = sm.BufferPool()
    step = sm.pooled_train_step(model, nn.MSELoss(), pool=pool)
    x, y = torch.randn(6, 4), torch.randn(6, 1)
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = step(x, y)
            expected = nn.MSELoss()(eager(x).float(), y)
        expected.backward()
        assert torch.equal(loss, expected.detach())
    for a, b in zip(eager.parameters(), model.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad)
    for a, b in zip(eager.buffers(), model.buffers(), strict=True):
        assert torch.equal(a, b)
    model.eval()
    eager.eval()
    fwd = sm.pooled_forward(model, pool=pool)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        assert torch.equal(fwd(x), eager(x))


def test_a_failed_call_leaves_the_model_as_eagers_failed_call_would(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Nothing is copied to be put back (those copies would sit above eager's peak for the
    # whole step): the running statistics are updated as far as the call got, as in eager,
    # the parameters are untouched, and the next call runs as eager's next step.
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    model = copy.deepcopy(eager)
    step = sm.pooled_train_step(model, nn.MSELoss(), pool=sm.BufferPool())
    x, y = torch.randn(6, 4), torch.randn(6, 1)
    step(x, y)
    nn.MSELoss()(eager(x), y).backward()
    key, compiled = next(iter(step._cache.items()))
    real = compiled.runner

    def fails_at_the_end(*args: object) -> object:
        real(*args)  # every in-place change of the graph is done by now
        raise RuntimeError("a kernel failed")

    monkeypatch.setitem(step._cache, key, dataclasses.replace(compiled, runner=fails_at_the_end))
    model.zero_grad(set_to_none=True)  # the signature of the first call
    eager.zero_grad(set_to_none=True)
    with pytest.raises(RuntimeError, match="a kernel failed"):
        step(x, y)
    eager(x)  # eager's forward ran before its failure too
    assert all(p.grad is None for p in model.parameters())
    for (name, a), b in zip(eager.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name  # num_batches_tracked included
    monkeypatch.setitem(step._cache, key, compiled)
    loss = step(x, y)
    expected = nn.MSELoss()(eager(x), y)
    expected.backward()
    assert torch.equal(loss, expected.detach())
    for a, b in zip(eager.parameters(), model.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad)


def test_none_in_inputs_and_targets_runs_as_eager() -> None:
    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
            out = self.linear(x)
            return out if mask is None else out * mask

    def loss_fn(out: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
        return out.pow(2).mean() if target is None else (out - target).pow(2).mean()

    torch.manual_seed(8)
    model = Masked()
    eager = copy.deepcopy(model)
    pool = sm.BufferPool()
    step = sm.pooled_train_step(model, loss_fn, pool=pool)
    fwd = sm.pooled_forward(model, pool=pool)
    x, mask = torch.randn(3, 4), torch.ones(4)
    # A tuple is positional arguments: model(x, None).
    assert torch.equal(step((x, None), None), loss_fn(eager(x, None), None).detach())
    with torch.no_grad():
        assert torch.equal(fwd((x, None)), eager(x, None))
        assert torch.equal(fwd((x, mask)), eager(x, mask))  # another signature
