"""Splitting a batch into micro-batches, and weighting their losses so that the accumulated
gradients are the whole batch's.

A mean-reduced loss over ``B`` examples is the weighted sum of its chunks' means, each weighted
by its share ``n_k / B``; a sum-reduced loss is the plain sum of its chunks'. The weight is a
0-d tensor argument (not a Python number), so one traced graph serves every share.
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree
from torch import nn

__all__ = [
    "Chunk",
    "Chunks",
    "Splitter",
    "WeightedLoss",
    "batch_size",
    "batch_stat_modules",
    "reduction_of",
]

Loss = Callable[[Any, Any], torch.Tensor]
# split(inputs, targets, chunks) -> [(inputs_k, targets_k, weight_k), ...]
UserSplit = Callable[[Any, Any, int], Sequence[tuple[Any, ...]]]


@dataclass(frozen=True)
class Chunks:
    """How a step cuts a batch into micro-batches ("chunks") and weighs their losses: one
    record, given as ``chunks=`` to ``sm.pooled_train_step``, ``sm.pooled_forward`` and
    ``sm.fit_eager_step`` (``chunks=4`` is short for ``chunks=sm.Chunks(4)``).

    Attributes:
        count: run every batch in this many chunks (a batch with fewer examples runs in one
            chunk per example, with a warning once per batch shape); ``None``: as many as
            ``budget=`` needs (a count and a budget are not given together).
        reduction: ``"mean"`` or ``"sum"``: how ``loss_fn`` reduces over the batch, where it
            does not say (``nn`` and ``torch.nn.functional`` losses do); an unknown callable
            is taken as a mean, with a warning. Train steps only.
        batch_dim: the batch dimension of every input, target and output tensor.
        split: ``split(inputs, targets, chunks)`` returns ``chunks`` tuples ``(inputs,
            targets[, weight])``, for layouts a plain split cannot cut (padded or packed
            sequences); a weight is the chunk's share of the batch's loss. Train steps only.
        exact: with ``budget=`` on a pooled train step: ``True`` (the default), chunks only
            where recomputation, which computes the very same values, cannot meet the
            budget; ``False``: whichever of the two the cost model says adds less time.

    Example::

        >>> import sharedmem as sm
        >>> sm.Chunks(4, batch_dim=1)
        Chunks(count=4, reduction=None, batch_dim=1, split=None, exact=True)
    """

    count: int | None = None
    reduction: str | None = None
    batch_dim: int = 0
    split: UserSplit | None = None
    exact: bool = True

    def __post_init__(self) -> None:
        count = self.count
        if count is not None and (isinstance(count, bool) or not isinstance(count, int)):
            raise TypeError(f"sharedmem: chunks must be an int >= 1, got {count!r}")
        if count is not None and count < 1:
            raise ValueError(f"sharedmem: chunks must be an int >= 1, got {count!r}")
        if self.reduction not in (None, "mean", "sum"):
            raise ValueError(
                f"sharedmem: reduction must be 'mean' or 'sum', got {self.reduction!r}"
            )
        Splitter(self.batch_dim, self.split)  # refuses a bad batch_dim or split
        if not isinstance(self.exact, bool):
            raise TypeError(
                f"sharedmem: exact must be True or False, got {type(self.exact).__name__}"
            )

    @classmethod
    def of(cls, chunks: object) -> Chunks | None:
        """``chunks=`` as a record: ``None`` stays ``None``, an int is the count."""
        if chunks is None or isinstance(chunks, Chunks):
            return chunks
        if isinstance(chunks, bool) or not isinstance(chunks, int):
            raise TypeError(
                "sharedmem: chunks must be a number of chunks or a sharedmem.Chunks "
                f"(sm.Chunks(4, batch_dim=1)), got {type(chunks).__name__}"
            )
        return cls(chunks)

    @property
    def splitter(self) -> Splitter:
        return Splitter(self.batch_dim, self.split)

    def spelled(self) -> str:
        """The record as a call would write it: ``"sm.Chunks(4, batch_dim=1)"``."""
        given = [] if self.count is None else [str(self.count)]
        for name, default in (("reduction", None), ("batch_dim", 0), ("exact", True)):
            value = getattr(self, name)
            if value != default:
                given.append(f"{name}={value!r}")
        if self.split is not None:
            given.append(f"split={getattr(self.split, '__name__', 'split')}")
        return f"sm.Chunks({', '.join(given)})"


class Chunk(NamedTuple):
    """One micro-batch and the weight its loss gets in the whole batch's loss."""

    inputs: Any
    targets: Any
    weight: float


def batch_size(tree: object, batch_dim: int, what: str) -> int:
    """The size of the batch dimension shared by every tensor of ``tree``."""
    sizes = {
        t.shape[batch_dim]
        for t in pytree.tree_leaves(tree)
        if isinstance(t, torch.Tensor) and t.dim() > batch_dim
    }
    flat = [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]
    if len(sizes) != 1 or any(t.dim() <= batch_dim for t in flat):
        shapes = ", ".join(str(tuple(t.shape)) for t in flat) or "no tensors"
        raise ValueError(
            f"sharedmem: to split a batch every tensor of the {what} needs the same size along "
            f"dimension {batch_dim} (batch_dim); got {shapes}. Pass "
            "chunks=sm.Chunks(batch_dim=...), or chunks=sm.Chunks(split=...) with a function "
            "for other layouts"
        )
    return int(sizes.pop())


def _split_tree(tree: object, sizes: Sequence[int], batch_dim: int) -> list[Any]:
    leaves, spec = pytree.tree_flatten(tree)
    parts = [
        torch.split(leaf, list(sizes), dim=batch_dim)
        if isinstance(leaf, torch.Tensor)
        else [leaf] * len(sizes)
        for leaf in leaves
    ]
    return [pytree.tree_unflatten([p[k] for p in parts], spec) for k in range(len(sizes))]


def chunk_sizes(total: int, chunks: int) -> list[int]:
    """``total`` examples in ``chunks`` near-equal parts, the bigger ones first."""
    small, extra = divmod(total, chunks)
    return [small + 1] * extra + [small] * (chunks - extra)


class Splitter:
    """Splits inputs and targets along ``batch_dim``, or with the user's ``split``.

    Args:
        batch_dim: the batch dimension of every tensor of the inputs and targets.
        split: ``split(inputs, targets, chunks)`` returns ``chunks`` tuples ``(inputs,
            targets)`` or ``(inputs, targets, weight)`` (for padded or packed sequences,
            where examples do not weigh the same); without a weight, each chunk weighs its
            share of the examples.
    """

    def __init__(self, batch_dim: object = 0, split: object = None) -> None:
        if isinstance(batch_dim, bool) or not isinstance(batch_dim, int) or batch_dim < 0:
            raise ValueError(f"sharedmem: batch_dim must be an int >= 0, got {batch_dim!r}")
        if split is not None and not callable(split):
            raise TypeError(f"sharedmem: split must be callable, got {type(split).__name__}")
        self.batch_dim = batch_dim
        self.user_split: UserSplit | None = split

    def size(self, inputs: object, targets: object = None) -> int:
        n = batch_size(inputs, self.batch_dim, "inputs")
        if any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(targets)):
            m = batch_size(targets, self.batch_dim, "targets")
            if m != n:
                raise ValueError(
                    f"sharedmem: the inputs hold {n} examples along dimension {self.batch_dim} "
                    f"but the targets {m}; pass chunks=sm.Chunks(split=...) if they are laid out "
                    "differently"
                )
        return n

    def examples(self, inputs: object, targets: object = None) -> int:
        """The most chunks a batch can run in: its examples (along ``batch_dim`` where a
        user's split cannot say; 64 where even that is not one size)."""
        if self.user_split is None:
            return self.size(inputs, targets)
        try:
            return batch_size(inputs, self.batch_dim, "inputs")
        except ValueError:
            return 64

    def split(self, inputs: object, targets: object, chunks: int) -> list[Chunk]:
        if self.user_split is not None:
            return self._user(inputs, targets, chunks)
        total = self.size(inputs, targets)
        sizes = chunk_sizes(total, chunks)
        xs = _split_tree(inputs, sizes, self.batch_dim)
        ys = _split_tree(targets, sizes, self.batch_dim)
        return [Chunk(x, y, n / total) for x, y, n in zip(xs, ys, sizes, strict=True)]

    def _user(self, inputs: object, targets: object, chunks: int) -> list[Chunk]:
        assert self.user_split is not None
        parts = list(self.user_split(inputs, targets, chunks))
        if not parts or any(not isinstance(p, tuple) or len(p) not in (2, 3) for p in parts):
            raise TypeError(
                "sharedmem: split(inputs, targets, chunks) must return a non-empty list of "
                "(inputs, targets) or (inputs, targets, weight) tuples"
            )
        if all(len(p) == 3 for p in parts):
            weights = [float(p[2]) for p in parts]
        elif all(len(p) == 2 for p in parts):
            counts = [self.size(p[0]) for p in parts]
            weights = [n / sum(counts) for n in counts]
        else:
            raise TypeError("sharedmem: split(...) must give a weight for every chunk or none")
        return [Chunk(p[0], p[1], w) for p, w in zip(parts, weights, strict=True)]


_FUNCTIONAL = "torch.nn.functional"


def reduction_of(loss_fn: Loss, given: object = None) -> tuple[str, bool]:
    """How ``loss_fn`` reduces over the batch: ``"mean"`` or ``"sum"``, and whether that was
    assumed (an unknown callable) rather than read off the loss.

    ``reduction="none"`` cannot be accumulated (the loss must be a scalar) and is refused.
    ``"batchmean"`` (``KLDivLoss``) is a mean over the batch.
    """
    if given is not None:
        if given not in ("mean", "sum"):
            raise ValueError(f"sharedmem: reduction must be 'mean' or 'sum', got {given!r}")
        return str(given), False
    found: object = getattr(loss_fn, "reduction", None)
    func: object = loss_fn
    if isinstance(loss_fn, functools.partial):
        found = loss_fn.keywords.get("reduction", found)
        func = loss_fn.func
    if found is None and getattr(func, "__module__", None) == _FUNCTIONAL:
        found = "mean"  # every functional loss of PyTorch defaults to the batch mean
    if found == "none":
        raise ValueError(
            "sharedmem: a loss with reduction='none' returns one value per element, which "
            "cannot be split and accumulated; reduce it ('mean' or 'sum')"
        )
    if found == "batchmean":
        return "mean", False
    if found in ("mean", "sum"):
        return str(found), False
    return "mean", True


class WeightedLoss:
    """``loss_fn(output, targets) * weight`` with ``targets`` arriving as ``(targets,
    weight)``: the weight is a 0-d tensor, so one trace serves every chunk's share."""

    def __init__(self, loss_fn: Loss) -> None:
        self.loss_fn = loss_fn

    def __call__(self, output: Any, weighted: tuple[Any, torch.Tensor]) -> torch.Tensor:
        targets, weight = weighted
        loss = self.loss_fn(output, targets)
        return loss * weight.to(loss.dtype)


BATCH_STATS: tuple[type[nn.Module], ...] = (nn.modules.batchnorm._BatchNorm,)


def batch_stat_modules(model: nn.Module) -> list[str]:
    """The modules whose training-mode result reads the batch as a whole (batch norm): a
    chunked step's result differs from the unchunked one there."""
    return [
        path or type(model).__name__
        for path, module in model.named_modules()
        if module.training and isinstance(module, BATCH_STATS)
    ]


def warn_once(flag: list[bool], message: str) -> None:
    """Warn with ``message`` the first time only (``flag`` holds whether it was said)."""
    if not flag:
        flag.append(True)
        warnings.warn(message, UserWarning, stacklevel=user_stacklevel())


_PACKAGE = str(Path(__file__).resolve().parent.parent)


def user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first caller outside this package
    (a step's policy is a few calls deep, and how many depends on the path)."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level
