"""What a CPU kernel allocates that its fake (meta) kernel does not say, measured once per
configuration by running it on zeros under the router's recording.

Two things are invisible to a fake-tensor run and decide real peaks:

- **scratch**: memory a kernel holds only while it runs. oneDNN's weight-gradient
  convolution keeps per-thread partial sums: 72 MiB for one 512x512 3x3 layer of ResNet-18
  whose weight is 9 MiB. It depends on the shapes, the strides, the thread count and the
  kernel oneDNN picks, so it is measured, not modelled.
- **results bigger than their fake shape**: ``mkldnn_rnn_layer``'s workspace, an empty tensor
  in its meta kernel and about a megabyte in reality, saved for backward.

A configuration is the op, every tensor argument's shape, strides, storage offset and dtype,
every other argument's value, and the thread count. Running it on zeros (its own tensors,
nothing of the caller's) costs one call of that op; the answer is kept for the process.
Ops that draw random numbers are never run (the caller's generator stays as it was), nor are
views and pointwise ops (no scratch; results as their fake shape says).

A step's first call measures its kernels before it runs, when its arena may not exist yet: one
kernel's zeros, results and scratch, beside an arena grown just after, would add to that call's
peak what no step needs at once. ``measured_in`` has them served from the pages the step's
arena reserved instead (best fit, around what tensors hold there), and grows the arena over
the highest byte they touched: bytes the step's plan then uses.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple, TypeGuard

import torch
import torch.utils._pytree as pytree
from torch._ops import OpOverload
from torch.utils._python_dispatch import _disable_current_modes

from .._backends import round_up
from .._devices import machine_available_bytes
from .._layout import extent
from .host import ArenaHost
from .native import native
from .plan import Recording

__all__ = ["KernelMemory", "kernel_memory", "measured_in"]


class KernelMemory(NamedTuple):
    """What one call of a kernel allocates, as measured.

    Attributes:
        scratch: the most bytes it holds while it runs beyond its results' (zero for most).
        results: the real bytes of each tensor result's storage, in ``pytree`` leaf order.
    """

    scratch: int
    results: tuple[int, ...]
    # Every allocation of the call in order, as ``(size, allocated, freed)``: the ticks of
    # its allocation and free in the call (one per allocation and per free), freed -1 for
    # what the call returns.
    sequence: tuple[tuple[int, int, int], ...] = ()


_cache: dict[tuple[Any, ...], KernelMemory | None] = {}
_MISSING = object()
# Fake results whose real storage is bigger (a workspace), by their fake storage: held
# weakly, as long as the fake run holds them.
_grown: weakref.WeakKeyDictionary[torch.UntypedStorage, int] = weakref.WeakKeyDictionary()
_lock = threading.Lock()
# Not run: they are not kernels with memory of their own, or running them has an effect
# beyond their result (a scalar read-out synchronizes; a copy writes its destination).
_SKIP = frozenset({"_local_scalar_dense", "copy_", "lift_fresh", "lift_fresh_copy", "item"})
_OPAQUE_ARGS = ("workspace", "reserve")
# Seeded ops that draw no random numbers where their dropout is 0, measured then: the CPU
# flash attention's per-thread buffers (8,448 B twice in a T5 step) were foreseen by no plan,
# and the two gradients the first call allocated after them went beside the arena.
_DRAW_ONLY_FOR_DROPOUT = {"_scaled_dot_product_flash_attention_for_cpu": "dropout_p"}


class _Room:
    """Where this thread's measurements are served (``measured_in``): an address range, a
    tensor over the buffer that keeps its memory, and the highest offset they touched."""

    def __init__(self, base: int, size: int, owner: torch.Tensor) -> None:
        self.base, self.size, self.owner = base, size, owner
        self.top = 0
        # The buffer's bytes before it was grown over what the measurements touched (None:
        # it was not): the first plan that runs in it gives back what it does not use.
        self.grown_from: int | None = None


_rooms = threading.local()


@contextmanager
def measured_in(host: ArenaHost, name: str) -> Iterator[_Room | None]:
    """Kernels measured on this thread meanwhile are served from the address range the
    buffer ``name`` of ``host`` reserved (best fit, around the tensors it holds), not by
    PyTorch's allocator; afterwards the buffer is grown, in place, over the highest byte
    they touched (the room yielded says from what: ``grown_from``). One kernel's zeros
    copy its parameters too, which the step does not allocate, so the growth may pass what
    the step's plan needs: its route gives that back when its plan first replays
    (``Route.predict``). Only on a stable-address CPU host with the router loaded, and where
    no tensor holds bytes of the buffer (gradients kept for an evaluation: a growth then is
    a passing state's, planned and given back by its route); elsewhere (``None`` yielded)
    they are measured beside it, as before."""
    router = native()
    base = host.arenas.base(name)
    if (
        router is None
        or host.device != "cpu"
        or not host.stable_address
        or getattr(_rooms, "room", None) is not None
        or (base is not None and router.live_bytes(base))
    ):
        yield None
        return
    capacity = host.device_capacity(name)
    view = host.tensor(name, (max(capacity, host.granularity),), torch.uint8)
    reach = host.in_place_room(name)
    if reach <= 0:
        yield None
        return
    host.arenas.served_from(name, view.data_ptr())
    room = _rooms.room = _Room(view.data_ptr(), reach, view)
    try:
        yield room
    finally:
        _rooms.room = None
    if room.top > host.device_capacity(name):
        grown = host.tensor(name, (round_up(room.top, host.granularity),), torch.uint8)
        host.arenas.served_from(name, grown.data_ptr())
        room.grown_from = capacity


def kernel_memory(
    func: object,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    results: Sequence[torch.Tensor] = (),
) -> KernelMemory | None:
    """``func``'s measured memory for these arguments (real or fake tensors; only their
    metadata is read), or ``None`` where it is not measured: the router is not loaded, a
    step is recording or replaying on this thread, the op is not a measured kind, or it
    refused zeros. ``results``: the fake call's tensor results; one found bigger in reality
    (a workspace) is remembered, so that the kernel that reads it is measured on its real
    size."""
    if not _measured_kind(func, args, kwargs):
        return None
    key = _key(func, args, kwargs)
    if key is None:
        return None
    with _lock:
        found = _cache.get(key, _MISSING)
    if found is _MISSING:
        router = native()
        if router is None or router.active() or not _affordable(args, kwargs, results):
            return None
        found = _measure(router, func, args, kwargs)
        with _lock:
            _cache[key] = found
    if isinstance(found, KernelMemory) and len(found.results) == len(results):
        for fake, real in zip(results, found.results, strict=True):
            if real > fake.untyped_storage().nbytes():
                _grown[fake.untyped_storage()] = real
    return found if isinstance(found, KernelMemory) else None


def _affordable(
    args: Sequence[Any], kwargs: dict[str, Any], results: Sequence[torch.Tensor]
) -> bool:
    # An estimate is often asked for a step too big to run: one op's zeros and results (its
    # scratch is usually smaller) are measured only where they take at most a quarter of
    # what the machine has free; else the kernel's scratch is modelled.
    tensors = [t for t in pytree.tree_leaves((list(args), kwargs)) if isinstance(t, torch.Tensor)]
    need = sum(extent(t) for t in tensors) + sum(extent(t) for t in results)
    return need <= machine_available_bytes() // 4


def _measured_kind(
    func: object, args: Sequence[Any], kwargs: dict[str, Any]
) -> TypeGuard[OpOverload]:
    if not isinstance(func, OpOverload) or func.namespace not in ("aten", "sharedmem"):
        return False
    name = func._schema.name.split("::")[-1]
    if func.is_view or name in _SKIP or torch.Tag.pointwise in func.tags:
        return False
    # A seeded op run to measure it would draw random numbers eager then draws again.
    return torch.Tag.nondeterministic_seeded not in func.tags or _draws_nothing(
        func, name, args, kwargs
    )


def _draws_nothing(
    func: OpOverload, name: str, args: Sequence[Any], kwargs: dict[str, Any]
) -> bool:
    """Whether this call of a seeded op draws no random numbers (its dropout is 0)."""
    dropout = _DRAW_ONLY_FOR_DROPOUT.get(name)
    if dropout is None:
        return False
    names = [a.name for a in func._schema.arguments]
    given = dict(zip(names, args, strict=False)) | kwargs
    default = func._schema.arguments[names.index(dropout)].default_value
    return given.get(dropout, default) == 0


def _key(func: OpOverload, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
    parts: list[Any] = [func, torch.get_num_threads()]
    tensors = 0
    # A workspace argument is read as its forward filled it: measured only at its real size.
    names = (a.name for a in func._schema.arguments)
    for name, arg in {**dict(zip(names, args, strict=False)), **kwargs}.items():
        opaque = any(word in name for word in _OPAQUE_ARGS)
        if opaque and isinstance(arg, torch.Tensor) and arg.untyped_storage() not in _grown:
            return None
    for leaf in pytree.tree_leaves((list(args), kwargs)):
        if isinstance(leaf, torch.Tensor):
            if leaf.device.type != "cpu" or leaf.layout != torch.strided:
                return None
            tensors += 1
            parts.append(
                (
                    tuple(leaf.shape),
                    tuple(leaf.stride()),
                    leaf.storage_offset(),
                    leaf.dtype,
                    _grown.get(leaf.untyped_storage()),
                )
            )
        elif leaf is None or isinstance(leaf, (bool, int, float, str, torch.dtype)):
            parts.append(leaf)
        elif isinstance(leaf, (torch.device, torch.layout, torch.memory_format)):
            parts.append(str(leaf))
        else:
            return None  # a symbolic size, a generator ...: not a fixed configuration
    return tuple(parts) if tensors else None


def _zeros_like(t: torch.Tensor) -> torch.Tensor:
    # Zeros in the same layout: valid indices, finite values, a kernel's usual path. A
    # workspace, at its real size.
    grown = _grown.get(t.untyped_storage())
    if grown is not None:
        return torch.zeros(grown // t.element_size(), dtype=t.dtype)
    span = extent(t) // t.element_size()
    flat = torch.zeros(t.storage_offset() + span, dtype=t.dtype)
    return flat.as_strided(t.shape, t.stride(), t.storage_offset())


def _measure(
    router: Any, func: OpOverload, args: Sequence[Any], kwargs: dict[str, Any]
) -> KernelMemory | None:
    def real(leaf: object) -> object:
        return _zeros_like(leaf) if isinstance(leaf, torch.Tensor) else leaf

    room: _Room | None = getattr(_rooms, "room", None)

    def begin() -> None:
        if room is None:
            router.begin_record(0, 0)  # no arena: all of it PyTorch's
        else:
            router.begin_record(room.base, room.size, room.owner)

    def end() -> Recording:
        recording = Recording(*router.end_record())
        if room is not None:
            served = zip(recording.served_at, recording.sizes, strict=True)
            room.top = max([room.top, *(at + size for at, size in served if at >= 0)])
        return recording

    # Under the caller's grad mode: some kernels choose by it (an RNN keeps its workspace for
    # backward only with grad enabled); zeros need no grad, so nothing is recorded.
    with _disable_current_modes():
        begin()  # the zeros apart, so that the kernel's own recording holds only its own
        try:
            call_args, call_kwargs = pytree.tree_map(real, (list(args), kwargs))
        finally:
            end()
        begin()
        try:
            out = func(*call_args, **call_kwargs)
        except Exception:  # a configuration zeros cannot run: not measured, modelled
            end()
            return None
        recording = end()
        results = tuple(
            leaf.untyped_storage().nbytes()
            for leaf in pytree.tree_leaves(out)
            if isinstance(leaf, torch.Tensor)
        )
        del out
    order = sorted(range(len(recording.sizes)), key=recording.alloc_at.__getitem__)
    sequence = tuple(
        (int(recording.sizes[i]), int(recording.alloc_at[i]), int(recording.free_at[i]))
        for i in order
    )
    scratch = max(0, recording.live_peak() - recording.outliving_bytes)
    return KernelMemory(scratch, results, sequence)
