"""Blob: virtual-size typed tensor views (data and gradient) over two SyncedMemory objects."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ._backends import Placement, resolve
from ._devices import DeviceLike
from ._synced import SyncedMemory
from ._validate import ShapeLike, check_blob_nbytes, check_dtype, check_shape

__all__ = ["Blob"]


def _shape_args(shape: tuple[object, ...]) -> object:
    # reshape(2, 3), reshape((2, 3)) and reshape(torch.Size([2, 3])) all mean the same shape.
    return shape[0] if len(shape) == 1 and not isinstance(shape[0], int) else shape


class Blob:
    """A typed view of a virtual shape over a data memory and a gradient memory.

    The shape is only a number: ``reshape`` is O(1) and the memories grow on the next access
    that needs more bytes. Capacity belongs to the memories, never to the blob, so blobs that
    share a memory may have different shapes and dtypes, and reshaping one of them larger is
    always safe (the memory grows, keeping its bytes).

    Every accessor returns a fresh view of the storage as it is now. Re-fetch views after a
    reshape or any access that may grow the memory: on a moving backend a growth leaves old
    views pointing at the old storage.

    Args:
        shape: the initial shape.
        dtype: the element type.
        device: ``"cpu"``, ``"emulated"``, ``"cuda"``, ``"cuda:N"`` or a ``torch.device``.
        backend: the device-side allocator by name; default: the device's default.

    Example::

        >>> import torch, sharedmem as sm
        >>> a = sm.Blob((2, 3), torch.float32)
        >>> a.mutable_data().fill_(1.5).sum().item()
        9.0
        >>> b = sm.Blob((2,), torch.float32)
        >>> b.share_data(a)
        >>> b.reshape(4, 4).data().shape
        torch.Size([4, 4])
    """

    def __init__(
        self,
        shape: ShapeLike = (),
        dtype: torch.dtype = torch.float32,
        *,
        device: DeviceLike = "cpu",
        backend: str | None = None,
        name: str = "",
        placement: Placement | None = None,
    ) -> None:
        self._shape = check_shape(shape)
        self._dtype = check_dtype(dtype)
        nbytes = check_blob_nbytes(self._shape, self._dtype)
        placement = placement if placement is not None else resolve(device, backend)
        self.name = name
        # Told before this blob takes another blob's memory (a pool refuses foreign memory
        # and forgets views it cached); may raise to refuse.
        self.on_share: Callable[[SyncedMemory], None] | None = None
        # Changes whenever the blob is retyped or takes another memory: a cache of its views
        # (the pool's fast path) compares one number instead of shape, dtype and memories.
        self.stamp = 0
        self._data = SyncedMemory(nbytes, name=name, placement=placement)
        self._grad = SyncedMemory(nbytes, name=f"{name}.grad" if name else "", placement=placement)

    # ---- shape ---------------------------------------------------------------------------

    @property
    def shape(self) -> torch.Size:
        return self._shape

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> str:
        return self._data.device

    def numel(self) -> int:
        return self._shape.numel()

    @property
    def nbytes(self) -> int:
        return self._shape.numel() * self._dtype.itemsize

    def reshape(self, *shape: object) -> Blob:
        """Set the virtual shape (O(1): nothing is allocated until an access needs it)."""
        return self.retype(check_shape(_shape_args(shape)), self._dtype)

    def astype(self, dtype: torch.dtype) -> Blob:
        """Set the element type (O(1), like ``reshape``); returns the blob."""
        return self.retype(self._shape, check_dtype(dtype))

    def retype(self, shape: ShapeLike, dtype: torch.dtype) -> Blob:
        """Set shape and element type at once (O(1)); both are checked before either changes."""
        size = check_shape(shape)
        kind = check_dtype(dtype)
        nbytes = check_blob_nbytes(size, kind)
        if size != self._shape or kind is not self._dtype:
            self._shape, self._dtype = size, kind
            self.stamp += 1
        self._data.set_size(nbytes)
        self._grad.set_size(nbytes)
        return self

    def _typing(self) -> tuple[torch.Size, torch.dtype, int, int]:
        """Shape, dtype and both memories' sizes: what ``_restore_typing`` puts back."""
        return self._shape, self._dtype, self._data.size, self._grad.size

    def _restore_typing(self, typing: tuple[torch.Size, torch.dtype, int, int]) -> None:
        # For a caller whose request failed (a refused growth): the blob is as it was.
        self._shape, self._dtype, data_size, grad_size = typing
        self.stamp += 1
        self._data.set_size(data_size)
        self._grad.set_size(grad_size)

    def retyped_view(
        self, shape: ShapeLike, dtype: torch.dtype, access: Callable[[Blob], torch.Tensor]
    ) -> tuple[torch.Tensor, SyncedMemory, int]:
        """Retype, then take ``access(self)``, as one step under the data memory's lock.

        Returns the view, the data memory and its stamp right after the access, so a cache can
        tell later whether anything changed. If the access fails (a refused growth), shape,
        dtype and sizes are put back before another thread can see them: a failed request
        changes nothing.
        """
        memory = self._data
        with memory.lock:
            before = self._typing()
            self.retype(shape, dtype)
            try:
                view = access(self)
            except BaseException:
                self._restore_typing(before)
                raise
            return view, memory, memory.version

    # ---- memories ------------------------------------------------------------------------

    @property
    def data_memory(self) -> SyncedMemory:
        return self._data

    @property
    def grad_memory(self) -> SyncedMemory:
        return self._grad

    def share_data(self, other: Blob) -> None:
        """Use ``other``'s data memory from now on (shapes and dtypes may differ)."""
        self._data = self._shared(other, "share_data")
        self.stamp += 1

    def share_grad(self, other: Blob) -> None:
        """Use ``other``'s gradient memory from now on (shapes and dtypes may differ)."""
        self._grad = self._shared(other, "share_grad")
        self.stamp += 1

    def _shared(self, other: object, verb: str) -> SyncedMemory:
        if not isinstance(other, Blob):
            raise TypeError(f"sharedmem: {verb} takes a Blob, got {type(other).__name__}")
        memory = other._data if verb == "share_data" else other._grad
        if memory.device != self.device:
            raise ValueError(
                f"sharedmem: {verb} needs blobs on one device, got {self.device!r} and "
                f"{memory.device!r}"
            )
        if self.on_share is not None:
            self.on_share(memory)
        return memory

    # ---- views ---------------------------------------------------------------------------

    def _typed(
        self, memory: SyncedMemory, access: Callable[[SyncedMemory], torch.Tensor]
    ) -> torch.Tensor:
        # A memory shared with a blob of another shape may have another logical size: set
        # ours first (O(1), content untouched), so the view is exactly our bytes.
        memory.set_size(self.nbytes)
        return access(memory).view(self._dtype).view(self._shape)

    def data(self) -> torch.Tensor:
        """The data on the device side, for reading."""
        return self._typed(self._data, SyncedMemory.device_data)

    def mutable_data(self) -> torch.Tensor:
        """The data on the device side, for writing."""
        return self._typed(self._data, SyncedMemory.mutable_device_data)

    def host_data(self) -> torch.Tensor:
        """The data on the host side, for reading."""
        return self._typed(self._data, SyncedMemory.host_data)

    def mutable_host_data(self) -> torch.Tensor:
        """The data on the host side, for writing."""
        return self._typed(self._data, SyncedMemory.mutable_host_data)

    def grad(self) -> torch.Tensor:
        """The gradient on the device side, for reading."""
        return self._typed(self._grad, SyncedMemory.device_data)

    def mutable_grad(self) -> torch.Tensor:
        """The gradient on the device side, for writing."""
        return self._typed(self._grad, SyncedMemory.mutable_device_data)

    def host_grad(self) -> torch.Tensor:
        """The gradient on the host side, for reading."""
        return self._typed(self._grad, SyncedMemory.host_data)

    def mutable_host_grad(self) -> torch.Tensor:
        """The gradient on the host side, for writing."""
        return self._typed(self._grad, SyncedMemory.mutable_host_data)

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        # Pickle and deepcopy (copy.deepcopy(model) with a Blob attribute): the same shape,
        # dtype and content in independent memories; blobs that share a memory and are copied
        # together still share it (pickle keeps one object per object).
        return (_rebuild_blob, (self._shape, self._dtype, self.name, self._data, self._grad))

    def __repr__(self) -> str:
        label = f"{self.name!r}, " if self.name else ""
        return (
            f"Blob({label}shape={tuple(self._shape)}, dtype={self._dtype}, device={self.device!r})"
        )


def _rebuild_blob(
    shape: torch.Size, dtype: torch.dtype, name: str, data: SyncedMemory, grad: SyncedMemory
) -> Blob:
    blob = Blob(shape, dtype, device=data.device, name=name, placement=data.placement)
    blob._data, blob._grad = data, grad
    return blob
