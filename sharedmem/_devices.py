"""Device strings: parsing, and which devices this machine can use.

Nothing here touches CUDA unless a CUDA device is asked for, so importing sharedmem and using
``cpu`` or ``emulated`` works on any machine.
"""

from __future__ import annotations

import os

import torch

from ._errors import SharedMemError

__all__ = [
    "DeviceLike",
    "available_devices",
    "machine_available_bytes",
    "normalize_device",
    "require_usable",
]

DeviceLike = str | torch.device

_FORMS = "'cpu', 'emulated', 'cuda' or 'cuda:N'"


def _cuda_count() -> int:
    # Through the CUDA backends' PyTorch seam, so that a test's CUDA stand-in counts too.
    from ._backends.cuda_torch_ops import ops

    return ops().device_count()


def available_devices() -> list[str]:
    """The device strings that work on this machine: ``cpu``, ``emulated``, then each GPU.

    Example::

        >>> import sharedmem as sm
        >>> sm.available_devices()[:2]
        ['cpu', 'emulated']
    """
    return ["cpu", "emulated"] + [f"cuda:{i}" for i in range(_cuda_count())]


def normalize_device(device: object) -> str:
    """Return the canonical string of ``device``: ``cpu``, ``emulated`` or ``cuda:N``.

    A bare ``cuda`` means the current CUDA device, as in PyTorch. Raises ``SharedMemError``
    for a CUDA device this machine cannot use.
    """
    index: int | None
    if isinstance(device, torch.device):
        kind, index = device.type, device.index
    elif isinstance(device, str):
        kind, _, rest = device.strip().partition(":")
        if rest and not rest.isdigit():
            raise ValueError(f"sharedmem: unknown device {device!r}; use {_FORMS}")
        index = int(rest) if rest else None
    else:
        raise TypeError(
            f"sharedmem: device must be a str or torch.device, got {type(device).__name__} "
            f"({device!r}); use {_FORMS}"
        )
    if kind in ("cpu", "emulated") and not index:
        return kind
    if kind == "cuda":
        require_usable("cuda" if index is None else f"cuda:{index}")
        from ._backends.cuda_api import refuse_after_fork
        from ._backends.cuda_torch_ops import ops

        refuse_after_fork()  # before PyTorch's current_device, which only says "spawn"
        return f"cuda:{ops().current_device() if index is None else index}"
    raise ValueError(f"sharedmem: unknown device {device!r}; use {_FORMS}")


def require_usable(device: str) -> None:
    """Raise ``SharedMemError`` if the CUDA device named by ``device`` cannot be used here."""
    count = _cuda_count()
    _, _, rest = device.partition(":")
    if count and (not rest or int(rest) < count):
        return
    why = (
        "no usable CUDA GPU was found (torch.cuda.is_available() is False)"
        if not count
        else f"this machine has {count} CUDA device(s)"
    )
    raise SharedMemError(
        f"sharedmem: device {device!r} is not usable here: {why}. "
        f"Devices that work here: {', '.join(repr(d) for d in available_devices())}. "
        "Use 'emulated' to exercise host/device code without a GPU."
    )


def machine_available_bytes() -> int:
    """The memory the operating system can give without swapping (``MemAvailable``)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
