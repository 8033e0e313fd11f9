"""What the step factories' policy arguments mean together: ``budget=``, ``chunks=`` (an int
or an ``sm.Chunks`` record) and ``recompute=`` (an ``sm.Recompute``), checked once, and the
keywords they replaced (``reduction=``, ``batch_dim=``, ``split=``, ``exact=``,
``max_slowdown=``), still taken with one ``DeprecationWarning`` that names the new spelling.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

from .._executor.policy import Recompute
from .budget import check_budget
from .chunking import Chunks, user_stacklevel

__all__ = ["Policy", "policy_of"]

# The keywords each factory took before the records, and which record holds each now.
_CHUNKING = ("reduction", "batch_dim", "split", "exact")
_OLD = {
    "pooled_train_step": (*_CHUNKING, "max_slowdown"),
    "pooled_forward": ("batch_dim",),
    "fit_eager_step": ("reduction", "batch_dim", "split"),
}


class Policy(NamedTuple):
    """A factory's policy arguments, checked: the budget (bytes, ``"free"`` or ``None``), how
    a batch is chunked (``None``: it is not), and the recomputation (without a budget what
    the step recomputes; with one, the cap on what the budget may choose; ``None``: the
    default of each)."""

    budget: int | str | None
    chunks: Chunks | None
    recompute: Recompute | None

    @property
    def fixed(self) -> int | None:
        """The fixed chunk count, if one was given."""
        return None if self.chunks is None else self.chunks.count

    @property
    def chunking(self) -> Chunks:
        """The chunking record (the defaults where none was given)."""
        return Chunks() if self.chunks is None else self.chunks

    @property
    def budgeted(self) -> bool:
        """Whether the step chunks at all (a budget, or a fixed count)."""
        return self.budget is not None or self.fixed is not None


def policy_of(
    factory: str,
    budget: object,
    chunks: object,
    recompute: object,
    old: dict[str, Any],
) -> Policy:
    """Check ``budget``, ``chunks`` and ``recompute`` as ``factory`` takes them, folding in
    the ``old`` keywords (with one ``DeprecationWarning``); refuse what does not go together.
    """
    record = Chunks.of(chunks)
    if old:
        record, recompute = _spell_anew(factory, budget, record, recompute, old)
    if recompute is not None and not isinstance(recompute, Recompute):
        raise TypeError(
            "sharedmem: recompute must be a sharedmem.Recompute (Recompute.OFF, "
            f"Recompute.within(1.3), Recompute.MOST), got {type(recompute).__name__}"
        )
    checked = check_budget(budget, None if record is None else record.count)
    policy = Policy(checked, record, recompute)
    if factory != "pooled_train_step":
        _refuse_train_only(factory, policy)
    if not policy.chunking.exact and checked is None:
        raise ValueError(
            "sharedmem: exact=False lets a budget be met by chunks where they are modelled "
            "faster than recomputation; without budget= there is nothing to choose: give one"
        )
    if record is not None and record.count is None and checked is None:
        raise ValueError(
            f"sharedmem: chunks={record.spelled()} gives no count: give one "
            "(sm.Chunks(4, ...)) or budget=... to choose it"
        )
    if recompute not in (None, Recompute.OFF) and policy.fixed is not None:
        raise ValueError(
            f"sharedmem: recompute={recompute} with a fixed number of chunks: nothing is "
            "chosen then; give budget= instead of a count (the recomputation caps what the "
            "budget may choose), or leave recompute= out"
        )
    return policy


def _refuse_train_only(factory: str, policy: Policy) -> None:
    chunking = policy.chunking
    if not chunking.exact:
        raise ValueError(
            "sharedmem: exact=False chooses between chunks and recomputation, which only "
            f"sm.pooled_train_step has; {factory} meets a budget by chunks alone: leave it out"
        )
    if factory == "pooled_forward" and (
        chunking.reduction is not None or chunking.split is not None
    ):
        raise ValueError(
            "sharedmem: a forward has no loss to weigh: reduction= and split= are for "
            "sm.pooled_train_step and sm.fit_eager_step; give pooled_forward "
            "chunks=sm.Chunks(count, batch_dim=...)"
        )


def _spell_anew(
    factory: str,
    budget: object,
    record: Chunks | None,
    recompute: object,
    old: dict[str, Any],
) -> tuple[Chunks | None, object]:
    """The records the old keywords stand for, said once in a ``DeprecationWarning``."""
    unknown = sorted(set(old) - set(_OLD[factory]))
    if unknown:
        raise TypeError(f"sharedmem: {factory}() got an unexpected keyword argument {unknown[0]!r}")
    fields = {k: v for k, v in old.items() if k in _CHUNKING}
    new: list[str] = []
    if fields:
        if record is not None and (record.count is None or record != Chunks(record.count)):
            raise TypeError(
                f"sharedmem: give {', '.join(f'{k}=' for k in fields)} inside "
                f"chunks={record.spelled()}, not beside it"
            )
        record = Chunks(None if record is None else record.count, **fields)
        parts = [] if record.count is None else [str(record.count)]
        parts += [f"{k}={_spelled(k, v)}" for k, v in fields.items()]
        new.append(f"chunks=sm.Chunks({', '.join(parts)})")
        if record.count is None and budget is None and record.exact:
            record = None  # as before: without a budget or a count nothing is chunked
            new[-1] += " with budget= or a count (without either it does nothing: leave it out)"
    if "max_slowdown" in old:
        if recompute is not None:
            raise TypeError(
                "sharedmem: max_slowdown= is recompute=sm.Recompute.within(...): give one "
                "or the other"
            )
        recompute = Recompute.within(old["max_slowdown"])
        new.append(f"recompute=sm.Recompute.within({recompute.max_slowdown})")
    given = ", ".join(f"{k}={v!r}" for k, v in old.items())
    warnings.warn(
        f"sharedmem: {factory}({given}) is deprecated: pass {', '.join(new)}",
        DeprecationWarning,
        stacklevel=user_stacklevel(),
    )
    return record, recompute


def _spelled(name: str, value: object) -> str:
    """A keyword's value as a call would write it (a function by its name)."""
    return getattr(value, "__name__", name) if name == "split" else repr(value)
