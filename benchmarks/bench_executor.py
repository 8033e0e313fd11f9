"""The pooled graph executor against eager PyTorch: step time, eval sharing, steady state, plan.

Two ordinary models, a small CNN (conv, relu, max-pool, linear, cross-entropy) and an MLP
(linear, relu, MSE), trained in float32 with ``sm.pooled_train_step`` and evaluated with
``sm.pooled_forward``, against the same models run eagerly (``zero_grad``, forward,
``backward``) in the same process, interleaved. Targets (issue 6):

- train step time at most 1.1x eager for the CNN at batch 64 (CPU);
- after a train step at batch B, evaluation at batch <= B adds at most 5% reserved bytes;
- zero pool growth in steady state (mixed batch sizes, train and eval);
- with ``plan="liveness"`` a steady step's peak beyond its gradients is at least 30% lower than
  with one buffer per node (``plan="per_node"``).

    python benchmarks/bench_executor.py [--quick] [--device cpu] [--json PATH]
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Progress, Row, interleaved, row, script_main, smoke_models

import sharedmem as sm
from sharedmem.testing import allocator_peak

Batch = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 8 * 8, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10)
    )


def _case(name: str, device: str) -> tuple[Callable[[], nn.Module], nn.Module, Batch]:
    where = "cpu" if device in ("cpu", "emulated") else device
    generator = torch.Generator().manual_seed(0)
    if name == "cnn":

        def images(b: int) -> tuple[torch.Tensor, torch.Tensor]:
            x = torch.randn(b, 3, 32, 32, generator=generator)
            return x.to(where), torch.randint(0, 10, (b,), generator=generator).to(where)

        return lambda: cnn().to(where), nn.CrossEntropyLoss(), images

    def vectors(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = torch.randn(b, 784, generator=generator), torch.randn(b, 10, generator=generator)
        return x.to(where), y.to(where)

    return lambda: mlp().to(where), nn.MSELoss(), vectors


def _sync(device: str) -> Callable[[], None]:
    return torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)


def step_times(name: str, device: str, batch: int, quick: bool, progress: Progress) -> list[Row]:
    """Median time of a train step and of an eval forward, eager and pooled."""
    make, loss_fn, data = _case(name, device)
    torch.manual_seed(0)
    eager_model, pooled_model = make(), make()
    pooled_model.load_state_dict(eager_model.state_dict())
    pool = sm.BufferPool(device)
    step = sm.pooled_train_step(pooled_model, loss_fn, pool=pool)
    fwd = sm.pooled_forward(pooled_model, pool=pool)
    x, y = data(batch)
    sync = _sync(device)

    def eager_train() -> None:
        eager_model.zero_grad()
        loss_fn(eager_model(x), y).backward()
        sync()

    def pooled_train() -> None:
        pooled_model.zero_grad()
        step(x, y)
        sync()

    def eager_eval() -> None:
        with torch.no_grad():
            eager_model(x)
        sync()

    def pooled_eval() -> None:
        fwd(x)
        sync()

    # --quick: the median of 6 interleaved rounds (a timing figure there has the tolerance of
    # bench --check); the full run takes 40.
    rounds, number = (6, 2) if quick else (40, 5)
    train = interleaved(
        {"eager": eager_train, "pooled": pooled_train},
        rounds=rounds,
        number=number,
        progress=progress,
        label=f"{name} train step",
    )
    evaluation = interleaved(
        {"eager": eager_eval, "pooled": pooled_eval},
        rounds=rounds,
        number=number,
        progress=progress,
        label=f"{name} eval forward",
    )
    train_ratio = train["pooled"] / train["eager"]
    label = f"{name} b{batch} ({device})"
    return [
        row(
            f"train step {label}",
            train["pooled"],
            "s",
            baseline=train["eager"],
            target="<= 1.1x eager" if name == "cnn" else "",
            ok=train_ratio <= 1.1 if name == "cnn" else None,
        ),
        row(f"eval forward {label}", evaluation["pooled"], "s", baseline=evaluation["eager"]),
    ]


def _allocator_peak(call: Callable[[], object], device: str) -> int:
    """PyTorch's allocator's peak over ``call()``, relative to its start: its events
    (DESIGN section 8) on the CPU, its caching allocator's peak on CUDA (as
    ``bench_cuda_router`` measures eager)."""
    if not device.startswith("cuda"):
        return allocator_peak(call)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    call()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def memory(name: str, device: str, batch: int, progress: Progress) -> list[Row]:
    """Eval sharing and steady state, in pool bytes; the liveness saving, as a steady step's
    peak beyond its gradients."""
    make, loss_fn, data = _case(name, device)
    rows = []
    beyond_grads: dict[str, int] = {}
    for plan in ("per_node", "liveness"):
        progress.say(f"executor: {name} memory, plan {plan} ...")
        torch.manual_seed(0)
        model = make()
        pool = sm.BufferPool(device)
        step = sm.pooled_train_step(model, loss_fn, pool=pool, plan=plan)
        fwd = sm.pooled_forward(model, pool=pool, plan=plan)
        step(*data(batch))
        # A steady call's peak (DESIGN section 8: the allocator's events plus the pool's
        # bytes), less the gradients it makes: what the plan decides. (The pool's bytes alone
        # do not compare: ``per_node``'s slot plan leaves what ``liveness``'s router serves
        # beside the arena.)
        model.zero_grad(set_to_none=True)
        peak = _allocator_peak(functools.partial(step, *data(batch)), device)
        peak += pool.stats()["reserved_bytes"]
        grads = sum(p.numel() * p.element_size() for p in model.parameters())
        beyond_grads[plan] = peak - grads
        train_bytes = pool.stats()["reserved_bytes"]
        model.eval()
        for b in (batch, batch // 2, 1):
            progress.tick(f"{name} eval sharing ({plan})")
            fwd(data(b)[0])
        eval_added = pool.stats()["reserved_bytes"] - train_bytes
        rows.append(
            row(
                f"eval adds, {name} b<={batch} ({plan})",
                eval_added,
                "bytes",
                baseline=train_bytes,
                target="<= 0.05x train",
                ok=eval_added <= 0.05 * train_bytes,
            )
        )
        sizes = [batch, batch // 2 + 1, batch]
        for b in sizes:  # every signature once
            progress.tick(f"{name} warm-up ({plan})")
            model.train()
            step(*data(b))
            model.eval()
            fwd(data(b)[0])
        before = pool.stats()
        for b in sizes * 3:
            progress.tick(f"{name} steady state ({plan})")
            model.train()
            step(*data(b))
            model.eval()
            fwd(data(b)[0])
        after = pool.stats()
        grown = after["reserved_bytes"] - before["reserved_bytes"]
        grows = after["num_grows"] - before["num_grows"]
        rows.append(
            row(
                f"steady-state growth, {name} ({plan})",
                grown,
                "bytes",
                target=f"0 bytes, 0 grows ({grows} grows)",
                ok=grown == 0 and grows == 0,
            )
        )
    rows.append(
        row(
            f"step peak beyond its gradients, {name} b{batch} (liveness vs per_node)",
            beyond_grads["liveness"],
            "bytes",
            baseline=beyond_grads["per_node"],
            target="<= 0.7x per_node",
            ok=beyond_grads["liveness"] <= 0.7 * beyond_grads["per_node"],
        )
    )
    return rows


def run(quick: bool = False, device: str = "cpu", progress: Progress | None = None) -> list[Row]:
    """Every figure of this benchmark, as rows (``--quick``: fewer repetitions)."""
    progress = progress or Progress.quiet()
    rows: list[Row] = []
    for name in smoke_models(("cnn", "mlp"), "mlp"):
        progress.say(f"executor: {name} step times ...")
        rows += step_times(name, device, 64, quick, progress)
        rows += memory(name, device, 64, progress)
    return rows


def main(argv: list[str] | None = None) -> list[Row]:
    title = f"pooled executor vs eager PyTorch on {{device}} ({torch.get_num_threads()} threads)"
    return script_main(__doc__, run, title, argv)


if __name__ == "__main__":
    main()
