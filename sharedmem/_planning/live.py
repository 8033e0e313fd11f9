"""Counting the bytes a step keeps alive, op by op, under fake tensors (nothing is allocated).

Every op's results are tracked by their storage until Python drops the last reference, as the
allocator would see them in eager: the peak of the running sum is the step's peak. For this
machine's CPU, what fake kernels do not show (a kernel's scratch while it runs, a workspace
bigger than its fake shape) is measured once per kernel configuration (``kernel_memory``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from .._routing.kernels import kernel_memory

__all__ = ["LiveBytes", "round_for"]


def round_for(device: str) -> Callable[[int], int]:
    """How the device's allocator rounds a block: PyTorch's CUDA caching allocator hands out
    multiples of 512 bytes; the CPU allocator takes what is asked."""
    if device.startswith("cuda"):
        return lambda n: -(-n // 512) * 512 if n else 0
    return lambda n: n


class LiveBytes(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """A dispatch mode that keeps the running sum of the bytes of every storage an op creates
    while that storage is alive, and its peak."""

    def __init__(
        self,
        rounding: Callable[[int], int],
        existing: Iterable[torch.Tensor] = (),
        *,
        measure: bool = False,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.rounding = rounding
        # Kernels' own scratch and real result sizes, measured (``kernel_memory``): only for
        # figures of this machine's CPU, where the measurement runs.
        self.measure = measure
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}
        # Storages that were there before (parameters, inputs): their views and in-place
        # results are no new bytes. Held, so their ids stay theirs.
        self._existing = {id(t.untyped_storage()): t.untyped_storage() for t in existing}

    def reset_peak(self) -> None:
        self.peak = self.live

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        results = [v for v in pytree.tree_leaves(out) if isinstance(v, torch.Tensor)]
        measured = kernel_memory(func, args, kwargs or {}, results) if self.measure else None
        if measured is not None and len(measured.results) != len(results):
            measured = None
        for k, value in enumerate(results):
            real = measured.results[k] if measured is not None else 0
            self._track(value.untyped_storage(), real)
        if measured is not None:  # the kernel's scratch, beside its results while it runs
            self.peak = max(self.peak, self.live + self.rounding(measured.scratch))
        return out

    def _track(self, storage: torch.UntypedStorage, real: int = 0) -> None:
        key = id(storage)
        if key in self._sizes or key in self._existing:
            return  # a view or an in-place result: no new bytes
        # ``real``: the measured size where the fake kernel says less (an RNN's workspace)
        nbytes = self.rounding(max(storage.nbytes(), real))
        self._sizes[key] = nbytes
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)
