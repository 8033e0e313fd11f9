"""The PyTorch side under the stand-in: "device" tensors are host memory at device addresses,
and streams are queues that run as late as CUDA allows.

A copy queued on a side stream does not run when it is issued: it runs when something waits
for it (an event synchronized or waited on, a stream waited on, the device synchronized).
That is the latest moment a GPU may run it, so a missing wait reads stale bytes here every
time, where on a GPU it would only do so when the copy happened to be slow. The current
stream of each device runs its work at once: work on it is ordinary tensor code, which the
host runs eagerly.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from sharedmem._backends.cuda_torch_ops import TorchCudaOps

from .driver import SimulatedRuntime
from .memory import DeviceMemory

_handles = itertools.count(0x5000)


class SimulatedStream:
    """A CUDA stream: operations queued in order, run when waited for (or at once when
    ``eager``, as the current stream)."""

    def __init__(self, index: int, lock: threading.RLock, *, eager: bool) -> None:
        self.device_index = index
        self.device = torch.device("cuda", index)
        self.cuda_stream = next(_handles)  # the raw cudaStream_t, as PyTorch's streams have
        self.eager = eager
        self._lock = lock
        self._queue: list[Callable[[], None]] = []
        self.issued = 0
        self.done = 0

    def __repr__(self) -> str:
        return f"SimulatedStream(cuda:{self.device_index}, {self.cuda_stream:#x})"

    def enqueue(self, operation: Callable[[], None]) -> None:
        with self._lock:
            self._queue.append(operation)
            self.issued += 1
            if self.eager:
                self.run_until(self.issued)

    def run_until(self, mark: int) -> None:
        with self._lock:
            while self.done < mark:
                # Counted before it runs: dropping the operation may free a memory, whose
                # finalizer synchronizes (runs this queue) again on this thread.
                operation = self._queue.pop(0)
                self.done += 1
                operation()
                del operation

    def synchronize(self) -> None:
        self.run_until(self.issued)

    def query(self) -> bool:
        return self.done == self.issued

    def wait_stream(self, other: SimulatedStream) -> None:
        # Later work here must follow what ``other`` has queued: running that now is allowed.
        other.synchronize()

    def wait_event(self, event: SimulatedEvent) -> None:
        event.synchronize()

    def record_event(self, event: SimulatedEvent | None = None) -> SimulatedEvent:
        event = event or SimulatedEvent()
        event.record(self)
        return event


class SimulatedEvent:
    """A CUDA event: a point in one stream's queue."""

    def __init__(self) -> None:
        self._stream: SimulatedStream | None = None
        self._mark = 0

    def record(self, stream: SimulatedStream) -> None:
        if not isinstance(stream, SimulatedStream):
            raise TypeError(f"cudasim: record needs a simulated stream, got {stream!r}")
        self._stream, self._mark = stream, stream.issued

    def synchronize(self) -> None:
        if self._stream is not None:
            self._stream.run_until(self._mark)

    def query(self) -> bool:
        return self._stream is None or self._stream.done >= self._mark


class _HostView:
    """A device range as ``__array_interface__``; holds what keeps the range alive."""

    def __init__(self, address: int, nbytes: int, keep: object) -> None:
        self.keep = keep
        self.__array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
        }


class _CachedBlock:
    """A block of the simulated caching allocator, freed with its last tensor."""

    def __init__(self, runtime: SimulatedRuntime, address: int) -> None:
        self.runtime, self.address = runtime, address

    def __del__(self) -> None:
        self.runtime.free(self.address)


def host_tensor(address: int, nbytes: int, keep: object) -> torch.Tensor:
    """A CPU tensor over ``nbytes`` at ``address`` that keeps ``keep`` alive."""
    return torch.from_numpy(np.asarray(_HostView(address, nbytes, keep)))


class SimulatedTorchOps(TorchCudaOps):
    """``TorchCudaOps`` for the stand-in: CPU tensors at simulated device addresses."""

    def __init__(self, memory: DeviceMemory, runtime: SimulatedRuntime, device_count: int):
        self.memory = memory
        self.runtime = runtime
        self.count = device_count
        self.lock = threading.RLock()
        self.streams: dict[int, SimulatedStream] = {}  # by raw handle
        self.current = [self._stream(i, eager=True) for i in range(device_count)]
        self._device = threading.local()
        self._pinned: dict[int, int] = {}  # PyTorch-pinned tensors: address -> bytes

    def _stream(self, index: int, *, eager: bool) -> SimulatedStream:
        stream = SimulatedStream(index, self.lock, eager=eager)
        self.streams[stream.cuda_stream] = stream
        return stream

    def flush(self) -> None:
        """Run everything queued on every stream (what synchronizing the device does)."""
        with self.lock:
            for stream in list(self.streams.values()):
                stream.synchronize()

    def _index(self, index: int) -> int:
        if not 0 <= index < self.count:
            raise RuntimeError(f"cudasim: invalid device ordinal {index} ({self.count} devices)")
        return index

    # ---- the seam ---------------------------------------------------------------------------

    def device_count(self) -> int:
        return self.count

    def current_device(self) -> int:
        return int(getattr(self._device, "index", 0))

    def tensor_device(self, index: int) -> torch.device:
        self._index(index)
        return torch.device("cpu")

    def wrap(self, memory: Any, index: int) -> torch.Tensor:
        interface = memory.__cuda_array_interface__
        assert interface["typestr"] == "|u1" and interface["strides"] is None, interface
        (nbytes,), (address, read_only) = interface["shape"], interface["data"]
        with self.memory.lock:
            if read_only or not self.memory.is_device_memory(address, nbytes):
                raise RuntimeError(
                    f"cudasim: {nbytes:,} bytes at {address:#x} are not device memory that "
                    "is mapped and accessible: wrapping them is an illegal address on a GPU"
                )
        return host_tensor(address, nbytes, memory)

    def empty(self, nbytes: int, index: int) -> torch.Tensor:
        address = self.runtime.malloc(nbytes, self._index(index))
        if address is None:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory (cudasim). Tried to allocate {nbytes:,} bytes"
            )
        return host_tensor(address, nbytes, _CachedBlock(self.runtime, address))

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        tensor = torch.empty(nbytes, dtype=torch.uint8)
        address = tensor.data_ptr()
        self._pinned[address] = nbytes
        weakref.finalize(tensor, self._pinned.pop, address, None)
        return tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        address, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        pinned = self._pinned.items()
        if any(a <= address and address + nbytes <= a + n for a, n in pinned):
            return True
        with self.memory.lock:
            return self.memory.is_registered(address, nbytes)

    @contextlib.contextmanager
    def device(self, index: int) -> Iterator[None]:
        previous = self.current_device()
        self._device.index = self._index(index)
        try:
            yield
        finally:
            self._device.index = previous

    def current_stream(self, index: int) -> SimulatedStream:
        return self.current[self._index(index)]

    def new_stream(self, index: int) -> SimulatedStream:
        with self.lock:
            return self._stream(self._index(index), eager=False)

    def own_stream(self, stream: object, index: int) -> SimulatedStream | None:
        if isinstance(stream, int) and not isinstance(stream, bool):
            found = self.streams.get(stream)
            if found is None:
                raise ValueError(f"cudasim: no stream has the handle {stream:#x}")
            stream = found
        if not isinstance(stream, SimulatedStream):
            return None  # cuda_streams checks it as PyTorch's (and refuses it)
        if stream.device_index != index:
            raise ValueError(
                f"sharedmem: the stream is on {stream.device} but the memory is on cuda:{index}; "
                f"pass a stream of cuda:{index} (torch.cuda.Stream(device={index}))"
            )
        return stream

    def copy_on(self, stream: Any, dst: torch.Tensor, src: torch.Tensor) -> None:
        assert dst.numel() == src.numel(), (dst.numel(), src.numel())
        stream.enqueue(lambda: dst.copy_(src))

    def used_on(self, tensor: torch.Tensor, stream: Any) -> None:
        pass  # blocks go back with their last tensor, after every queued copy ran

    def new_event(self) -> SimulatedEvent:
        return SimulatedEvent()

    def synchronize(self, index: int) -> None:
        self._index(index)
        self.flush()

    def empty_cache(self) -> None:
        pass  # the simulated caching allocator caches nothing

    def capturing(self) -> bool:
        return False

    def mem_get_info(self, index: int) -> tuple[int, int]:
        self._index(index)
        with self.memory.lock:
            return self.memory.capacity - self.memory.used, self.memory.capacity

    def memory_reserved(self, index: int) -> int:
        return 0

    def total_memory(self, index: int) -> int:
        self._index(index)
        return self.memory.capacity
