"""Stage variable-length batches through one SyncedMemory instead of a tensor per step.

A data loader fills token batches of changing length on the host, pushes each to the device
asynchronously while it prepares the next one, and a "model" reads it there. One memory serves
every step: it grows to the longest batch seen and then stays put, so after the first steps
nothing is allocated. Runs on any device (``--device emulated`` shows real host/device copies
without a GPU; ``cuda`` uses pinned host memory and a copy stream).

    python examples/host_staging.py --device emulated --steps 50
"""

from __future__ import annotations

import argparse

import torch

import sharedmem as sm


def main(argv: list[str] | None = None) -> dict[str, int]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="emulated", help="cpu, emulated, cuda or cuda:N")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=2048)
    args = parser.parse_args(argv)

    generator = torch.Generator().manual_seed(0)
    staging = sm.SyncedMemory(device=args.device, name="tokens")
    checksum = 0
    grows_after_warmup = 0
    for step in range(args.steps):
        length = int(torch.randint(16, args.max_length + 1, (1,), generator=generator))
        nbytes = args.batch * length * 8  # int64 token ids
        staging.set_size(nbytes)  # O(1): a number, nothing is allocated here
        tokens = staging.mutable_host_data().view(torch.int64).view(args.batch, length)
        tokens.random_(0, 50_000, generator=generator)  # "tokenize" into the host buffer
        expected = int(tokens.sum())
        grows_before = staging.num_grows
        staging.push_async()  # starts the copy; the device read below waits for it
        on_device = staging.device_data().view(torch.int64).view(args.batch, length)
        assert int(on_device.sum()) == expected, "the device saw other bytes than the host wrote"
        checksum ^= expected
        if step >= args.steps // 2:
            grows_after_warmup += staging.num_grows - grows_before
    stats = {
        "steps": args.steps,
        "host_capacity": staging.host_capacity,
        "device_capacity": staging.device_capacity,
        "num_grows": staging.num_grows,
        "grows_in_second_half": grows_after_warmup,
        "host_to_device_bytes": staging.host_to_device_bytes,
    }
    print(f"staged {args.steps} batches of up to {args.max_length} tokens on {staging.device}")
    for key, value in stats.items():
        print(f"  {key:<22} {value:>14,}")
    return stats


if __name__ == "__main__":
    main()
