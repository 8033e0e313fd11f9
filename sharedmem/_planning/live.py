"""Counting the bytes a step keeps alive, op by op, under fake tensors (nothing is allocated).

Every op's results are tracked by their storage until Python drops the last reference, as the
allocator would see them in eager: the peak of the running sum is the step's peak.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

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
        self, rounding: Callable[[int], int], existing: Iterable[torch.Tensor] = ()
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.rounding = rounding
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
        for value in pytree.tree_leaves(out):
            if isinstance(value, torch.Tensor):
                self._track(value.untyped_storage())
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self._sizes or key in self._existing:
            return  # a view or an in-place result: no new bytes
        nbytes = self.rounding(storage.nbytes())
        self._sizes[key] = nbytes
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)
