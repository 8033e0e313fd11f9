"""Every storage an eager loop keeps alive, counted once, with what it is and when it lived.

A dispatch mode sees each op's results; a storage the op did not take from its arguments is
new memory and is counted, by the device allocator's rounding (``live.round_for``), until
Python drops its last reference. Events (a storage made, freed, saved for backward, released)
are numbered, so what was live at any moment, and what it was then, can be told afterwards:
a phase keeps only the number of the moment it peaked, not a copy of what was live.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from .estimate import CATEGORIES
from .live import round_for

__all__ = ["ROLES", "StorageLedger", "TrackedStorage"]

# What a tensor can be, by identity, strongest first: a weight saved for backward is still a
# parameter. "activations" (saved for backward) and "temporaries" (the rest) are not roles:
# they follow from the saved spans below.
ROLES = ("parameters", "gradients", "optimizer_state", "inputs")

# torch.tensor(...) and friends allocate outside the dispatcher and hand the fresh tensor to
# lift_fresh, whose schema says it aliases its argument: its result is new memory all the same.
_FRESH_ALIASES = frozenset({torch.ops.aten.lift_fresh.default})


@dataclass(slots=True, eq=False)
class TrackedStorage:
    """One counted storage: its bytes, the events that bound its life, what it is."""

    nbytes: int
    born: int  # the event that made it (0: there before tracking began)
    died: int | None = None
    role: str | None = None  # one of ROLES once known; it sticks until the next refresh
    saved: int = 0  # how many autograd slots hold it for backward now
    spans: list[list[int]] = field(default_factory=list)  # [from, to) while saved; to=-1 open
    finalizer: weakref.finalize[..., Any] | None = None

    def alive_at(self, moment: int) -> bool:
        return self.born <= moment and (self.died is None or self.died > moment)

    def category_at(self, moment: int) -> str:
        return self.role if self.role is not None else self.counted_at(moment)

    def counted_at(self, moment: int) -> str:
        """Its category at ``moment`` without a role: saved for backward then, or not."""
        for start, end in self.spans:
            if start <= moment and (end < 0 or end > moment):
                return "activations"
        return "temporaries"


class _Saved:
    """What autograd keeps for a saved tensor while the tracker runs: the tensor, and a
    release when autograd drops it (after backward used it, or with the graph)."""

    __slots__ = ("key", "ledger", "tensor")

    def __init__(self, tensor: torch.Tensor, key: int, ledger: StorageLedger) -> None:
        self.tensor, self.key, self.ledger = tensor, key, ledger

    def __del__(self) -> None:
        self.ledger.release(self.key)


class StorageLedger(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """A dispatch mode keeping every live storage of the loop on ``device`` (``"cpu"`` or
    ``"cuda:N"``: one allocator's memory) and the running sum of their bytes.

    ``live`` is what the allocator holds for counted storages now; ``peak`` and ``peak_at``
    are the highest it reached since ``reset_peak`` and the event at which it did.
    """

    def __init__(self, device: str) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.device = device
        self._rounding = round_for(device)
        self.entries: dict[int, TrackedStorage] = {}  # by id of the storage object
        self.freed: list[TrackedStorage] = []  # died since reset_peak: the peak may hold them
        self.events = 0
        self.live = 0
        self.peak = 0
        self.peak_at = 0
        self.on_read: Any = None  # called with each op's tensor arguments, when set
        # Frees come from whichever thread drops the last reference (autograd's device
        # threads on a GPU), and from the garbage collector in the middle of our own work.
        self._lock = threading.RLock()
        self._aliasing: dict[Any, bool] = {}

    # -- counting ----------------------------------------------------------------------

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if self.on_read is not None:
            self.on_read(pytree.tree_leaves((args, kwargs)))
        out = func(*args, **kwargs)
        results = [v for v in pytree.tree_leaves(out) if isinstance(v, torch.Tensor)]
        if results:
            taken = self._argument_storages(func, args, kwargs)
            for value in results:
                storage = value.untyped_storage()
                if id(storage) not in taken:
                    self.add(storage)
        return out

    def _argument_storages(self, func: Any, args: Any, kwargs: Any) -> set[int]:
        """The storages an aliasing op (a view, an in-place or ``out=`` op) may return."""
        aliasing = self._aliasing.get(func)
        if aliasing is None:
            schema = getattr(func, "_schema", None)
            returns = schema.returns if schema is not None else ()
            aliasing = func not in _FRESH_ALIASES and (
                schema is None or any(r.alias_info is not None for r in returns)
            )
            self._aliasing[func] = aliasing
        if not aliasing:
            return set()
        leaves = pytree.tree_leaves((args, kwargs))
        return {id(v.untyped_storage()) for v in leaves if isinstance(v, torch.Tensor)}

    def add(self, storage: torch.UntypedStorage, role: str | None = None) -> TrackedStorage | None:
        """Count ``storage`` from now on (once); a storage already counted is returned."""
        key = id(storage)
        entry = self.entries.get(key)
        if entry is not None or str(storage.device) != self.device:  # another memory
            return entry
        nbytes = self._rounding(storage.nbytes())
        fresh = TrackedStorage(nbytes, 0, role=role)  # made before the lock: it may collect
        with self._lock:
            self.events += 1
            fresh.born = self.events
            self.entries[key] = fresh
            self.live += nbytes
            if self.live > self.peak:
                self.peak, self.peak_at = self.live, self.events
        fresh.finalizer = weakref.finalize(storage, self._free, key)
        return fresh

    def adopt(self, tensors: Iterable[tuple[torch.Tensor, str]]) -> None:
        """Count what was there before tracking began, as of event 0, with its role."""
        for tensor, role in tensors:
            entry = self.add(tensor.untyped_storage(), role)
            if entry is not None and entry.born == self.events:
                entry.born = 0

    def _free(self, key: int) -> None:
        with self._lock:
            entry = self.entries.pop(key, None)
            if entry is None:
                return
            self.events += 1
            entry.died = self.events
            self.live -= entry.nbytes
            self.freed.append(entry)

    def close(self) -> None:
        """Stop counting: what is still alive no longer calls back into the ledger."""
        with self._lock:
            for entry in self.entries.values():
                if entry.finalizer is not None:
                    entry.finalizer.detach()
            self.entries.clear()
            self.freed = []

    def reset_peak(self) -> None:
        with self._lock:
            self.peak, self.peak_at = self.live, self.events
            self.freed = []

    # -- saved for backward ------------------------------------------------------------

    def pack(self, tensor: torch.Tensor) -> _Saved:
        key = id(tensor.untyped_storage())
        with self._lock:
            entry = self.entries.get(key)
            if entry is not None:
                entry.saved += 1
                if entry.saved == 1:
                    # Saved by the op that made it: an activation from its first moment on.
                    start = entry.born if entry.born == self.events else self.events + 1
                    self.events = max(self.events, start)
                    entry.spans.append([start, -1])
        return _Saved(tensor, key, self)

    def release(self, key: int) -> None:
        with self._lock:
            entry = self.entries.get(key)
            if entry is None or entry.saved == 0:
                return
            entry.saved -= 1
            if entry.saved == 0:
                self.events += 1
                entry.spans[-1][1] = self.events

    @staticmethod
    def unpack(saved: _Saved) -> torch.Tensor:
        return saved.tensor

    # -- what was live, by category ----------------------------------------------------

    def by_category(self, moment: int) -> dict[str, int]:
        """Bytes live at ``moment`` (now, or this phase's peak) by category."""
        totals = dict.fromkeys(CATEGORIES, 0)
        with self._lock:
            for entry in [*self.entries.values(), *self.freed]:
                if entry.alive_at(moment):
                    totals[entry.category_at(moment)] += entry.nbytes
        return totals

    def refresh_roles(self, roles: Iterable[tuple[torch.Tensor, str]]) -> list[TrackedStorage]:
        """Give each live storage the role of the tensors it backs now; ``inputs`` stays.

        Returns the storages that were counted as a temporary or an activation until now
        (their role is new), so that records of moments they lived through can be mended.
        """
        wanted: dict[int, str] = {}
        for tensor, role in roles:
            storage = tensor.untyped_storage()
            key = id(storage)
            if key not in self.entries:
                self.add(storage)  # made where the dispatcher did not see it: count it now
            current = wanted.get(key)
            if current is None or ROLES.index(role) < ROLES.index(current):
                wanted[key] = role
        learned = []
        with self._lock:
            for key, entry in self.entries.items():
                now = wanted.get(key)
                if now is None and entry.role == "inputs":
                    continue  # an input stays one for as long as it lives
                if now != entry.role:
                    if entry.role is None:
                        learned.append(entry)
                    entry.role = now
        return learned

    def storage_of(self, tensor: torch.Tensor) -> TrackedStorage | None:
        return self.entries.get(id(tensor.untyped_storage()))
