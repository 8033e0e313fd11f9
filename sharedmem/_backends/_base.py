"""The private interface between SyncedMemory and whatever provides raw bytes.

A backend serves one side of a memory (host or device). Its public methods hold the policy
that every backend shares (rounding to the allocation granularity, refusing nonsense); a
subclass fills in the four hooks ``_allocate``, ``_grow``, ``_shrink`` and ``_free``, and a
device backend also ``upload`` / ``download`` for copies between the sides.

Blocks are immutable: growing or shrinking returns a new ``Block`` (which may share the old
mapping on a stable-address backend). A refused growth therefore cannot leave a half-changed
block behind; the caller still holds the old one.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = ["Backend", "Block", "Fence", "MovingBackend", "Placement", "rewindow", "round_up"]


class Fence(Protocol):
    """A copy between the sides that may still be running.

    ``wait_host`` blocks the calling thread until the copy is done; ``wait_device`` orders the
    device work issued from now on (on the current stream) after it, blocking only where the
    backend cannot do better.
    """

    def wait_host(self) -> None: ...

    def wait_device(self) -> None: ...


def round_up(nbytes: int, granularity: int) -> int:
    """Round ``nbytes`` up to a multiple of ``granularity``."""
    return -(-nbytes // granularity) * granularity


def rewindow(base: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """Point ``base``, a block's tensor, at ``window`` (the same address, another capacity).

    A stable-address block keeps one tensor object across growth and shrink, so every view of
    it shares one version counter, as views of one tensor do: autograd still sees a saved view
    changed in place through a view taken after a growth. The version is put back afterwards:
    pointing at more (or fewer) bytes at the same address changes none of them.
    """
    version = base._version
    with torch.no_grad():
        base.set_(window.untyped_storage(), 0, window.shape, window.stride())
    # An older torch lacks this (or takes other arguments): the counter stays one ahead.
    with contextlib.suppress(AttributeError, TypeError):
        torch._C._autograd._unsafe_set_version_counter((base,), (version,))
    return base


@dataclass(frozen=True, eq=False)
class Block:
    """Physical bytes on one side.

    Attributes:
        tensor: a 1-D ``uint8`` tensor starting at the block's first byte and spanning at
            least ``capacity`` bytes. On a stable-address backend it is one tensor object for
            the block's whole life, re-pointed at each capacity (``rewindow``).
        capacity: bytes this block may use; the grow-only capacity of its side.
        handle: backend-private state (an mmap, a CUDA handle); ``None`` for plain tensors.
    """

    tensor: torch.Tensor
    capacity: int
    handle: object = None

    @property
    def address(self) -> int:
        return int(self.tensor.data_ptr())


class Backend(ABC):
    """Obtains, grows, shrinks and frees the raw bytes of one side.

    Attributes:
        kind: the backend's name as users select it (``"reserved"``, ``"vmm"`` ...).
        stable_address: growth keeps the block's address (old views stay valid).
        granularity: capacities are multiples of this many bytes.
        device: the torch device string of the tensors the blocks hold.
    """

    # Class attributes on concrete backends; adaptors copy them from their upstream.
    kind: str
    stable_address: bool

    def __init__(self, *, device: str, granularity: int) -> None:
        self.device = device
        self.granularity = granularity

    @property
    def memory_name(self) -> str:
        """The memory space as users name it, for messages (``"emulated"`` holds ``cpu``
        tensors)."""
        return self.device

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.device!r})"

    def round(self, nbytes: int) -> int:
        return round_up(nbytes, self.granularity)

    def allocate(self, nbytes: int) -> Block:
        """A new block of at least ``nbytes`` (> 0) bytes."""
        assert nbytes > 0, nbytes
        return self._allocate(self.round(nbytes))

    def grow(self, block: Block, nbytes: int, keep: int) -> tuple[Block, int]:
        """A block of at least ``nbytes`` whose first ``keep`` bytes equal ``block``'s.

        Returns the block and the number of bytes copied to keep them (0 when the backend
        grows in place). On failure ``block`` is untouched and still owned by the caller.
        """
        assert nbytes > block.capacity and 0 <= keep <= block.capacity, (nbytes, keep, block)
        return self._grow(block, self.round(nbytes), keep)

    def will_move(self, block: Block, nbytes: int) -> bool:
        """Whether growing ``block`` to ``nbytes`` (rounded) moves it: then old and new blocks
        are held at once while the bytes are copied. A stable-address backend that moves
        past its reserved range says so per block."""
        return not self.stable_address

    def shrink(self, block: Block, nbytes: int, keep: int) -> tuple[Block | None, int]:
        """Give back the part of ``block`` beyond ``nbytes``; ``None`` when nothing remains.

        The first ``keep`` (<= ``nbytes``) bytes survive. Returns the block and bytes copied.
        """
        assert 0 <= keep <= nbytes, (keep, nbytes)
        target = self.round(nbytes)
        if target >= block.capacity:
            return block, 0
        if target == 0:
            self._free(block)
            return None, 0
        return self._shrink(block, target, keep)

    def free(self, block: Block) -> None:
        """Give ``block`` back now (``release``, ``shrink_to_fit``); views of it may read zeros."""
        self._free(block)

    def forget(self, block: Block) -> None:  # noqa: B027 (deliberately nothing by default)
        """The memory that held ``block`` was collected; views of it may still be in use.

        Nothing is zeroed or unmapped here: every backend's storage goes back to the system
        with its last view (an mmap, a CUDA owner, an allocator tensor). Adaptors count it.
        """

    # Copies between the host side and this (device) side. Host backends never get these
    # calls. A copy may run on after the call returns; it then returns a Fence, and the memory
    # waits on it before anything else touches either buffer. ``asynchronous`` asks for that
    # (push_async / pull_async); ``stream`` is the CUDA stream to copy on (None: the backend's).
    def upload(
        self,
        dst: torch.Tensor,
        src: torch.Tensor,
        *,
        stream: object = None,
        asynchronous: bool = False,
    ) -> Fence | None:
        """Copy host bytes ``src`` into this side's ``dst`` (same length)."""
        return self._copy(dst, src, to_device=True, stream=stream, asynchronous=asynchronous)

    def download(
        self,
        dst: torch.Tensor,
        src: torch.Tensor,
        *,
        stream: object = None,
        asynchronous: bool = False,
    ) -> Fence | None:
        """Copy this side's bytes ``src`` into host ``dst`` (same length)."""
        return self._copy(dst, src, to_device=False, stream=stream, asynchronous=asynchronous)

    def _copy(
        self,
        dst: torch.Tensor,
        src: torch.Tensor,
        *,
        to_device: bool,
        stream: object,
        asynchronous: bool,
    ) -> Fence | None:
        """Hook for both copy directions; by default a plain copy, done when it returns."""
        dst.copy_(src)
        return None

    @abstractmethod
    def _allocate(self, nbytes: int) -> Block: ...

    @abstractmethod
    def _grow(self, block: Block, nbytes: int, keep: int) -> tuple[Block, int]: ...

    @abstractmethod
    def _shrink(self, block: Block, nbytes: int, keep: int) -> tuple[Block, int]: ...

    @abstractmethod
    def _free(self, block: Block) -> None: ...


class MovingBackend(Backend):
    """Blocks are plain tensors from an allocator: a growth allocates anew and copies the
    bytes to keep, a shrink likewise, and a freed block goes back with its last reference."""

    stable_address = False

    def _grow(self, block: Block, nbytes: int, keep: int) -> tuple[Block, int]:
        new = self._allocate(nbytes)
        new.tensor[:keep].copy_(block.tensor[:keep])
        return new, keep

    def _shrink(self, block: Block, nbytes: int, keep: int) -> tuple[Block, int]:
        return self._grow(block, nbytes, keep)

    def _free(self, block: Block) -> None:
        pass  # the tensor returns to its allocator when the last view of it is gone


@dataclass(frozen=True)
class Placement:
    """Where a memory's two sides live.

    Attributes:
        device: the canonical device string.
        host: the host side's backend.
        accel: the device side's backend, or ``None`` when the device side is the host
            memory (``cpu``): one memory, no copies.
    """

    device: str
    host: Backend
    accel: Backend | None

    @property
    def device_backend(self) -> Backend:
        """The backend that serves device-side accesses (the host one on ``cpu``)."""
        return self.host if self.accel is None else self.accel
