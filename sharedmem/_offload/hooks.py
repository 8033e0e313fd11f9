"""Activation offload: tensors saved for backward go to pooled host buffers and come back,
prefetched, just before backward needs them (vDNN on a pool)."""

from __future__ import annotations

import threading
import warnings
from typing import Any

import torch

from .._errors import SharedMemError
from .._layout import extent
from .._pool import BufferPool
from .._validate import _SUPPORTED_DTYPES, check_nbytes
from .copies import copies_for
from .names import names_of
from .step import OffloadStep, Saved

__all__ = ["save_on_pool"]

_DEFAULT_MIN_BYTES = 1 << 20
_DEFAULT_DEPTH = 2  # restored tensors in flight ahead of backward, at most
_WINDOW = 2  # offloads in flight behind forward, at most
_COUNTERS = (
    "offloaded_bytes_total",
    "prefetched_bytes_total",
    "restored_bytes_total",
    "kept_bytes_total",
    "pooled_bytes_total",
)

_active = threading.local()  # the save_on_pool active in this thread, if any


class save_on_pool(torch.autograd.graph.saved_tensors_hooks):
    """Keep tensors saved for backward in pool buffers; with ``offload``, on the host side.

    Inside the block every tensor autograd saves for backward that is at least ``min_bytes``
    is copied into a pool buffer, and autograd keeps a small handle instead of the tensor, so
    the tensor's device memory goes back to the allocator once the copy has read it. Offloads
    run behind forward (on a side stream on CUDA), at most two in flight: the third makes
    compute wait for the oldest, which bounds the device memory they hold when copies are
    slower than compute. In backward each tensor is restored into a fresh device tensor just
    before its node runs; with ``prefetch`` the ones saved just before it (backward runs
    roughly last-in first-out) are restored ahead, so copies overlap compute. The last
    offloads of forward are still on the device when backward starts and are handed back
    without a copy.

    What is left alone (kept by autograd as usual): parameters, frozen ones too, other leaves
    that require grad, and views of them (they stay alive anyway), tensors under ``min_bytes``,
    tensors on another device than the pool's, and tensors a byte copy cannot carry (sparse,
    quantized, nested, tensor subclasses, conjugate or negative views). A module's registered
    buffers are plain tensors that nothing tells from inputs: a big one that is saved is
    copied like any activation (exact, but it frees nothing, as the module keeps it); make
    a big constant a frozen ``nn.Parameter`` to keep it out.

    **Buffers.** Saved tensors go into buffers named ``offload.<n>`` (``saved.<n>`` without
    ``offload``), ``n`` being the tensor's place in its forward: numbering starts at 0 at every
    entry, and again when a forward follows a backward inside one block (a training loop
    inside one ``with``). The same model run again therefore reuses the same buffers in the
    same order: the host side grows during the first step (pinned once, on CUDA) and never
    again, which ``stats()["num_grows"]`` and ``host_reserved_bytes`` show. A buffer is reused
    only once autograd has dropped every handle to it (after backward, or when the graph is
    freed); a graph still alive keeps its buffers, and the next step uses ``offload.<n>.1``
    (and so on) meanwhile. Leave these names to ``save_on_pool``, and release the pool only
    when no graph needs them.

    **Exactness.** A saved tensor is carried as the raw bytes from its first element to its last
    and rebuilt with the same shape, strides, dtype and alignment, so views, transposed and
    channels-last tensors round-trip bit for bit, and gradients equal those of the plain run.
    A tensor saved by several nodes, or a view lying inside a tensor already saved (``flatten``
    before a classifier), is stored once and restored once per backward.

    **Memory safety.** Restored tensors come from the device's allocator (PyTorch's caching
    allocator on CUDA, which reuses memory without driver calls), never from a ring of pool
    buffers: whoever keeps one (the engine while a node runs, a ``create_graph`` graph, code
    reading ``grad_fn._saved_self``) keeps its memory, so nothing can be overwritten under it.
    A restored tensor is kept until every save of it has been unpacked in the current backward,
    as long as the plain run keeps the original. With ``retain_graph=True`` the host copy stays
    until the graph is freed, so every further backward restores again and is exact. On CUDA
    every copy is ordered against the compute stream by events, and device memory is only
    dropped once the compute stream has waited for the copy using it (or after
    ``record_stream``), so the caching allocator never hands out bytes a copy still uses.

    A saved tensor changed in place after it was saved (through itself or any view of it)
    raises ``SharedMemError``, a ``RuntimeError`` with autograd's words, in backward, as
    autograd does without hooks (with hooks, ``save_on_cpu`` included, autograd checks nothing).

    **Stats** (``pool.stats()``, and ``report()`` when not zero; running totals over every
    step): ``offloaded_bytes_total`` copied into host buffers, ``pooled_bytes_total`` copied
    into device buffers (``offload=False``), ``restored_bytes_total`` copied back for backward,
    ``prefetched_bytes_total`` the part of those that was restored ahead of use,
    ``kept_bytes_total`` handed back from device memory still held for an
    offload in flight (no copy). On ``emulated`` the copies also count in
    ``device_to_host_bytes`` and ``host_to_device_bytes``.

    Nesting ``save_on_pool`` (on any pool) raises ``SharedMemError``. It is for eager autograd;
    it does not apply to ``torch.compile``-d code or to a pooled graph executor, which manages
    its own buffers.

    Args:
        pool: the pool that holds the saved tensors.
        offload: ``True``: host buffers (the memory of ``cpu`` itself, emulated host memory,
            pinned memory on CUDA), giving the device memory back. ``False`` (deprecated: a
            step's memory in the pool is ``with pool.step(name, *inputs):`` around forward
            and backward, which serves every allocation of the step without a copy): the
            pool's device buffers (saved activations show in the pool's stats and count
            against its limit).
        prefetch: restore ahead of use (``True``: up to 2 tensors ahead; an int: that many).
        min_bytes: smaller tensors are left alone (default 1 MiB).

    Example::

        >>> import torch, sharedmem as sm
        >>> pool = sm.BufferPool("emulated")
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)])
        >>> x = torch.randn(1024, 512)  # 2 MiB activations
        >>> with sm.save_on_pool(pool):
        ...     loss = model(x).square().sum()
        >>> loss.backward()
        >>> s = pool.stats()
        >>> back = s["restored_bytes_total"] + s["kept_bytes_total"]
        >>> s["offloaded_bytes_total"] >> 20, back >> 20
        (10, 10)
        >>> s["device_reserved_bytes"], s["num_grows"]
        (0, 5)
    """

    def __init__(
        self,
        pool: BufferPool,
        *,
        offload: bool = True,
        prefetch: bool | int = True,
        min_bytes: int = _DEFAULT_MIN_BYTES,
    ) -> None:
        if not isinstance(pool, BufferPool):
            raise TypeError(
                f"sharedmem: save_on_pool takes a BufferPool, got {type(pool).__name__}"
            )
        if not isinstance(offload, bool):
            raise TypeError(f"sharedmem: offload must be a bool, got {type(offload).__name__}")
        if not offload:
            warnings.warn(
                "sharedmem: save_on_pool(pool, offload=False) is deprecated: to keep a step's "
                "memory in the pool, run forward and backward in `with pool.step(name, "
                "*inputs):` (every allocation of the step served from the pool, no copies); "
                "save_on_pool is for offloading saved tensors to host memory",
                DeprecationWarning,
                stacklevel=2,
            )
        if isinstance(prefetch, bool):
            depth = _DEFAULT_DEPTH if prefetch else 0
        elif isinstance(prefetch, int):
            depth = check_nbytes(prefetch, "prefetch")
        else:
            raise TypeError(
                f"sharedmem: prefetch must be a bool or an int, got {type(prefetch).__name__}"
            )
        self._pool = pool
        self._offload = offload
        # Without offload a restore is a copy on the device: nothing to overlap.
        self._depth = depth if offload else 0
        self._min_bytes = check_nbytes(min_bytes, "min_bytes")
        self._copies = copies_for(pool.device)
        self._names = names_of(pool, "offload" if offload else "saved")
        # The thread inside the block, and the step of its current forward. Both change under
        # the lock: two threads entering one object at once must not both get in, and the
        # pack hook (also run by autograd's device threads) may start the next step.
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._step: OffloadStep | None = None
        for key in _COUNTERS:
            pool.count(key, 0)  # the keys are in stats() from the start
        super().__init__(self._pack, _unpack)

    def __enter__(self) -> None:
        me = threading.get_ident()
        with self._lock:  # checked and claimed at once
            if self._owner is not None and self._owner != me:
                raise SharedMemError(
                    "sharedmem: this save_on_pool object is already in use in another thread; "
                    "give each thread its own (sm.save_on_pool(pool) in the thread)"
                )
            if self._owner is not None or getattr(_active, "hooks", None) is not None:
                raise SharedMemError(
                    "sharedmem: save_on_pool cannot be nested (one is already active in this "
                    "thread): saved tensors would go to two places at once. Use a single "
                    "save_on_pool around the whole forward."
                )
            self._owner = me
        _active.hooks = self
        try:
            self._step = self._new_step()
            super().__enter__()
        except BaseException:
            self._leave()
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            super().__exit__(*exc)
        finally:
            step = self._leave()
            if step is not None:
                step.close()  # the step lives on in the handles autograd holds

    def _leave(self) -> OffloadStep | None:
        with self._lock:
            step, self._step, self._owner = self._step, None, None
        _active.hooks = None
        return step

    def _new_step(self) -> OffloadStep:
        return OffloadStep(
            self._pool,
            self._names,
            self._copies,
            offload=self._offload,
            depth=self._depth,
            window=_WINDOW,
        )

    def _current_step(self) -> OffloadStep | None:
        """The step a save belongs to: a new one when the last forward is over."""
        with self._lock:
            step = self._step
            if step is not None and step.spent():
                # A forward after a backward in the same block (a training loop inside one
                # ``with``): its tensors are numbered from 0 again, so every iteration uses
                # the same buffers; the old step lives on in the handles autograd holds.
                step.close(retire=True)
                step = self._step = self._new_step()
            return step

    def _pack(self, tensor: torch.Tensor) -> Any:
        nbytes = extent(tensor) if self._eligible(tensor) else 0
        step = self._current_step() if nbytes >= max(self._min_bytes, 1) else None
        if step is None:
            # Left alone. Detached so that the handle does not hold the tensor's own graph
            # (an output saved by its node would otherwise form a reference cycle).
            return tensor.detach()
        return step.pack(tensor, nbytes)

    def _eligible(self, tensor: torch.Tensor) -> bool:
        base = tensor._base  # a view of a parameter (weight.t() in addmm) stays like it
        return (
            type(tensor) is torch.Tensor  # not a Parameter (frozen or not), not a subclass
            and not (tensor.requires_grad and tensor.is_leaf)
            and not (base is not None and _kept_anyway(base))
            and tensor.layout == torch.strided
            and not tensor.is_nested
            and not tensor.is_quantized
            and not tensor.is_conj()
            and not tensor.is_neg()
            and tensor.dtype in _SUPPORTED_DTYPES
            and tensor.device == self._copies.device
            and tensor.data_ptr() % tensor.element_size() == 0
        )


def _kept_anyway(base: torch.Tensor) -> bool:
    """Whether a view's base outlives the step anyway, so that moving it would save nothing:
    a parameter (a frozen one too: LoRA, fine-tuning), or another leaf that requires grad."""
    return isinstance(base, torch.nn.Parameter) or (base.requires_grad and base.is_leaf)


def _unpack(packed: Any) -> torch.Tensor:
    if isinstance(packed, Saved):
        return packed.slot.step.unpack(packed)
    assert isinstance(packed, torch.Tensor)
    return packed
