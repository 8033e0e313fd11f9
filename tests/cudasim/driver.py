"""The part of ``cuda.bindings.driver`` and ``runtime`` that sharedmem calls, simulated.

Every call answers as cuda-python 13.4 does: a tuple that starts with the real ``CUresult`` or
``cudaError_t``, with ``None`` for every value when the call fails. Arguments are converted as
the bindings convert them (an address or a size may be a float or any int-like object, a handle
or a device a plain int; a string is a ``TypeError``), and checked as the driver checks them:
the structs' fields and enums, the minimum granularity, and the documented rules of the virtual
memory calls. Everything else in the real modules (enums, structs, constants) is passed through,
and a function this module does not simulate raises, so a backend that starts calling one is
found out here.

Rules kept, and where they are written (the CUDA Driver API reference, as shipped in the
cuda-bindings 13.4.4 docstrings, and the "API synchronization behavior" page):

* ``cuCtxSynchronize`` waits for the current context's device only; ``cudaFree`` synchronizes
  the current device before it frees (API synchronization behavior).
* ``cuMemSetAccess`` grants access per device (its ``desc`` list names the locations); the
  pages are usable from the devices listed only (checked when queued work runs, and when a
  backend wraps them for a device).
* ``cuMemAddressReserve``, ``cuMemCreate``, ``cuMemMap``: sizes and addresses are multiples of
  the *minimum* granularity; an impossible reservation answers ``CUDA_ERROR_INVALID_VALUE`` or
  ``CUDA_ERROR_OUT_OF_MEMORY`` (both documented; which one is not; ``impossible`` picks).
* ``cuMemCreate`` / ``cudaMalloc`` memory is not cleared: it holds the byte ``FRESH``.
* During a global-mode stream capture on any thread (``SimulatedTorchOps.begin_capture``),
  the calls the CUDA Programming Guide lists as unsafe (``cudaMalloc``, ``cudaFree``,
  ``cuMemCreate``, ``cuMemMap``, ``cuMemHostRegister``, ``cuCtxSynchronize``) answer
  ``CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`` and invalidate the capture.
* A device that faulted (an illegal address) fails every later call of its context with
  ``CUDA_ERROR_ILLEGAL_ADDRESS``: the error is sticky.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from cuda.bindings import driver as real_driver
from cuda.bindings import runtime as real_runtime

from .memory import (
    GRANULARITY,
    MINIMUM_GRANULARITY,
    PAGE,
    DeviceMemory,
    Handle,
    Mapping,
    Reservation,
    fill_fresh,
    make_accessible,
    make_inaccessible,
    make_read_only,
)

R = real_driver.CUresult
E = real_runtime.cudaError_t
OK = R.CUDA_SUCCESS
INVALID = R.CUDA_ERROR_INVALID_VALUE
OOM = R.CUDA_ERROR_OUT_OF_MEMORY
CAPTURE = R.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
VERSION = 13040  # the CUDA version the simulated driver and runtime report
_CONTEXT = 0x1000  # device N's primary context is CUcontext(_CONTEXT + N)
_MIN = MINIMUM_GRANULARITY


def _int(value: object, what: str) -> int:
    """A number as the bindings take a ``size_t`` / ``int``: anything int-like, floats too."""
    if isinstance(value, str | bytes) or not hasattr(value, "__int__"):
        raise TypeError(f"cudasim: {what} must be a number, got {type(value).__name__}")
    return int(value)  # type: ignore[call-overload]


def _as(value: object, kind: type, what: str) -> int:
    """An argument the bindings convert to ``kind`` (``CUdeviceptr``, a handle, a device):
    one of those, ``None`` (0) or an int-like value; anything else is a ``TypeError``."""
    if value is None:
        return 0
    if isinstance(value, kind):
        return int(value)  # type: ignore[call-overload]
    try:
        return int(kind(value))
    except TypeError:
        raise TypeError(f"cudasim: {what} must be {kind.__name__} or an int") from None


def _pointer(value: object, what: str = "ptr") -> int:
    return _as(value, real_driver.CUdeviceptr, what)


def _of(value: object, kind: type, what: str) -> Any:
    if not isinstance(value, kind):
        raise TypeError(f"cudasim: {what} must be {kind.__name__}, got {type(value).__name__}")
    return value


class SimulatedDriver:
    """``cuda.bindings.driver`` for the simulated devices (sharing one memory).

    Args:
        memory: what the driver keeps.
        device_count: how many devices answer.
        synchronize: runs what device N's streams have queued (``cuCtxSynchronize``).
        impossible: the code an impossible reservation gets (a size beyond the address
            space): ``CUDA_ERROR_INVALID_VALUE`` or ``CUDA_ERROR_OUT_OF_MEMORY``.
    """

    def __init__(
        self,
        memory: DeviceMemory,
        device_count: int,
        synchronize: Callable[[int], None],
        *,
        impossible: str = "CUDA_ERROR_INVALID_VALUE",
    ) -> None:
        self.memory = memory
        self.device_count = device_count
        self._synchronize = synchronize
        self.impossible = getattr(R, impossible)
        self._contexts = threading.local()

    def __getattr__(self, name: str) -> Any:
        value = getattr(real_driver, name)
        if name.startswith("cu") and callable(value):
            raise NotImplementedError(f"cudasim: {name} is not simulated; add it to cudasim")
        return value  # enums, structs and constants are the real ones

    # ---- devices and contexts ---------------------------------------------------------------

    def _stack(self) -> list[int]:
        if not hasattr(self._contexts, "stack"):
            self._contexts.stack = []
        stack: list[int] = self._contexts.stack
        return stack

    def _current(self) -> bool:
        return bool(self._stack())

    def current_device(self) -> int:
        """The device of the context current to this thread (0 when none is)."""
        return self._stack()[-1] - _CONTEXT if self._stack() else 0

    def refused(self) -> Any:
        """The error of a call in the current context: a sticky fault, or none (``None``)."""
        if self._current() and self.current_device() in self.memory.faulted:
            return R.CUDA_ERROR_ILLEGAL_ADDRESS
        if not self._current():
            return R.CUDA_ERROR_INVALID_CONTEXT
        return None

    def unsafe_in_capture(self) -> bool:
        """Whether a capture forbids an unsafe call now; if so, the call invalidates it."""
        return self.memory.capture_refuses(threading.get_ident())

    def cuInit(self, flags: int) -> tuple[Any]:
        return (OK if _int(flags, "flags") == 0 else INVALID,)

    def _device(self, dev: object, what: str = "dev") -> int:
        return _as(dev, real_driver.CUdevice, what)

    def cuDeviceGet(self, ordinal: int) -> tuple[Any, Any]:
        if not 0 <= _int(ordinal, "ordinal") < self.device_count:
            return R.CUDA_ERROR_INVALID_DEVICE, None
        return OK, real_driver.CUdevice(ordinal)

    def cuDeviceGetAttribute(self, attrib: Any, dev: Any) -> tuple[Any, int | None]:
        _of(attrib, real_driver.CUdevice_attribute, "attrib")
        if not 0 <= self._device(dev) < self.device_count:
            return R.CUDA_ERROR_INVALID_DEVICE, None
        names = real_driver.CUdevice_attribute
        supported = (
            names.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
            names.CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED,
        )
        return OK, int(attrib in supported)

    def cuDeviceCanAccessPeer(self, dev: Any, peerDev: Any) -> tuple[Any, int | None]:
        index, peer = self._device(dev), self._device(peerDev, "peerDev")
        if not (0 <= index < self.device_count and 0 <= peer < self.device_count):
            return R.CUDA_ERROR_INVALID_DEVICE, None
        return OK, int(index != peer and self.memory.peers)  # never a device to itself

    def cuDevicePrimaryCtxRetain(self, dev: Any) -> tuple[Any, Any]:
        index = self._device(dev)
        if not 0 <= index < self.device_count:
            return R.CUDA_ERROR_INVALID_DEVICE, None
        return OK, real_driver.CUcontext(_CONTEXT + index)

    def cuCtxPushCurrent(self, ctx: Any) -> tuple[Any]:
        self._stack().append(_as(ctx, real_driver.CUcontext, "ctx"))
        return (OK,)

    def cuCtxPopCurrent(self) -> tuple[Any, Any]:
        if not self._stack():
            return R.CUDA_ERROR_INVALID_CONTEXT, None
        return OK, real_driver.CUcontext(self._stack().pop())

    def cuCtxSynchronize(self) -> tuple[Any]:
        error = self.refused()
        if error is not None:
            return (error,)
        if self.unsafe_in_capture():
            return (CAPTURE,)
        self._synchronize(self.current_device())  # this context's device, no other
        return (R.CUDA_ERROR_ILLEGAL_ADDRESS if self.refused() is not None else OK,)

    def cuPointerGetAttribute(self, attribute: Any, ptr: Any) -> tuple[Any, int | None]:
        _of(attribute, real_driver.CUpointer_attribute, "attribute")
        address = _pointer(ptr)
        if attribute != real_driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
            raise NotImplementedError(f"cudasim: cuPointerGetAttribute({attribute.name})")
        with self.memory.lock:
            device = self.memory.device_of(address)
        return (INVALID, None) if device is None else (OK, device)

    # ---- virtual memory management ----------------------------------------------------------

    def _check_prop(self, prop: Any) -> bool:
        _of(prop, real_driver.CUmemAllocationProp, "prop")
        return (
            prop.type == real_driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
            and prop.location.type == real_driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            and 0 <= prop.location.id < self.device_count
        )

    def cuMemGetAllocationGranularity(self, prop: Any, option: Any) -> tuple[Any, int | None]:
        flags = real_driver.CUmemAllocationGranularity_flags
        option = flags(_int(option, "option"))  # an int is converted, as the bindings do
        if not self._check_prop(prop):
            return INVALID, None
        return OK, GRANULARITY if option == flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED else _MIN

    def cuMemGetInfo(self) -> tuple[Any, int | None, int | None]:
        error = self.refused()
        if error is not None:
            return error, None, None
        with self.memory.lock:
            return OK, self.memory.capacity - self.memory.used, self.memory.capacity

    def cuMemAddressReserve(self, size: int, alignment: int, addr: Any, flags: int) -> Any:
        size, alignment = _int(size, "size"), _int(alignment, "alignment")
        _pointer(addr, "addr")  # a hint; like the driver, free to ignore it
        error = self.refused()
        if error is not None:
            return error, None
        aligned = alignment == 0 or (alignment % _MIN == 0)
        if size <= 0 or size % _MIN or not aligned or _int(flags, "flags") != 0:
            return INVALID, None
        with self.memory.lock:
            if size > self.memory.address_space:  # no range could ever hold it
                return self.impossible, None
            address = self.memory.take_range(size, max(alignment, GRANULARITY))
            if address is None:
                return OOM, None
            self.memory.reservations[address] = Reservation(size)
        return OK, real_driver.CUdeviceptr(address)

    def cuMemAddressFree(self, ptr: Any, size: int) -> tuple[Any]:
        address, size = _pointer(ptr), _int(size, "size")
        with self.memory.lock:
            reservation = self.memory.reservations.get(address)
            # The size must be the reserved one; a range still mapped cannot be freed.
            if reservation is None or reservation.size != size or reservation.mappings:
                return (INVALID,)
            del self.memory.reservations[address]
            self.memory.give_range(address, size)
        return (OK,)

    def cuMemCreate(self, size: int, prop: Any, flags: int) -> tuple[Any, Any]:
        size = _int(size, "size")
        if not self._check_prop(prop) or size <= 0 or size % _MIN or _int(flags, "f") != 0:
            return INVALID, None
        error = self.refused()
        if error is not None:
            return error, None
        if self.unsafe_in_capture():
            return CAPTURE, None
        with self.memory.lock:
            if not self.memory.charge(size):
                return OOM, None
            key, self.memory.next_handle = self.memory.next_handle, self.memory.next_handle + 1
            self.memory.handles[key] = Handle(size, prop.location.id)
        return OK, real_driver.CUmemGenericAllocationHandle(key)

    def _handle(self, handle: object) -> int:
        return _as(handle, real_driver.CUmemGenericAllocationHandle, "handle")

    def cuMemRelease(self, handle: Any) -> tuple[Any]:
        key = self._handle(handle)
        with self.memory.lock:
            found = self.memory.handles.get(key)
            if found is None or found.released:
                return (INVALID,)
            found.released = True  # its memory goes once its last mapping is unmapped
            self.memory.handle_gone(key)
        return (OK,)

    def cuMemMap(self, ptr: Any, size: int, offset: int, handle: Any, flags: int) -> tuple[Any]:
        address, size, offset = _pointer(ptr), _int(size, "size"), _int(offset, "offset")
        key = self._handle(handle)
        if address % _MIN or size <= 0 or size % _MIN or offset % _MIN:
            return (INVALID,)
        if self.unsafe_in_capture():
            return (CAPTURE,)
        with self.memory.lock:
            found = self.memory.handles.get(key)
            if found is None or found.released or offset + size > found.size or flags != 0:
                return (INVALID,)
            inside = self.memory.reservation_at(address, size)
            if inside is None:  # only inside a reserved range
                return (INVALID,)
            mappings = inside[1].mappings
            if any(at < address + size and address < at + m.size for at, m in mappings.items()):
                return (INVALID,)  # only onto unmapped addresses
            mappings[address] = Mapping(size, key)  # no access until cuMemSetAccess
            found.mappings += 1
        return (OK,)

    def _whole_mappings(self, address: int, size: int) -> list[tuple[int, Mapping]] | None:
        """The mappings that exactly tile ``[address, address + size)``, or ``None``."""
        inside = self.memory.reservation_at(address, size)
        if inside is None or size <= 0:
            return None
        found = sorted(
            (at, m)
            for at, m in inside[1].mappings.items()
            if at < address + size and address < at + m.size
        )
        end = address
        for at, mapping in found:
            if at != end:
                return None  # a gap, or a mapping that starts before the range
            end = at + mapping.size
        return found if found and end == address + size else None

    def cuMemSetAccess(self, ptr: Any, size: int, desc: Any, count: int) -> tuple[Any]:
        address, size, count = _pointer(ptr), _int(size, "size"), _int(count, "count")
        if not isinstance(desc, list | tuple):
            raise TypeError(f"cudasim: desc must be a list, got {type(desc).__name__}")
        for item in desc:
            _of(item, real_driver.CUmemAccessDesc, "desc[i]")
        flags = real_driver.CUmemAccess_flags
        if count != len(desc) or count == 0:
            return (INVALID,)
        for item in desc:
            location = item.location
            if location.type != real_driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE:
                return (INVALID,)
            if not 0 <= location.id < self.device_count or item.flags not in list(flags):
                return (INVALID,)
        with self.memory.lock:
            tiles = self._whole_mappings(address, size)
            if tiles is None:  # the range must be fully mapped
                return (INVALID,)
            fresh = [(at, m) for at, m in tiles if not m.access]
            for _, mapping in tiles:
                for item in desc:  # per device: a device not listed keeps what it had
                    if item.flags == flags.CU_MEM_ACCESS_FLAGS_PROT_NONE:
                        mapping.access.pop(item.location.id, None)
                    else:
                        writable = item.flags == flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
                        mapping.access[item.location.id] = writable
            for at, mapping in tiles:  # the host's pages: the most any device may do
                if any(mapping.access.values()):
                    make_accessible(at, mapping.size)
                elif mapping.access:
                    make_read_only(at, mapping.size)
                else:
                    make_inaccessible(at, mapping.size)
            for at, mapping in fresh:
                if any(mapping.access.values()):
                    fill_fresh(at, mapping.size)  # new physical memory is not cleared
        return (OK,)

    def cuMemUnmap(self, ptr: Any, size: int) -> tuple[Any]:
        address, size = _pointer(ptr), _int(size, "size")
        with self.memory.lock:
            tiles = self._whole_mappings(address, size)
            if tiles is None:  # only whole mappings, never a part of one
                return (INVALID,)
            found = self.memory.reservation_at(address, size)
            assert found is not None
            # Unmapping does not wait for work in flight: work still queued over the pages
            # would touch an illegal address.
            self.memory.gone(address, size, "cuMemUnmap", self.current_device())
            for at, mapping in tiles:
                del found[1].mappings[at]
                self.memory.handles[mapping.handle].mappings -= 1
                self.memory.handle_gone(mapping.handle)
            make_inaccessible(address, size)
        return (OK,)

    # ---- host registration ------------------------------------------------------------------

    def cuMemHostRegister(self, p: Any, bytesize: int, Flags: int) -> tuple[Any]:
        address, size, flags = _pointer(p, "p"), _int(bytesize, "bytesize"), _int(Flags, "Flags")
        known = (
            real_driver.CU_MEMHOSTREGISTER_PORTABLE
            | real_driver.CU_MEMHOSTREGISTER_DEVICEMAP
            | real_driver.CU_MEMHOSTREGISTER_IOMEMORY
            | real_driver.CU_MEMHOSTREGISTER_READ_ONLY
        )
        error = self.refused()
        if error is not None:
            return (error,)
        if size <= 0 or address == 0 or flags & ~known:
            return (INVALID,)
        if self.unsafe_in_capture():
            return (CAPTURE,)
        # Pages are locked whole: two registrations may not share a page.
        first, end = address // PAGE * PAGE, -(-(address + size) // PAGE) * PAGE
        with self.memory.lock:
            for at, length in self.memory.registered.items():
                if at // PAGE * PAGE < end and first < -(-(at + length) // PAGE) * PAGE:
                    return (R.CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED,)
            if sum(self.memory.registered.values()) + size > self.memory.pinned_capacity:
                return (OOM,)
            self.memory.registered[address] = size
        return (OK,)

    def cuMemHostUnregister(self, p: Any) -> tuple[Any]:
        address = _pointer(p, "p")
        error = self.refused()
        if error is not None:
            return (error,)
        with self.memory.lock:
            size = self.memory.registered.pop(address, None)
            if size is None:  # only a registration's start
                return (R.CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED,)
            # Registrations are portable: any device's queued copy may still use the pages.
            self.memory.gone(address, size, "cuMemHostUnregister", self.current_device())
        return (OK,)


class SimulatedRuntime:
    """``cuda.bindings.runtime``: device count, versions, ``cudaMalloc`` / ``cudaFree``.

    ``cudaMalloc`` allocates on the device of the driver context current to the thread.
    """

    def __init__(self, memory: DeviceMemory, driver: SimulatedDriver):
        self.memory = memory
        self.driver = driver
        self.device_count = driver.device_count

    def __getattr__(self, name: str) -> Any:
        value = getattr(real_runtime, name)
        if name.startswith("cuda") and callable(value):
            raise NotImplementedError(f"cudasim: {name} is not simulated; add it to cudasim")
        return value

    def cudaGetDeviceCount(self) -> tuple[Any, int]:
        return E.cudaSuccess, self.device_count

    def cudaRuntimeGetVersion(self) -> tuple[Any, int]:
        return E.cudaSuccess, VERSION

    def cudaDriverGetVersion(self) -> tuple[Any, int]:
        return E.cudaSuccess, VERSION

    def _refused(self) -> Any:
        if self.driver.current_device() in self.memory.faulted:
            return E.cudaErrorIllegalAddress
        if self.driver.unsafe_in_capture():
            return E.cudaErrorStreamCaptureUnsupported
        return None

    def cudaMalloc(self, size: int) -> tuple[Any, int | None]:
        size = _int(size, "size")
        error = self._refused()
        if error is not None:
            return error, None
        address = self.malloc(size, self.driver.current_device())
        return (E.cudaErrorMemoryAllocation, None) if address is None else (E.cudaSuccess, address)

    def cudaFree(self, devPtr: Any) -> tuple[Any]:
        address = _pointer(devPtr, "devPtr")
        error = self._refused()
        if error is not None:
            return (error,)
        self.driver._synchronize(self.driver.current_device())  # cudaFree waits for the device
        freed = self.free(address, self.driver.current_device())
        return (E.cudaSuccess,) if freed else (E.cudaErrorInvalidValue,)

    def malloc(self, size: int, device: int) -> int | None:
        """``size`` bytes of mapped device memory (256-byte aligned, as cudaMalloc is)."""
        if size <= 0:
            return None
        span = -(-size // PAGE) * PAGE
        with self.memory.lock:
            if not self.memory.charge(span):
                return None
            address = self.memory.take_range(span, PAGE)
            if address is None:
                self.memory.used -= span
                return None
            self.memory.allocations[address] = span
            self.memory.allocated_on[address] = device
        make_accessible(address, span)
        fill_fresh(address, span)  # cudaMalloc does not clear
        return address

    def free(self, address: int, device: int) -> bool:
        """Give an allocation back; work still queued over it is a fault on ``device``."""
        with self.memory.lock:
            span = self.memory.allocations.pop(address, None)
            if span is None:
                return False
            self.memory.gone(address, span, "freeing", device)
            del self.memory.allocated_on[address]
            make_inaccessible(address, span)
            self.memory.give_range(address, span)
            self.memory.used -= span
        return True
