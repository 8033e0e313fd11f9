"""The CUDA router on real train steps: zoo models through ``sm.pooled_train_step`` and
``pool.step()`` with ``sm.install_cuda_router()``, against eager PyTorch on the same GPU.

Each model runs in two processes, since the router must be PyTorch's CUDA allocator before the
first CUDA allocation and PyTorch keeps no allocator statistics under it:

- **eager**: PyTorch's caching allocator. A call's peak is ``torch.cuda.max_memory_allocated()``
  over forward and backward, less what was allocated before it (parameters, optimizer state):
  the allocator's own count of the call's bytes (DESIGN §8 on the GPU).
- **routed**: the router installed. A pooled call's peak is ``step.last_call.measured_peak``
  (the arena it was served from, plus the most PyTorch's allocator held beside it, as the router
  saw every allocation). The same process trains a second copy of the model eagerly, in step, so
  that losses and gradients are compared bit for bit where nothing else differs.

Every step is ``zero_grad()`` (gradients ``None``), the loss, backward, an SGD step; the last
step's figures are reported. Deterministic algorithms are asked for in both processes.

    python benchmarks/bench_cuda_router.py                  # every zoo model this GPU builds
    python benchmarks/bench_cuda_router.py tv_resnet18 hf_gpt2 --steps 4 --json out.json
    python benchmarks/bench_cuda_router.py --recompute most tv_resnet18   # giving time too

``--recompute most`` (``sm.Recompute.MOST``) or a slowdown such as ``1.35``
(``sm.Recompute.within(1.35)``) gives the pooled step time for memory: the values computed again
on the GPU's kernels, still bit for bit against the eager twin.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_map

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

DEFAULT_MODELS = (
    "tv_resnet18",
    "tv_mobilenet_v3_small",
    "timm_vit_tiny_patch16_224",
    "hf_gpt2",
    "hf_llama",
    "lstm_lm",
)


def _to(value: Any, device: str) -> Any:
    """``value``'s tensors (any pytree of them) on ``device``."""
    return tree_map(lambda v: v.to(device) if isinstance(v, torch.Tensor) else v, value)


def _policy(spelled: str | None) -> Any:
    """``--recompute``'s value as an ``sm.Recompute`` ("most", or a slowdown above 1), or
    ``None`` (the default's); a ``ValueError`` naming the choices for anything else."""
    import sharedmem as sm

    if spelled is None:
        return None
    if spelled == "most":
        return sm.Recompute.MOST
    try:
        slowdown = float(spelled)
    except ValueError:
        slowdown = 0.0
    if not slowdown > 1.0:
        raise ValueError(
            f"bench_cuda_router: --recompute takes 'most' or a slowdown above 1 (1.35), "
            f"not {spelled!r}"
        )
    return sm.Recompute.within(slowdown)


def _child(name: str, mode: str, steps: int, recompute: str | None = None) -> dict[str, Any]:
    """One model in this process: ``mode`` is "eager" or "routed" (``recompute``: what the
    pooled step may compute again, as ``--recompute`` spells it)."""
    import sharedmem as sm

    if mode == "routed" and not sm.install_cuda_router():
        return {"error": "install_cuda_router() returned False"}
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    from bench_routing import _call, _loss
    from zoo import zoo

    (entry,) = [m for m in zoo() if m.name == name]

    def build() -> Any:
        torch.manual_seed(0)
        model, inputs, targets, loss_fn = entry.build()
        model = model.cuda().train()
        return model, _to(inputs, "cuda"), _to(targets, "cuda"), loss_fn

    model, inputs, targets, loss_fn = build()
    sgd = torch.optim.SGD(model.parameters(), lr=1e-3)

    def eager_step(m: Any, opt: Any) -> tuple[torch.Tensor, int]:
        m.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        base = 0
        if mode == "eager":  # no statistics under the router
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        loss = _loss(_call(m, inputs), targets, loss_fn)
        loss.backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base if mode == "eager" else 0
        opt.step()
        return loss.detach(), peak

    out: dict[str, Any] = {"model": name}
    if mode == "eager":
        peaks = [eager_step(model, sgd)[1] for _ in range(steps)]
        out["eager_peak"] = peaks[-1]
        out["eager_first_peak"] = peaks[0]
        return out
    twin, control = build()[0], build()[0]
    twin_sgd = torch.optim.SGD(twin.parameters(), lr=1e-3)
    control_sgd = torch.optim.SGD(control.parameters(), lr=1e-3)
    pool = sm.BufferPool("cuda")
    policy = _policy(recompute)
    if policy is None:
        step = sm.pooled_train_step(model, loss_fn, pool=pool)
    else:
        step = sm.pooled_train_step(model, loss_fn, pool=pool, recompute=policy)
    exact = repeatable = True
    for index in range(steps):
        torch.manual_seed(100 + index)  # the same dropout masks for all three
        expected, _ = eager_step(twin, twin_sgd)
        # A second eager copy: where it differs from the first, the GPU's kernels are not
        # deterministic for this model, and a pooled step cannot be compared bit for bit.
        torch.manual_seed(100 + index)
        again, _ = eager_step(control, control_sgd)
        repeatable &= torch.equal(again, expected) and all(
            torch.equal(a.grad, b.grad)
            for a, b in zip(twin.parameters(), control.parameters(), strict=True)
            if a.grad is not None
        )
        model.zero_grad(set_to_none=True)
        torch.manual_seed(100 + index)
        loss = step(inputs) if loss_fn is None else step(inputs, targets)
        torch.cuda.synchronize()
        exact &= torch.equal(loss.detach(), expected)
        exact &= all(
            torch.equal(a.grad, b.grad)
            for a, b in zip(twin.parameters(), model.parameters(), strict=True)
            if a.grad is not None
        )
        sgd.step()
    last = step.last_call
    stats = pool.stats()
    out.update(
        recompute=None if policy is None else policy.describe(),
        recomputed=step.plan_summary().recomputed,
        pooled_peak=last.measured_peak if last else None,
        planned_peak=last.planned_peak if last else None,
        measured=last.measured if last else None,
        served=stats.get("arena_served_bytes"),
        beside=stats.get("arena_fallback_bytes"),
        exact=exact,
        eager_repeatable=repeatable,
    )
    return out


def _run_child(name: str, mode: str, steps: int, recompute: str | None) -> dict[str, Any]:
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8", PYTHONUNBUFFERED="1")
    giving = ["--recompute", recompute] if recompute is not None else []
    done = subprocess.run(
        [sys.executable, __file__, "--child", mode, "--steps", str(steps), *giving, name],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stdout + done.stderr).strip().splitlines()[-12:]
        return {"model": name, "error": f"exit {done.returncode}: " + " | ".join(tail)}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def _option(args: list[str], flag: str, default: str | None) -> str | None:
    """The value after ``flag`` in ``args`` (both removed), or ``default``."""
    if flag not in args:
        return default
    at = args.index(flag)
    value = args[at + 1]
    del args[at : at + 2]
    return value


def main(args: list[str]) -> int:
    steps = int(_option(args, "--steps", "4") or 4)
    out = _option(args, "--json", None)
    child = _option(args, "--child", None)
    recompute = _option(args, "--recompute", None)
    try:
        _policy(recompute)
    except ValueError as error:
        print(error)
        return 2
    if child:
        try:
            print(json.dumps(_child(args[0], child, steps, recompute)), flush=True)
        except Exception as error:  # reported by the parent, with the model's name
            import traceback

            traceback.print_exc()
            print(json.dumps({"model": args[0], "error": repr(error)[:400]}), flush=True)
        return 0
    if not torch.cuda.is_available():
        print("bench_cuda_router: needs a CUDA GPU (torch.cuda.is_available() is False)")
        return 2
    names = args or list(DEFAULT_MODELS)
    # Every child at once: each process has its own allocator, so the figures do not mix.
    with ThreadPoolExecutor(max_workers=8) as workers:
        futures = {
            (name, mode): workers.submit(_run_child, name, mode, steps, recompute)
            for name in names
            for mode in ("eager", "routed")
        }
    rows = []
    for name in names:
        row = {**futures[name, "eager"].result(), **futures[name, "routed"].result(), "model": name}
        if "eager_peak" in row and row.get("pooled_peak"):
            row["ratio"] = row["pooled_peak"] / row["eager_peak"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(
        f"\n{'model':<26} {'eager peak':>12} {'pooled peak':>12} {'ratio':>6} "
        f"{'served':>12} {'beside':>12}  bit for bit (eager repeats itself)"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['model']:<26} ERROR {r['error'][:300]}")
            continue
        print(
            f"{r['model']:<26} {r.get('eager_peak', 0):>12,} {r.get('pooled_peak') or 0:>12,} "
            f"{r.get('ratio', 0):>6.3f} {r.get('served') or 0:>12,} {r.get('beside') or 0:>12,}  "
            f"{r.get('exact')} ({r.get('eager_repeatable')})"
        )
    if out:
        Path(out).write_text(json.dumps(rows, indent=2))
    return 1 if any("error" in r or not r.get("exact") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
