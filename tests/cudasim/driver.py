"""The part of ``cuda.bindings.driver`` and ``runtime`` that sharedmem calls, simulated.

Every call answers as cuda-python does (a tuple that starts with the real ``CUresult`` or
``cudaError_t``) and checks what it is given as the real bindings and driver do: the types
(``TypeError`` for an argument the bindings would not accept), the structs' fields and enums,
the granularity, and the documented rules of the virtual memory calls. Everything else in the
real modules (enums, structs, constants) is passed through, and a function this module does
not simulate raises, so a backend that starts calling one is found out here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from cuda.bindings import driver as real_driver
from cuda.bindings import runtime as real_runtime

from .memory import (
    GRANULARITY,
    PAGE,
    DeviceMemory,
    Handle,
    Mapping,
    Reservation,
    make_accessible,
    make_inaccessible,
    make_read_only,
)

R = real_driver.CUresult
E = real_runtime.cudaError_t
OK = R.CUDA_SUCCESS
INVALID = R.CUDA_ERROR_INVALID_VALUE
OOM = R.CUDA_ERROR_OUT_OF_MEMORY
VERSION = 13040  # the CUDA version the simulated driver and runtime report
_CONTEXT = 0x1000  # device N's primary context is CUcontext(_CONTEXT + N)


def _int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"cudasim: {what} must be an int, got {type(value).__name__}")
    return value


def _pointer(value: object, what: str = "ptr") -> int:
    """An address as the bindings take it: an int or a ``CUdeviceptr``."""
    if isinstance(value, real_driver.CUdeviceptr):
        return int(value)
    return _int(value, what)


def _of(value: object, kind: type, what: str) -> Any:
    if not isinstance(value, kind):
        raise TypeError(f"cudasim: {what} must be {kind.__name__}, got {type(value).__name__}")
    return value


class SimulatedDriver:
    """``cuda.bindings.driver`` for one simulated device (or more, sharing one memory)."""

    def __init__(self, memory: DeviceMemory, device_count: int, flush: Callable[[], None]):
        self.memory = memory
        self.device_count = device_count
        self._flush = flush  # runs every queued stream operation (cuCtxSynchronize)
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

    def cuInit(self, flags: int) -> tuple[Any]:
        return (OK if _int(flags, "flags") == 0 else INVALID,)

    def cuDeviceGet(self, ordinal: int) -> tuple[Any, Any]:
        if not 0 <= _int(ordinal, "ordinal") < self.device_count:
            return R.CUDA_ERROR_INVALID_DEVICE, None
        return OK, real_driver.CUdevice(ordinal)

    def cuDeviceGetAttribute(self, attrib: Any, dev: Any) -> tuple[Any, int]:
        _of(attrib, real_driver.CUdevice_attribute, "attrib")
        _of(dev, real_driver.CUdevice, "dev")
        names = real_driver.CUdevice_attribute
        supported = (
            names.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
            names.CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED,
        )
        return OK, int(attrib in supported)

    def cuDevicePrimaryCtxRetain(self, dev: Any) -> tuple[Any, Any]:
        index = int(_of(dev, real_driver.CUdevice, "dev"))
        return OK, real_driver.CUcontext(_CONTEXT + index)

    def cuCtxPushCurrent(self, ctx: Any) -> tuple[Any]:
        self._stack().append(int(_of(ctx, real_driver.CUcontext, "ctx")))
        return (OK,)

    def cuCtxPopCurrent(self) -> tuple[Any, Any]:
        if not self._stack():
            return R.CUDA_ERROR_INVALID_CONTEXT, None
        return OK, real_driver.CUcontext(self._stack().pop())

    def cuCtxSynchronize(self) -> tuple[Any]:
        if not self._current():
            return (R.CUDA_ERROR_INVALID_CONTEXT,)
        self._flush()
        return (OK,)

    def cuPointerGetAttribute(self, attribute: Any, ptr: Any) -> tuple[Any, int]:
        _of(attribute, real_driver.CUpointer_attribute, "attribute")
        address = _pointer(ptr)
        if attribute != real_driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
            raise NotImplementedError(f"cudasim: cuPointerGetAttribute({attribute.name})")
        with self.memory.lock:
            device = self.memory.device_of(address)
        return (INVALID, 0) if device is None else (OK, device)

    # ---- virtual memory management ----------------------------------------------------------

    def _check_prop(self, prop: Any) -> bool:
        _of(prop, real_driver.CUmemAllocationProp, "prop")
        return (
            prop.type == real_driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
            and prop.location.type == real_driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            and 0 <= prop.location.id < self.device_count
        )

    def cuMemGetAllocationGranularity(self, prop: Any, option: Any) -> tuple[Any, int]:
        _of(option, real_driver.CUmemAllocationGranularity_flags, "option")
        return (OK, GRANULARITY) if self._check_prop(prop) else (INVALID, 0)

    def cuMemGetInfo(self) -> tuple[Any, int, int]:
        if not self._current():
            return R.CUDA_ERROR_INVALID_CONTEXT, 0, 0
        with self.memory.lock:
            return OK, self.memory.capacity - self.memory.used, self.memory.capacity

    def cuMemAddressReserve(self, size: int, alignment: int, addr: Any, flags: int) -> Any:
        size, alignment, flags = _int(size, "size"), _int(alignment, "alignment"), flags
        _pointer(addr, "addr")  # a hint; like the driver, free to ignore it
        if not self._current():
            return R.CUDA_ERROR_INVALID_CONTEXT, real_driver.CUdeviceptr(0)
        aligned = alignment == 0 or (alignment % GRANULARITY == 0)
        if size <= 0 or size % GRANULARITY or not aligned or _int(flags, "flags") != 0:
            return INVALID, real_driver.CUdeviceptr(0)
        with self.memory.lock:
            address = self.memory.take_range(size, max(alignment, GRANULARITY))
            if address is None:
                return OOM, real_driver.CUdeviceptr(0)
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
        if not self._check_prop(prop) or size <= 0 or size % GRANULARITY or flags != 0:
            return INVALID, real_driver.CUmemGenericAllocationHandle(0)
        if not self._current():
            return R.CUDA_ERROR_INVALID_CONTEXT, real_driver.CUmemGenericAllocationHandle(0)
        with self.memory.lock:
            if not self.memory.charge(size):
                return OOM, real_driver.CUmemGenericAllocationHandle(0)
            key, self.memory.next_handle = self.memory.next_handle, self.memory.next_handle + 1
            self.memory.handles[key] = Handle(size, prop.location.id)
        return OK, real_driver.CUmemGenericAllocationHandle(key)

    def cuMemRelease(self, handle: Any) -> tuple[Any]:
        key = int(_of(handle, real_driver.CUmemGenericAllocationHandle, "handle"))
        with self.memory.lock:
            found = self.memory.handles.get(key)
            if found is None or found.released:
                return (INVALID,)
            found.released = True  # its memory goes once its last mapping is unmapped
            self.memory.handle_gone(key)
        return (OK,)

    def cuMemMap(self, ptr: Any, size: int, offset: int, handle: Any, flags: int) -> tuple[Any]:
        address, size, offset = _pointer(ptr), _int(size, "size"), _int(offset, "offset")
        key = int(_of(handle, real_driver.CUmemGenericAllocationHandle, "handle"))
        if address % GRANULARITY or size <= 0 or size % GRANULARITY or offset % GRANULARITY:
            return (INVALID,)
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
            granted = desc[-1].flags
            for _, mapping in tiles:
                mapping.accessible = granted == flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            if granted == flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE:
                make_accessible(address, size)
            elif granted == flags.CU_MEM_ACCESS_FLAGS_PROT_READ:
                make_read_only(address, size)
            else:
                make_inaccessible(address, size)
        return (OK,)

    def cuMemUnmap(self, ptr: Any, size: int) -> tuple[Any]:
        address, size = _pointer(ptr), _int(size, "size")
        with self.memory.lock:
            tiles = self._whole_mappings(address, size)
            if tiles is None:  # only whole mappings, never a part of one
                return (INVALID,)
            found = self.memory.reservation_at(address, size)
            assert found is not None
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
        if not self._current():
            return (R.CUDA_ERROR_INVALID_CONTEXT,)
        if size <= 0 or address == 0 or flags & ~known:
            return (INVALID,)
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
        if not self._current():
            return (R.CUDA_ERROR_INVALID_CONTEXT,)
        with self.memory.lock:
            if self.memory.registered.pop(address, None) is None:  # only a registration's start
                return (R.CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED,)
        return (OK,)


class SimulatedRuntime:
    """``cuda.bindings.runtime``: device count, versions, ``cudaMalloc`` / ``cudaFree``.

    ``cudaMalloc`` allocates on the device of the driver context current to the thread.
    """

    def __init__(self, memory: DeviceMemory, driver: SimulatedDriver, flush: Callable[[], None]):
        self.memory = memory
        self.driver = driver
        self.device_count = driver.device_count
        self._flush = flush

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

    def cudaMalloc(self, size: int) -> tuple[Any, int]:
        address = self.malloc(_int(size, "size"), self.driver.current_device())
        return (E.cudaErrorMemoryAllocation, 0) if address is None else (E.cudaSuccess, address)

    def cudaFree(self, devPtr: Any) -> tuple[Any]:
        self._flush()  # cudaFree waits for the device, as documented
        freed = self.free(_pointer(devPtr, "devPtr"))
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
        return address

    def free(self, address: int) -> bool:
        with self.memory.lock:
            span = self.memory.allocations.pop(address, None)
            if span is None:
                return False
            del self.memory.allocated_on[address]
            make_inaccessible(address, span)
            self.memory.give_range(address, span)
            self.memory.used -= span
        return True
