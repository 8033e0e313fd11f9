"""Facts about a tensor's layout that several layers need (the floor: imports only torch)."""

from __future__ import annotations

import torch

__all__ = ["extent"]


def extent(t: torch.Tensor) -> int:
    """Bytes from the first element of ``t`` to one past its last (0 when it is empty).

    Strides are never negative in PyTorch, so this is the span of storage a view touches.

    Example::

        >>> import torch
        >>> extent(torch.empty(4, 3).t())  # a transposed view still spans 12 floats
        48
    """
    if t.numel() == 0:
        return 0
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return (last + 1) * t.element_size()
