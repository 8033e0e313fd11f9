"""PyTorch's default training loop served from the pool, call by call, against eager.

A user's loop, as written: ``optimizer.zero_grad()`` (gradients set to ``None``), the forward
and backward, ``optimizer.step()``; then gradient accumulation (micro-steps that add into the
gradients) and an evaluation at twice the batch between steps. Two entry points: ``with
pool.step("train", ...)`` around the forward and backward, and ``pooled_train_step``; a
third where asked for, ``compile_backend`` (the forward and loss through ``torch.compile``
with the pool's backend; evaluations through ``pool.step()``). An eager copy of the model
runs the same calls in the same process and state.

Per call:
- ``peak``: the call's peak, pooled / eager, by DESIGN §8: the running sum of the allocator's
  events relative to the call's start, plus for the pooled call the pool's reserved bytes
  after it, less the arena bytes tensors of earlier calls held at its start (gradients the
  user keeps, each in the whole 64-byte units it holds in the arena: eager holds the same
  tensors outside its measure, as live at the start);
- ``served``: the share of the call's allocation bytes served from the arena (what PyTorch's
  allocator served is the sum of its allocation events).

The sequence (``state`` column): ``none`` x4, ``present`` x2 (accumulation), ``none`` x2,
then ``none``/``present`` alternating, then ``eval`` (batch 2B, no grad) between steps, then
one more ``none`` (the training step after an evaluation), then ``replaced`` x2 (gradients
replaced by fresh tensors the user made, ``p.grad = torch.zeros_like(p)``, and added into)
and the default loop's ``none`` once more.

    python benchmarks/bench_default_loop.py               # ResNet-18 (b8, 64px), hf_gpt2
    python benchmarks/bench_default_loop.py tv_resnet18   # only these
    python benchmarks/bench_default_loop.py --optimizer   # the optimizer step (ResNet-18)
    python benchmarks/bench_default_loop.py --optimizer adamw-foreach   # one optimizer

``--optimizer``: the default loop's ``optimizer.step()`` (foreach AdamW, SGD with momentum)
in a ``pool.step()`` block of its own, beside the pooled training block, against eager and
against the same loop with the optimizer step outside the pool (``run_optimizer``).
"""

from __future__ import annotations

import copy
import inspect
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import zoo as zoo_module
from bench_routing import _call, _loss
from harness import arena_held  # (its import also quiets Kineto's per-profile log lines)

import sharedmem as sm

SEQUENCE = (
    ["none"] * 4
    + ["present"] * 2
    + ["none"] * 2
    + ["none", "present"] * 3
    + ["eval"] * 2
    + ["none"]
    + ["replaced"] * 2
    + ["none"]
)


def allocator_events(step: Callable[[], object]) -> tuple[int, int]:
    """The peak of the running sum of the allocator's events while ``step()`` runs (relative
    to its start), and the bytes it allocated."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action

    with profile(
        activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
    ) as prof:
        step()
    live = peak = made = 0
    for _, action, _, size in prof._memory_profile().timeline:
        if action == Action.CREATE:
            live += size
            made += size
        elif action == Action.DESTROY:
            live -= size
        peak = max(peak, live)
    return peak, made


def _doubled(inputs: Any) -> Any:
    if isinstance(inputs, torch.Tensor):
        return torch.cat([inputs, inputs])
    if isinstance(inputs, dict):
        return {k: _doubled(v) for k, v in inputs.items()}
    return inputs


def grads_of(model: torch.nn.Module) -> dict[str, Any]:
    """``params=model`` where ``pool.step`` takes it (an older version runs without it)."""
    return {"params": model} if "params" in inspect.signature(sm.BufferPool.step).parameters else {}


def build(name: str) -> Any:
    entry = next((m for m in zoo_module.zoo() if m.name == name), None)
    if entry is None:  # the zoo is optional: say what is missing instead of a traceback
        raise SystemExit(
            f"bench_default_loop: no model {name!r} here (the model zoo is optional: install "
            "torchvision/transformers, see benchmarks/zoo.py, or name one `zoo.zoo()` lists)"
        )
    torch.manual_seed(0)
    model, inputs, targets, loss_fn = entry.build()
    if name == "tv_resnet18":  # the size: batch 8 at 64x64
        inputs, targets = zoo_module._images(8, 64)
    return model, inputs, targets, loss_fn


def run(name: str, entry_point: str) -> list[dict[str, Any]]:
    model, inputs, targets, loss_fn = build(name)
    model.train()
    pooled_model = copy.deepcopy(model)
    pool = sm.BufferPool("cpu")
    opts = {
        "eager": torch.optim.SGD(model.parameters(), lr=1e-3),
        "pooled": torch.optim.SGD(pooled_model.parameters(), lr=1e-3),
    }
    step = (
        sm.pooled_train_step(pooled_model, loss_fn, pool=pool)
        if entry_point == "pooled_train_step"
        else None
    )
    compiled = None
    if entry_point == "compile_backend":  # the forward and loss compiled as one function
        from sharedmem._compile import compile_backend

        torch._dynamo.reset()

        def forward_loss(inputs: Any, targets: Any) -> torch.Tensor:
            return _loss(_call(pooled_model, inputs), targets, loss_fn)

        compiled = torch.compile(forward_loss, backend=compile_backend(pool))
    eval_inputs = _doubled(inputs)

    def train(which: str) -> None:
        m = model if which == "eager" else pooled_model
        if which == "pooled" and step is not None:
            step(inputs, targets) if loss_fn is not None else step(inputs)
        elif which == "pooled" and compiled is not None:
            compiled(inputs, targets).backward()
        elif which == "pooled":
            with pool.step("train", inputs, targets, **grads_of(m)):
                _loss(_call(m, inputs), targets, loss_fn).backward()
        else:
            _loss(_call(m, inputs), targets, loss_fn).backward()

    def evaluate(which: str) -> None:
        m = model if which == "eager" else pooled_model
        m.eval()
        with torch.no_grad():
            if which == "pooled":
                with pool.step("eval", eval_inputs):
                    _call(m, eval_inputs)
            else:
                _call(m, eval_inputs)
        m.train()

    rows = []
    for state in SEQUENCE:
        figures = {}
        for which in ("eager", "pooled"):
            m = model if which == "eager" else pooled_model
            if state in ("none", "replaced") and any(p.grad is not None for p in m.parameters()):
                opts[which].step()
                opts[which].zero_grad()  # PyTorch's default: set to None
            if state == "replaced":  # gradients the user made: fresh tensors, added into
                for p in m.parameters():
                    p.grad = torch.zeros_like(p) if p.requires_grad else None
            before = pool.stats()
            held = arena_held(pool)
            torch.manual_seed(1)
            run_one = (
                (lambda w=which: evaluate(w)) if state == "eval" else (lambda w=which: train(w))
            )
            peak, made = allocator_events(run_one)
            after = pool.stats()
            if which == "pooled":
                peak += after["reserved_bytes"] - held
                served = after.get("arena_served_bytes", 0) - before.get("arena_served_bytes", 0)
                figures["served"] = served / (served + made) if served + made else 1.0
            figures[which] = peak
        rows.append(
            {
                "state": state,
                "peak": figures["pooled"] / figures["eager"] if figures["eager"] else 1.0,
                "served": figures["served"],
                "eager": figures["eager"],
                "pooled": figures["pooled"],
            }
        )
    exact = all(
        (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad)
        for a, b in zip(model.parameters(), pooled_model.parameters(), strict=True)
    ) and all(
        torch.equal(a, b)
        for a, b in zip(model.parameters(), pooled_model.parameters(), strict=True)
    )
    stats = pool.stats()
    print(
        f"{name} via {entry_point}: bit-exact {exact}; recorded {stats.get('recorded_calls', 0)}, "
        f"replanned {stats.get('replanned_calls', 0)}, diverged {stats.get('diverged_calls', 0)}, "
        f"reserved {stats['reserved_bytes']:,}"
    )
    return rows


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adamw-foreach": lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=True),
    "sgd-momentum-foreach": lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9, foreach=True),
}


def run_optimizer(name: str, optimizer: str, steps: int = 6) -> list[dict[str, Any]]:
    """The default loop's optimizer step, call by call: eager; with the training step in the
    pool and ``optimizer.step()`` outside it (``outside``); and in a block of its own
    (``pooled``). Peaks by DESIGN §8 as the rows above (the gradients the training block left
    in the arena held at the call's start are subtracted, as eager holds them outside its
    measure); ``served``: the optimizer call's share of allocation bytes from the arena;
    ``loop``: the whole iteration's peak (training, optimizer, ``zero_grad()``) with the
    optimizer pooled over eager's, and ``loop_out`` with it outside. Each row is two
    iterations: one measured whole, then one measured call by call (the first row's whole
    iteration holds the step that makes the optimizer's state)."""
    from sharedmem._routing import native

    model, inputs, targets, loss_fn = build(name)
    model.train()
    models = {w: copy.deepcopy(model) for w in ("eager", "outside", "pooled")}
    optims = {w: OPTIMIZERS[optimizer](m.parameters()) for w, m in models.items()}
    pools = {w: sm.BufferPool("cpu") for w in ("outside", "pooled")}
    rows = []
    in_arena = 0
    for _ in range(steps):
        figures: dict[str, float] = {}
        for which, m in models.items():
            opt, pool = optims[which], pools.get(which)

            def train(m: torch.nn.Module = m, pool: sm.BufferPool | None = pool) -> None:
                if pool is None:
                    _loss(_call(m, inputs), targets, loss_fn).backward()
                else:
                    with pool.step("train", inputs, targets, **grads_of(m)):
                        _loss(_call(m, inputs), targets, loss_fn).backward()

            def step(opt: torch.optim.Optimizer = opt, which: str = which) -> None:
                if which == "pooled":
                    with pools["pooled"].step("optimizer"):
                        opt.step()
                else:
                    opt.step()

            def iteration(train: Callable[[], None] = train, step: Callable[[], None] = step,
                          opt: torch.optim.Optimizer = opt) -> None:  # fmt: skip
                train()
                step()
                opt.zero_grad()

            torch.manual_seed(1)
            loop, _ = allocator_events(iteration)
            figures[f"loop_{which}"] = loop + (
                0 if pool is None else pool.stats()["reserved_bytes"]
            )
            torch.manual_seed(1)
            train()
            held = 0 if pool is None else arena_held(pool)
            before = {} if pool is None else pool.stats()
            peak, made = allocator_events(step)
            if pool is not None:
                after = pool.stats()
                peak += after["reserved_bytes"] - held
                served = after.get("arena_served_bytes", 0) - before.get("arena_served_bytes", 0)
                if which == "pooled":
                    figures["served"] = served / (served + made) if served + made else 1.0
                    base = pool.arenas.base("act.0")
                    spans = [] if base is None else native().live_ranges(base)
                    for state in opt.state.values():
                        for t in state.values():
                            if isinstance(t, torch.Tensor) and base is not None:
                                at = t.data_ptr() - base
                                in_arena += any(lo <= at < hi for lo, hi in spans)
            figures[which] = peak
            opt.zero_grad()
        rows.append(
            {
                "eager": figures["eager"],
                "outside": figures["outside"],
                "pooled": figures["pooled"],
                "peak": figures["pooled"] / figures["eager"],
                "peak_out": figures["outside"] / figures["eager"],
                "served": figures["served"],
                "loop": figures["loop_pooled"] / figures["loop_eager"],
                "loop_out": figures["loop_outside"] / figures["loop_eager"],
            }
        )
    exact = all(
        torch.equal(a, b) and torch.equal(a, c)
        for a, b, c in zip(*(m.parameters() for m in models.values()), strict=True)
    )
    stats = pools["pooled"].stats()
    print(
        f"{name}, {optimizer} in pool.step(): bit-exact {exact}; state tensors in the arena "
        f"{in_arena}; recorded {stats.get('recorded_calls', 0)}, replayed "
        f"{stats.get('replayed_calls', 0)}, diverged {stats.get('diverged_calls', 0)}, "
        f"reserved {stats['reserved_bytes']:,} (training outside: "
        f"{pools['outside'].stats()['reserved_bytes']:,})"
    )
    return rows


def main_optimizer(args: list[str]) -> None:
    names = [a for a in args if a not in OPTIMIZERS]
    for name in names or ["tv_resnet18"]:
        for optimizer in [a for a in args if a in OPTIMIZERS] or OPTIMIZERS:
            rows = run_optimizer(name, optimizer)
            print(
                f"{'call':>4} {'eager':>12} {'outside':>12} {'pooled':>12} {'peak':>6} "
                f"{'out':>6} {'served':>7} {'loop':>6} {'loop_out':>8}"
            )
            for i, r in enumerate(rows):
                print(
                    f"{i:4} {r['eager']:12,} {r['outside']:12,} {r['pooled']:12,} "
                    f"{r['peak']:6.3f} {r['peak_out']:6.3f} {r['served']:7.1%} "
                    f"{r['loop']:6.3f} {r['loop_out']:8.3f}"
                )
            steady = rows[2:]
            print(
                f"{name}, {optimizer}: steady optimizer calls: served median "
                f"{statistics.median(r['served'] for r in steady):.1%}; peak/eager max "
                f"{max(r['peak'] for r in steady):.3f} (outside the pool "
                f"{max(r['peak_out'] for r in steady):.3f}); iteration peak/eager max "
                f"{max(r['loop'] for r in steady):.3f} "
                f"(outside {max(r['loop_out'] for r in steady):.3f})",
                flush=True,
            )


def main(names: list[str]) -> None:
    for name in names or ["tv_resnet18", "hf_gpt2"]:
        for entry_point in ("pool.step", "pooled_train_step"):
            rows = run(name, entry_point)
            print(f"{'call':>4} {'state':8} {'eager':>12} {'pooled':>12} {'peak':>6} {'served':>7}")
            for i, r in enumerate(rows):
                print(
                    f"{i:4} {r['state']:8} {r['eager']:12,} {r['pooled']:12,} {r['peak']:6.3f} "
                    f"{r['served']:7.1%}"
                )
            steady = [r for i, r in enumerate(rows) if i > 0 and r["state"] == "none"]
            print(
                f"{name} via {entry_point}: max peak {max(r['peak'] for r in rows):.3f} "
                f"(first call {rows[0]['peak']:.3f}); steady default-loop calls: served median "
                f"{statistics.median(r['served'] for r in steady):.1%}, min "
                f"{min(r['served'] for r in steady):.1%}",
                flush=True,
            )


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(__doc__)
        sys.exit(0)
    if "--optimizer" in sys.argv:
        main_optimizer([a for a in sys.argv[1:] if a != "--optimizer"])
    else:
        main(sys.argv[1:])
