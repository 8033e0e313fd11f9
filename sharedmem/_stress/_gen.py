"""Random operations, tilted toward where memory code breaks.

Sizes cluster around what a memory already holds (a fraction of it, or a little more:
shrink-then-grow-back is where a side synced at a small size could leak its stale tail),
around page and allocation boundaries, and at the small end; the rest spread log-uniformly up
to ``max_bytes``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import torch

from ._faults import FAULT_KINDS
from ._model import PoolModel
from ._ops import DTYPES, WHOLE, Op

__all__ = ["Generator"]

_BOUNDARIES = (0, 1, 63, 64, 65, 511, 512, 4095, 4096, 4097, 8191, 8192, 8193, 12_289)
_FRACTIONS = (0.0, 0.25, 0.5, 0.9, 1.0, 1.0, 1.1, 1.5, 2.0)

# (kind, weight): reads and writes dominate, as in a training loop; the rare whole-pool
# operations come often enough to land in every round.
_WEIGHTS = (
    ("read", 30.0),
    ("write", 24.0),
    ("tensor", 8.0),
    ("reshape", 16.0),
    ("shrink", 3.0),
    ("release", 1.0),
    ("release_side", 3.0),
    ("push", 2.0),
    ("pull", 2.0),
    ("share", 0.3),  # rare: sharing only ever merges memories, so it piles up in a round
    ("trim", 0.5),
    ("pool_release", 0.1),
    ("limit", 1.5),
)


class Generator:
    """Draws operations for one worker.

    Args:
        rng: the worker's random source.
        model: the round's model (sizes are drawn relative to what memories hold).
        blobs: the blob indices this worker may use.
        private: those it may also share memories between (no other worker touches them).
        max_bytes: the largest blob.
        noise_span: how far into the noise a write may start.
        faults: the chance that an operation carries an injected fault.
    """

    def __init__(
        self,
        rng: random.Random,
        model: PoolModel,
        blobs: Sequence[int],
        private: Sequence[int],
        *,
        max_bytes: int,
        noise_span: int,
        faults: float,
    ) -> None:
        self.rng = rng
        self.model = model
        self.blobs = list(blobs)
        self.private = list(private)
        self.max_bytes = max_bytes
        self.noise_span = noise_span
        self.faults = faults
        # Sharing needs two buffers no other worker touches.
        weights = [(k, w) for k, w in _WEIGHTS if k != "share" or len(self.private) >= 2]
        self.kinds = [k for k, _ in weights]
        total = 0.0
        self.cum: list[float] = []
        for _, w in weights:
            total += w
            self.cum.append(total)

    def nbytes(self, written: int) -> int:
        rng, r = self.rng, self.rng.random()
        if written and r < 0.45:
            n = int(written * rng.choice(_FRACTIONS))
        elif r < 0.6:
            n = rng.choice(_BOUNDARIES)
        elif r < 0.8:
            n = rng.randrange(257)
        else:
            n = int(self.max_bytes ** rng.random())
        return min(n, self.max_bytes)

    def shape(self, nbytes: int) -> tuple[tuple[int, ...], torch.dtype]:
        rng = self.rng
        dtype = rng.choice(DTYPES)
        numel = nbytes // dtype.itemsize
        r = rng.random()
        if numel == 1 and r < 0.3:
            return (), dtype
        if numel >= 4 and r < 0.4:
            rows = rng.randrange(1, 9)
            return (rows, numel // rows), dtype
        return (numel,), dtype

    def _range(self, nbytes: int) -> tuple[int, int, int]:
        """Bytes to write into a view of ``nbytes``, and where they come from in the noise."""
        rng = self.rng
        offset = rng.randrange(self.noise_span)
        if rng.random() < 0.4:
            return 0, WHOLE, offset
        a, b = rng.randrange(nbytes + 1), rng.randrange(nbytes + 1)
        return min(a, b), max(a, b), offset

    def next(self) -> Op:
        rng = self.rng
        kind = rng.choices(self.kinds, cum_weights=self.cum)[0]
        fault = None
        if self.faults and rng.random() < self.faults:
            fault = (rng.choice(FAULT_KINDS), rng.choice((1, 1, 1, 2)))
        blob = rng.choice(self.blobs)
        grad = rng.random() < 0.25
        side = "host" if rng.random() < 0.5 else "device"
        model = self.model.blobs[blob]
        match kind:
            case "reshape":
                shape, dtype = self.shape(self.nbytes(model.memory(grad).written))
                return Op(kind, blob, grad, side, shape=shape, dtype=dtype)
            case "limit":
                # Larger than the blob is now, so that the access usually needs to grow.
                n = max(model.nbytes, self.nbytes(model.memory(grad).written)) + 1
                shape, dtype = self.shape(min(n * rng.choice((1, 2, 4)), self.max_bytes))
                start, stop, offset = self._range(math.prod(shape) * dtype.itemsize)
                return Op(kind, blob, grad, side, 0, shape, dtype, start, stop, offset, fault)
            case "write" | "tensor":
                start, stop, offset = self._range(model.nbytes)
                grad = grad and kind == "write"  # the pool's hot path serves the data memory
                return Op(kind, blob, grad, side, 0, (), torch.uint8, start, stop, offset, fault)
            case "share":
                a, b = rng.sample(self.private, 2)
                return Op(kind, a, grad, other=b)
            case "trim" | "pool_release":
                return Op(kind, fault=fault if kind == "trim" else None)
            case "release":
                return Op(kind, blob, grad)
            case _:
                return Op(kind, blob, grad, side, fault=fault)
