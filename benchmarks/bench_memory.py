"""Bytes, not seconds: train+eval sharing, variable shapes, and what a growth costs.

* train + eval: the demo's Caffe-style MLP with per-net buffers against one shared pool; the
  eval net may add at most 5% of the train net's bytes (Caffe: 11-16%).
* variable shapes: a token classifier over a stream of batches of random length (the
  workload of ``examples/variable_length.py``), with no warm-up batch of its own. Warm-up is
  the stream up to the first batch of its longest length, where every buffer reaches its
  high-water mark; the growths in it are reported, and after it there must be none
  ("zero allocations after warm-up"), however the lengths go up and down. Reserved bytes
  must stay within 5% of the sum of per-name high-water marks. On CUDA the same workload run
  with ``torch.empty`` per step is compared by what the caching allocator reserves
  (``torch.cuda.memory_reserved``).
* growth: a buffer grows 1 MiB -> 64 MiB in steps; on a stable-address backend 0 bytes are
  copied and the peak is the new capacity, against allocate-copy-free (old + new).

    python benchmarks/bench_memory.py [--quick] [--device cpu] [--json PATH]
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Progress, Row, growth_rows, row, script_main

import sharedmem as sm
from sharedmem._cli.demo import DemoConfig, run_demo

MiB = 1 << 20


def train_eval(quick: bool, device: str, progress: Progress) -> list[Row]:
    # The bytes are settled after the first step of each net; more steps only show the loss.
    # The demo's third part (pooled_train_step under a budget) adds nothing to these bytes.
    result = run_demo(
        DemoConfig(device=device, steps=5 if quick else 60),
        verbose=False,
        progress=lambda line: progress.tick(f"train+eval: {line}"),
        fit=False,
    )
    train, evaluation = result["shared_bytes"]
    per_train, per_eval = result["per_net_bytes"]
    return [
        row(
            "train+eval: eval adds, one shared pool",
            evaluation,
            "bytes",
            baseline=train,
            target="<= 0.05x train net",
            ok=evaluation <= 0.05 * train,
        ),
        row(
            "train+eval: total bytes, shared / per-net",
            train + evaluation,
            "bytes",
            baseline=per_train + per_eval,
            target="< 1.00x",
            ok=train + evaluation < per_train + per_eval,
        ),
    ]


def _token_batches(quick: bool) -> list[tuple[int, int]]:
    g = torch.Generator().manual_seed(0)
    # Seed 0 first draws its longest length (511) at step 37: enough steps come after it.
    count = 100 if quick else 200
    return [(16, int(torch.randint(1, 513, (1,), generator=g))) for _ in range(count)]


def _classify(
    new: Callable[..., torch.Tensor], batch: int, length: int, weights: tuple[torch.Tensor, ...]
) -> None:
    """One forward of the token classifier; ``new(name, shape)`` gives each activation."""
    embedding, w1, w2 = weights
    tokens = torch.randint(0, embedding.shape[0], (batch * length,), device=embedding.device)
    embedded = new("embedded", (batch * length, w1.shape[0]))
    torch.index_select(embedding, 0, tokens, out=embedded)
    hidden = new("hidden", (batch * length, w1.shape[1]))
    torch.mm(embedded, w1, out=hidden)
    pooled = new("pooled", (batch, w1.shape[1]))
    torch.mean(hidden.view(batch, length, -1), 1, out=pooled)
    torch.mm(pooled, w2, out=new("logits", (batch, w2.shape[1])))


def variable_shapes(quick: bool, device: str, progress: Progress) -> list[Row]:
    torch_device = device if device.startswith("cuda") else "cpu"
    weights = tuple(
        torch.randn(*shape, device=torch_device) for shape in ((1000, 64), (64, 256), (256, 5))
    )
    batches = _token_batches(quick)
    lengths = [length for _, length in batches]
    warm = lengths.index(max(lengths)) + 1  # steps up to the first batch of the longest length
    pool = sm.BufferPool(device)
    for step, (batch, length) in enumerate(batches, start=1):
        with pool.phase("warm-up" if step <= warm else "after"):
            _classify(pool.tensor, batch, length, weights)
        progress.tick(f"variable shapes: step {step}/{len(batches)}")
    stats, phases = pool.stats(), pool.phase_stats()
    records = sum(length > max(lengths[:i], default=0) for i, length in enumerate(lengths))
    after = phases["after"]["num_grows"]
    rows = [
        row(
            f"variable shapes: growths in warm-up (steps 1-{warm}: {records} new longest)",
            phases["warm-up"]["num_grows"],
            "",
        ),
        row(
            f"variable shapes: growths after warm-up (steps {warm + 1}-{len(batches)})",
            after,
            "",
            target="== 0",
            ok=after == 0,
        ),
        row(
            "variable shapes: reserved / high-water marks",
            stats["device_reserved_bytes"],
            "bytes",
            baseline=stats["high_water_bytes"],
            target="<= 1.05x",
            ok=stats["device_reserved_bytes"] <= 1.05 * stats["high_water_bytes"],
        ),
    ]
    if device.startswith("cuda"):  # what the caching allocator keeps for the same workload
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(device)
        where = torch.device(device)

        def empty(_name: str, shape: tuple[int, ...]) -> torch.Tensor:
            return torch.empty(shape, device=where)

        for batch, length in batches:
            _classify(empty, batch, length, weights)
        caching = torch.cuda.memory_reserved(device) - before
        rows.append(
            row(
                "variable shapes: pool / caching allocator reserved",
                stats["device_reserved_bytes"],
                "bytes",
                baseline=caching,
                target="<= 1.00x",
                ok=stats["device_reserved_bytes"] <= caching,
            )
        )
    return rows


def growth(quick: bool, device: str) -> list[Row]:
    """Grow one buffer 1 MiB -> 64 MiB (quick: 16 MiB) keeping its content."""
    final = (16 if quick else 64) * MiB
    rows = []
    for backend in sm.backend_names(device)[:1] + ("pageable",) * (device == "emulated"):
        pool = sm.BufferPool(device, backend=backend)
        size = MiB
        while size <= final:
            pool.tensor("grown", (size,), torch.uint8).fill_(1)
            size *= 2
        stats = pool.stats()
        rows += growth_rows(
            f"growth to {final // MiB} MiB ({backend})",
            stats["grow_copy_bytes"],
            stats["peak_reserved_bytes"],  # only the device side was ever touched
            stats["device_reserved_bytes"],
            pool.blob("grown").data_memory.placement.device_backend.stable_address,
        )
    return rows


def run(quick: bool = False, device: str = "cpu", progress: Progress | None = None) -> list[Row]:
    progress = progress or Progress.quiet()
    rows = train_eval(quick, device, progress)
    progress.say("memory: variable shapes ...")
    rows += variable_shapes(quick, device, progress)
    progress.say("memory: growth ...")
    return rows + growth(quick, device)


def main(argv: list[str] | None = None) -> list[Row]:
    return script_main(__doc__, run, "memory on {device}", argv)


if __name__ == "__main__":
    main()
