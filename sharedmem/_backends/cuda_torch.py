"""Device memory from PyTorch's CUDA caching allocator.

The backend for code that wants every byte where PyTorch can see it: blocks are ordinary
tensors, so they show up in ``torch.cuda.memory_stats`` / ``memory_allocated``, take part in
the allocator's caching, and need nothing but PyTorch. A growth allocates the new capacity,
copies the bytes to keep and returns the old tensor to the cache, so the address moves and the
peak is old + new; views taken before a growth keep the old storage.
"""

from __future__ import annotations

from typing import Any

import torch

from ._base import Block, MovingBackend
from .cuda_owner import retry_on_oom
from .cuda_streams import CudaBackend
from .cuda_torch_ops import ops

__all__ = ["TorchCudaBackend"]


class TorchCudaBackend(MovingBackend, CudaBackend):
    """Device memory from PyTorch's caching allocator; grows by allocate, copy, free."""

    kind = "torch"

    def __init__(self, device: str) -> None:
        super().__init__(device, granularity=512)  # the caching allocator's own rounding

    def _allocate(self, nbytes: int) -> Block:
        tensor = retry_on_oom(lambda: ops().empty(nbytes, self.index), nbytes, self.memory_name)
        return Block(tensor, nbytes)

    def _used_on(self, tensor: torch.Tensor, stream: Any) -> None:
        # The caching allocator reuses a freed block on its allocation stream at once; tell it
        # that a side stream uses this one, so a copy still running there is not overwritten.
        ops().used_on(tensor, stream)
