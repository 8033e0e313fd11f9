"""Random draws made again, bit for bit: the ops that let a recomputation reach dropout.

Dropout on CPU fills a fresh tensor with ``bernoulli_`` and keeps it (four bytes an element)
from the forward to the backward. To compute it again instead, the draw must give the same
numbers, and the generator must end where eager's ends, so that every later draw is eager's.
Two ops of the ``sharedmem`` namespace do that:

- ``sharedmem::rng_state(like)``, placed right before the forward's draw, returns the state
  of ``like``'s device's default generator (a small CPU tensor: 5056 bytes for the CPU's
  Mersenne Twister, 16 for CUDA's Philox seed and offset). It draws nothing.
- ``sharedmem::replay_<op>(rng_state, *args)``, placed where backward reads the value, runs
  ``op`` with the generator set to that state, then puts the generator back where it was.

The kernels draw as they did: the same op on a tensor of the same layout, from the same state,
with the same threads. Ops with an explicit ``generator=`` are not replayed (``replayable``).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch._ops import OpOverload
from torch.fx import Node

from .ops import library

__all__ = ["RANDOM_FILLS", "replay_op", "replayable", "rng_state_op", "state_bytes"]

aten = torch.ops.aten

# In-place draws that overwrite every element of their first argument from the default
# generator (dropout's noise on CPU is ``empty_like(x).bernoulli_(1 - p)``).
RANDOM_FILLS: frozenset[OpOverload] = frozenset(
    {aten.bernoulli_.float, aten.uniform_.default, aten.normal_.default}
)

# The tags that keep these ops out of kernel measurement and any recomputation of their own.
_TAGS = (torch.Tag.nondeterministic_seeded,)


def replayable(node: Node) -> bool:
    """Whether ``node`` is a random fill drawn from its device's default generator."""
    return (
        node.op == "call_function"
        and node.target in RANDOM_FILLS
        and node.kwargs.get("generator") is None
        and not any(isinstance(a, torch.Generator) for a in node.args)
    )


def state_bytes(device: torch.device) -> int:
    """The size of ``device``'s default generator state, without initializing CUDA."""
    return _state_bytes(device.type)


@functools.cache
def _state_bytes(device_type: str) -> int:
    if device_type == "cpu":
        return torch.default_generator.get_state().numel()
    return 16  # Philox: seed and offset, 8 bytes each


@functools.cache
def rng_state_op() -> OpOverload:
    """``sharedmem::rng_state(Tensor like) -> Tensor``: the default generator's state of
    ``like``'s device, as a CPU tensor of bytes."""
    namespace = library()
    namespace.define("rng_state(Tensor like) -> Tensor", tags=_TAGS)  # type: ignore[no-untyped-call]

    def fake(like: torch.Tensor) -> torch.Tensor:  # on the CPU, whatever ``like``'s device
        return torch.empty(state_bytes(like.device), dtype=torch.uint8)

    namespace.impl("rng_state", _get_state, "CPU")  # type: ignore[no-untyped-call]
    namespace.impl("rng_state", _get_state, "CUDA")  # type: ignore[no-untyped-call]
    torch.library.register_fake("sharedmem::rng_state", fake, lib=namespace)
    found: OpOverload = torch.ops.sharedmem.rng_state.default
    return found


@functools.cache
def replay_op(op: OpOverload) -> OpOverload:
    """``sharedmem::replay_<op>(Tensor rng_state, *op's arguments)``: ``op`` drawn from that
    generator state, the generator restored after; its schema is ``op``'s otherwise."""
    namespace = library()
    schema = str(op._schema)  # aten::bernoulli_.float(Tensor(a!) self, ...) -> Tensor(a!)
    name = "replay_" + schema.split("::", 1)[1].split("(", 1)[0].replace(".", "_")
    arguments = schema.split("(", 1)[1]
    namespace.define(f"{name}(Tensor rng_state, {arguments}", tags=_TAGS)  # type: ignore[no-untyped-call]

    def run(state: torch.Tensor, *args: object, **kwargs: object) -> object:
        first = args[0]
        assert isinstance(first, torch.Tensor)
        with _drawing_from(state, first.device):
            return op(*args, **kwargs)

    def meta(state: torch.Tensor, *args: object, **kwargs: object) -> object:
        return op(*args, **kwargs)

    namespace.impl(name, run, "CPU")  # type: ignore[no-untyped-call]
    namespace.impl(name, run, "CUDA")  # type: ignore[no-untyped-call]
    namespace.impl(name, meta, "Meta")  # type: ignore[no-untyped-call]
    found: OpOverload = getattr(torch.ops.sharedmem, name).default
    return found


def _get_state(like: torch.Tensor) -> torch.Tensor:
    return _state_of(like.device)


def _state_of(device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return torch.get_rng_state()
    return torch.cuda.get_rng_state(device)


def _set_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.cuda.set_rng_state(state, device)


@contextmanager
def _drawing_from(state: torch.Tensor, device: torch.device) -> Iterator[None]:
    now = _state_of(device)
    _set_state(state, device)
    try:
        yield
    finally:  # every later draw is eager's
        _set_state(now, device)
