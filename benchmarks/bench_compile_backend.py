"""``torch.compile`` with the pool as its backend, on zoo models, against eager, against
``torch.compile(backend="aot_eager")`` (the same capture, graphs run as they are) and against
``pool.step()`` around the eager step (today's routed block).

Per model, a train step is the model's forward and loss (compiled as one function) and the
backward, gradients ``None`` at its start (``zero_grad()``, PyTorch's default loop), or
present (``--grads present``: zeroed in place, as in accumulation):

- bit-exact: every gradient of a seeded step equal to eager's, for ``aot_eager`` and ours;
- served: the share of the compiled graphs' allocation bytes served from the arena (the
  router's counts of the last call of each graph);
- peak: the allocator's events (DESIGN §8) while the step runs, relative to what was live at
  its start, plus the pool's reserved bytes for pooled runs; as a ratio to eager's;
- time: interleaved medians, as a ratio to eager's and to ``aot_eager``'s (and the ratios
  of the fastest runs, and of the process's CPU time: both less disturbed by other
  processes on a shared machine).

    python benchmarks/bench_compile_backend.py                 # the four default models
    python benchmarks/bench_compile_backend.py tv_resnet18     # only these
    python benchmarks/bench_compile_backend.py --partition default --span graph hf_gpt2
    python benchmarks/bench_compile_backend.py --varlen 60  # lengths 8..128, one capture
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_routing import _call, _loss
from zoo import skipped, zoo

import sharedmem as sm
from sharedmem._compile import compile_backend
from sharedmem.testing import allocator_peak

# The partition functions compared: torch.compile's, the default one, and the project's
# recomputation by cost (cheap ops only; as much as lowers the peak).
PARTITIONS: dict[str, Any] = {
    "min_cut": "min_cut",
    "default": "default",
    "recompute": sm.Recompute.OFF,
    "recompute-most": sm.Recompute.MOST,
}
DEFAULT_MODELS = ("tv_resnet18", "timm_vit_tiny_patch16_224", "hf_gpt2", "hf_bert")


def measure(
    name: str, build: Callable[[], Any], partition: str, span: str, reps: int, present: bool
) -> dict[str, Any]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, inputs, targets, loss_fn = build()
    model.train()
    pool = sm.BufferPool("cpu")
    block_pool = sm.BufferPool("cpu")
    backend = compile_backend(pool, partition=PARTITIONS[partition], span=span)  # type: ignore[arg-type]

    def forward_loss(inputs: Any, targets: Any) -> torch.Tensor:
        return _loss(_call(model, inputs), targets, loss_fn)

    aot_step = torch.compile(forward_loss, backend="aot_eager")
    our_step = torch.compile(forward_loss, backend=backend)

    def eager() -> None:
        forward_loss(inputs, targets).backward()

    def aot() -> None:
        aot_step(inputs, targets).backward()

    def ours() -> None:
        our_step(inputs, targets).backward()

    def block() -> None:
        with block_pool.step("train", inputs, targets):
            eager()

    runs = {"eager": eager, "aot_eager": aot, "ours": ours, "pool.step": block}

    def fresh() -> None:
        model.zero_grad(set_to_none=not present)

    compile_s = {}
    for label, run in runs.items():  # warm up: compile, record, plan, replay
        for i in range(3):
            fresh()
            start = time.perf_counter()
            run()
            if i == 0:
                compile_s[label] = time.perf_counter() - start

    grads: dict[str, list[torch.Tensor | None]] = {}
    peaks: dict[str, int] = {}
    for label, run in runs.items():
        fresh()
        torch.manual_seed(1)  # the same dropout masks for all
        peaks[label] = allocator_peak(run)
        if label == "ours":
            peaks[label] += pool.stats()["reserved_bytes"]
        if label == "pool.step":
            peaks[label] += block_pool.stats()["reserved_bytes"]
        grads[label] = [None if p.grad is None else p.grad.clone() for p in model.parameters()]

    def exact(label: str) -> bool:
        return all(
            (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
            for a, b in zip(grads["eager"], grads[label], strict=True)
        )

    times: dict[str, list[float]] = {label: [] for label in runs}
    cpu: dict[str, list[float]] = {label: [] for label in runs}
    for _ in range(reps):
        for label, run in runs.items():
            fresh()
            start, start_cpu = time.perf_counter(), time.process_time()
            run()
            times[label].append(time.perf_counter() - start)
            cpu[label].append(time.process_time() - start_cpu)
    median = {label: statistics.median(t) for label, t in times.items()}
    least = {label: min(t) for label, t in times.items()}  # the least disturbed run
    # The process's CPU time: what other processes on a loaded machine change least.
    cpu_median = {label: statistics.median(t) for label, t in cpu.items()}

    served = allocated = 0
    for graph in backend.graphs:
        for route in graph.routes():
            if route.recording is None or not route.last:
                continue
            served += route.last.get("served_bytes", 0)
            allocated += route.recording.total_bytes
    stats = pool.stats()
    return {
        "model": name,
        "exact_aot": exact("aot_eager"),
        "exact_ours": exact("ours"),
        "exact_block": exact("pool.step"),
        "served": served / allocated if allocated else 1.0,
        "peak_aot": peaks["aot_eager"] / peaks["eager"],
        "peak_ours": peaks["ours"] / peaks["eager"],
        "peak_block": peaks["pool.step"] / peaks["eager"],
        "time_ours": median["ours"] / median["eager"],
        "time_ours_aot": median["ours"] / median["aot_eager"],
        "time_aot": median["aot_eager"] / median["eager"],
        "time_block": median["pool.step"] / median["eager"],
        "min_ours": least["ours"] / least["eager"],
        "min_ours_aot": least["ours"] / least["aot_eager"],
        "cpu_ours": cpu_median["ours"] / cpu_median["eager"],
        "cpu_ours_aot": cpu_median["ours"] / cpu_median["aot_eager"],
        "cpu_block": cpu_median["pool.step"] / cpu_median["eager"],
        "eager_ms": median["eager"] * 1e3,
        "compile_s": compile_s["ours"],
        "graphs": backend.stats()["graphs"],
        "arena": stats["reserved_bytes"],
        "diverged": stats.get("diverged_calls", 0),
        "eager_peak": peaks["eager"],
    }


HEADER = (
    f"{'model':28} {'exact aot/ours/blk':>18} {'served':>7} {'peak aot':>8} {'ours':>6} "
    f"{'blk':>6} {'time ours':>9} {'vs aot':>7} {'aot':>6} {'blk':>6} {'eager ms':>8} "
    f"{'compile s':>9} {'graphs':>6} {'arena':>10} {'eager peak':>11} {'min: ours':>9} "
    f"{'vs aot':>7} {'cpu: ours':>9} {'vs aot':>7} {'blk':>6}"
)


def line(r: dict[str, Any]) -> str:
    flags = "/".join("yes" if r[k] else "NO" for k in ("exact_aot", "exact_ours", "exact_block"))
    return (
        f"{r['model']:28} {flags:>18} {r['served']:7.1%} {r['peak_aot']:8.3f} "
        f"{r['peak_ours']:6.3f} {r['peak_block']:6.3f} {r['time_ours']:9.3f} "
        f"{r['time_ours_aot']:7.3f} {r['time_aot']:6.3f} {r['time_block']:6.3f} "
        f"{r['eager_ms']:8.1f} {r['compile_s']:9.1f} {r['graphs']:6d} {r['arena']:10,} "
        f"{r['eager_peak']:11,} {r['min_ours']:9.3f} {r['min_ours_aot']:7.3f} "
        f"{r['cpu_ours']:9.3f} {r['cpu_ours_aot']:7.3f} {r['cpu_block']:6.3f}"
    )


class _LM(torch.nn.Module):
    """bench_varlen's workload in brief: a small causal LM with dropout (issue 34)."""

    def __init__(self, vocab: int = 1000, width: int = 128) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.pos = torch.nn.Parameter(torch.randn(128, width) * 0.02)
        layer = torch.nn.TransformerEncoderLayer(
            width, 4, 512, dropout=0.1, batch_first=True, norm_first=True
        )
        self.blocks = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.shape[1]
        mask = torch.nn.Transformer.generate_square_subsequent_mask(n)
        h = self.blocks(self.embed(ids) + self.pos[:n], mask=mask, is_causal=True)
        out: torch.Tensor = self.head(h)
        return out


def varlen(steps: int) -> None:
    """Lengths drawn from 8..128 each step, a short batch every tenth: eager against ours,
    interleaved, the same seed before each; every loss compared."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _LM()
    twin = copy.deepcopy(model)
    pool = sm.BufferPool("cpu")
    backend = compile_backend(pool)

    def step(m: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        logits = m(ids[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    compiled = torch.compile(step, backend=backend)
    draw = torch.Generator().manual_seed(1)
    exact, capture_s = True, 0.0
    cpu: dict[str, list[float]] = {"eager": [], "ours": []}
    for i in range(steps):
        n = int(torch.randint(8, 129, (1,), generator=draw))
        ids = torch.randint(0, 1000, (2 if i % 10 == 9 else 8, n + 1), generator=draw)
        losses = []
        for label, m, run in (("eager", model, step), ("ours", twin, compiled)):
            m.zero_grad()
            torch.manual_seed(i)
            graphs = len(backend.graphs)
            start, start_cpu = time.perf_counter(), time.process_time()
            loss = run(m, ids)
            loss.backward()
            if label == "ours" and len(backend.graphs) > graphs:
                capture_s += time.perf_counter() - start
            elif i >= STEADY_AFTER:
                cpu[label].append(time.process_time() - start_cpu)
            losses.append(loss.detach())
        exact = exact and torch.equal(losses[0], losses[1])
    stats = pool.stats()
    ratio = statistics.median(cpu["ours"]) / statistics.median(cpu["eager"])
    print(
        f"varlen LM, {steps} steps: losses bit-exact {exact}; graphs compiled "
        f"{len(backend.graphs)} ({capture_s:.1f} s in the calls that compiled); routes "
        f"{backend.stats()['routes']} (recorded calls {stats.get('recorded_calls', 0)}, "
        f"replayed {stats.get('replayed_calls', 0)}); steady step CPU time ours/eager "
        f"{ratio:.3f} (median after step {STEADY_AFTER})"
    )


STEADY_AFTER = 10


class Options:
    """The script's command line: zoo model names, then ``--name value`` options."""

    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {
        "partition": tuple(PARTITIONS),
        "span": ("step", "graph"),
        "grads": ("none", "present"),
    }

    def __init__(self, argv: list[str]) -> None:
        self.models: list[str] = []
        self.partition, self.span, self.grads = "min_cut", "step", "none"
        self.reps, self.varlen = 9, 0
        words = iter(argv)
        for word in words:
            if not word.startswith("--"):
                self.models.append(word)
                continue
            key, value = word[2:], next(words, None)
            if value is None or not hasattr(self, key) or key == "models":
                sys.exit(f"bench_compile_backend: usage: see the module's docstring ({word})")
            if key in self.CHOICES and value not in self.CHOICES[key]:
                sys.exit(f"bench_compile_backend: --{key} takes one of {self.CHOICES[key]}")
            setattr(self, key, int(value) if key in ("reps", "varlen") else value)
        self.models = self.models or list(DEFAULT_MODELS)


def main(argv: list[str]) -> None:
    args = Options(argv)
    if args.varlen:
        varlen(args.varlen)
        return
    entries = {m.name: m for m in zoo()}
    for zoo_name, why in skipped().items():
        print(f"skipped {zoo_name}: {why}")
    print(
        f"partition: {args.partition}; span: {args.span}; "
        f"gradients {args.grads} at each step's start"
    )
    print(HEADER, flush=True)
    for name in args.models:
        if name not in entries:
            print(f"{name:28} not in the zoo here")
            continue
        try:
            row = measure(
                name,
                entries[name].build,
                args.partition,
                args.span,
                args.reps,
                present=args.grads == "present",
            )
        except Exception as error:  # one model's failure is a line, not the end of the run
            print(f"{name:28} failed: {type(error).__name__}: {str(error)[:300]}")
            continue
        print(line(row), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
