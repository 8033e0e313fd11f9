"""BufferPool: named buffers that every net and every step share, with a limit and stats."""

from __future__ import annotations

import contextlib
import functools
import mmap
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import torch

from .._backends import Backend, Placement, resolve, round_up
from .._blob import Blob
from .._devices import DeviceLike
from .._errors import SharedMemError
from .._routing import Arenas, arena_live_bytes
from .._synced import SyncedMemory
from .._validate import ShapeLike, check_bytes, check_dtype, check_name, check_nbytes, check_shape
from .adaptors import AccountedBackend, LimitedBackend
from .blocks import StepBlocks
from .figures import PoolFigures, unique_memories
from .ledger import Ledger
from .timeline import Sample

__all__ = ["BufferPool"]


class _Cached:
    """What the fast path remembers of a name's last view, and the one check that it may be
    handed out again."""

    __slots__ = ("blob", "dtype", "key", "memory", "stamp", "version", "view")

    def __init__(
        self,
        key: object,
        dtype: torch.dtype,
        blob: Blob,
        view: torch.Tensor,
        memory: SyncedMemory,
        version: int,
    ) -> None:
        self.key, self.dtype, self.blob, self.view = key, dtype, blob, view
        self.memory, self.version, self.stamp = memory, version, blob.stamp

    def serves(self, shape: object, dtype: torch.dtype) -> bool:
        """The cached view is what a request for ``shape`` and ``dtype`` would return now."""
        key = self.key
        return (
            dtype is self.dtype
            and self.memory.version == self.version  # no growth, move, sync or release since
            # Not retyped since by anything else (the other fast path, blob(), reshape) and
            # not moved to another memory by share_data.
            and self.blob.stamp == self.stamp
            # The shape as asked for before, spelt alike and with int elements: (2.0, 3.0)
            # equals (2, 3) but is no shape, and must fail here as on the slow path. A key is
            # only ever kept as the caller's own object when it holds nothing mutable.
            and (shape is key or (type(shape) is type(key) and shape == key and _plain(shape)))
        )


class _PoolLink:
    """What a pool's backends and blobs call back into the pool through: one weak reference,
    so that nothing they hold keeps the pool alive (a memory frees its blocks when collected,
    and a pool that goes out of scope is collected at once, not at the next cyclic
    collection)."""

    __slots__ = ("_pool",)

    def __init__(self, pool: BufferPool) -> None:
        self._pool = weakref.ref(pool)

    def moved(self) -> None:
        """A block moved or was given back: cached views must go."""
        pool = self._pool()
        if pool is not None:
            pool._forget_views()

    def limit(self) -> int | None:
        pool = self._pool()
        return None if pool is None else pool.limit

    def explain(self, label: str, allocator_failed: bool) -> str:
        pool = self._pool()
        return "" if pool is None else pool._figures.explain(label, allocator_failed)

    def adopt(self, name: str, memory: SyncedMemory) -> None:
        """Before the buffer ``name`` takes ``memory`` by share_data / share_grad."""
        pool = self._pool()
        if pool is not None:
            pool._adopt(name, memory)


class BufferPool:
    """Named buffers shared by every net and every step, grown to the largest request.

    A name is one memory: a training net and an evaluation net, or every batch size of one
    net, that ask for the same name get the same bytes, grown to the largest request ever
    seen and then left in place. ``tensor`` is the hot path of a custom loop: in steady state
    (same name, shape and dtype as last time, nothing moved) it costs a dictionary lookup.

    Views are valid until the next access that changes the buffer; on a moving backend a
    growth leaves old views on the old storage. Ask for the view every step.

    Threads may acquire, grow and read buffers of one pool at once. Two threads writing one
    buffer (or reshaping one name differently) at the same time race on the bytes, as they
    would on one tensor: that is the caller's to avoid.

    Args:
        device: ``"cpu"``, ``"emulated"``, ``"cuda"``, ``"cuda:N"`` or a ``torch.device``.
        limit: a cap on reserved device bytes (on ``cpu``, on the one memory), as bytes or a
            size such as ``"8G"`` (the spelling a step's ``budget=`` takes); ``None``: none.
        backend: the device-side allocator by name (see ``sm.backend_names``).
        adaptors: callables that wrap a backend in another (features by composition, such as
            fault injection); applied to both sides, first innermost.
        timeline: record reserved and active bytes each time a phase closes (see
            ``record_timeline``).

    Example::

        >>> import torch, sharedmem as sm
        >>> pool = sm.BufferPool("cpu")
        >>> x = pool.tensor("fc1.out", (256, 1024))      # train net, batch 256
        >>> y = pool.tensor("fc1.out", (250, 1024))      # eval net, batch 250: same bytes
        >>> x.data_ptr() == y.data_ptr(), pool.stats()["num_buffers"]
        (True, 1)
    """

    def __init__(
        self,
        device: DeviceLike = "cpu",
        *,
        limit: int | str | None = None,
        backend: str | None = None,
        adaptors: Sequence[Callable[[Backend], Backend]] = (),
        timeline: bool = False,
    ) -> None:
        self._base = resolve(device, backend)
        self._limit = None if limit is None else check_bytes(limit, "limit")
        self._ledger = Ledger(single=self._base.accel is None)
        self._blobs: dict[str, Blob] = {}
        self._fast: dict[str, _Cached] = {}
        self._fast_host: dict[str, _Cached] = {}
        self._lock = threading.Lock()  # guards creating names, not using them
        self._protected: dict[str, str] = {}  # names a layer holds (protect()) -> by whom
        self._figures = PoolFigures(self.device, self._blobs, self._ledger, timeline=timeline)
        self._link = _PoolLink(self)
        self._arenas = Arenas()  # the routing state of this pool's arenas, owned here
        self._blocks = StepBlocks(self)
        host, accel = self._base.host, self._base.accel
        for adapt in adaptors:  # e.g. fault injection, innermost first
            host = adapt(host)
            accel = None if accel is None else adapt(accel)
        # The host side of a two-sided device is accounted but never limited.
        moved = self._link.moved
        self._host = AccountedBackend(host, self._ledger, "host", moved)
        self._accel = (
            None if accel is None else AccountedBackend(accel, self._ledger, "device", moved)
        )

    # ---- names -----------------------------------------------------------------------------

    @property
    def device(self) -> str:
        return self._base.device

    @property
    def granularity(self) -> int:
        """Device-side capacities are whole multiples of this many bytes (4096 on the CPU's
        default backend, the VMM granule on ``cuda``): what a planner rounds buffers to."""
        return int(self._device_side.granularity)

    @property
    def stable_address(self) -> bool:
        """Whether device-side growth keeps a buffer's address (no copy, old views valid)."""
        return bool(self._device_side.stable_address)

    @property
    def _device_side(self) -> AccountedBackend:
        # The device's own backend, or the host's on a device with one side (cpu).
        return self._accel if self._accel is not None else self._host

    @property
    def arenas(self) -> Arenas:
        """The routing state of this pool's arenas (what steps served from the pool keep
        between calls); the routing layer's, owned by the pool."""
        return self._arenas

    def device_capacity(self, name: str) -> int:
        """The device bytes the buffer ``name`` holds now (0 for a name the pool lacks)."""
        blob = self._blobs.get(name)
        return 0 if blob is None else blob.data_memory.device_capacity

    def names(self) -> list[str]:
        """The buffer names, in the order they were first asked for."""
        return list(self._blobs)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._blobs

    def __len__(self) -> int:
        return len(self._blobs)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._blobs))

    def __reduce__(self) -> tuple[object, ...]:
        raise TypeError(
            "sharedmem: a BufferPool cannot be pickled or copied: its buffers, limit and "
            "accounting belong to this process. Create a pool in the other process (or copy) "
            "with BufferPool(device, limit=...), and pickle the blobs whose content you need "
            "(pool.blob(name))"
        )

    def __repr__(self) -> str:
        return (
            f"BufferPool(device={self.device!r}, buffers={len(self)}, "
            f"reserved={self._ledger.total:,}, limit={self._limit})"
        )

    def _placement(self, name: str) -> Placement:
        # Each name gets adaptors that know it, so an out-of-memory error can name the buffer.
        limited = self._host if self._accel is None else self._accel
        link = self._link
        guarded = LimitedBackend(limited, self._ledger, link.limit, link.explain, name, self.device)
        if self._accel is None:
            return Placement(self.device, guarded, None)
        return Placement(self.device, self._host, guarded)

    def blob(
        self, name: str, shape: ShapeLike | None = None, dtype: torch.dtype | None = None
    ) -> Blob:
        """The named blob, created on first use (shape ``(0,)``, float32 unless given).

        A given ``shape`` or ``dtype`` is applied (O(1)); the memory grows on the next access.
        Every argument is checked before anything changes: a bad call creates no name.
        """
        check_name(name)
        size = None if shape is None else check_shape(shape)
        kind = None if dtype is None else check_dtype(dtype)
        blob = self._blobs.get(name)
        if blob is None:
            with self._lock:
                blob = self._blobs.get(name)
                if blob is None:
                    blob = Blob((0,), name=name, placement=self._placement(name))
                    blob.on_share = functools.partial(self._link.adopt, name)
                    self._blobs[name] = blob
        if size is not None or kind is not None:
            blob.retype(blob.shape if size is None else size, kind or blob.dtype)
        return blob

    def _adopt(self, name: str, memory: SyncedMemory) -> None:
        """Before the buffer ``name`` takes ``memory`` by share_data / share_grad."""
        # Only memory this pool accounts for and limits: a foreign memory would grow past
        # the limit and outside every figure of stats().
        backend = memory.placement.device_backend
        if getattr(backend, "ledger", None) is not self._ledger:
            raise ValueError(
                f"sharedmem: buffer {name!r} of a BufferPool can only share memory of the same "
                "pool (its limit and stats cover only its own memory); share the other way "
                f"round (other.share_data(pool.blob({name!r}))), or take both from one pool"
            )
        # The fast path would keep the memory left behind (and its bytes) alive.
        self._fast.pop(name, None)
        self._fast_host.pop(name, None)

    # ---- the hot path ------------------------------------------------------------------

    def tensor(
        self, name: str, shape: ShapeLike, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """The named buffer's device-side view, with write intent; the hot path of a loop.

        Each call returns a new tensor object (an alias of the same bytes), so changing one
        view's metadata in place (``resize_``, ``t_``) cannot disturb the next call's.
        """
        try:
            entry = self._fast.get(name)
        except TypeError:  # an unhashable name: the slow path says what is wrong
            entry = None
        if entry is not None and entry.serves(shape, dtype):
            return entry.view.detach()
        return self._acquire(self._fast, name, shape, dtype, Blob.mutable_data)

    def host_tensor(
        self, name: str, shape: ShapeLike, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """The named buffer's host-side view, with write intent (staging, offload)."""
        try:
            entry = self._fast_host.get(name)
        except TypeError:
            entry = None
        if entry is not None and entry.serves(shape, dtype):
            return entry.view.detach()
        return self._acquire(self._fast_host, name, shape, dtype, Blob.mutable_host_data)

    def _acquire(
        self,
        cache: dict[str, _Cached],
        name: str,
        shape: ShapeLike,
        dtype: torch.dtype,
        access: Callable[[Blob], torch.Tensor],
    ) -> torch.Tensor:
        check_name(name)
        size, kind = check_shape(shape), check_dtype(dtype)  # before anything changes
        holder = self._protected.get(name)
        if holder is not None:
            raise SharedMemError(
                f"sharedmem: buffer {name!r} is in use by {holder}; a view of it now would "
                f"let a write corrupt what it holds. Use another name (the {name.split('.')[0]}.* "
                "names belong to that layer), or ask after it is done (after backward)"
            )
        created = name not in self._blobs
        blob = self.blob(name)
        # Remember the shape as the caller spells it, to compare with the next call's: an int,
        # a Size or a tuple of ints as it is, a list of ints as a copy (the caller may change
        # theirs); anything else (numpy ints, an array) as a plain tuple, which such a call
        # never matches: tuples of ints are the fast spelling.
        key: object = tuple(size)
        if _plain(shape):
            key = list(shape) if type(shape) is list else shape
        try:
            view, memory, version = blob.retyped_view(size, kind, access)
        except BaseException:
            if created:  # a refused first request leaves no name behind
                self._drop_new_name(name, blob)
            raise
        cache[name] = _Cached(key, dtype, blob, view, memory, version)
        return view.detach()

    def _drop_new_name(self, name: str, blob: Blob) -> None:
        with self._lock:
            # Unless another thread has used the name meanwhile (its request may have grown it).
            memory = blob.data_memory
            if self._blobs.get(name) is blob and memory.reserved_bytes == 0:
                del self._blobs[name]
                self._fast.pop(name, None)
                self._fast_host.pop(name, None)

    # ---- figures: the pool's PoolFigures answers --------------------------------------------

    def stats(self) -> dict[str, int]:
        """The pool's figures (DESIGN §3): reserved, active and peak bytes, traffic counters,
        the counters of layers built on the pool (``count``; see ``PoolFigures.stats``), and
        ``cached_plans`` / ``evicted_plans``: the ``step()`` signatures whose plans are kept
        now, and those dropped as least recently used (see ``step``)."""
        return self._figures.stats() | self._blocks.stats()

    def phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Attribute growth, peaks and traffic inside the block to the phase ``name``."""
        return self._figures.phase(name)

    def phase_stats(self) -> dict[str, dict[str, int]]:
        """Per phase totals; see ``PoolFigures.phase_stats``."""
        return self._figures.phase_stats()

    def record_timeline(self, on: bool = True) -> None:
        """Start (afresh) or stop recording the memory timeline (a sample per phase close)."""
        self._figures.record_timeline(on)

    @property
    def timeline(self) -> list[Sample]:
        """The recorded samples (empty when the timeline is off)."""
        return self._figures.timeline

    def plot_timeline(self, path: str | Path) -> Path:
        """Write the memory timeline as a PNG (needs matplotlib: ``sharedmem[plot]``)."""
        return self._figures.plot_timeline(path)

    def report(self) -> str:
        """A table a person reads: every buffer, biggest first, totals last."""
        return self._figures.report()

    def count(self, key: str, amount: int) -> None:
        """Add ``amount`` to the counter ``key`` of ``stats()`` (layers built on the pool):
        bytes where the name says ``bytes``, a count otherwise."""
        self._figures.count(key, amount)

    def count_unpooled(self, nbytes: int) -> None:
        """Record bytes one call of a layer on top had to allocate outside the pool."""
        self._figures.count_unpooled(nbytes)

    # ---- whole steps served from the pool ---------------------------------------------------

    def step(
        self,
        name: str,
        *inputs: object,
        arena: str = "act.0",
        params: torch.nn.Module | Iterable[torch.Tensor] | None = None,
    ) -> contextlib.AbstractContextManager[None]:
        """Serve every allocation of the block from one arena of this pool (no tracing).

        The first run of a signature (``name``, the shapes, dtypes and devices of ``inputs``,
        whether autograd is on, and which of ``params`` have a gradient) runs inside the arena
        buffer ``arena`` as it is, each allocation at the first free range that holds it (PyTorch's
        allocator serves only what does not fit), while its allocation sequence is recorded; the
        sequence is then planned at offsets of the arena (a named buffer like any other, shared with
        pooled steps of the same name: train and eval blocks, every batch size and gradient state
        share its bytes, each planned into the arena as the others left it), and later runs get
        those addresses. The arena grows only where a plan lowers the step's peak by growing.
        Allocations that outlive the block (new gradients, the loss) are planned into the arena too,
        in the room the activations leave during backward: their bytes stay fenced while the user
        holds them, and are free again once ``optimizer.zero_grad()`` frees them. One the user still
        holds when the same block runs next (a gradient kept by ``zero_grad(set_to_none=False)``, a
        loss kept in a list) is left to PyTorch's allocator from then on; a block that runs while
        such tensors are held (an evaluation before ``zero_grad()``) is planned around them, once,
        and may grow the arena up to the peak eager holds in that state (the held bytes and its own)
        where that lowers its peak (its first run too: it is served past the arena's bytes, in
        the pages the arena's address range reserved, and the arena grown over what it served).
        An ``optimizer.step()`` in the block that makes the optimizer's
        state (its first step, or a parameter's first gradient) runs as without the pool, so that
        the state, which lives across steps, is never in the arena; the temporaries of its later
        steps are served, and around gradients held in the arena its plan may grow the arena
        (docs/step.md). Any allocation of another thread is PyTorch's as usual. A run that does
        something else (another sequence) is served by PyTorch from there on and recorded anew:
        results are always those of the same code without the block. On ``cuda`` pools, and where
        the router cannot be built, the block runs as it is.

        The plans and recordings of the 64 signatures used most recently are kept (least
        recently used dropped; ``stats()``'s ``cached_plans`` and ``evicted_plans`` count
        them, ``clear_plans()`` drops them all): a loop that meets a new shape every call
        keeps a bounded state, and a dropped signature is recorded anew when it comes back.

        Threads may run blocks of one pool at once, of the same name too: each holds the
        arena while it runs, and a block that finds it held serves from a lane of its own
        (a buffer named ``"<arena>.lane1"`` and so on, grown to what the plan needs, and
        kept for the next time two blocks overlap), so no two blocks share a byte and none
        waits for another, as two eager threads would each allocate their own.

        Args:
            name: the block's name ("train", "eval").
            inputs: the block's inputs, for its signature (any nesting of tensors and values).
            arena: the arena's buffer name.
            params: the parameters whose gradients the block makes (a module, or tensors):
                which of them have a gradient is part of the signature, so that a loop whose
                gradient state changes (accumulation: none, then present) keeps one plan per
                state instead of recording the block anew at each change.

        Example::

            >>> import torch, sharedmem as sm
            >>> pool, model = sm.BufferPool("cpu"), torch.nn.Linear(8, 2)
            >>> for _ in range(3):
            ...     x = torch.randn(4, 8)
            ...     with pool.step("train", x):
            ...         model(x).square().sum().backward()
        """
        return self._blocks.block(name, inputs, arena, params)

    def clear_plans(self) -> int:
        """Drop the plans and recordings ``step()`` keeps (each signature is recorded anew on
        its next call); returns how many signatures were kept. The arena's bytes stay: give
        them back with ``trim()`` or ``release()``."""
        return self._blocks.clear()

    def growth_room(self, name: str) -> int | None:
        """The most device bytes the buffer ``name`` may grow to under the limit (``None``:
        no limit), counting that a moving backend holds the old block during the copy."""
        if self._limit is None:
            return None
        blob = self._blobs.get(name)
        capacity = 0 if blob is None else blob.data_memory.device_capacity
        others = self._ledger.device_reserved - capacity
        room = self._limit - others - (0 if self.stable_address else capacity)
        return max(capacity, room)

    # ---- names held by layers on top ---------------------------------------------------

    def protect(self, name: str, holder: str) -> None:
        """Refuse ``tensor(name)`` / ``host_tensor(name)`` until ``unprotect(name)``: a layer
        on top (activation offload) holds bytes there that a write by hand would corrupt."""
        check_name(name)
        with self._lock:
            self._protected[name] = holder
            # Cached views would skip the check: the next request takes the checked path.
            self._fast.pop(name, None)
            self._fast_host.pop(name, None)

    def unprotect(self, name: str) -> None:
        """Undo ``protect(name)`` (nothing if it is not protected)."""
        with self._lock:
            self._protected.pop(name, None)

    # ---- limit, trimming ---------------------------------------------------------------

    @property
    def limit(self) -> int | None:
        """The cap on reserved device bytes, or ``None``."""
        return self._limit

    def set_limit(self, nbytes: int | str | None) -> None:
        """Set or clear (``None``) the cap on reserved device bytes: bytes, or a size such as
        ``"8G"``.

        A limit below what is reserved now frees nothing; it refuses further growth.
        """
        self._limit = None if nbytes is None else check_bytes(nbytes, "limit")

    def reserved_after(self, sizes: Mapping[str, int]) -> int:
        """The device bytes this pool would hold at the peak of growing each named buffer to
        at least ``sizes[name]`` bytes; nothing is allocated (what a planner checks against a
        limit or a budget). A moving backend holds a buffer's old block beside its new one
        while it copies: the biggest such moment is included.

        Args:
            sizes: bytes per buffer name; names the pool does not have yet are new buffers.
        """
        side = self._device_side
        added = held = 0
        for name, nbytes in sizes.items():
            blob = self._blobs.get(name)
            have = 0 if blob is None else blob.data_memory.device_capacity
            want = side.round(check_nbytes(nbytes, "size"))
            if want > have:
                added += want - have
                if have and not side.stable_address:
                    held = max(held, have)
        return self._ledger.device_reserved + added + held

    def in_place_room(self, name: str) -> int:
        """The most device bytes the buffer ``name`` may grow to where it keeps its address:
        the address range its block reserved (a stable-address host pool), within the limit;
        its capacity where any growth would move it (or it has no block yet). Those bytes are
        mapped already: a routed recording may serve from them before the buffer grows over
        them (``Route``), touching only the pages it serves."""
        check_name(name)
        blob = self._blobs.get(name)
        if blob is None:
            return 0
        memory = blob.data_memory
        capacity = memory.device_capacity
        block = memory._device.block  # the pool owns its memories
        if not self.stable_address or block is None or not isinstance(block.handle, mmap.mmap):
            return capacity
        reach = len(block.handle) // self.granularity * self.granularity
        room = self.growth_room(name)
        return max(capacity, reach if room is None else min(reach, room))

    def give_back_above(self, name: str, nbytes: int) -> int:
        """Give back the device bytes of the buffer ``name`` above ``nbytes`` (rounded up to
        whole granules), where its bytes below stay where they are (a stable-address pool;
        elsewhere nothing is given back); returns the bytes given back. What lives below
        ``nbytes`` is untouched: a routed arena gives back what a passing state grew it by
        while the tensors it holds (gradients) stay."""
        check_name(name)
        keep = round_up(check_nbytes(nbytes), self.granularity)
        blob = self._blobs.get(name)
        if blob is None or not self.stable_address:
            return 0
        memory = blob.data_memory
        if memory.device_capacity <= keep:
            return 0
        self._forget_views()
        blob.retype((keep,), torch.uint8)
        return memory.shrink_to_fit()

    def trim(self) -> int:
        """Shrink every buffer to its current size; returns the bytes given back.

        On a stable-address backend (the defaults on ``cpu``, ``emulated`` and ``cuda`` with
        vmm) the buffers stay where they are, so views of the bytes below each size stay
        valid. On a moving backend (``pageable``, ``cudart``, ``torch``) trimming moves every
        buffer it shrinks, like a growth does: a view taken before ``trim()`` no longer reaches
        the buffer, and a write through it is lost. There, call ``trim()`` between steps,
        when no thread holds or is acquiring a view, and fetch views afresh after it.
        """
        self._forget_views()
        return sum(memory.shrink_to_fit() for memory in self._movable())

    def release(self) -> int:
        """Free every buffer's memory (names stay, content goes); returns the bytes freed.

        An arena that still holds tensors of a step (see ``step``: a tensor kept past its
        step's end) is left as it is, by ``trim`` too, until those tensors are freed.
        """
        self._forget_views()
        return sum(memory.release() for memory in self._movable())

    def _movable(self) -> list[SyncedMemory]:
        # Memories that no routed allocation lives in: those may shrink, move or go.
        held = {
            id(self._blobs[name].data_memory)
            for name in list(self._blobs)
            if arena_live_bytes(self, name)
        }
        return [m for m in unique_memories(self._blobs) if id(m) not in held]

    def _forget_views(self) -> None:
        # The fast path's cached views would keep old blocks of moving backends (and of CUDA
        # backends that free with the last view) alive after they were given back.
        self._fast.clear()
        self._fast_host.clear()


def _plain(shape: object) -> bool:
    """``shape`` is an int, a Size, or a tuple or list of ints: nothing that merely compares
    equal to one (a float, a 0-d tensor) and nothing mutable inside."""
    kind = type(shape)
    if kind is tuple or kind is list:  # the common spellings first: this is the hot path
        # A loop, not all(...): a generator costs four times as much.
        for dim in shape:  # type: ignore[attr-defined]  # noqa: SIM110
            if type(dim) is not int:
                return False
        return True
    return kind is int or kind is _SIZE


_SIZE = torch.Size  # a module global: no attribute lookup on torch per call
