"""Backends: how raw bytes are obtained for each side of a memory, chosen per device.

``resolve(device, backend)`` returns the ``Placement`` for a device string and an optional
backend name: the host backend, and the device backend (``None`` on ``cpu``, where the device
side is the host memory itself).
"""

from __future__ import annotations

import functools

import torch

from .._devices import normalize_device
from ._base import Backend, Block, Fence, Placement, rewindow, round_up
from .emulated import EmulatedPageable, EmulatedReserved
from .host import PageableBackend, ReservedBackend

__all__ = [
    "Backend",
    "Block",
    "Fence",
    "Placement",
    "backend_names",
    "resolve",
    "rewindow",
    "round_up",
]

# The first name of each list is the default.
_NAMES: dict[str, tuple[str, ...]] = {
    "cpu": ("reserved", "pageable"),
    "emulated": ("reserved", "pageable"),
    "cuda": ("vmm", "cudart", "torch"),
}


def backend_names(device: object) -> tuple[str, ...]:
    """The backend names a device accepts, default first.

    Answers for any device this package knows, usable here or not (``"cuda"`` on a machine
    without a GPU included), so that code can be written for a device before it runs on one.

    Args:
        device: ``"cpu"``, ``"emulated"``, ``"cuda"``, ``"cuda:N"`` or a ``torch.device``.

    Example::

        >>> import sharedmem as sm
        >>> sm.backend_names("emulated")
        ('reserved', 'pageable')
    """
    if isinstance(device, torch.device):
        kind = device.type
    elif isinstance(device, str):
        kind = device.strip().partition(":")[0]
    else:
        raise TypeError(
            f"sharedmem: device must be a str or torch.device, got {type(device).__name__}"
        )
    names = _NAMES.get(kind)
    if names is None:
        raise ValueError(
            f"sharedmem: unknown device {device!r}; use one of {', '.join(map(repr, _NAMES))} "
            "(with an index for cuda: 'cuda:0')"
        )
    return names


def resolve(device: object = "cpu", backend: object = None) -> Placement:
    """The placement for ``device`` with the named device ``backend`` (default: the first)."""
    name = normalize_device(device)
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"sharedmem: backend must be a str or None, got {type(backend).__name__}")
    choices = backend_names(name)
    if backend is not None and backend not in choices:
        raise ValueError(
            f"sharedmem: unknown backend {backend!r} for device {name!r}; "
            f"choose one of {', '.join(repr(c) for c in choices)}"
        )
    # On CUDA the default depends on what the device supports; cuda.placement chooses it.
    return _placement(name, backend or (None if name.startswith("cuda") else choices[0]))


@functools.cache
def _placement(device: str, backend: str | None) -> Placement:
    # One placement (and backend instances) per (device, backend): backends keep no per-block
    # state, and sharing them lets a pool account for all its memories in one place. On CUDA
    # the backend is None when not named: a named backend the device cannot serve is an
    # error, the default falls back.
    host = ReservedBackend()
    if device == "cpu":
        return Placement(device, PageableBackend() if backend == "pageable" else host, None)
    if device == "emulated":
        accel: Backend = EmulatedPageable() if backend == "pageable" else EmulatedReserved()
        return Placement(device, host, accel)
    from .cuda import placement  # imported only when a CUDA device is asked for

    return placement(device, backend)
