"""The pooled graph executor gives eager PyTorch's results with activations in the pool."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

import sharedmem as sm

RTOL = 1e-10
Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * 4 * 4, 32),
        nn.ReLU(),
        nn.Linear(32, 10),
    )


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 3)
    )


def bn_dropout() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Dropout(0.3),
        nn.Flatten(),
        nn.Linear(8 * 8 * 8, 16),
        nn.BatchNorm1d(16),
        nn.ReLU(),
        nn.Dropout(0.5),
        nn.Linear(16, 10),
    )


class TinyLM(nn.Module):
    """Embedding, layer and group norm, GELU, softmax, chunk/cat, transposes, tied weights."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.ln = nn.LayerNorm(16)
        self.fc = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 16)
        self.gn = nn.GroupNorm(2, 16)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.ln(self.emb(idx))
        a, b = self.fc(h).chunk(2, dim=-1)
        h = h + self.drop(self.fc2(torch.cat([nn.functional.gelu(a), b.sigmoid()], dim=-1)))
        t = h.transpose(1, 2)  # not contiguous
        h = (self.gn(t.contiguous()) * 2 + t).transpose(1, 2)
        h = h.softmax(-1) * h + h.mean(dim=1, keepdim=True).expand_as(h)
        return self.head(h)


def lm_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, 50), y.reshape(-1))


def twins(make: Callable[[], nn.Module]) -> tuple[nn.Module, nn.Module]:
    """Two identical float64 models: one for eager, one for the executor."""
    torch.manual_seed(1234)
    eager = make().double()
    pooled = make().double()
    pooled.load_state_dict(eager.state_dict())
    return eager, pooled


def image_batch(b: int, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(b, 3, size, size, dtype=torch.float64), torch.randint(0, 10, (b,))


def assert_same_state(eager: nn.Module, pooled: nn.Module) -> None:
    for (name, a), b in zip(eager.named_parameters(), pooled.parameters(), strict=True):
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, rtol=RTOL, atol=0, msg=name)
    for (name, a), b in zip(eager.named_buffers(), pooled.buffers(), strict=True):
        torch.testing.assert_close(b, a, rtol=RTOL, atol=0, msg=name)


def train_both(
    eager: nn.Module,
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    loss_fn: Loss,
    x: torch.Tensor,
    y: torch.Tensor,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)  # dropout draws the same masks in both when seeded alike
    expected = loss_fn(eager(x), y)
    expected.backward()
    torch.manual_seed(seed)
    return step(x, y), expected.detach()


@pytest.fixture(params=["cpu", "emulated"])
def pool(request: pytest.FixtureRequest) -> Iterator[sm.BufferPool]:
    yield sm.BufferPool(request.param)


def test_cnn_train_step_equals_eager_across_batch_sizes(pool: sm.BufferPool) -> None:
    eager, pooled = twins(cnn)
    loss_fn = nn.CrossEntropyLoss()
    step = sm.pooled_train_step(pooled, loss_fn, pool=pool)
    for i, b in enumerate([8, 5, 8, 1, 5]):
        for m in (eager, pooled):
            m.zero_grad()
        x, y = image_batch(b)
        loss, expected = train_both(eager, step, loss_fn, x, y, seed=i)
        torch.testing.assert_close(loss, expected, rtol=RTOL, atol=0)
        assert_same_state(eager, pooled)
    assert len(step.plan_summaries()) == 3  # one graph per batch size


def test_mlp_with_mse_equals_eager_and_forward_matches(pool: sm.BufferPool) -> None:
    eager, pooled = twins(mlp)
    loss_fn = nn.MSELoss()
    step = sm.pooled_train_step(pooled, loss_fn, pool=pool)
    fwd = sm.pooled_forward(pooled, pool=pool)
    for i, b in enumerate([16, 7, 16]):
        for m in (eager, pooled):
            m.zero_grad(set_to_none=i % 2 == 0)  # both None and zeroed gradients
        x, y = torch.randn(b, 20, dtype=torch.float64), torch.randn(b, 3, dtype=torch.float64)
        loss, expected = train_both(eager, step, loss_fn, x, y, seed=i)
        torch.testing.assert_close(loss, expected, rtol=RTOL, atol=0)
        assert_same_state(eager, pooled)
        with torch.no_grad():
            torch.testing.assert_close(fwd(x), eager(x), rtol=RTOL, atol=0)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_batch_norm_and_dropout_equal_eager(pool: sm.BufferPool, training: bool) -> None:
    eager, pooled = twins(bn_dropout)
    eager.train(training)
    pooled.train(training)
    loss_fn = nn.CrossEntropyLoss()
    step = sm.pooled_train_step(pooled, loss_fn, pool=pool)
    fwd = sm.pooled_forward(pooled, pool=pool)
    for i, b in enumerate([6, 4, 6]):
        for m in (eager, pooled):
            m.zero_grad()
        x, y = image_batch(b)
        loss, expected = train_both(eager, step, loss_fn, x, y, seed=10 + i)
        torch.testing.assert_close(loss, expected, rtol=RTOL, atol=0)
        assert_same_state(eager, pooled)  # running statistics and num_batches_tracked too
        torch.manual_seed(20 + i)
        with torch.no_grad():
            expected_out = eager(x)
        torch.manual_seed(20 + i)
        torch.testing.assert_close(fwd(x), expected_out, rtol=RTOL, atol=0)
        assert_same_state(eager, pooled)
    if training:
        assert int(pooled[1].num_batches_tracked) == 6


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_a_small_language_model_equals_eager(pool: sm.BufferPool, training: bool) -> None:
    eager, pooled = twins(TinyLM)
    eager.train(training)
    pooled.train(training)
    step = sm.pooled_train_step(pooled, lm_loss, pool=pool)
    fwd = sm.pooled_forward(pooled, pool=pool)
    for i, length in enumerate([7, 5, 7]):
        for m in (eager, pooled):
            m.zero_grad()
        idx, y = torch.randint(0, 50, (3, length)), torch.randint(0, 50, (3, length))
        loss, expected = train_both(eager, step, lm_loss, idx, y, seed=i)
        torch.testing.assert_close(loss, expected, rtol=RTOL, atol=0)
        assert_same_state(eager, pooled)
        torch.manual_seed(i)
        with torch.no_grad():
            expected_out = eager(idx)
        torch.manual_seed(i)
        torch.testing.assert_close(fwd(idx), expected_out, rtol=RTOL, atol=1e-15)


class RecurrentLM(nn.Module):
    """Embedding, a recurrent layer stack, a vocabulary head (CPU float32 runs mkldnn's RNN)."""

    def __init__(self, cell: type[nn.RNNBase], layers: int, dropout: float) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.rnn = cell(8, 16, num_layers=layers, batch_first=True, dropout=dropout)
        self.head = nn.Linear(16, 50)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.emb(idx))
        logits: torch.Tensor = self.head(out)
        return logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    ("cell", "layers", "dropout"),
    [(nn.LSTM, 1, 0.0), (nn.LSTM, 2, 0.0), (nn.LSTM, 2, 0.3), (nn.GRU, 2, 0.3)],
    ids=["lstm1", "lstm2", "lstm2-dropout", "gru2-dropout"],
)
def test_recurrent_layers_equal_eager_bit_for_bit(
    cell: type[nn.RNNBase], layers: int, dropout: float, dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    eager = RecurrentLM(cell, layers, dropout).to(dtype)
    pooled = RecurrentLM(cell, layers, dropout).to(dtype)
    pooled.load_state_dict(eager.state_dict())
    pool = sm.BufferPool("cpu")
    step = sm.pooled_train_step(pooled, lm_loss, pool=pool)
    fwd = sm.pooled_forward(pooled, pool=pool)
    for i, length in enumerate([7, 5]):
        for m in (eager, pooled):
            m.zero_grad()
            m.train()
        idx, y = torch.randint(0, 50, (3, length)), torch.randint(0, 50, (3, length))
        loss, expected = train_both(eager, step, lm_loss, idx, y, seed=i)
        assert torch.equal(loss, expected)
        for a, b in zip(eager.parameters(), pooled.parameters(), strict=True):
            assert a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad)
        for m in (eager, pooled):
            m.eval()
        with torch.no_grad():
            assert torch.equal(fwd(idx), eager(idx))


def test_random_ops_consume_the_generator_as_eager_does(pool: sm.BufferPool) -> None:
    eager, pooled = twins(bn_dropout)
    step = sm.pooled_train_step(pooled, nn.CrossEntropyLoss(), pool=pool)
    x, y = image_batch(4)
    torch.manual_seed(7)
    nn.CrossEntropyLoss()(eager(x), y).backward()
    after_eager = torch.rand(5)
    torch.manual_seed(7)
    step(x, y)
    assert torch.equal(torch.rand(5), after_eager)


def test_gradients_accumulate_like_backward(pool: sm.BufferPool) -> None:
    eager, pooled = twins(mlp)
    pooled[0].bias.requires_grad_(False)  # frozen: no gradient at all
    eager[0].bias.requires_grad_(False)
    loss_fn = nn.MSELoss()
    step = sm.pooled_train_step(pooled, loss_fn, pool=pool)
    for i in range(3):  # no zero_grad in between: gradients add up
        x, y = torch.randn(4, 20, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
        train_both(eager, step, loss_fn, x, y, seed=i)
    assert pooled[0].bias.grad is None
    assert_same_state(eager, pooled)
    grad = pooled[0].weight.grad
    assert grad is not None and grad.stride() == pooled[0].weight.stride()


def test_unused_parameter_keeps_a_none_gradient() -> None:
    class Partial(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = nn.Linear(4, 2)
            self.unused = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x)

    model = Partial()
    step = sm.pooled_train_step(model, nn.MSELoss(), pool=sm.BufferPool())
    step(torch.randn(3, 4), torch.randn(3, 2))
    assert model.used.weight.grad is not None
    assert model.unused.weight.grad is None


def test_sgd_loop_of_200_steps_converges_like_eager() -> None:
    eager, pooled = twins(mlp)
    pool = sm.BufferPool("cpu")
    step = sm.pooled_train_step(pooled, nn.MSELoss(), pool=pool)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (eager, pooled)]
    generator = torch.Generator().manual_seed(0)
    teacher = torch.randn(20, 3, dtype=torch.float64, generator=generator)
    losses = []
    for _ in range(200):
        x = torch.randn(32, 20, dtype=torch.float64, generator=generator)
        y = torch.tanh(x @ teacher)
        for opt in optimizers:
            opt.zero_grad()
        expected = nn.MSELoss()(eager(x), y)
        expected.backward()
        losses.append(step(x, y).item())
        for opt in optimizers:
            opt.step()
        assert losses[-1] == pytest.approx(expected.item(), rel=1e-8)
    assert sum(losses[-10:]) < 0.1 * sum(losses[:10])
    for a, b in zip(eager.parameters(), pooled.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("make", [cnn, mlp], ids=["cnn", "mlp"])
def test_eval_after_train_adds_at_most_5_percent(make: Callable[[], nn.Module]) -> None:
    _, model = twins(make)
    pool = sm.BufferPool("cpu")
    loss_fn = nn.CrossEntropyLoss() if make is cnn else nn.MSELoss()
    step = sm.pooled_train_step(model, loss_fn, pool=pool)
    fwd = sm.pooled_forward(model, pool=pool)
    big = 16

    def batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        if make is cnn:
            return image_batch(b)
        return torch.randn(b, 20, dtype=torch.float64), torch.randn(b, 3, dtype=torch.float64)

    step(*batch(big))
    train_bytes = pool.stats()["reserved_bytes"]
    model.eval()
    for b in (big, 9, 1):
        fwd(batch(b)[0])
    assert pool.stats()["reserved_bytes"] <= 1.05 * train_bytes
    assert fwd.plan_summary().added_bytes <= 0.05 * train_bytes


def test_steady_state_allocates_nothing_in_the_pool() -> None:
    _, model = twins(cnn)
    pool = sm.BufferPool("emulated")
    step = sm.pooled_train_step(model, nn.CrossEntropyLoss(), pool=pool)
    fwd = sm.pooled_forward(model, pool=pool)
    sizes = [8, 3, 8, 5]
    # Warm-up: every signature and gradient state recorded, then replayed once (the replay
    # of an accumulation state's plan may grow the arena to it, up to eager's peak there).
    for b in sizes * 2:
        step(*image_batch(b))
        fwd(image_batch(b)[0])
    before = pool.stats()
    for b in sizes * 3:
        step(*image_batch(b))
        fwd(image_batch(b)[0])
    after = pool.stats()
    for key in ("reserved_bytes", "num_grows", "num_buffers", "host_to_device_bytes"):
        assert after[key] == before[key], key


def test_liveness_saves_at_least_30_percent_against_one_buffer_per_node() -> None:
    reserved = {}
    for plan in ("per_node", "liveness"):
        _, model = twins(cnn)
        pool = sm.BufferPool("cpu")
        step = sm.pooled_train_step(model, nn.CrossEntropyLoss(), pool=pool, plan=plan)
        step.routing = False  # the slot plan's own figures
        step(*image_batch(16))
        reserved[plan] = pool.stats()["high_water_bytes"]
        summary = step.plan_summary()
        assert summary.plan == plan
        assert summary.per_node_bytes >= summary.pooled_bytes
    assert reserved["liveness"] <= 0.7 * reserved["per_node"]
    assert summary.saving >= 0.3
    assert "liveness plan" in str(summary)


def test_ops_without_out_form_are_counted_as_unpooled() -> None:
    _, model = twins(cnn)
    pool = sm.BufferPool("cpu")
    step = sm.pooled_train_step(model, nn.CrossEntropyLoss(), pool=pool)
    step.routing = False  # the slot plan (where the router is not built): what runs beside it
    step(*image_batch(4))
    summary = step.plan_summary()
    assert "aten.convolution.default" in summary.unpooled_ops  # no native out= form
    assert pool.stats()["unpooled_bytes_total"] == summary.unpooled_bytes > 0
    model.zero_grad(set_to_none=True)  # the same signature again
    step(*image_batch(4))
    assert pool.stats()["unpooled_bytes_total"] == 2 * summary.unpooled_bytes


def test_in_place_ops_and_pytree_inputs_and_outputs() -> None:
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(6, 6)

        def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
            h = self.fc(batch["a"])
            h.mul_(2).add_(batch["b"])  # in-place on an intermediate
            h = torch.relu_(h)
            return h, h.sum(dim=1)

    def loss_fn(out: tuple[torch.Tensor, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
        return (out[0] - y).pow(2).mean() + out[1].abs().mean()

    eager, pooled = twins(Pair)
    step = sm.pooled_train_step(pooled, loss_fn, pool=sm.BufferPool())
    batch = {"a": torch.randn(5, 6, dtype=torch.float64), "b": torch.randn(5, 6).double()}
    y = torch.randn(5, 6, dtype=torch.float64)
    # A model whose one argument is a dict is given (batch,): a dict alone is keywords.
    loss = step((batch,), y)
    expected = loss_fn(eager(batch), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=RTOL, atol=0)
    assert_same_state(eager, pooled)
    fwd = sm.pooled_forward(pooled, pool=sm.BufferPool())
    out = fwd((batch,))
    assert isinstance(out, tuple) and len(out) == 2
    with torch.no_grad():
        torch.testing.assert_close(out[1], eager(batch)[1], rtol=RTOL, atol=0)


def test_returned_tensors_are_fresh_unless_asked_for_pool_views() -> None:
    _, model = twins(mlp)
    pool = sm.BufferPool("cpu")
    step = sm.pooled_train_step(model, nn.MSELoss(), pool=pool)
    x, y = torch.randn(4, 20, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    loss = step(x, y)
    kept = loss.clone()
    step(2 * x, y)
    assert torch.equal(loss, kept)  # the loss is not a view into the pool
    fresh = sm.pooled_forward(model, pool=pool)
    views = sm.pooled_forward(model, pool=pool, outputs_in_pool=True)
    a, b = fresh(x), views(x)
    a0, b0 = a.clone(), b.clone()
    torch.testing.assert_close(a0, b0)
    fresh(2 * x)
    views(2 * x)
    assert torch.equal(a, a0)  # fresh: still what it was
    assert not torch.equal(b, b0)  # a view into the pool: overwritten by the next call


def test_the_graph_is_cached_per_signature() -> None:
    _, model = twins(bn_dropout)
    step = sm.pooled_train_step(model, nn.CrossEntropyLoss(), pool=sm.BufferPool())
    x, y = image_batch(4)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        step(x, y)
    assert len(step.plan_summaries()) == 1
    # With gradients present the step adds into them in its own graph.
    step(x, y)
    step(x, y)
    assert len(step.plan_summaries()) == 2
    assert "adding into existing gradients" in str(step.plan_summary())
    model.eval()  # the training flag is part of the signature
    step(x, y)
    step(x.float().double(), y)
    assert len(step.plan_summaries()) == 3
    assert "def run(" in step.source()


def test_unsupported_ops_raise_naming_the_op() -> None:
    class DataDependent(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x[x > 0].sum() * x

    fwd = sm.pooled_forward(DataDependent(), pool=sm.BufferPool())
    with pytest.raises(sm.SharedMemError, match=r"sharedmem: aten\.\w+.* is not supported") as e:
        fwd(torch.randn(4))
    # It names the model's source line, as errors raised while tracing do.
    assert "test_executor.py:" in str(e.value) and "return x[x > 0].sum() * x" in str(e.value)

    class Item(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * float(x.max())

    fwd = sm.pooled_forward(Item(), pool=sm.BufferPool())
    with pytest.raises(sm.SharedMemError, match=r"sharedmem: aten\._local_scalar_dense"):
        fwd(torch.randn(4))


def test_bad_arguments_say_what_was_wrong() -> None:
    model, pool = mlp(), sm.BufferPool()
    with pytest.raises(TypeError, match=r"sharedmem: model must be a torch\.nn\.Module"):
        sm.pooled_forward(lambda x: x, pool=pool)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"sharedmem: pool must be a sharedmem\.BufferPool"):
        sm.pooled_forward(model, pool="cpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sharedmem: plan must be one of"):
        sm.pooled_train_step(model, nn.MSELoss(), pool=pool, plan="greedy")
    with pytest.raises(TypeError, match="sharedmem: loss_fn must be callable"):
        sm.pooled_train_step(model, "mse", pool=pool)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sharedmem: buffer name must not be empty"):
        sm.pooled_forward(model, pool=pool, prefix="")
    with pytest.raises(TypeError, match="sharedmem: outputs_in_pool must be a bool"):
        sm.pooled_forward(model, pool=pool, outputs_in_pool=1)  # type: ignore[arg-type]
    step = sm.pooled_train_step(model, nn.MSELoss(), pool=pool)
    with pytest.raises(ValueError, match="sharedmem: inputs must not require grad"):
        step(torch.randn(2, 20, requires_grad=True), torch.randn(2, 3))
    with pytest.raises(ValueError, match="sharedmem: plan_summary\\(\\) needs a first call"):
        step.plan_summary()


def test_a_model_on_another_device_than_the_pool_is_refused() -> None:
    step = sm.pooled_train_step(mlp().to("meta"), nn.MSELoss(), pool=sm.BufferPool("cpu"))
    with pytest.raises(ValueError, match="sharedmem: the pool is on 'cpu' but a tensor"):
        step(torch.randn(2, 20, device="meta"), torch.randn(2, 3, device="meta"))


LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "mse": nn.MSELoss(),
    "mse_sum": nn.MSELoss(reduction="sum"),
    "l1": nn.L1Loss(),
    "smooth_l1": nn.SmoothL1Loss(),
    "huber": nn.HuberLoss(),
    "soft_margin": lambda out, y: nn.functional.soft_margin_loss(out, y.sign()),
    "bce": lambda out, y: nn.functional.binary_cross_entropy(out.sigmoid(), y.sigmoid()),
    "bce_logits": lambda out, y: nn.functional.binary_cross_entropy_with_logits(out, y.sigmoid()),
    "kl_div": lambda out, y: nn.functional.kl_div(
        out.log_softmax(1), y.softmax(1), reduction="batchmean"
    ),
    "cross_entropy": lambda out, y: nn.functional.cross_entropy(out, y.argmax(1)),
}


def assert_out_kernels_stay_inside(
    make: Callable[[], nn.Module], loss_fn: Loss, x: torch.Tensor, y: torch.Tensor, backend: str
) -> None:
    # Some out= kernels resize ``out`` while they work (mse_loss resizes a 0-dim out to the
    # input's shape): that must neither write past a buffer into bytes no plan gave it nor
    # reallocate a pool buffer's storage. Fill every slot's unplanned tail with a canary and
    # check that a step leaves it, and every buffer's storage, as they were.
    eager, pooled = twins(make)
    pool = sm.BufferPool("cpu", backend=backend)
    # One buffer per intermediate, each exactly as big as its value: no slack to hide in.
    step = sm.pooled_train_step(pooled, loss_fn, pool=pool, plan="per_node")
    step(x, y)  # traces, plans and runs once
    planned = {n: pool.blob(n).nbytes for n in pool.names()}

    def raw(n: str) -> torch.Tensor:
        return pool.tensor(n, (pool.blob(n).data_memory.device_capacity,), torch.uint8)

    def untouched_storage(n: str) -> bool:
        fresh = sm.BufferPool("cpu", backend=backend).tensor("probe", raw(n).shape, torch.uint8)
        return raw(n).untyped_storage().nbytes() == fresh.untyped_storage().nbytes()

    tails = {}
    for n, used in planned.items():
        assert untouched_storage(n), n
        raw(n)[used:].fill_(0xAB)
        tails[n] = raw(n)[used:].clone()
    pooled.zero_grad()
    loss, expected = train_both(eager, step, loss_fn, x, y, seed=0)
    torch.testing.assert_close(loss, expected, rtol=RTOL, atol=0)
    for n, used in planned.items():
        assert untouched_storage(n), n
        assert torch.equal(raw(n)[used:], tails[n]), n


@pytest.mark.parametrize("backend", ["reserved", "pageable"])
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_out_kernels_write_only_inside_their_buffers(name: str, backend: str) -> None:
    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return LOSSES[name](out, y) * 2  # so the loss itself is an intermediate in the pool

    x, y = torch.randn(8, 20, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    assert_out_kernels_stay_inside(mlp, loss_fn, x, y, backend)


@pytest.mark.parametrize("backend", ["reserved", "pageable"])
def test_out_kernels_of_a_cnn_write_only_inside_their_buffers(backend: str) -> None:
    assert_out_kernels_stay_inside(bn_dropout, nn.CrossEntropyLoss(), *image_batch(4), backend)


@pytest.mark.parametrize("backend", ["reserved", "pageable"])
def test_out_kernels_of_a_language_model_write_only_inside_their_buffers(backend: str) -> None:
    idx, y = torch.randint(0, 50, (3, 6)), torch.randint(0, 50, (3, 6))
    assert_out_kernels_stay_inside(TinyLM, lm_loss, idx, y, backend)
