"""The operations of a stress run: small frozen records that fully determine what each does.

An operation names a blob by its index in the round's table of names and carries every choice
made for it, down to where its written bytes come from in the run's noise, and the fault to
inject while it runs. Replaying the same list on a fresh pool therefore does the same thing,
which is what lets a failing sequence be shrunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["DTYPES", "EXCLUSIVE", "KINDS", "WHOLE", "Op", "describe"]

# Element types a blob takes; the runner compares bytes, so any whole-byte dtype will do.
DTYPES = (torch.uint8, torch.int16, torch.float32, torch.float64, torch.bool, torch.complex64)

KINDS = (
    "reshape",  # blob.reshape(shape).astype(dtype): O(1), never touches memory
    "write",  # a mutable accessor of the blob, then bytes [start, stop) of it from the noise
    "tensor",  # the same through the pool's hot path, pool.tensor / pool.host_tensor
    "read",  # a read accessor, checked byte for byte
    "share",  # blob.share_data(other) / share_grad(other)
    "shrink",  # memory.shrink_to_fit()
    "release",  # memory.release()
    "release_side",  # memory.release_host() / release_device()
    "push",  # memory.push_async()
    "pull",  # memory.pull_async()
    "trim",  # pool.trim()
    "pool_release",  # pool.release()
    "limit",  # reshape and write under a limit of what is reserved now: no growth may pass
)
# Operations that touch every buffer or the pool's limit: threads run them alone.
EXCLUSIVE = frozenset({"trim", "pool_release", "limit"})
# A write's ``stop`` meaning "to the end of the view", however long a replay finds it.
WHOLE = 1 << 62


@dataclass(frozen=True, slots=True)
class Op:
    """One operation. Fields an operation's kind does not use keep their defaults.

    Attributes:
        kind: one of ``KINDS``.
        blob: the blob, by index in the round's table of names.
        grad: use the gradient memory rather than the data memory.
        side: ``"host"`` or ``"device"``.
        other: ``share``: the blob whose memory ``blob`` takes.
        shape, dtype: ``reshape`` and ``limit``: the new shape and dtype.
        start, stop: the bytes written, clamped to the view (a replay may see a smaller one).
        offset: where the written bytes start in the run's noise.
        fault: ``(kind, k)``: fail the k-th event of that kind while this operation runs.
    """

    kind: str
    blob: int = 0
    grad: bool = False
    side: str = "device"
    other: int = 0
    shape: tuple[int, ...] = ()
    dtype: torch.dtype = torch.uint8
    start: int = 0
    stop: int = 0
    offset: int = 0
    fault: tuple[str, int] | None = None


_ORDINALS = {1: "1st", 2: "2nd", 3: "3rd"}


def _memory(op: Op, names: Sequence[str]) -> str:
    return f"{names[op.blob]}.{'grad' if op.grad else 'data'}_memory"


def _accessor(op: Op, write: bool) -> str:
    host = op.side == "host"
    what = "grad" if op.grad else "data"
    name = ("mutable_" if write else "") + ("host_" if host else "") + what
    return name


def _shape(op: Op) -> str:
    return f"{op.shape!r}.astype({str(op.dtype).removeprefix('torch.')})"


def describe(op: Op, names: Sequence[str]) -> str:
    """One line of near-Python that says what ``op`` does."""
    b = names[op.blob]
    stop = "" if op.stop >= WHOLE else op.stop
    written = f"[{op.start}:{stop}] = noise[{op.offset}:]"
    match op.kind:
        case "reshape":
            text = f"{b}.reshape{_shape(op)}"
        case "write":
            text = f"{b}.{_accessor(op, True)}(){written}"
        case "tensor":
            verb = "host_tensor" if op.side == "host" else "tensor"
            text = f"pool.{verb}({b!r}, <{b}.shape>, <{b}.dtype>){written}"
        case "read":
            text = f"check {b}.{_accessor(op, False)}()"
        case "share":
            text = f"{b}.share_{'grad' if op.grad else 'data'}({names[op.other]})"
        case "shrink":
            text = f"{_memory(op, names)}.shrink_to_fit()"
        case "release":
            text = f"{_memory(op, names)}.release()"
        case "release_side":
            text = f"{_memory(op, names)}.release_{op.side}()"
        case "push" | "pull":
            text = f"{_memory(op, names)}.{op.kind}_async()"
        case "trim" | "pool_release":
            text = f"pool.{op.kind.removeprefix('pool_')}()"
        case "limit":
            text = (
                f"with limit=<reserved now>: {b}.reshape{_shape(op)}."
                f"{_accessor(op, True)}(){written}"
            )
        case _:
            raise ValueError(f"sharedmem: unknown stress operation {op.kind!r}")
    if op.fault is not None:
        kind, k = op.fault
        text += f"  # fail the {_ORDINALS.get(k, f'{k}th')} {kind}"
    return text
