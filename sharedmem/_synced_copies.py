"""The copies between a SyncedMemory and device tensors outside it.

``download_async`` / ``upload_async`` serve activation offload: the bytes come from (or go to)
a device tensor the memory does not own, while the memory's own state machine keeps track of
the copy in flight. They live here so that ``_synced.py`` stays the state machine alone; the
state they use is declared below and set by ``SyncedMemory``.
"""

from __future__ import annotations

import threading

import torch

from ._backends import Fence
from ._side import Side
from ._validate import check_byte_tensor

__all__ = ["ExternalCopies"]


class ExternalCopies:
    """Asynchronous copies between a memory's host side and device tensors outside it."""

    # The state of SyncedMemory these copies go through.
    _lock: threading.RLock
    _host: Side
    _device: Side
    _size: int
    _written: int
    host_to_device_bytes: int
    device_to_host_bytes: int

    def _to_host(self, upto: int, *, stream: object = None, asynchronous: bool = False) -> None:
        raise NotImplementedError

    def _wrote(self, side: Side) -> None:
        raise NotImplementedError

    def _touch(self) -> None:
        raise NotImplementedError

    def download_async(self, source: torch.Tensor, stream: object = None) -> Fence | None:
        """Like ``pull_async``, from ``source`` (1-D uint8, ``size`` device bytes outside this
        memory) into the host side, which becomes the head as after a host write. Returns the
        copy's fence, or ``None`` once done (always on ``cpu``); keep ``source`` till then."""
        check_byte_tensor(source, self._size, "source")
        with self._lock:
            self._to_host(self._written)  # as mutable_host_data: the head holds every byte
            self._host.settle()  # a copy still reading these bytes finishes before we write
            target = self._host.view(self._size)
            self._wrote(self._host)
            if self._device is self._host:
                target.copy_(source)
                return None
            backend = self._device.backend
            fence = backend.download(target, source, stream=stream, asynchronous=True)
            self._host.fence = fence
            self.device_to_host_bytes += self._size
            self._touch()  # a copy in flight: a cached view must not skip waiting for it
            return fence

    def upload_async(self, target: torch.Tensor, stream: object = None) -> Fence | None:
        """Like ``push_async``, from the host side into ``target`` (1-D uint8, ``size`` device
        bytes outside this memory). Returns the fence its reader waits on, or ``None`` once
        done (always on ``cpu``); host writes and growth wait for the copy."""
        check_byte_tensor(target, self._size, "target")
        with self._lock:
            self._to_host(min(self._size, self._written))
            self._host.settle()
            source = self._host.view(self._size)
            if self._device is self._host:
                target.copy_(source)
                return None
            backend = self._device.backend
            fence = backend.upload(target, source, stream=stream, asynchronous=True)
            self._host.fence = fence  # the copy reads the host bytes
            self.host_to_device_bytes += self._size
            self._touch()
            return fence
