"""Copies between the host and a CUDA device, on streams, fenced by events.

A copy runs on the current stream (the synchronous accessors) or, for ``push_async`` /
``pull_async``, on the given stream or a per-device side stream. A side stream first waits for
the current stream, because the kernel that produced the bytes (or still reads the bytes about
to be overwritten) may still be running there. Every copy returns a fence backed by a CUDA
event recorded after it: ``wait_host`` synchronizes the event (the memory calls it before it
hands out host views, grows or frees a side), ``wait_device`` makes the current stream wait for
it (before a device view is handed out), which orders later device work without blocking.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from ._base import Backend
from .cuda_api import device_index
from .cuda_torch_ops import ops

__all__ = ["CudaBackend", "EventFence", "side_stream"]


class EventFence:
    """A copy on a CUDA stream, marked by an event recorded after it."""

    __slots__ = ("_event", "_index")

    def __init__(self, event: Any, index: int) -> None:
        self._event = event
        self._index = index

    def wait_host(self) -> None:
        self._event.synchronize()

    def wait_device(self) -> None:
        # Device work is issued on the current stream: order it after the copy, no blocking.
        ops().current_stream(self._index).wait_event(self._event)


# Keyed by the ops in use too: a stand-in installed by a test has streams of its own.
_side_streams: dict[tuple[int, int], Any] = {}
_side_lock = threading.Lock()


def side_stream(index: int) -> Any:
    """The per-device stream that ``push_async`` / ``pull_async`` copy on by default."""
    key = (id(ops()), index)
    stream = _side_streams.get(key)
    if stream is None:
        with _side_lock:
            stream = _side_streams.get(key)
            if stream is None:
                stream = ops().new_stream(index)
                _side_streams[key] = stream
    return stream


def _as_stream(stream: object, index: int) -> Any:
    own = ops().own_stream(stream, index)
    if own is not None:
        return own
    device = torch.device("cuda", index)
    if isinstance(stream, int) and not isinstance(stream, bool):  # a raw cudaStream_t
        stream = torch.cuda.ExternalStream(stream, device=device)  # type: ignore[no-untyped-call]
    elif (
        isinstance(stream, torch.Stream)
        and not isinstance(stream, torch.cuda.Stream)
        and stream.device.type == "cuda"
    ):
        # A generic stream (torch.accelerator); the CUDA flavour knows how to copy on it.
        stream = torch.cuda.Stream(  # type: ignore[no-untyped-call]
            stream_id=stream.stream_id,
            device_index=stream.device_index,
            device_type=stream.device_type,
        )
    if not isinstance(stream, torch.cuda.Stream):
        raise TypeError(
            "sharedmem: stream must be a torch.cuda.Stream, a raw cudaStream_t (int) or None, "
            f"got {type(stream).__name__}"
        )
    if stream.device != device:
        raise ValueError(
            f"sharedmem: the stream is on {stream.device} but the memory is on {device}; "
            f"pass a stream of {device} (torch.cuda.Stream(device={index}))"
        )
    return stream


class CudaBackend(Backend):
    """The device side on a CUDA device: copies to and from the host on streams."""

    def __init__(self, device: str, *, granularity: int) -> None:
        # ``device`` is the torch device of the blocks' tensors (host memory under a test's
        # stand-in); ``memory_name`` stays "cuda:N" for messages and errors.
        self.index = device_index(device)
        self.cuda_device = device
        super().__init__(device=str(ops().tensor_device(self.index)), granularity=granularity)

    @property
    def memory_name(self) -> str:
        return self.cuda_device

    def _copy(
        self,
        dst: torch.Tensor,
        src: torch.Tensor,
        *,
        to_device: bool,
        stream: object,
        asynchronous: bool,
    ) -> EventFence:
        mine = dst if to_device else src  # the tensor of this (device) side
        torch_ops = ops()
        current = torch_ops.current_stream(self.index)
        if stream is not None:
            chosen = _as_stream(stream, self.index)
        else:
            chosen = side_stream(self.index) if asynchronous else current
        if chosen != current:
            # The bytes may still be being produced (or read) by work on the current stream.
            chosen.wait_stream(current)
            self._used_on(mine, chosen)
        torch_ops.copy_on(chosen, dst, src)
        event = torch_ops.new_event()
        event.record(chosen)
        return EventFence(event, self.index)

    def _used_on(self, tensor: torch.Tensor, stream: Any) -> None:
        """Hook: ``tensor`` (of this side) is used on ``stream``, not the current one."""
