"""CUDA devices: which backends serve a device, and the calls into cuda-python they share.

Imported only when a CUDA device is asked for, and cuda-python only inside functions, so that
importing sharedmem and using ``cpu`` or ``emulated`` never touches CUDA.

The CUDA modules, one responsibility each:

* here: choosing the backends of a device;
* ``cuda_api``: loading cuda-python (12.x and 13.x), checking its ``(error, value)`` results,
  making a device's context current;
* ``cuda_owner``: lifetime (bytes freed when their last view is gone), out of memory;
* ``cuda_streams``: copies between the sides on streams, fenced by events;
* ``cuda_vmm``, ``cudart``, ``cuda_torch``: the three device backends;
* ``cuda_pinned``: the pinned host side.

**Choice.** The default is the first of ``vmm`` (stable addresses, growth without copying),
``cudart`` and ``torch`` that can run here: ``vmm`` where the device reports
``CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED`` and a trial reservation works,
``cudart`` where cuda-python's runtime works with the installed driver (cuda-python 13 brings
the CUDA 13 runtime, which needs a driver of 580 or later), and ``torch``, which needs nothing
but PyTorch, everywhere else. Each is tried once per device. Naming a backend that cannot run
raises ``SharedMemError`` with the reason and the fix instead of silently falling back.
The host side is the pinned reserved range where a trial registration of one page through the
driver API works, and pinned tensors from PyTorch otherwise; neither depends on cuda-python's
runtime, so the host side works wherever PyTorch does.

**Contexts.** Driver and cuda-python runtime calls run with device N's primary context pushed
(the one PyTorch uses), so ``cuda:N`` allocates on device N whatever the current device is.
"""

from __future__ import annotations

import functools

from .._errors import SharedMemError
from ._base import Backend, Placement
from .cuda_api import device_index, vmm_supported

__all__ = ["default_backend", "placement", "usable_backends"]


# ---- choosing the backends of a device ----------------------------------------------------------


@functools.cache
def default_backend(index: int) -> str:
    """The backend ``device="cuda:N"`` gets when none is named: the first that can run here."""
    return next(kind for kind in _PREFERENCE if _builds(index, kind))


def usable_backends(index: int) -> tuple[str, ...]:
    """The backends that can run on device ``index`` here, in order of preference."""
    return tuple(kind for kind in _PREFERENCE if _builds(index, kind))


_PREFERENCE = ("vmm", "cudart", "torch")  # torch needs nothing but PyTorch: always last


def _builds(index: int, kind: str) -> bool:
    # Building a backend runs its checks: a trial reservation for vmm, a trial call of
    # cuda-python's runtime for cudart.
    try:
        _device_backend(index, kind)
    except SharedMemError:
        return False
    return True


@functools.cache
def _device_backend(index: int, kind: str) -> Backend:
    # Cached per (device, kind) when it can be built; a failure is not cached (its checks
    # are), so naming the backend again says why once more.
    device = f"cuda:{index}"
    if kind == "torch":
        from .cuda_torch import TorchCudaBackend

        return TorchCudaBackend(device)
    if kind == "cudart":
        from .cudart import CudartBackend

        return CudartBackend(device)
    if not vmm_supported(index):
        raise SharedMemError(
            f"sharedmem: {device} does not support CUDA virtual memory management "
            "(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0), which "
            "backend='vmm' needs; use backend='cudart' or backend='torch'."
        )
    from .cuda_vmm import VmmBackend

    return VmmBackend(device)


@functools.cache
def _host_backend(index: int) -> Backend:
    from .cuda_pinned import PinnedPageableBackend, PinnedReservedBackend, registration_works

    return (
        PinnedReservedBackend(index) if registration_works(index) else PinnedPageableBackend(index)
    )


def placement(device: str, backend: str | None) -> Placement:
    """The placement of a CUDA device: pinned host memory and the named device backend.

    Backends are shared per device, so every memory on ``cuda:N`` with the same backend name
    (given or default) has the same placement.
    """
    index = device_index(device)
    kind = backend or default_backend(index)
    return Placement(device, _host_backend(index), _device_backend(index, kind))
