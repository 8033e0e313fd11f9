"""Device memory from the CUDA runtime (cuda-python's ``cudaMalloc`` / ``cudaFree``).

Each block is one ``cudaMalloc`` allocation, wrapped as a tensor without copying (through
``__cuda_array_interface__``): PyTorch's caching allocator never sees it, so it is not held in
PyTorch's cache and ``torch.cuda.empty_cache`` cannot take it. A growth allocates the new
capacity, copies the bytes to keep and frees the old allocation, so the address moves.

Freeing is deferred to the last view. The state machine frees a block when it shrinks, grows
or releases a side, but a user may still hold a view from before; ``cudaFree`` then would
leave that view pointing at memory the next allocation may reuse (or at nothing). So ``free``
drops only our reference: the allocation's owner is referenced by every tensor viewing it and
calls ``cudaFree`` when the last one is gone, which without outside views is at once. A view
that outlives a release keeps its bytes (and their old content) alive until it dies.
Freeing synchronizes the device first, as ``cudaFree`` always does.

cuda-python's runtime module links its own CUDA runtime, of cuda-python's version: cuda-python
13 needs a driver of 580 or later. The backend checks once that the runtime answers and, where
it does not, says which versions disagree and how to fix it; the default backend then is
another one (see ``cuda``).
"""

from __future__ import annotations

import functools
from typing import Any

from .._errors import SharedMemError
from ._base import Block
from .cuda_api import MATCH_ADVICE, bindings, check, error_name, on_device
from .cuda_owner import Meter, Owner, retry_on_oom
from .cuda_streams import CudaBackend

__all__ = ["CudartBackend", "runtime_problem"]


def _version(number: int) -> str:
    return f"{number // 1000}.{number % 1000 // 10}"  # 12090 -> "12.9"


@functools.cache
def runtime_problem() -> str | None:
    """Why cuda-python's CUDA runtime cannot run in this process, or ``None`` when it can."""
    runtime = bindings().runtime
    error, count = runtime.cudaGetDeviceCount()
    if int(error) == 0 and count:
        return None
    mine: Any = check(runtime.cudaRuntimeGetVersion(), "cudaRuntimeGetVersion")
    error_driver, driver = runtime.cudaDriverGetVersion()
    if int(error_driver) != 0 or not driver:
        why = "no CUDA driver answers it"
    elif driver < mine:
        why = f"the driver supports CUDA {_version(driver)} at most"
    else:
        why = f"the driver supports CUDA {_version(driver)}"
    found = error_name(error) if int(error) != 0 else "no device"
    return (
        f"cuda-python's runtime is CUDA {_version(mine)} and {why} (cudaGetDeviceCount: "
        f"{found}). {MATCH_ADVICE}; or use backend='vmm' (the driver API alone) or "
        "backend='torch'."
    )


class _Allocation(Owner):
    """One ``cudaMalloc`` allocation, freed when the last tensor viewing it is gone."""

    def __init__(self, index: int, address: int, nbytes: int, meter: Meter) -> None:
        super().__init__(index, address, nbytes)
        self.meter = meter
        meter.add(nbytes)

    def _close(self) -> None:
        cuda = bindings()
        with on_device(self.index):
            # cudaFree waits for the device anyway; saying so keeps it true whatever runtime
            # cuda-python links (its own static one, or the one PyTorch uses).
            check(cuda.driver.cuCtxSynchronize(), "cuCtxSynchronize")
            check(cuda.runtime.cudaFree(self.address), "cudaFree")
        self.meter.sub(self.nbytes)


class CudartBackend(CudaBackend):
    """Device memory from ``cudaMalloc``, wrapped without copying; moves when it grows.

    Attributes:
        meter: bytes allocated and not yet freed (``held``) and the most ever (``peak``).
    """

    kind = "cudart"
    stable_address = False

    def __init__(self, device: str) -> None:
        # Fail here, with the reason and the fix, when cuda-python's runtime cannot run.
        problem = runtime_problem()
        if problem is not None:
            raise SharedMemError(f"sharedmem: backend='cudart' cannot run on {device}: {problem}")
        super().__init__(device, granularity=512)
        self.meter = Meter()

    def _allocate(self, nbytes: int) -> Block:
        def attempt() -> _Allocation:
            with on_device(self.index):
                address = check(bindings().runtime.cudaMalloc(nbytes), "cudaMalloc")
            return _Allocation(self.index, int(address), nbytes, self.meter)

        owner = retry_on_oom(attempt, nbytes, self.memory_name)
        return Block(owner.tensor(), nbytes, owner)

    def _grow(self, block: Block, nbytes: int, keep: int) -> tuple[Block, int]:
        new = self._allocate(nbytes)
        new.tensor[:keep].copy_(block.tensor[:keep])
        self._free(block)
        return new, keep

    def _shrink(self, block: Block, nbytes: int, keep: int) -> tuple[Block, int]:
        return self._grow(block, nbytes, keep)

    def _free(self, block: Block) -> None:
        pass  # cudaFree runs when the last view of the allocation is gone (see the module doc)
