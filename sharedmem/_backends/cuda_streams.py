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

import torch

from ._base import Backend
from .cuda_api import device_index

__all__ = ["CudaBackend", "EventFence", "side_stream"]


class EventFence:
    """A copy on a CUDA stream, marked by an event recorded after it."""

    __slots__ = ("_event", "_index")

    def __init__(self, event: torch.cuda.Event, index: int) -> None:
        self._event = event
        self._index = index

    def wait_host(self) -> None:
        self._event.synchronize()

    def wait_device(self) -> None:
        # Device work is issued on the current stream: order it after the copy, no blocking.
        torch.cuda.current_stream(self._index).wait_event(self._event)


_side_streams: dict[int, torch.cuda.Stream] = {}
_side_lock = threading.Lock()


def side_stream(index: int) -> torch.cuda.Stream:
    """The per-device stream that ``push_async`` / ``pull_async`` copy on by default."""
    stream = _side_streams.get(index)
    if stream is None:
        with _side_lock:
            stream = _side_streams.get(index)
            if stream is None:
                stream = torch.cuda.Stream(device=index)  # type: ignore[no-untyped-call]
                _side_streams[index] = stream
    return stream


def _as_stream(stream: object, index: int) -> torch.cuda.Stream:
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
        super().__init__(device=device, granularity=granularity)
        self.index = device_index(device)

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
        current = torch.cuda.current_stream(self.index)
        if stream is not None:
            chosen = _as_stream(stream, self.index)
        else:
            chosen = side_stream(self.index) if asynchronous else current
        if chosen == current:
            dst.copy_(src, non_blocking=True)
        else:
            # The bytes may still be being produced (or read) by work on the current stream.
            chosen.wait_stream(current)
            with torch.cuda.stream(chosen):
                dst.copy_(src, non_blocking=True)
            self._used_on(mine, chosen)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(chosen)
        return EventFence(event, self.index)

    def _used_on(self, tensor: torch.Tensor, stream: torch.cuda.Stream) -> None:
        """Hook: ``tensor`` (of this side) is used on ``stream``, not the current one."""
