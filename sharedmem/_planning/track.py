"""``sm.track_memory``: where an eager training loop's memory goes, phase by phase.

The phases are found where they happen: a call of the model (forward), of
``torch.autograd.backward`` / ``torch.autograd.grad`` (backward), of ``optimizer.step``
(step) and of ``zero_grad`` (on the optimizer or the model); what runs between a forward and
the backward after it is the loss. The bytes are the ``storages`` ledger's: every storage
counted once, by what it is.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from .._devices import DeviceLike, normalize_device
from .._errors import SharedMemError
from .storages import StorageLedger, TrackedStorage
from .track_report import PhaseMemory, format_report

__all__ = ["MemoryTracker", "PhaseMemory", "track_memory"]

_ACTIVE: list[MemoryTracker] = []  # at most one: the dispatch mode and the patches are global


@dataclass
class _Open:
    """A phase that has begun and not ended; ``depth`` counts its calls inside itself."""

    name: str
    depth: int = 1


@dataclass(eq=False)
class _Segment:
    """A phase being recorded, and once closed, the moments its figures were taken at."""

    name: str
    step: int
    start: int
    before: dict[str, int]
    end: int = -1
    peak_at: int = -1
    live: dict[str, int] | None = None
    peak: dict[str, int] | None = None

    def moments(self) -> Iterator[tuple[int, dict[str, int]]]:
        yield self.start, self.before
        if self.live is not None and self.peak is not None:
            yield self.end, self.live
            yield self.peak_at, self.peak


class MemoryTracker:
    """Records an eager loop's memory per phase; made by ``sm.track_memory``.

    A tracker records one run of its ``with`` block; trackers do not nest (one dispatch mode
    and one set of hooks see the whole process).
    """

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, device: str
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.device = device
        # The emulated device's memory is host memory, and plain tensors there are CPU ones.
        self._ledger = StorageLedger("cpu" if device == "emulated" else device)
        self._segments: list[_Segment] = []
        self._open: _Segment | None = None
        self._stack: list[_Open] = []  # the open phases, innermost last
        self._last_closed = ""  # the last phase closed between phases ("forward" -> loss)
        self._forward_start = 0
        self._last_live: tuple[int, dict[str, int]] = (-1, {})
        self._steps = 0
        self._state = "new"
        self._thread = threading.get_ident()
        self._exits = contextlib.ExitStack()

    @property
    def phases(self) -> list[PhaseMemory]:
        """The phases recorded so far, in order."""
        return [
            PhaseMemory(s.name, s.step, dict(s.before), dict(s.live), dict(s.peak))
            for s in self._segments
            if s.live is not None and s.peak is not None
        ]

    def report(self) -> str:
        """A table a person reads: each phase's live and peak bytes by category, and what
        the first step's loss, backward and optimizer step added."""
        return format_report(self.phases, self.device)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Mark a phase of your own: what runs inside is recorded under ``name``.

        A phase inside another (yours or a found one) splits it: the outer phase is recorded
        in two parts, before and after the inner one, each under its own name.

        Args:
            name: the phase's name in ``phases`` and the report.

        Example::

            >>> import torch, sharedmem as sm
            >>> model = torch.nn.Linear(8, 2)
            >>> with sm.track_memory(model) as t:
            ...     with t.phase("batch"):
            ...         x = torch.randn(4, 8)
            ...     y = model(x)
            >>> [p.name for p in t.phases]
            ['batch', 'forward']
        """
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"sharedmem: a phase's name must be a non-empty str, got {name!r}")
        if self._state != "active":
            raise SharedMemError(
                "sharedmem: phase() marks a phase inside `with sm.track_memory(...) as t:`; "
                f"this tracker is {'not started' if self._state == 'new' else 'finished'}"
            )
        self._enter(name, found=False)
        try:
            yield
        finally:
            self._leave(name)

    # -- the context -------------------------------------------------------------------

    def __enter__(self) -> MemoryTracker:
        if self._state != "new":
            raise SharedMemError(
                "sharedmem: a tracker records one run of its with block; call "
                "sm.track_memory(model, optimizer) again for another"
            )
        if _ACTIVE:
            raise SharedMemError(
                "sharedmem: track_memory is already active; trackers do not nest (the "
                "outer one already counts everything the inner one would)"
            )
        _ACTIVE.append(self)
        self._state = "active"
        try:
            self._start()
        except BaseException:
            self._finish()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            while self._stack:  # an exception left phases open: record them as they are
                self._leave(self._stack[-1].name, force=True)
            self._close(name="other")
        finally:
            self._finish()

    def _start(self) -> None:
        ledger = self._ledger
        ledger.adopt(self._roles())
        hooks = self._exits
        model = self.model
        hooks.callback(model.register_forward_pre_hook(self._forward_pre, with_kwargs=True).remove)
        hooks.callback(model.register_forward_hook(self._forward_post, always_call=True).remove)
        if self.optimizer is not None:
            opt = self.optimizer
            hooks.callback(opt.register_step_pre_hook(lambda *_: self._enter("step")).remove)
            hooks.callback(opt.register_step_post_hook(lambda *_: self._leave("step")).remove)
        for owner in (model, self.optimizer):
            if owner is not None:
                hooks.enter_context(_wrapped(owner, "zero_grad", self._around("zero_grad")))
        for name in ("backward", "grad"):
            hooks.enter_context(_wrapped(torch.autograd, name, self._around("backward")))
        # Under someone else's saved-tensor hooks (an offload, a checkpoint) ours would replace
        # theirs and change what the loop keeps: then saved tensors count as temporaries.
        if torch._C._autograd._top_saved_tensors_default_hooks(False) is None:
            hooks.enter_context(
                torch.autograd.graph.saved_tensors_hooks(ledger.pack, ledger.unpack)
            )
        hooks.enter_context(ledger)
        self._begin("other")

    def _finish(self) -> None:
        try:
            self._exits.close()
        finally:
            self._ledger.on_read = None
            self._ledger.close()
            self._state = "done"
            _ACTIVE.remove(self)

    def _roles(self) -> Iterator[tuple[torch.Tensor, str]]:
        """Every tensor that has a role now: the model's, its gradients, the optimizer's."""
        for tensor in (*self.model.parameters(), *self.model.buffers()):
            yield tensor, "parameters"
            if tensor.grad is not None:
                yield tensor.grad, "gradients"
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is not None:
                        yield param.grad, "gradients"
            for state in self.optimizer.state.values():
                for value in pytree.tree_leaves(state):
                    if isinstance(value, torch.Tensor):
                        yield value, "optimizer_state"

    # -- where phases are found --------------------------------------------------------

    def _forward_pre(self, _module: nn.Module, args: Any, kwargs: Any) -> None:
        if self._thread == threading.get_ident() and not self._in("forward"):
            for value in pytree.tree_leaves((args, kwargs)):
                if isinstance(value, torch.Tensor):
                    self._learn(self._ledger.add(value.untyped_storage()), "inputs")
        self._enter("forward")

    def _forward_post(self, _module: nn.Module, _args: Any, _out: Any) -> None:
        self._leave("forward")

    def _loss_reads(self, tensors: list[Any]) -> None:
        """Tensors made before the forward that the loss reads are inputs (the targets)."""
        for value in tensors:
            if isinstance(value, torch.Tensor):
                entry = self._ledger.storage_of(value)
                if entry is None:  # made before tracking began: counted from here on
                    entry = self._ledger.add(value.untyped_storage())
                elif entry.born > self._forward_start:
                    continue  # made by the forward or the loss: not an input
                self._learn(entry, "inputs")

    def _around(self, name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(original)
            def call(*args: Any, **kwargs: Any) -> Any:
                if self._state != "active" or self._thread != threading.get_ident():
                    return original(*args, **kwargs)
                self._enter(name)
                try:
                    return original(*args, **kwargs)
                finally:
                    self._leave(name)

            return call

        return wrap

    # -- phases and segments -----------------------------------------------------------

    def _in(self, name: str) -> bool:
        return bool(self._stack) and self._stack[-1].name == name

    def _enter(self, name: str, *, found: bool = True) -> None:
        if self._state != "active" or self._thread != threading.get_ident():
            return
        if found and self._in(name):  # the same phase again inside itself: one phase
            self._stack[-1].depth += 1
            return
        if self._stack:
            self._close(name=self._stack[-1].name)
        else:
            gap = "loss" if self._last_closed == "forward" and name == "backward" else "other"
            self._close(name=gap)
        self._stack.append(_Open(name))
        if name in ("forward", "backward"):
            self._ledger.on_read = None
        if name == "forward" and sum(p.name == "forward" for p in self._stack) == 1:
            self._forward_start = self._ledger.events
        self._begin(name)

    def _leave(self, name: str, *, force: bool = False) -> None:
        if self._state != "active" or self._thread != threading.get_ident():
            return
        if not self._in(name):
            return  # a phase that began before tracking did (or in another thread)
        self._stack[-1].depth -= 1
        if self._stack[-1].depth > 0 and not force:
            return
        self._close(name=name)
        self._stack.pop()
        if name == "forward" and not any(p.name == "forward" for p in self._stack):
            self._ledger.on_read = self._loss_reads  # until the next backward or forward
        if self._stack:
            self._begin(self._stack[-1].name)  # the outer phase goes on
            return
        self._last_closed = name
        if name == "step" or (name == "backward" and self.optimizer is None):
            self._steps += 1
        self._begin("")  # between phases: named when it closes

    def _begin(self, name: str) -> None:
        ledger = self._ledger
        at, before = self._last_live
        if at != ledger.events:
            before = ledger.by_category(ledger.events)
        self._open = _Segment(name, self._steps, ledger.events, dict(before))
        ledger.reset_peak()

    def _close(self, *, name: str) -> None:
        segment, ledger = self._open, self._ledger
        if segment is None:
            return
        for entry in ledger.refresh_roles(self._roles()):
            self._mend(entry, entry.role)  # this segment's start included
        self._open = None
        segment.name = segment.name or name
        segment.end, segment.peak_at = ledger.events, ledger.peak_at
        segment.live = ledger.by_category(segment.end)
        segment.peak = ledger.by_category(segment.peak_at)
        self._last_live = (segment.end, segment.live)
        quiet = segment.start == segment.end
        if segment.name != "other" or not quiet:  # a gap where nothing happened: no record
            self._segments.append(segment)

    def _learn(self, entry: TrackedStorage | None, role: str) -> None:
        if entry is not None and entry.role is None:
            entry.role = role
            self._mend(entry, role)

    def _mend(self, entry: TrackedStorage, role: str | None) -> None:
        """Move ``entry`` to ``role`` at every recorded moment it lived through, where it was
        counted as a temporary or an activation: a role is what a tensor is, all along."""
        if role is None:
            return
        segments = [*self._segments, *([self._open] if self._open is not None else [])]
        for segment in reversed(segments):
            for moment, figures in segment.moments():
                if entry.alive_at(moment):
                    figures[entry.counted_at(moment)] -= entry.nbytes
                    figures[role] += entry.nbytes
            if segment.start < entry.born:
                break  # earlier segments ended before it was made


def track_memory(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    device: DeviceLike | None = None,
) -> MemoryTracker:
    """Track where an eager training loop's memory goes, phase by phase.

    Use it around an ordinary loop: ``with sm.track_memory(model, optimizer) as t:``. The
    phases are found by themselves (``zero_grad``, ``forward``, ``loss``, ``backward``,
    ``step``), or marked with ``t.phase(name)``; ``t.phases`` lists a ``PhaseMemory`` per
    phase (live bytes at its start and end, and at its peak, by category) and ``t.report()``
    prints them with what the first step's loss, backward and optimizer step added.

    Every storage made on ``device`` inside the block is counted once, from the op that made
    it until Python drops it, by the device allocator's rounding (512-byte blocks on CUDA): at
    each phase's end the total is exactly what the allocator holds for them. Before the block,
    only the model's parameters and buffers, their gradients and the optimizer's state are
    counted; an input made before the block is counted from its first use. Not seen: an
    op's own scratch memory (freed before it returns, it can raise the allocator's peak
    above ``peak``), and memory made outside PyTorch's ops (``torch.from_numpy``). Under
    another saved-tensor hook (``torch.utils.checkpoint``, ``sm.save_on_pool``), inside the
    block or around it, the tracker leaves that hook alone and what it keeps counts as
    temporaries where it lives, not as activations.

    Args:
        model: the model whose calls are the forward phase.
        optimizer: its ``step`` is the step phase and its ``state`` the optimizer state.
        device: whose memory is counted (one allocator's: a batch still on the host is not
            a GPU's); the model's by default. ``"emulated"`` counts the CPU's: plain tensors
            have no emulated device, a loop beside an emulated pool runs on the CPU.

    Example::

        >>> import torch, sharedmem as sm
        >>> model = torch.nn.Linear(64, 10)
        >>> opt = torch.optim.Adam(model.parameters())
        >>> with sm.track_memory(model, opt) as t:
        ...     x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
        ...     opt.zero_grad()
        ...     loss = torch.nn.functional.cross_entropy(model(x), y)
        ...     loss.backward()
        ...     opt.step()
        >>> [p.name for p in t.phases]
        ['other', 'zero_grad', 'forward', 'loss', 'backward', 'step']
        >>> t.phases[-1].live["optimizer_state"] == 2 * (64 * 10 + 10) * 4 + 2 * 4
        True
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"sharedmem: model must be a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"sharedmem: optimizer must be a torch.optim.Optimizer or None, "
            f"got {type(optimizer).__name__}"
        )
    name = normalize_device(_device_of(model) if device is None else device)
    return MemoryTracker(model, optimizer, name)


@contextlib.contextmanager
def _wrapped(
    owner: object, name: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> Iterator[None]:
    """Replace ``owner.name`` by ``wrap(owner.name)`` for the block, and put it back."""
    own = vars(owner) if hasattr(owner, "__dict__") else {}
    had, previous = name in own, own.get(name)
    object.__setattr__(owner, name, wrap(getattr(owner, name)))
    try:
        yield
    finally:
        if had:
            object.__setattr__(owner, name, previous)
        else:
            object.__delattr__(owner, name)


def _device_of(model: nn.Module) -> torch.device:
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")
