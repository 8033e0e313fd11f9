"""Bytes, not seconds: train+eval sharing, variable shapes, and what a growth costs.

* train + eval: the demo's Caffe-style MLP with per-net buffers against one shared pool; the
  eval net may add at most 5% of the train net's bytes (Caffe: 11-16%).
* variable shapes: a token classifier over batches of changing length (the workload of
  ``examples/variable_length.py``): zero growth after warm-up, reserved bytes within 5% of the
  sum of per-name high-water marks. On CUDA the same workload run with ``torch.empty`` per
  step is compared by what the caching allocator reserves (``torch.cuda.memory_reserved``).
* growth: a buffer grows 1 MiB -> 64 MiB in steps; on a stable-address backend 0 bytes are
  copied and the peak is the new capacity, against allocate-copy-free (old + new).

    python benchmarks/bench_memory.py [--quick] [--device cpu] [--json PATH]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Row, print_rows, row, write_json

import sharedmem as sm
from sharedmem._demo import DemoConfig, run_demo

MiB = 1 << 20


def train_eval(quick: bool, device: str) -> list[Row]:
    result = run_demo(DemoConfig(device=device, steps=20 if quick else 60), verbose=False)
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
    count = 40 if quick else 200
    return [(16, int(torch.randint(1, 513, (1,), generator=g))) for _ in range(count)]


def _classify(new: object, batch: int, length: int, weights: tuple[torch.Tensor, ...]) -> None:
    """One forward of the token classifier; ``new(name, shape)`` gives each activation."""
    embedding, w1, w2 = weights
    tokens = torch.randint(0, embedding.shape[0], (batch * length,), device=embedding.device)
    embedded = new("embedded", (batch * length, w1.shape[0]))  # type: ignore[operator]
    torch.index_select(embedding, 0, tokens, out=embedded)
    hidden = new("hidden", (batch * length, w1.shape[1]))  # type: ignore[operator]
    torch.mm(embedded, w1, out=hidden)
    pooled = new("pooled", (batch, w1.shape[1]))  # type: ignore[operator]
    torch.mean(hidden.view(batch, length, -1), 1, out=pooled)
    torch.mm(pooled, w2, out=new("logits", (batch, w2.shape[1])))  # type: ignore[operator]


def variable_shapes(quick: bool, device: str) -> list[Row]:
    torch_device = device if device.startswith("cuda") else "cpu"
    weights = tuple(
        torch.randn(*shape, device=torch_device) for shape in ((1000, 64), (64, 256), (256, 5))
    )
    batches = _token_batches(quick)
    pool = sm.BufferPool(device)
    with pool.phase("warm-up"):
        _classify(pool.tensor, 16, max(length for _, length in batches), weights)
    with pool.phase("stream"):
        for batch, length in batches:
            _classify(pool.tensor, batch, length, weights)
    stats = pool.stats()
    grows = pool.phase_stats()["stream"]["num_grows"]
    rows = [
        row(
            "variable shapes: growths after warm-up",
            grows,
            "",
            target="== 0",
            ok=grows == 0,
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
        for batch, length in batches:
            _classify(
                lambda _name, shape: torch.empty(shape, device=torch_device), batch, length, weights
            )
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
        stable = pool.blob("grown").data_memory.placement.device_backend.stable_address
        capacity = stats["device_reserved_bytes"]
        rows.append(
            row(
                f"growth to {final // MiB} MiB ({backend}): bytes copied",
                stats["grow_copy_bytes"],
                "bytes",
                target="== 0 (stable address)" if stable else "moving backend",
                ok=stats["grow_copy_bytes"] == 0 if stable else None,
            )
        )
        rows.append(
            row(
                f"growth to {final // MiB} MiB ({backend}): peak / new capacity",
                stats["peak_reserved_bytes"],  # only the device side was ever touched
                "bytes",
                baseline=capacity,
                target="== 1.00x (stable address)" if stable else "old + new",
                ok=stats["peak_reserved_bytes"] == capacity if stable else None,
            )
        )
    return rows


def run(quick: bool = False, device: str = "cpu") -> list[Row]:
    return train_eval(quick, device) + variable_shapes(quick, device) + growth(quick, device)


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rows = run(args.quick, args.device)
    print_rows(f"memory on {args.device}", rows)
    if args.json:
        write_json(args.json, rows, device=args.device, torch=torch.__version__)
    return rows


if __name__ == "__main__":
    main()
