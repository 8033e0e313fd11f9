"""Stage variable-length batches through two reused SyncedMemory buffers, copies overlapped.

A data loader fills token batches of changing length on the host. It starts pushing batch k
to the device asynchronously, prepares batch k + 1 on the host in the second staging memory
while that copy is in flight (double buffering), and only then lets the "model" read batch k
on the device, which waits for its copy. Each staging memory grows only when a batch is
longer than any it held before, so once the longest batches have come by nothing is
allocated. Runs on any device (``--device emulated`` shows real host/device copies without a
GPU; ``cuda`` uses pinned host memory and a copy stream).

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
    staging = [sm.SyncedMemory(device=args.device, name=f"tokens{i}") for i in (0, 1)]
    lengths = [
        int(torch.randint(16, args.max_length + 1, (1,), generator=generator))
        for _ in range(args.steps)
    ]
    expected: list[int] = []  # what the host wrote into each batch, to check the device side
    grows = [0] * args.steps  # growths of each batch's memory, host and device side
    events: list[tuple[str, int]] = []  # the order things happened in, for the overlap check

    def prepare(k: int) -> None:
        """Tokenize batch k into the host side of its staging memory."""
        memory = staging[k % 2]
        before = memory.num_grows  # before set_size and the host access: both may grow it
        memory.set_size(args.batch * lengths[k] * 8)  # int64 ids; O(1), allocates nothing
        tokens = memory.mutable_host_data().view(torch.int64).view(args.batch, lengths[k])
        tokens.random_(0, 50_000, generator=generator)
        expected.append(int(tokens.sum()))
        grows[k] -= before
        events.append(("prepare", k))

    def consume(k: int) -> None:
        """The "model" reads batch k on the device: the read waits for its copy."""
        memory = staging[k % 2]
        on_device = memory.device_data().view(torch.int64).view(args.batch, lengths[k])
        assert int(on_device.sum()) == expected[k], "the device saw other bytes than the host wrote"
        grows[k] += memory.num_grows  # nothing touched this memory since prepare(k)
        events.append(("consume", k))

    prepare(0)
    for k in range(args.steps):
        staging[k % 2].push_async()  # starts the copy of batch k (may grow the device side)
        events.append(("push", k))
        if k + 1 < args.steps:
            prepare(k + 1)  # host work while batch k's copy is in flight, in the other memory
        consume(k)

    overlapped = sum(
        events.index(("push", k)) < events.index(("prepare", k + 1)) < events.index(("consume", k))
        for k in range(args.steps - 1)
    )
    # A batch is a new longest one when it is longer than every earlier batch of its memory.
    new_longest = [
        k < 2 or lengths[k] > max(lengths[j] for j in range(k % 2, k, 2)) for k in range(args.steps)
    ]
    stats = {
        "steps": args.steps,
        "verified_batches": sum(kind == "consume" for kind, _ in events),
        "overlapped_batches": overlapped,
        "host_capacity": sum(m.host_capacity for m in staging),
        "device_capacity": sum(m.device_capacity for m in staging),
        "num_grows": sum(m.num_grows for m in staging),
        "grows_counted": sum(grows),
        "new_longest_batches": sum(new_longest),
        # A staging memory grows only for a batch longer than every earlier one it held.
        "grows_on_other_batches": sum(
            g for g, new in zip(grows, new_longest, strict=True) if not new
        ),
        "host_to_device_bytes": sum(m.host_to_device_bytes for m in staging),
    }
    print(
        f"staged {args.steps} batches of up to {args.max_length} tokens on {staging[0].device} "
        "through 2 staging memories"
    )
    for key, value in stats.items():
        print(f"  {key:<26} {value:>14,}")
    return stats


if __name__ == "__main__":
    main()
