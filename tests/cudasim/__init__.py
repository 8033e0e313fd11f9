"""A CUDA stand-in, so that every CUDA path of sharedmem runs (and is checked) without a GPU.

``SimulatedCuda`` replaces the two seams of the CUDA backends while it is installed: the
cuda-python modules (``cuda_api.install_bindings``) with a simulated driver and runtime that
keep the documented rules of the calls we make (see ``driver``), and the PyTorch side
(``cuda_torch_ops.install``) with one whose "device" tensors are host memory at simulated
device addresses inside a reserved host range (see ``memory``) and whose streams run their
work as late as CUDA allows (see ``torch_ops``). It is never kinder than a GPU (DESIGN §5):
where it must choose, it chooses the answer that exposes a bug.

**What it models, and the documented rule behind each check.** "Reference" is the CUDA Driver
API reference as shipped in the cuda-bindings 13.4.4 docstrings; "Sync" is NVIDIA's "API
synchronization behavior" page; "Guide" is the CUDA C++ Programming Guide.

* Streams (``torch_ops``): every stream, each device's current stream included, runs its
  queue only at a synchronization point (event or stream synchronize, a wait on a current
  stream followed by use, a device synchronize, ``cudaFree``) or earlier when the seeded
  ``Scheduler`` says: work issued to a stream runs asynchronously to the host, in issue order
  on that stream, in no order between streams unless an event or stream wait orders it
  (Guide, "Streams"; ``cuStreamWaitEvent``, Reference). A missing wait reads or carries the
  wrong bytes.
* One device at a time: ``cuCtxSynchronize`` waits for the current context's work only
  (Reference), ``torch.cuda.synchronize(i)`` for device ``i``'s, ``cudaFree`` synchronizes
  the current device (Sync). Unmapping (``cuMemUnmap``, which does not wait: Reference),
  freeing or unregistering memory that queued work still touches is a fault.
* Virtual memory: reservations, handles, maps and access as in the Reference for
  ``cuMemAddressReserve``, ``cuMemCreate``, ``cuMemMap``, ``cuMemSetAccess`` (access is per
  device: a device not in the ``desc`` list faults on the first touch), ``cuMemUnmap``,
  ``cuMemRelease``, ``cuMemAddressFree``; sizes in multiples of the minimum granularity, which
  differs from the recommended one (``cuMemGetAllocationGranularity``). Pages mapped without
  access fault for real (``mprotect``).
* Failure codes: an impossible reservation answers ``CUDA_ERROR_INVALID_VALUE`` or
  ``CUDA_ERROR_OUT_OF_MEMORY`` (both listed for ``cuMemAddressReserve``; ``impossible=``
  picks); running out of physical or pinned memory answers out of memory; a fault is sticky
  (``CUDA_ERROR_ILLEGAL_ADDRESS`` on every later call of that context, "an illegal memory
  access" from every later synchronize), as the Reference describes for asynchronous errors.
* Stream capture: during a global-mode capture on any thread (a thread-local one on the
  calling thread), ``cudaMalloc``, ``cudaFree``, ``cuMemCreate``, ``cuMemMap``,
  ``cuMemHostRegister``, ``cuCtxSynchronize`` and a device synchronize are refused with
  ``CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`` and invalidate the capture (Guide, "Prohibited and
  unhandled operations"; ``cudaStreamBeginCapture``'s modes, Reference).
* As the bindings: results are ``(error, value...)`` tuples with ``None`` values on error;
  arguments converted as the bindings convert them; fresh ``cudaMalloc`` / ``cuMemCreate``
  memory holds the byte ``FRESH``, not zeros (neither call clears: Reference); fork children
  of a process that initialised CUDA cannot use it (Guide, "Initialization").

**What it does not model.** Kernels run as host code: ordinary tensor code on "device"
tensors (``fill_``, ``copy_``, ``.cpu()``) runs eagerly when called, as if on the current
stream after everything waited for and before everything still queued (stricter than a GPU,
see ``torch_ops``); it cannot race, and its speed says nothing. There is no caching allocator
(freed blocks go back at once), no real peer-to-peer fabric, no unified addressing with the
host beyond the shared address range, no graph replay. The answers it can only guess (which
code an impossible reservation gets on a given driver, capture seen from another thread) are
asked of a real GPU by ``./dev gpu-check`` (``tests/gpu_answers.py``).

Example::

    with SimulatedCuda(capacity=256 << 20, seed=1) as cuda:
        memory = sm.SyncedMemory(1000, device="cuda", backend="vmm")
        ...
    assert cuda.leaks() == [] and cuda.faults == []
"""

from __future__ import annotations

import gc
from types import SimpleNamespace
from typing import Any

from sharedmem import _backends
from sharedmem._backends import cuda, cuda_api, cuda_owner, cuda_streams, cuda_torch_ops, cudart
from sharedmem._routing import cuda_native

from .driver import SimulatedDriver, SimulatedRuntime
from .memory import GRANULARITY, MINIMUM_GRANULARITY, DeviceMemory
from .torch_ops import Scheduler, SimulatedEvent, SimulatedStream, SimulatedTorchOps

__all__ = [
    "GRANULARITY",
    "MINIMUM_GRANULARITY",
    "Scheduler",
    "SimulatedCuda",
    "SimulatedEvent",
    "SimulatedStream",
]


def _forget_cached_choices() -> None:
    """Backends, placements and checks are cached per device: built on the driver in use."""
    for cached in (
        cuda.default_backend,
        cuda._device_backend,
        cuda._host_backend,
        cudart.runtime_problem,
        _backends._placement,
    ):
        cached.cache_clear()
    cuda_streams._side_streams.clear()


class SimulatedCuda:
    """The stand-in for cuda-python's driver and runtime and for ``torch.cuda``.

    Args:
        capacity: bytes of device memory; more is refused with ``CUDA_ERROR_OUT_OF_MEMORY``.
        pinned_capacity: bytes of host memory that can be registered (pinned) at once.
        device_count: how many devices there are (two by default, so that ``cuda:N`` code
            runs; they share one capacity, and the driver knows which device each byte is on).
        seed: seeds the scheduler that may run queued work early; ``None``: never early.
        peers: what ``cuDeviceCanAccessPeer`` answers for two different devices.
        impossible: the code of a reservation larger than the address space
            (``CUDA_ERROR_INVALID_VALUE`` or ``CUDA_ERROR_OUT_OF_MEMORY``; both documented).
    """

    def __init__(
        self,
        *,
        capacity: int = 1 << 30,
        pinned_capacity: int = 1 << 34,
        device_count: int = 2,
        seed: int | None = None,
        peers: bool = True,
        impossible: str = "CUDA_ERROR_INVALID_VALUE",
    ) -> None:
        self.memory = DeviceMemory(capacity, pinned_capacity)
        self.memory.peers = peers
        # Synchronizing a context (cuCtxSynchronize, cudaFree) runs what its device queued.
        self.driver = SimulatedDriver(
            self.memory, device_count, self._synchronize, impossible=impossible
        )
        self.runtime = SimulatedRuntime(self.memory, self.driver)
        self.ops = SimulatedTorchOps(self.memory, self.runtime, device_count, Scheduler(seed))
        self._previous: tuple[Any, Any, bool] | None = None

    @property
    def faults(self) -> list[str]:
        """What went wrong on the devices (illegal addresses, memory freed under queued work)."""
        return list(self.memory.faults)

    def _synchronize(self, index: int) -> None:
        self.ops.flush(index)

    def install(self) -> None:
        assert self._previous is None, "already installed"
        bindings = SimpleNamespace(driver=self.driver, runtime=self.runtime)
        self._previous = (
            cuda_api.install_bindings(bindings),
            cuda_torch_ops.install(self.ops),
            cuda_api._used,
        )
        _forget_cached_choices()

    def uninstall(self) -> None:
        """Let every memory of the test go (while the stand-in still answers), then put the
        real modules back."""
        assert self._previous is not None, "not installed"
        gc.collect()
        cuda_owner.run_pending()
        self.ops.flush()
        _forget_cached_choices()
        gc.collect()
        bindings, ops, used = self._previous
        cuda_native._forget()  # an installed CUDA router was the stand-in's allocator
        cuda_api.install_bindings(bindings)
        cuda_torch_ops.install(ops)
        cuda_api._used = used
        self._previous = None

    def leaks(self) -> list[str]:
        """What the driver still holds (reservations, handles, allocations, registrations)."""
        with self.memory.lock:
            return self.memory.leaks()

    def __enter__(self) -> SimulatedCuda:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()
