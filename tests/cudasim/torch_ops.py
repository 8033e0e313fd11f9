"""The PyTorch side under the stand-in: "device" tensors are host memory at device addresses,
and every stream is a queue that runs as late as CUDA allows.

**Streams.** Every stream, each device's current stream included, queues what is put on it
(``copy_on``) and runs it only when something waits for it: an event or a stream synchronized,
a ``wait_event`` / ``wait_stream`` on a device's current stream (what follows is the caller's
use of the bytes), a device synchronized (``synchronize``, ``cuCtxSynchronize``,
``cudaFree``). A ``wait_event`` / ``wait_stream`` on any other stream queues a barrier there,
as on a GPU: that stream's later work waits, the host does not. Besides, a seeded random
``Scheduler`` may run queued work earlier, at a point it picks (each time work is queued or
waited on): a GPU may run a copy at any moment after it is issued, unless the device is kept
busy (``sleep``, the stand-in's ``torch.cuda._sleep``) until something waits for the sleep. So
a missing wait shows up as wrong bytes either way: a reader that did not wait reads the bytes
from before the copy, and a writer that did not wait for a copy still reading its bytes changes
what the copy carries. A test that must catch a missing wait whatever the seed keeps the device
busy before the copy.

**Where the host stays eager.** Ordinary tensor code of the backends and of a test (``fill_``,
``copy_`` between views, ``.cpu()``, a growth's copy) cannot be intercepted: it runs on the
host when it is called. The stand-in reads it as work on the current stream that is ordered
after what was waited for (a ``wait_event`` on the current stream) and *before* everything
still queued, which is stricter than a GPU (where work queued on the current stream runs in
order with it): a device view must be waited for before it is used, as ``device_data`` does.

**Checks.** When queued work runs, each device range it touches must be mapped and accessible
from the stream's device (``cuMemSetAccess`` is per device; ``cudaMalloc`` memory is reachable
from the devices ``cuDeviceCanAccessPeer`` allows); giving memory back (unmap, free,
unregister) while queued work still touches it is a fault too. A fault is recorded in
``DeviceMemory.faults`` (every test on the stand-in fails when one is left) and is sticky:
every later synchronization of that device raises, as after an illegal address on a GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import random
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from sharedmem._backends.cuda_torch_ops import TorchCudaOps

from .allocator import UPSTREAM_ALLOC, UPSTREAM_FREE, PluggableAllocator
from .driver import SimulatedRuntime
from .memory import DeviceMemory

_handles = itertools.count(0x5000)


class Scheduler:
    """When queued work may run before anything waits for it.

    Args:
        seed: seeds the choices; ``None`` never runs anything early (every copy as late as
            CUDA allows).
        eagerness: the chance, at each point, that some queued work runs early.
    """

    def __init__(self, seed: int | None = None, eagerness: float = 0.25) -> None:
        self.seed = seed
        self.eagerness = eagerness if seed is not None else 0.0
        self._random = random.Random(seed)

    def __repr__(self) -> str:
        return f"Scheduler(seed={self.seed}, eagerness={self.eagerness})"

    def point(self, streams: list[SimulatedStream]) -> None:
        """A moment at which a GPU might have run some queued work: maybe run some."""
        if self.eagerness <= 0 or self._random.random() >= self.eagerness:
            return
        busy = [stream for stream in streams if stream.pending() and not stream.asleep()]
        if busy:
            stream = self._random.choice(busy)
            stream.run_until(stream.done + self._random.randint(1, stream.pending()))


class _Operation:
    """One queued operation: what it runs, and the byte ranges it touches."""

    __slots__ = ("ranges", "run", "what")

    def __init__(self, run: Callable[[], None], ranges: list[tuple[int, int]], what: str):
        self.run, self.ranges, self.what = run, ranges, what


def _range(tensor: torch.Tensor) -> tuple[int, int]:
    return tensor.data_ptr(), tensor.numel() * tensor.element_size()


class SimulatedStream:
    """A CUDA stream: operations queued in order, run when waited for (module doc)."""

    def __init__(self, ops: SimulatedTorchOps, index: int, *, current: bool) -> None:
        self.device_index = index
        self.device = torch.device("cuda", index)
        self.cuda_stream = next(_handles)  # the raw cudaStream_t, as PyTorch's streams have
        self.current = current
        self._ops = ops
        self._lock = ops.lock
        self._queue: list[_Operation] = []
        self.issued = 0
        self.done = 0

    def __repr__(self) -> str:
        kind = "current " if self.current else ""
        return f"SimulatedStream({kind}cuda:{self.device_index}, {self.cuda_stream:#x})"

    def pending(self) -> int:
        return self.issued - self.done

    def enqueue(self, operation: _Operation) -> None:
        with self._lock:
            self._queue.append(operation)
            self.issued += 1
        self._ops.scheduler_point()

    def run_until(self, mark: int) -> None:
        with self._lock:
            while self.done < mark:
                # Counted before it runs: dropping the operation may free a memory, whose
                # finalizer synchronizes (runs this queue) again on this thread.
                operation = self._queue.pop(0)
                self.done += 1
                self._ops.execute(self, operation)
                del operation

    def touching(self, address: int, size: int) -> str | None:
        """What queued (not yet run) work of this stream touches the range, if any."""
        for operation in list(self._queue):
            if any(a < address + size and address < a + n for a, n in operation.ranges):
                return f"{operation.what} queued on {self} still touches it"
        return None

    def asleep(self) -> bool:
        return self.device_index in self._ops.sleeping

    def synchronize(self) -> None:
        self.run_until(self.issued)
        self._ops.check_faults(self.device_index)

    def query(self) -> bool:
        return self.done == self.issued

    def _after(self, stream: SimulatedStream, mark: int, what: str) -> None:
        """Later work here follows ``stream``'s first ``mark`` operations."""
        if self.current:
            # What follows on a current stream is the caller's eager use of the bytes: the
            # work waited for runs now (a synchronization point).
            stream.run_until(mark)
        else:
            self.enqueue(_Operation(lambda: stream.run_until(mark), [], what))

    def wait_stream(self, other: SimulatedStream) -> None:
        self._after(other, other.issued, f"a wait for {other}")

    def wait_event(self, event: SimulatedEvent) -> None:
        if event._stream is not None:
            self._after(event._stream, event._mark, f"a wait for an event of {event._stream}")

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
            self._stream._ops.check_faults(self._stream.device_index)

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

    def __init__(self, runtime: SimulatedRuntime, address: int, device: int) -> None:
        self.runtime, self.address, self.device = runtime, address, device

    def __del__(self) -> None:
        self.runtime.free(self.address, self.device)


def host_tensor(address: int, nbytes: int, keep: object) -> torch.Tensor:
    """A CPU tensor over ``nbytes`` at ``address`` that keeps ``keep`` alive."""
    return torch.from_numpy(np.asarray(_HostView(address, nbytes, keep)))


_live_ops: weakref.WeakSet[SimulatedTorchOps] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for each in list(_live_ops):
        each.bad_fork = each.bad_fork or each.initialised


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class SimulatedTorchOps(TorchCudaOps):
    """``TorchCudaOps`` for the stand-in: CPU tensors at simulated device addresses.

    Args:
        memory: the driver's records.
        runtime: allocates the caching allocator's blocks.
        device_count: how many devices.
        scheduler: when queued work may run early (default: never).
    """

    def __init__(
        self,
        memory: DeviceMemory,
        runtime: SimulatedRuntime,
        device_count: int,
        scheduler: Scheduler | None = None,
    ):
        self.memory = memory
        self.runtime = runtime
        self.count = device_count
        self.scheduler = scheduler or Scheduler()
        self.lock = threading.RLock()
        self.streams: dict[int, SimulatedStream] = {}  # by raw handle
        self.current = [self._stream(i, current=True) for i in range(device_count)]
        self._device = threading.local()
        self._pinned: dict[int, int] = {}  # PyTorch-pinned tensors: address -> bytes
        self.initialised = False  # whether PyTorch's CUDA was used (for fork)
        self.bad_fork = False  # a fork child of a process that had initialised CUDA
        self.allocator: PluggableAllocator | None = None  # installed by install_allocator
        self.upstream_calls: tuple[Any, ...] = ()
        self.sleeping: set[int] = set()  # devices kept busy (``sleep``)
        memory.queued_users = self.queued_users
        _live_ops.add(self)

    def _stream(self, index: int, *, current: bool) -> SimulatedStream:
        stream = SimulatedStream(self, index, current=current)
        self.streams[stream.cuda_stream] = stream
        return stream

    def scheduler_point(self) -> None:
        with self.lock:
            self.scheduler.point(list(self.streams.values()))

    def execute(self, stream: SimulatedStream, operation: _Operation) -> None:
        """Run a queued operation on ``stream``'s device, or record the fault it makes."""
        device = stream.device_index
        if device in self.memory.faulted:
            return  # a faulted context runs nothing more
        memory = self.memory
        with memory.lock:
            for address, size in operation.ranges:
                on_device = memory.base <= address < memory.base + memory.address_space
                if on_device and not memory.is_device_memory(address, size, device):
                    owner = memory.device_of(address)
                    whose = "unmapped" if owner is None else f"memory of cuda:{owner}"
                    memory.fault(
                        device,
                        f"illegal address: {operation.what} on {stream} touches {size:,} bytes "
                        f"at {address:#x} ({whose}) without access from cuda:{device}",
                    )
                    return
        operation.run()

    def check_faults(self, index: int) -> None:
        if index in self.memory.faulted:
            raise RuntimeError(
                "CUDA error: an illegal memory access was encountered (cudasim: "
                f"{'; '.join(self.memory.faults)})"
            )

    def queued_users(self, address: int, size: int) -> str | None:
        """Queued work over ``[address, address + size)``, described; ``None`` if none.

        Takes no lock: the driver asks while holding its own."""
        for stream in list(self.streams.values()):
            found = stream.touching(address, size)
            if found is not None:
                return found
        return None

    def sleep(self, index: int) -> None:
        """``torch.cuda._sleep``: a kernel on device ``index``'s current stream that keeps the
        device busy until something waits for it: till it has run, the scheduler runs nothing
        of that device early (a wait for work queued before it does not end it)."""
        self.sleeping.add(self._index(index))
        wake = _Operation(lambda: self.sleeping.discard(index), [], "a sleep")
        self.current[index].enqueue(wake)

    def flush(self, index: int | None = None) -> None:
        """Run everything queued on device ``index``'s streams (every device's: ``None``)."""
        with self.lock:
            for stream in list(self.streams.values()):
                if index is None or stream.device_index == index:
                    stream.run_until(stream.issued)

    def begin_capture(self, stream: SimulatedStream | None = None, mode: str = "global") -> int:
        """Begin capturing ``stream`` (default: this thread's current stream of device 0) in
        ``mode`` (``global``, ``thread_local`` or ``relaxed``); returns its handle."""
        assert mode in ("global", "thread_local", "relaxed"), mode
        stream = stream or self.current_stream(self.current_device())
        self.memory.captures[stream.cuda_stream] = (threading.get_ident(), mode)
        return stream.cuda_stream

    def end_capture(self, handle: int) -> bool:
        """End a capture; whether it survived (no unsafe call invalidated it)."""
        del self.memory.captures[handle]
        broken = handle in self.memory.invalidated
        self.memory.invalidated.discard(handle)
        return not broken

    def _index(self, index: int) -> int:
        if not 0 <= index < self.count:
            raise RuntimeError(f"cudasim: invalid device ordinal {index} ({self.count} devices)")
        self.initialised = True
        return index

    # ---- the seam ---------------------------------------------------------------------------

    def device_count(self) -> int:
        return self.count

    def current_device(self) -> int:
        if self.bad_fork:  # as torch.cuda.current_device() in such a child, on a GPU
            raise RuntimeError("Cannot re-initialize CUDA in forked subprocess.")
        return int(getattr(self._device, "index", 0))

    def tensor_device(self, index: int) -> torch.device:
        self._index(index)
        return torch.device("cpu")

    def wrap(self, memory: Any, index: int) -> torch.Tensor:
        interface = memory.__cuda_array_interface__
        assert interface["typestr"] == "|u1" and interface["strides"] is None, interface
        (nbytes,), (address, read_only) = interface["shape"], interface["data"]
        with self.memory.lock:
            if read_only or not self.memory.is_device_memory(address, nbytes, index):
                raise RuntimeError(
                    f"cudasim: {nbytes:,} bytes at {address:#x} are not device memory that "
                    f"is mapped and accessible from cuda:{index}: using them there is an "
                    "illegal address on a GPU"
                )
        return host_tensor(address, nbytes, memory)

    def empty(self, nbytes: int, index: int) -> torch.Tensor:
        address = self.runtime.malloc(nbytes, self._index(index))
        if address is None:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory (cudasim). Tried to allocate {nbytes:,} bytes"
            )
        return host_tensor(address, nbytes, _CachedBlock(self.runtime, address, index))

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

    def routing_upstream(self) -> tuple[int, int]:
        """The CUDA router's upstream pair, as C calls into the stand-in's memory: an
        allocation is ``cudaMalloc``'s (uncleared, 256-byte aligned) on the stream's device; a
        free is stream-ordered, so the stream's queued work runs first, and work another
        stream still has queued over the bytes is a fault (as with ``cuMemFreeAsync``)."""

        def alloc(out: Any, size: int, stream: int | None) -> int:
            owner = self.streams.get(stream or 0)
            device = owner.device_index if owner is not None else self.current_device()
            address = self.runtime.malloc(size, device)
            if address is None:
                return 2  # CUDA_ERROR_OUT_OF_MEMORY
            out[0] = address
            return 0

        def free(address: int, stream: int | None) -> int:
            owner = self.streams.get(stream or 0)
            if owner is not None:
                owner.run_until(owner.issued)
            device = self.memory.allocated_on.get(address)
            if device is None or not self.runtime.free(address, device):
                return 1  # CUDA_ERROR_INVALID_VALUE
            return 0

        self.upstream_calls = (UPSTREAM_ALLOC(alloc), UPSTREAM_FREE(free))  # kept alive
        return tuple(  # type: ignore[return-value]
            ctypes.cast(call, ctypes.c_void_p).value for call in self.upstream_calls
        )

    def install_allocator(self, library: str, alloc: str, free: str) -> None:
        """What ``CUDAPluggableAllocator`` and ``change_current_allocator`` do: the pair is
        loaded by name and serves the stand-in's "PyTorch" allocations from now on
        (``self.allocator``); refused, as PyTorch refuses it, once an allocator was used."""
        if self.allocator is not None and self.allocator.used:
            raise RuntimeError("Can't swap an already initialized allocator")
        self.allocator = PluggableAllocator(self, library, alloc, free)

    def current_stream(self, index: int) -> SimulatedStream:
        return self.current[self._index(index)]

    def new_stream(self, index: int) -> SimulatedStream:
        with self.lock:
            return self._stream(self._index(index), current=False)

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
        if not isinstance(stream, SimulatedStream):
            raise TypeError(f"cudasim: copy_on needs a simulated stream, got {stream!r}")
        what = f"a copy of {src.numel() * src.element_size():,} bytes"
        with self.memory.lock:
            if any(self.memory.spans_registrations(*_range(t)) for t in (dst, src)):
                raise RuntimeError(f"CUDA error: invalid argument ({what} spans two registrations)")
        stream.enqueue(_Operation(lambda: dst.copy_(src), [_range(dst), _range(src)], what))

    def used_on(self, tensor: torch.Tensor, stream: Any) -> None:
        pass  # blocks go back with their last tensor, after every queued copy ran

    def new_event(self) -> SimulatedEvent:
        return SimulatedEvent()

    def synchronize(self, index: int) -> None:
        self._index(index)
        if self.memory.capture_refuses(threading.get_ident()):
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        self.flush(index)  # this device's streams, no other's
        self.check_faults(index)

    def empty_cache(self) -> None:
        pass  # the simulated caching allocator caches nothing

    def capturing(self) -> bool:
        # Any capture that forbids this thread an unsafe call: global mode on any thread.
        return bool(self.memory.capture_forbids(threading.get_ident()))

    def forked_after_init(self) -> bool:
        return self.bad_fork

    def mem_get_info(self, index: int) -> tuple[int, int]:
        self._index(index)
        with self.memory.lock:
            return self.memory.capacity - self.memory.used, self.memory.capacity

    def memory_reserved(self, index: int) -> int:
        return 0

    def total_memory(self, index: int) -> int:
        self._index(index)
        return self.memory.capacity
