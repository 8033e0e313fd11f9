"""The main job: a Caffe-style training loop, first with per-net buffers, then on one pool,
then the same training under about half the memory.

A small MLP on synthetic data writes every activation and gradient into named pool buffers
with ``out=`` operations. Training runs at batch 256 and evaluation at batch 250, as in
Caffe's examples. With per-net allocation each net owns its buffers; with one shared pool the
evaluation net reuses the training net's buffers by name and adds (almost) nothing. Last, the
same MLP as an ``nn.Module`` trains through a pooled train step under a budget that makes it
split every batch into chunks (``demo_fit``), on the same loss curve.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch

from .._pool import BufferPool
from .._pool.report import human_bytes
from .demo_data import DemoConfig, SyntheticData, initial_weights

__all__ = ["DemoConfig", "demo_verdict", "run_demo"]


class Params:
    """Weights shared by the training and evaluation nets: blobs (data and grad) of a pool."""

    SHAPES = ("W1", "b1", "W2", "b2", "W3", "b3")

    def __init__(self, pool: BufferPool, config: DemoConfig) -> None:
        self.pool = pool
        for index, weight in enumerate(initial_weights(config), start=1):
            pool.blob(f"W{index}", weight.shape).mutable_host_data().copy_(weight)
            pool.blob(f"b{index}", (weight.shape[1],)).mutable_host_data().zero_()

    def data(self, name: str) -> torch.Tensor:
        return self.pool.blob(name).data()

    def sgd(self, lr: float) -> None:
        for name in self.SHAPES:
            blob = self.pool.blob(name)
            blob.mutable_data().add_(blob.grad(), alpha=-lr)


class MLPNet:
    """Forward and backward by hand; every activation and its gradient lives in ``pool``."""

    def __init__(self, pool: BufferPool, params: Params, batch: int, config: DemoConfig) -> None:
        self.pool, self.params, self.batch, self.config = pool, params, batch, config

    def load(self, inputs: torch.Tensor, labels: torch.Tensor) -> None:
        """Stage a batch on the host side; the forward reads it on the device side."""
        self.pool.host_tensor("data", inputs.shape).copy_(inputs)
        self.pool.host_tensor("label", labels.shape, torch.int64).copy_(labels)

    def _act(self, name: str, width: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.pool.tensor(name, (self.batch, width), dtype)

    def _grad(self, name: str) -> torch.Tensor:
        return self.pool.blob(name).mutable_grad()

    def forward(self) -> float:
        c, p = self.config, self.params
        x = self.pool.blob("data").data()
        h = c.hidden
        torch.addmm(p.data("b1"), x, p.data("W1"), out=self._act("fc1", h))
        torch.clamp_min(self._act("fc1", h), 0.0, out=self._act("relu1", h))
        torch.addmm(p.data("b2"), self._act("relu1", h), p.data("W2"), out=self._act("fc2", h))
        torch.clamp_min(self._act("fc2", h), 0.0, out=self._act("relu2", h))
        logits = self._act("fc3", c.classes)
        torch.addmm(p.data("b3"), self._act("relu2", h), p.data("W3"), out=logits)
        logprob = self._act("logprob", c.classes)
        torch.log_softmax(logits, 1, out=logprob)
        labels = self.pool.blob("label").data()
        picked = self._act("picked", 1)
        torch.gather(logprob, 1, labels.view(-1, 1), out=picked)
        return -float(picked.mean())

    def backward(self) -> None:
        c, p, b = self.config, self.params, self.batch
        h = c.hidden
        # d loss / d logits = (softmax - onehot) / batch
        dlogits = self._grad("fc3")
        torch.exp(self._act("logprob", c.classes), out=dlogits)
        labels = self.pool.blob("label").data().view(-1, 1)
        dlogits.scatter_add_(1, labels, self._act("picked", 1).fill_(-1.0)).div_(b)
        self._layer_backward(3, self._act("relu2", h), dlogits)
        drelu2 = self._grad("relu2")
        torch.mm(dlogits, p.data("W3").t(), out=drelu2)
        dfc2 = self._grad("fc2")
        torch.ops.aten.threshold_backward.grad_input(
            drelu2, self._act("fc2", h), 0.0, grad_input=dfc2
        )
        self._layer_backward(2, self._act("relu1", h), dfc2)
        drelu1 = self._grad("relu1")
        torch.mm(dfc2, p.data("W2").t(), out=drelu1)
        dfc1 = self._grad("fc1")
        torch.ops.aten.threshold_backward.grad_input(
            drelu1, self._act("fc1", h), 0.0, grad_input=dfc1
        )
        self._layer_backward(1, self.pool.blob("data").data(), dfc1)

    def _layer_backward(self, index: int, below: torch.Tensor, dout: torch.Tensor) -> None:
        weight, bias = self.params.pool.blob(f"W{index}"), self.params.pool.blob(f"b{index}")
        torch.mm(below.t(), dout, out=weight.mutable_grad())
        torch.sum(dout, 0, out=bias.mutable_grad())

    def accuracy(self) -> float:
        predicted = self.pool.tensor("argmax", (self.batch,), torch.int64)
        torch.argmax(self._act("fc3", self.config.classes), 1, out=predicted)
        labels = self.pool.blob("label").data()
        correct = self.pool.tensor("correct", (self.batch,), torch.bool)
        torch.eq(predicted, labels, out=correct)
        return float(correct.sum()) / self.batch


def _train(
    config: DemoConfig,
    train_pool: BufferPool,
    eval_pool: BufferPool,
    log: bool,
    progress: Callable[[int], None],
) -> dict[str, Any]:
    """Train and evaluate, in phases "train" and "eval"; returns losses and accuracies.

    ``progress`` hears the number of each step done.
    """
    data = SyntheticData(config)
    params = Params(BufferPool(config.device), config)
    train_net = MLPNet(train_pool, params, config.train_batch, config)
    eval_net = MLPNet(eval_pool, params, config.eval_batch, config)
    losses, accuracies = [], []
    for step in range(config.steps):
        with train_pool.phase("train"):
            train_net.load(*data.batch(config.train_batch))
            losses.append(train_net.forward())
            train_net.backward()
            params.sgd(config.lr)
        progress(step + 1)
        if (step + 1) % config.eval_every == 0 or step + 1 == config.steps:
            with eval_pool.phase("eval"):
                eval_net.load(*data.batch(config.eval_batch))
                eval_loss = eval_net.forward()
                accuracies.append(eval_net.accuracy())
            if log:
                print(
                    f"  step {step + 1:>4}  train loss {losses[-1]:.4f}  "
                    f"eval loss {eval_loss:.4f}  eval accuracy {accuracies[-1]:.3f}"
                )
    return {"losses": losses, "accuracies": accuracies}


def run_demo(
    config: DemoConfig,
    *,
    verbose: bool = True,
    plot: str | None = None,
    progress: Callable[[str], None] | None = None,
    fit: bool = True,
) -> dict[str, Any]:
    """Run both allocation schemes and print the comparison; returns every figure.

    With ``plot``, the shared pool records its memory timeline and writes it there as a PNG.
    ``progress`` hears a line after every training step (the benchmark shows it when quiet).
    ``fit=False`` leaves out the third part (``pooled_train_step`` under half its memory;
    ``"fit"`` is then ``None``): the benchmark's bytes come from the first two.
    """
    say = print if verbose else (lambda *a, **k: None)
    started = time.perf_counter()
    say(
        f"sharedmem demo: MLP {config.features}-{config.hidden}-{config.hidden}-"
        f"{config.classes} on {config.device}, train batch {config.train_batch}, "
        f"eval batch {config.eval_batch}, {config.steps} steps"
    )
    say("\n[1/3] per-net allocation: each net owns its buffers")
    train_pool, eval_pool = BufferPool(config.device), BufferPool(config.device)
    hear = progress if progress is not None else (lambda line: None)
    per_net = _train(
        config,
        train_pool,
        eval_pool,
        verbose,
        lambda step: hear(f"per-net allocation, step {step}/{config.steps}"),
    )
    per_net_bytes = (
        train_pool.stats()["device_reserved_bytes"],
        eval_pool.stats()["device_reserved_bytes"],
    )
    say("\n[2/3] one shared pool: the eval net reuses the train net's buffers by name")
    pool = BufferPool(config.device, timeline=plot is not None)
    shared = _train(
        config,
        pool,
        pool,
        verbose,
        lambda step: hear(f"one shared pool, step {step}/{config.steps}"),
    )
    shared_total = pool.stats()["device_reserved_bytes"]
    # What each phase made the pool grow by, device side (host staging is counted apart).
    phases = pool.phase_stats()
    eval_added = phases["eval"]["added_device_bytes"]
    shared_bytes = (shared_total - eval_added, eval_added)

    per_net_total = sum(per_net_bytes)
    saving = 1.0 - shared_total / per_net_total
    eval_share = shared_bytes[1] / shared_bytes[0]
    say("\nactivation and gradient bytes on the device")
    say(f"  {'':<22}{'train net':>14}{'eval net':>14}{'total':>14}{'eval adds':>11}")
    for label, (train, evaluation) in (
        ("per-net allocation", per_net_bytes),
        ("one shared pool", shared_bytes),
    ):
        say(
            f"  {label:<22}{train:>14,}{evaluation:>14,}{train + evaluation:>14,}"
            f"{evaluation / train:>10.2%}"
        )
    say(
        f"  saving: {saving:.1%} of the per-net total ({human_bytes(per_net_total)} -> "
        f"{human_bytes(shared_total)}); eval adds {eval_share:.2%} of the train net "
        "(target: at most 5%)"
    )
    say("\n" + pool.report())
    if plot is not None:
        say(f"memory timeline written to {pool.plot_timeline(plot)}")
    fitted = None
    if fit:
        say(
            "\n[3/3] the MLP as an nn.Module through sm.pooled_train_step, under half the memory "
            "its step needs: each batch in chunks"
        )
        from .demo_fit import STEPS, run_fit_demo  # the executor and planner: for this part only

        steps = min(config.steps, STEPS)
        fitted = run_fit_demo(
            config, say, lambda step: hear(f"under half the memory, step {step}/{steps}")
        )
        if fitted is not None:  # None: no budget below the step's need could be met
            pairs = zip(fitted["losses"], fitted["unchunked_losses"], strict=True)
            drift = max((abs(a - b) / abs(b) for a, b in pairs), default=0.0)
            say(f"  the two loss curves are at most {drift:.1e} apart (relative)")
    elapsed = time.perf_counter() - started
    say(f"\nloss {shared['losses'][0]:.4f} -> {shared['losses'][-1]:.4f}; done in {elapsed:.1f} s")
    return {
        "per_net_bytes": per_net_bytes,
        "shared_bytes": shared_bytes,
        "saving": saving,
        "eval_share": eval_share,
        "losses": shared["losses"],
        "accuracies": shared["accuracies"],
        "per_net_losses": per_net["losses"],
        "fit": fitted,
        "seconds": elapsed,
        "pool": pool,
    }


def demo_verdict(
    losses: list[float], per_net_losses: list[float], *, tolerance: float = 1e-4
) -> str | None:
    """Why the demo's run counts as failed, or ``None`` when it worked.

    Two runs of the same training must compute the same losses up to rounding (``tolerance``,
    relative: allocation must not change the maths; a mean taken in chunks may change the
    last bits, which SGD carries from step to step), every loss must be finite, and a run
    long enough to learn (20 steps or more) must end below where it started; a short run may
    go either way on noisy batches.
    """
    if not all(math.isfinite(loss) for loss in losses):
        return "a loss is not finite"
    # Equal up to rounding: a matrix kernel may take another path for another buffer address
    # (alignment), which changes the last bits, never more.
    if len(losses) != len(per_net_losses) or not all(
        math.isclose(a, b, rel_tol=tolerance) for a, b in zip(losses, per_net_losses, strict=False)
    ):
        return "the two runs' losses differ beyond rounding"
    if len(losses) >= 20 and not losses[-1] < losses[0]:
        return f"the loss did not go down ({losses[0]:.4f} -> {losses[-1]:.4f})"
    return None
