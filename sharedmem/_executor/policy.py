"""What a train step's planner computes again in backward: a question asked as a value.

The planner (``recompute``) is given a ``Recompute`` record and answers it; nothing is set on
an executor and reset afterwards. A record is frozen, so it compares, hashes and keys a
compiled graph as it is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

__all__ = ["Recompute"]


@dataclass(frozen=True)
class Recompute:
    """What a pooled train step may compute again in backward instead of keeping it from the
    forward, by the modelled time it may add.

    Three kinds, one field:

    - ``Recompute.OFF`` (``max_slowdown=1.0``, the default): only values that cost no
      modelled time (pointwise ops, norms: their time hides in the memory traffic the step
      saves); bit for bit the step as traced.
    - ``Recompute.within(1.3)``: convolutions, matrix products and attention too, cheapest
      per byte they free first, while the modelled time they add stays within 30% of the
      step's own (``sharedmem/_executor/cost.py``): the least memory at that cost.
    - ``Recompute.MOST`` (``max_slowdown=math.inf``): every such value that lowers the peak.

    Every kind computes the very ops eager ran on the very same inputs: the results and
    gradients are bit for bit the default step's; only time and memory differ.

    ``max_slowdown`` means one thing wherever a record is given (``recompute=`` of
    ``sm.pooled_train_step``): the most time recomputation may add. Without a budget the
    step takes all the memory that time buys; with ``budget=`` only as much as the budget
    needs (``Recompute.OFF``: chunks meet it; without ``recompute=`` there is no cap).

    Attributes:
        max_slowdown: the most modelled time the recomputation may add, as a factor of the
            step's own (at least 1.0; ``math.inf``: as much as lowers the peak).

    Example::

        >>> from sharedmem import Recompute
        >>> Recompute.within(1.3), Recompute.MOST.describe()
        (Recompute(max_slowdown=1.3), 'as much as lowers the peak')
    """

    max_slowdown: float = 1.0

    OFF: ClassVar[Recompute]
    MOST: ClassVar[Recompute]

    def __post_init__(self) -> None:
        value = self.max_slowdown
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(
                "sharedmem: Recompute's max_slowdown must be a number (1.3: up to 30% more "
                f"time, math.inf: as much as lowers the peak), got {type(value).__name__}"
            )
        if not value >= 1.0:  # (NaN too)
            raise ValueError(
                "sharedmem: Recompute's max_slowdown must be at least 1.0 (1.0: nothing "
                f"costly), got {value!r}"
            )
        object.__setattr__(self, "max_slowdown", float(value))

    @classmethod
    def within(cls, max_slowdown: float) -> Recompute:
        """The least memory recomputation reaches within ``max_slowdown`` (modelled)."""
        return cls(max_slowdown)

    @classmethod
    def adding(cls, fraction: float | bool) -> Recompute:
        """From the time recomputation may add as a fraction of the step's own (``0.3``:
        +30%; ``True``: as much as lowers the peak; ``False`` or ``0``: off), the planner's
        own spelling (``recompute(heavy=...)``)."""
        if fraction is True:
            return cls.MOST
        if fraction is False:
            return cls.OFF
        return cls(1.0 + float(fraction))

    @property
    def heavy(self) -> bool | float:
        """The planner's ``heavy`` argument: ``False`` (off), ``True`` (as much as lowers
        the peak) or the fraction of the step's time it may add."""
        if self.max_slowdown == 1.0:
            return False
        if math.isinf(self.max_slowdown):
            return True
        return self.max_slowdown - 1.0

    @property
    def costly(self) -> bool:
        """Whether ops with a modelled cost (convolutions, matrix products) may be recomputed."""
        return self.max_slowdown > 1.0

    def describe(self) -> str:
        """In words: ``"off"``, ``"up to +30% modelled time"``, ``"as much as lowers the
        peak"``."""
        heavy = self.heavy
        if heavy is False:
            return "off"
        if heavy is True:
            return "as much as lowers the peak"
        return f"up to +{float(heavy):.0%} modelled time"


Recompute.OFF = Recompute(1.0)
Recompute.MOST = Recompute(math.inf)
