"""CUDA device memory. Imported only when a CUDA device is asked for."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .._errors import OutOfMemoryError
from ._base import Backend, Block
from .host import ReservedBackend

if TYPE_CHECKING:
    from . import Placement

__all__ = ["TorchCudaBackend", "placement"]


class TorchCudaBackend(Backend):
    """Device memory from PyTorch's caching allocator; grows by allocate, copy, free."""

    kind = "torch"
    stable_address = False

    def __init__(self, device: str) -> None:
        super().__init__(device=device, granularity=512)

    def _new(self, nbytes: int) -> torch.Tensor:
        try:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        except torch.cuda.OutOfMemoryError:
            # Cached but unused blocks may be what stands in the way: give them back once.
            torch.cuda.empty_cache()
        try:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        except torch.cuda.OutOfMemoryError:
            reserved = torch.cuda.memory_reserved(self.device)
            raise OutOfMemoryError(nbytes, reserved, None, self.device) from None

    def _allocate(self, nbytes: int) -> Block:
        return Block(self._new(nbytes), nbytes)

    def _grow(self, block: Block, nbytes: int, keep: int) -> tuple[Block, int]:
        new = self._allocate(nbytes)
        new.tensor[:keep].copy_(block.tensor[:keep])
        return new, keep

    def _shrink(self, block: Block, nbytes: int, keep: int) -> tuple[Block, int]:
        return self._grow(block, nbytes, keep)

    def _free(self, block: Block) -> None:
        pass  # the tensor returns to the caching allocator with its last reference


def placement(device: str, backend: str) -> Placement:
    from . import Placement

    if backend != "torch":
        raise NotImplementedError(backend)
    return Placement(device, ReservedBackend(), TorchCudaBackend(device))
