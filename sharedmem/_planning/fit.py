"""Budgets: the fewest micro-batches whose planned peak fits, chosen before running from the
executor's plan (or, for a plain eager model, from the estimate's fake-tensor run), never by
trying and catching an out-of-memory error. A pooled step owns its budget as a policy
(``TrainBudget``, ``ForwardBudget``: the step's ``budget_policy``); ``EagerFitStep`` is the
eager, poolless step that fits a budget the same way.

A choice is made once per input signature, budget and limit, so the same budget and shapes
always give the same chunks. The search is a bisection over the number of chunks (a chunk's
need falls as chunks get smaller); each distinct chunk shape is planned once.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .._errors import OutOfMemoryError, SharedMemError
from .._executor import PooledForward, PooledTrainStep
from .._executor.calling import OwnLoss, call_model, check_targets, plain_mapping
from .._executor.executor import MemoryPlan
from .._executor.policy import Recompute
from .._executor.step import CallFigures
from .._pool import BufferPool
from .._pool.report import human_bytes
from .budget import ChunkNeed, Need, budget_bytes, check_budget
from .chunking import (
    Chunk,
    Loss,
    Splitter,
    WeightedLoss,
    batch_stat_modules,
    reduction_of,
    user_stacklevel,
    warn_once,
)
from .estimate import eager_train, measures_kernels
from .live import round_for

__all__ = ["EagerFitStep", "ForwardBudget", "TrainBudget", "planned_peak"]


def planned_peak(plan: MemoryPlan) -> int:
    """A plan's peak, the one figure every report gives for it: its pool bytes on a pool of
    its own and the most beside the pool at once. (Whether it fits a budget is judged on the
    pool as it is: its buffers' granularity and what else it holds, ``Need``.)"""
    return plan.pooled_bytes + plan.beside_peak


def signature(*trees: object) -> tuple[object, ...]:
    """Shapes, dtypes and devices of the trees' tensors, and their structure."""
    key: list[object] = []
    for tree in trees:
        leaves, spec = pytree.tree_flatten(tree)
        key.append(str(spec))
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                key.append((tuple(leaf.shape), leaf.dtype, leaf.device))
            else:
                key.append(repr(leaf))
    return tuple(key)


class Fitted:
    """The part every fitted step shares: the budget or fixed count, the choice per
    signature and its cache, and what is said once.

    Args:
        model: the module (for the notices about batch-wide modules).
        budget: bytes, ``"free"`` or ``None``.
        chunks: a fixed count, or ``None``.
        splitter: how a batch is split.
        device: where the step runs.
        pool: the pool the step's buffers live in (``None`` for a plain eager step).
    """

    def __init__(
        self,
        model: nn.Module,
        budget: object,
        chunks: object,
        splitter: Splitter,
        device: torch.device,
        pool: BufferPool | None,
    ) -> None:
        self.model = model
        self.budget: int | str | None = check_budget(budget, chunks)
        self.fixed: int | None = chunks  # type: ignore[assignment]
        self.splitter = splitter
        self.device = device
        self.pool = pool
        self._failures: dict[int, BaseException] = {}  # why chunk counts could not run
        self._chosen: dict[tuple[object, ...], int] = {}
        self._counts: dict[str, int] = {}  # signature label -> chunks, for reading
        self._said: dict[str, list[bool]] = {}
        # Signatures (count keys) met in one chunk by recomputing more (``_recomputes``), each
        # with the recomputation that met it, and what the latest count chosen recomputes.
        self._recomputed: dict[tuple[object, ...], Recompute] = {}
        self._latest = Recompute.OFF
        # Where both fit and chunks may be chosen (``exact=False``): the modelled time each
        # adds, by signature label: (chunks, their added fraction, recomputation's).
        self.compared: dict[str, tuple[int, float, float]] = {}
        # Where recomputation alone could not meet the budget, by signature label: the
        # least it plans, and the floor no recomputation goes below (bytes, the op).
        self.unreached: dict[str, tuple[int, int, str]] = {}
        # Plans made during one search, by (step, signature, with gradients, recomputation):
        # the pool stands still while it plans, so a chunk shape met again (in two counts,
        # or by the recomputation tried first and then compared) is planned once.
        self._plans: dict[tuple[object, ...], MemoryPlan] = {}

    # ---- reading ----------------------------------------------------------------------------

    def chunks_for(self, inputs: object, targets: object = None) -> int:
        """The number of chunks a call with these inputs (and targets) runs in; chosen now
        (planned, not run) if no call of that signature chose yet."""
        return self._count(inputs, targets, self._accumulating())

    @property
    def chosen(self) -> dict[str, int]:
        """Chunks chosen so far, by signature (batch shapes), in the order first seen."""
        return dict(self._counts)

    @property
    def recompute(self) -> Recompute:
        """What the latest choice recomputes in one chunk (``Recompute.OFF``: nothing
        costly, or chunks were chosen)."""
        return self._latest

    @property
    def recomputing(self) -> bool:
        """Whether the latest choice recomputes costly ops to fit in one chunk."""
        return self._latest.costly

    def report(self) -> str:
        """A table of the chunk counts chosen per signature."""
        return "\n".join(self.report_lines())

    def report_lines(self) -> list[str]:
        """The chunk counts chosen per signature, and what recomputation reached."""
        head = f"budget {self.budget!r}" if self.fixed is None else f"fixed {self.fixed} chunks"
        rows = [f"chunks per batch signature ({head}):"]
        rows += [f"  {label:<48}{n:>6}" for label, n in self._counts.items()]
        if self._recomputed:
            levels = ", ".join(v.describe() for v in self._recomputed.values())
            rows.append(
                f"  {len(self._recomputed)} signature(s) fit in one chunk by computing "
                "convolutions and matrix products again in backward (the same step, bit for "
                f"bit, at the cost of that time: {levels})"
            )
        for label, (least, floor, op) in self.unreached.items():
            rows.append(
                f"  {label}: chunked: recomputation alone reaches a planned peak of {least:,} "
                "bytes at the least"
                + (
                    f"; none goes below {floor:,} bytes, what {op} needs at once (its "
                    "operands, results and scratch beside the gradients made before it)"
                    if floor
                    else ""
                )
            )
        for label, (chunks, by_chunks, by_recomputing) in self.compared.items():
            chosen = f"{chunks} chunks" if by_chunks < by_recomputing else "recomputation"
            rows.append(
                f"  {label}: {chosen} chosen (exact=False): {chunks} chunks modelled "
                f"+{by_chunks:.1%} time, recomputation +{by_recomputing:.1%}"
            )
        return rows

    # ---- choosing ---------------------------------------------------------------------------

    def _accumulating(self) -> bool:
        """Whether gradients are there already (the step adds into them)."""
        return any(p.grad is not None for p in self.model.parameters())

    def _count(self, inputs: object, targets: object, accumulating: bool) -> int:
        total = self.splitter.examples(inputs, targets)
        if self.fixed is not None:
            chunks = min(self.fixed, total)
            if chunks < self.fixed and _label(inputs, targets) not in self._counts:
                # Clamped, not refused: a loader's last batch may be smaller than the rest.
                warnings.warn(
                    f"sharedmem: chunks={self.fixed} but the batch holds {total} example"
                    f"{'' if total == 1 else 's'}, the most chunks it can run in: it runs in "
                    f"{chunks} chunks of one example (said once per batch shape)",
                    UserWarning,
                    stacklevel=user_stacklevel(),
                )
            self._remember(inputs, targets, chunks)
            return chunks
        assert self.budget is not None
        budget = budget_bytes(self.budget, self.device, self.pool)
        limit = None if self.pool is None else self.pool.limit
        key = (signature(inputs, targets), budget, limit, accumulating)
        chosen = self._chosen.get(key)
        if chosen is None:
            try:
                chosen, level = self._search(inputs, targets, total, budget, limit, accumulating)
            finally:
                self._plans.clear()  # plans are kept for one search only
            if level is not None:
                self._recomputed[key] = level
            self._chosen[key] = chosen
            self._remember(inputs, targets, chosen)
        self._latest = self._recomputed.get(key, Recompute.OFF)
        return chosen

    def _budget_bytes(self) -> int | None:
        """The budget in bytes now (``None`` for a fixed chunk count)."""
        return None if self.budget is None else budget_bytes(self.budget, self.device, self.pool)

    def _recomputes(
        self, inputs: object, targets: object, budget: int, limit: int | None, accumulating: bool
    ) -> Recompute | None:
        """The least recomputation with which the whole batch, which does not fit the budget
        as planned by default, fits it in one chunk (the same computation, unlike chunks);
        ``None`` where none does."""
        return None

    def _remember(self, inputs: object, targets: object, chunks: int) -> None:
        self._counts[_label(inputs, targets)] = chunks

    def _search(
        self,
        inputs: object,
        targets: object,
        total: int,
        budget: int,
        limit: int | None,
        accumulating: bool,
    ) -> tuple[int, Recompute | None]:
        """Search for the fewest chunks that fit (a bisection, each probe put where the needs
        known place the budget: ``_interpolated``), and the recomputation with which one chunk
        fits (tried before any chunks: ``_recomputes``; ``None``: none). If none does with
        the pool as it is (its buffers were sized by other shapes), this step's own buffers
        are given back once and the search runs again on what is left."""
        for attempt in range(2):
            self._plans.clear()  # the pool's own buffers may have been given back
            needs: dict[int, Need | None] = {}

            def fits(chunks: int, needs: dict[int, Need | None] = needs) -> bool:
                if chunks not in needs:
                    needs[chunks] = self._need(inputs, targets, chunks, accumulating)
                need = needs[chunks]
                return need is not None and need.fits(budget, limit)

            if fits(1):
                return 1, None
            level: Recompute | None = None
            if attempt == 0:
                level = self._recomputes(inputs, targets, budget, limit, accumulating)
                if level is not None and self.exact:
                    return 1, level
            low, high = 1, total  # low does not fit; high is the most there can be
            misses = 0  # probes in a row that did not halve the range
            while high - low > 1:
                middle = (low + high) // 2
                guess = _interpolated(needs, low, high, total, budget) if misses < 2 else None
                probe = middle if guess is None else guess
                before = high - low
                if fits(probe):
                    high = probe
                else:
                    low = probe
                misses = misses + 1 if 2 * (high - low) > before else 0
            if level is not None and not (
                fits(high) and self._chunks_faster(inputs, targets, high, level)
            ):
                return 1, level
            if fits(high):
                return high, None
            if attempt == 0 and not self._give_back():
                break
        self._refuse(inputs, targets, total, budget, limit, accumulating)
        raise AssertionError("unreachable: _refuse raises")

    def _give_back(self) -> bool:
        """Free this step's own pool buffers; whether there were any."""
        return False

    # Whether a budget must be met by the same computation where recomputation reaches it
    # (``exact=False``: chunks compete on modelled time; see ``_chunks_faster``).
    exact = True

    def _chunks_faster(
        self, inputs: object, targets: object, chunks: int, level: Recompute
    ) -> bool:
        """Whether running ``chunks`` chunks adds less modelled time than recomputing at
        ``level`` in one (both fit)."""
        return False

    def _need(
        self,
        inputs: object,
        targets: object,
        chunks: int,
        accumulating: bool,
        recompute: Recompute = Recompute.OFF,
    ) -> Need | None:
        """The need of running the batch as ``chunks`` chunks: its biggest chunk's, with
        every chunk's pool buffers taken together; ``None`` where the model cannot run
        chunks that small (batch norm on one example). ``recompute``: planned with that
        recomputation (one chunk)."""
        parts = self.splitter.split(inputs, targets, chunks)
        beside: dict[str, int] = {}
        slots: dict[str, int] = {}
        for part in _distinct(parts):
            try:
                chunk = self._chunk_need(part, chunks, accumulating, recompute)
            except (RuntimeError, ValueError) as failure:
                if chunks == 1:
                    raise  # the model cannot run this batch at all: say so as it is
                self._failures[chunks] = failure
                return None
            if sum(chunk.beside.values()) > sum(beside.values()):
                beside = chunk.beside
            for name, nbytes in chunk.slots.items():
                slots[name] = max(slots.get(name, 0), nbytes)
        pool = 0 if self.pool is None else self.pool.reserved_after(slots)
        parts_ = {"pool buffers": pool, **beside} if self.pool is not None else dict(beside)
        return Need(sum(parts_.values()), pool, parts_)

    def _chunk_need(
        self, part: Chunk, chunks: int, accumulating: bool, recompute: Recompute
    ) -> ChunkNeed:
        raise NotImplementedError

    def _refuse(
        self,
        inputs: object,
        targets: object,
        chunks: int,
        budget: int,
        limit: int | None,
        accumulating: bool,
    ) -> None:
        need = self._need(inputs, targets, chunks, accumulating)
        if need is None:
            raise ValueError(
                f"sharedmem: the batch does not fit {human_bytes(budget)} in fewer than "
                f"{chunks} chunks, and the model cannot run chunks of one example: "
                f"{self._failures.get(chunks)}"
            )
        over = need.total - budget if need.total > budget else need.pool - (limit or 0)
        cap = budget if need.total > budget else limit
        where = f"the budget of {human_bytes(budget)}"
        if need.total <= budget:
            where = f"the pool's limit of {human_bytes(limit or 0)}"
        summary = (
            f"sharedmem: out of memory on {self.device} before running: one chunk of the "
            f"smallest size ({chunks} chunks) needs {human_bytes(need.total)}, "
            f"{human_bytes(over)} more than {where}. Biggest consumers: {need.describe()}. "
            "Nothing ran and nothing was lost. To go on: raise the budget or the pool's "
            "limit, give memory back (pool.trim() or release()), or shrink an example"
        )
        raise OutOfMemoryError(need.total, need.pool, cap, str(self.device), summary=summary)

    def _say_batch_wide(self, chunks: int) -> None:
        """Say once that chunking changes what batch-wide modules compute."""
        modules = batch_stat_modules(self.model) if chunks > 1 else []
        if modules:
            warn_once(
                self._said.setdefault("batch", []),
                f"sharedmem: the batch runs in {chunks} chunks, and {', '.join(modules[:3])} "
                "read the batch as a whole in training mode (batch norm): their statistics are "
                "each chunk's, so results differ from the unchunked step. Pass chunks=1 (or "
                "use GroupNorm/LayerNorm) where that matters",
            )


def give_back_slots(executor: PooledTrainStep | PooledForward) -> bool:
    """Free the memory of the executor's slot buffers (scratch between calls: the next call
    regrows them to its own plan); whether any held memory."""
    pool = executor.pool
    return sum(pool.blob(name).data_memory.release() for name in executor.slot_names()) > 0


def _interpolated(
    needs: dict[int, Need | None], low: int, high: int, total: int, budget: int
) -> int | None:
    """The count strictly between ``low`` (does not fit) and ``high`` (fits, or the most
    there can be) whose biggest chunk the two nearest needs known, taken as a line in the
    biggest chunk's examples, put at the budget; ``None`` where they cannot say (then the
    search bisects). Only where the next probe falls: the search keeps its bounds, so it
    ends at the same count a bisection does (the fewest that fits, as the need falls with
    the chunk's size), in fewer plans (each a trace of a new chunk shape)."""
    known = [(-(-total // c), need.total) for c, need in sorted(needs.items()) if need is not None]
    below = [(s, n) for s, n in known if s >= -(-total // low)]  # low's chunk or bigger
    above = [(s, n) for s, n in known if s <= -(-total // high)]
    points = below[-2:] if not above else [below[-1], above[0]]
    if len(points) < 2:
        return None
    (s1, n1), (s2, n2) = points
    if s1 == s2 or n1 == n2:
        return None
    slope = (n1 - n2) / (s1 - s2)
    if slope <= 0:
        return None
    size = s2 + (budget - n2) / slope  # the biggest chunk the budget holds, on that line
    if size < 1:
        return None
    chunks = -(-total // max(1, math.floor(size)))  # the fewest with chunks that small
    return min(max(chunks, low + 1), high - 1)


def _distinct(parts: Iterable[Chunk]) -> list[Chunk]:
    seen: dict[tuple[object, ...], Chunk] = {}
    for part in parts:
        seen.setdefault(signature(part.inputs, part.targets), part)
    return list(seen.values())


def _tensors(tree: object) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _label(inputs: object, targets: object) -> str:
    """A signature in words, for reading: the batch's shapes."""
    return " ".join(str(tuple(t.shape)) for t in _tensors((inputs, targets)))


def _synced_last(
    ddp: DistributedDataParallel | None, k: int, chunks: int
) -> AbstractContextManager[object]:
    """Under DDP the chunks before the last accumulate locally (``no_sync()``, as DDP's own
    gradient accumulation) and the last all-reduces the sum: one all-reduce of each bucket
    per step, whatever the number of chunks."""
    return ddp.no_sync() if ddp is not None and k < chunks - 1 else nullcontext()


def _new_grads(plan: MemoryPlan) -> dict[str, int]:
    return {"beside the pool (new gradients included)": plan.beside_peak}


def _grad_bytes(model: nn.Module, rounding: Callable[[int], int]) -> int:
    trainable = (p for p in model.parameters() if p.requires_grad)
    return sum(rounding(p.numel() * p.element_size()) for p in trainable)


class TrainBudget(Fitted):
    """A pooled train step's budget (or fixed chunk count): the step's ``budget_policy``.

    Made by ``sm.pooled_train_step(..., budget=...)`` or ``chunks=...``; see there. It
    chooses, per signature, the recomputation or the chunks a batch runs in, and runs it
    through the step (``step._call``), each question asked as an argument.
    """

    def __init__(
        self,
        step: PooledTrainStep,
        *,
        budget: object,
        chunks: object,
        reduction: object,
        splitter: Splitter,
        max_slowdown: float | None = None,
        exact: bool = True,
    ) -> None:
        super().__init__(step.model, budget, chunks, splitter, step.device, step.pool)
        self.step = step
        self.max_slowdown = max_slowdown
        self.exact = exact
        self.reduction, self._assumed = reduction_of(step.loss_fn, reduction)
        self._weighted: PooledTrainStep | None = None

    def run(self, inputs: object, targets: object = None) -> torch.Tensor:
        """Run the batch in chunks, accumulate the gradients into ``p.grad``, return the
        whole batch's loss."""
        step = self.step
        inputs, targets = plain_mapping(inputs), step.check_targets(targets)
        before = [p.grad is None for p in self.model.parameters()]
        chunks = self._count(inputs, targets, not all(before))
        budget = self._budget_bytes()
        if chunks == 1:
            return step._call(inputs, targets, self._latest, budget=budget)
        self._say(chunks)
        total: torch.Tensor | None = None
        figures: list[CallFigures] = []
        parts = self.splitter.split(inputs, targets, chunks)
        for k, part in enumerate(parts):
            with _synced_last(step.ddp, k, len(parts)):
                loss, runner = self._run_chunk(part)
            total = loss if total is None else total + loss
            assert runner.last_call is not None
            figures.append(runner.last_call)
        assert total is not None
        step.last_call = _chunked(figures, chunks, budget, self._new_grad_bytes(before))
        step._last = runner._last  # plan_summary() and source(): the chunks' graph
        return total

    def _new_grad_bytes(self, absent: list[bool]) -> int:
        """The bytes of the gradients this call made (absent before it) beside the pool:
        held by every chunk after the first. Those the router placed in the step's arena are
        in the pool's reserved bytes already."""
        step = self.step
        arenas = [
            (base, base + step.pool.device_capacity(name))
            for name, base in step.pool.arenas.lanes(f"{step.prefix}0")
        ]

        def beside(grad: torch.Tensor) -> bool:
            at = grad.untyped_storage().data_ptr()
            return not any(low <= at < high for low, high in arenas)

        return sum(
            p.grad.untyped_storage().nbytes()
            for p, was in zip(self.model.parameters(), absent, strict=True)
            if was and p.grad is not None and beside(p.grad)
        )

    def _weights(self) -> bool:
        return self.reduction == "mean" or self.splitter.user_split is not None

    def _weighted_step(self) -> PooledTrainStep:
        if self._weighted is None:
            step = self.step
            # The DDP wrapper where there is one: each chunk's gradients go to its buckets.
            model = step.model if step.ddp is None else step.ddp
            self._weighted = PooledTrainStep(
                model, WeightedLoss(step.loss_fn), step.pool, step.plan, step.prefix
            )
            self._weighted.routing = step.routing
        return self._weighted

    def _run_chunk(self, part: Chunk) -> tuple[torch.Tensor, PooledTrainStep]:
        if not self._weights():
            return self.step._call(part.inputs, part.targets, Recompute.OFF), self.step
        weight = torch.tensor(part.weight, dtype=torch.float64, device=self.step.device)
        weighted = self._weighted_step()
        return weighted._call(part.inputs, (part.targets, weight), Recompute.OFF), weighted

    def _recomputes(
        self, inputs: object, targets: object, budget: int, limit: int | None, accumulating: bool
    ) -> Recompute | None:
        # Before chunks, which change what batch-wide modules see and the order of the sums:
        # the whole batch with convolutions and matrix products computed again in backward,
        # the least of it that fits (bisected over ``RECOMPUTE_LEVELS``, cheapest values
        # first), within ``max_slowdown``.
        if self.step.plan != "liveness":
            return None
        levels = recompute_levels(self.max_slowdown)
        if not levels:
            return None

        def need_at(level: Recompute) -> Need | None:
            return self._need(inputs, targets, 1, accumulating, level)

        def fits(level: Recompute) -> bool:
            need = need_at(level)
            return need is not None and need.fits(budget, limit)

        least = need_at(levels[-1])
        if least is None or not least.fits(budget, limit):
            if least is not None:  # say why: what it reached, and what bounds it
                plan = self._plan(self.step, inputs, targets, accumulating, levels[-1])
                self.unreached[_label(inputs, targets)] = (
                    planned_peak(plan), plan.floor, plan.floor_op
                )  # fmt: skip
            return None
        low, high = -1, len(levels) - 1  # levels[high] fits; levels[low] does not (-1: none)
        while high - low > 1:
            middle = (low + high) // 2
            if fits(levels[middle]):
                high = middle
            else:
                low = middle
        found = levels[high]
        if found == Recompute.MOST:
            return found
        # Between two levels the peak can fall steeply (ViT-tiny's half budget: 190 MB at
        # +10%, 91 MB at +20%): the least time that fits is looked for in between too.
        below = 1.0 if low < 0 else levels[low].max_slowdown
        for _ in range(REFINE_STEPS):
            halfway = Recompute((below + found.max_slowdown) / 2)
            if fits(halfway):
                found = halfway
            else:
                below = halfway.max_slowdown
        return found

    def _chunks_faster(
        self, inputs: object, targets: object, chunks: int, level: Recompute
    ) -> bool:
        # The cost model of recomputation, with what chunks add: each chunk calls every op
        # again (``OP_CALL_FLOPS`` each) and reads the weights again, so ``chunks`` chunks of
        # a batch cost more than the batch, and small ones more so.
        step = self.step
        whole = step.modelled_time(inputs, targets)
        chunked = 0.0
        for part in self.splitter.split(inputs, targets, chunks):
            runner, chunk_targets = self._chunk_step(part, chunks)
            chunked += runner.modelled_time(part.inputs, chunk_targets)
        plan = self._plan(step, inputs, targets, False, level)
        by_chunks = chunked / whole - 1.0
        fraction = plan.recompute_cost
        fraction *= step.modelled_time(inputs, targets, per_call=False) / whole  # of the same
        self.compared[_label(inputs, targets)] = (chunks, by_chunks, fraction)
        return by_chunks < fraction

    def _plan(
        self,
        step: PooledTrainStep,
        inputs: object,
        targets: object,
        with_grads: bool,
        recompute: Recompute,
    ) -> MemoryPlan:
        """``step.memory_plan``, made once per search (``_plans``)."""
        key = (id(step), signature(inputs, targets), with_grads, recompute)
        plan = self._plans.get(key)
        if plan is None:
            plan = step.memory_plan(inputs, targets, with_grads=with_grads, recompute=recompute)
            self._plans[key] = plan
        return plan

    def _chunk_step(self, part: Chunk, chunks: int) -> tuple[PooledTrainStep, object]:
        """The step that plans one of ``chunks`` chunks, and the targets it takes: where
        chunks are weighted, the weighted step with a stand-in weight (its value changes
        neither the graph nor its plan)."""
        if chunks == 1 or not self._weights():
            return self.step, part.targets
        weight = torch.zeros((), dtype=torch.float64, device=self.step.device)
        return self._weighted_step(), (part.targets, weight)

    def _chunk_need(
        self, part: Chunk, chunks: int, accumulating: bool, recompute: Recompute
    ) -> ChunkNeed:
        def plan(with_grads: bool) -> MemoryPlan:
            step, targets = self._chunk_step(part, chunks)
            return self._plan(step, part.inputs, targets, with_grads, recompute)

        # The plan's timeline at its busiest: unpooled results, their scratch, and the new
        # gradients. A chunk that adds into gradients already there (every chunk after the
        # first) adds each where backward makes it final, beside the gradients held.
        first = None if accumulating else plan(False)
        if first is not None and chunks == 1:
            return ChunkNeed(_new_grads(first), first.slot_bytes)
        later = plan(True)
        held = {
            "gradients held between chunks": _grad_bytes(self.model, round_for(str(self.device))),
            "beside the pool": later.beside_peak,
        }
        slots = dict(later.slot_bytes)
        if first is None:
            return ChunkNeed(held, slots)
        for name, nbytes in first.slot_bytes.items():
            slots[name] = max(slots.get(name, 0), nbytes)
        # The busiest chunk: the first (new gradients) or a later one (the gradients held).
        if first.beside_peak > sum(held.values()):
            return ChunkNeed(_new_grads(first), slots)
        return ChunkNeed(held, slots)

    def _give_back(self) -> bool:
        return give_back_slots(self.step)

    def _say(self, chunks: int) -> None:
        self._say_batch_wide(chunks)
        if self._assumed and self._weights():
            warn_once(
                self._said.setdefault("reduction", []),
                "sharedmem: the loss function does not say how it reduces over the batch; "
                "its chunks are weighted as a mean (PyTorch's default). If it sums, pass "
                "chunks=sm.Chunks(..., reduction='sum')",
            )


class ForwardBudget(Fitted):
    """A pooled forward's budget (or fixed chunk count): each batch runs in as many chunks as
    it needs, the outputs concatenated along the batch dimension; the forward's
    ``budget_policy``.

    Made by ``sm.pooled_forward(..., budget=...)`` or ``chunks=...``; see there.
    """

    def __init__(
        self, forward: PooledForward, *, budget: object, chunks: object, splitter: Splitter
    ) -> None:
        super().__init__(forward.model, budget, chunks, splitter, forward.device, forward.pool)
        self.forward = forward

    def run(self, inputs: object, targets: object = None) -> Any:
        """Run the batch in chunks and return the outputs, concatenated."""
        forward = self.forward
        inputs = plain_mapping(inputs)
        chunks = self._count(inputs, None, False)
        budget = self._budget_bytes()
        if chunks == 1:
            return forward._call(inputs, budget=budget)
        if self.model.training:
            self._say_batch_wide(chunks)
        outputs, figures = [], []
        for part in self.splitter.split(inputs, None, chunks):
            outputs.append(forward._call(part.inputs))
            assert forward.last_call is not None
            figures.append(forward.last_call)
        forward.last_call = _chunked(figures, chunks, budget, 0)
        return concatenate(outputs, self.splitter.batch_dim)

    def _chunk_need(
        self, part: Chunk, chunks: int, accumulating: bool, recompute: Recompute
    ) -> ChunkNeed:
        plan = self.forward.memory_plan(part.inputs)
        rounding = round_for(str(self.device))
        # Every chunk's output is held until they are joined, then the joined copy.
        held = 1 if chunks == 1 else 2 * chunks
        beside = {
            "beside the pool (one output included)": plan.beside_peak,
            "outputs": (held - 1) * rounding(plan.returned_bytes),
        }
        return ChunkNeed(beside, plan.slot_bytes)

    def _give_back(self) -> bool:
        return give_back_slots(self.forward)


def _chunked(figures: list[CallFigures], chunks: int, budget: int | None, held: int) -> CallFigures:
    """A chunked call's figures from its chunks': the biggest chunk's, each chunk after the
    first with the gradients the call made before it (``held`` bytes) beside it."""
    measured = [f.measured_peak + (held if k else 0) for k, f in enumerate(figures)]
    counted = [f.budget_counted + (held if k else 0) for k, f in enumerate(figures)]
    biggest = max(range(len(figures)), key=measured.__getitem__)
    return figures[biggest]._replace(
        planned_peak=max(f.planned_peak for f in figures),
        measured_peak=measured[biggest],
        chunks=chunks,
        budget=budget,
        budget_counted=max(counted),
    )


def _described(tree: object) -> str:
    """``'4x16 float32'``: the tensors of ``tree``, as a message names them."""
    return (
        ", ".join(
            f"{'x'.join(map(str, t.shape)) or 'scalar'} {str(t.dtype).removeprefix('torch.')}"
            for t in pytree.tree_leaves(tree)
            if isinstance(t, torch.Tensor)
        )
        or "no tensors"
    )


def concatenate(outputs: list[Any], batch_dim: int) -> Any:
    """The chunks' outputs joined along ``batch_dim``, leaf by leaf."""
    flat = [pytree.tree_flatten(out) for out in outputs]
    spec = flat[0][1]
    joined = []
    for leaves in zip(*(leaves for leaves, _ in flat), strict=True):
        first = leaves[0]
        if isinstance(first, torch.Tensor):
            if first.dim() <= batch_dim:
                raise ValueError(
                    "sharedmem: a chunked forward joins its outputs along the batch dimension, "
                    f"but one output has shape {tuple(first.shape)}; pass chunks=1"
                )
            joined.append(torch.cat(leaves, dim=batch_dim))
        else:
            joined.append(first)
    return pytree.tree_unflatten(joined, spec)


class EagerFitStep(Fitted):
    """An eager train step, without a pool, that runs each batch in as many chunks as its
    budget needs.

    Made by ``sm.fit_eager_step``; see there.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Loss | None,
        *,
        budget: object,
        chunks: object,
        reduction: object,
        splitter: Splitter,
    ) -> None:
        first = next(iter(model.parameters()), None)
        device = first.device if first is not None else torch.device("cpu")
        super().__init__(model, budget, chunks, splitter, device, None)
        self.own_loss = loss_fn is None
        self.loss_fn: Loss = OwnLoss() if loss_fn is None else loss_fn
        self.reduction, self._assumed = reduction_of(self.loss_fn, reduction)

    def __call__(self, inputs: object, targets: object = None) -> torch.Tensor:
        """``loss_fn(model(inputs), targets).backward()`` in chunks; the batch's loss."""
        inputs, targets = plain_mapping(inputs), check_targets(self.own_loss, targets)
        chunks = self._count(inputs, targets, self._accumulating())
        if chunks == 1:
            parts = [Chunk(inputs, targets, 1.0)]
        else:
            self._say_batch_wide(chunks)
            parts = self.splitter.split(inputs, targets, chunks)
        weigh = chunks > 1 and (self.reduction == "mean" or self.splitter.user_split is not None)
        total: torch.Tensor | None = None
        ddp = self.model if isinstance(self.model, DistributedDataParallel) else None
        for k, part in enumerate(parts):
            with _synced_last(ddp, k, len(parts)):
                loss = self.loss_fn(call_model(self.model, part.inputs), part.targets)
                if weigh:
                    loss = loss * part.weight
                loss.backward()  # type: ignore[no-untyped-call]
            loss = loss.detach()
            total = loss if total is None else total + loss
        assert total is not None
        return total

    def _chunk_need(
        self, part: Chunk, chunks: int, accumulating: bool, recompute: Recompute
    ) -> ChunkNeed:
        rounding = round_for(str(self.device))
        try:
            train = eager_train(
                self.model, part.inputs, part.targets, self.loss_fn, None, rounding,
                measure=measures_kernels(str(self.device), None),
            )  # fmt: skip
        except SharedMemError:
            raise
        except RuntimeError as e:  # an op refused its operands (a width the model does not take)
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise SharedMemError(
                "sharedmem: fit_eager_step could not estimate a chunk of "
                f"{_described(part.inputs)} (targets {_described(part.targets)}) before "
                f"running it: {type(e).__name__}: {first.rstrip('.')}. Eager PyTorch fails "
                "there too: check the inputs and targets against the model"
            ) from e
        held = _grad_bytes(self.model, rounding) if accumulating or chunks > 1 else 0
        beside = {
            "forward and backward": train.forward_backward,
            "gradients held between chunks": held,
        }
        return ChunkNeed(beside, {})


# The recomputation a budget tries before chunks, least first: the most modelled time it may
# add, as a fraction of the step's own (the last: as much as lowers the peak).
RECOMPUTE_LEVELS: tuple[Recompute, ...] = (
    *(Recompute.adding(f) for f in (0.02, 0.05, 0.1, 0.2, 0.35, 0.6, 1.0)),
    Recompute.MOST,
)
# Halvings of the gap between the last level that does not fit and the first that does.
REFINE_STEPS = 3


def recompute_levels(max_slowdown: float | None) -> list[Recompute]:
    """The levels of ``RECOMPUTE_LEVELS`` within ``max_slowdown`` (``None``: all), with
    ``max_slowdown`` itself as the last where it falls between two."""
    if max_slowdown is None:
        return list(RECOMPUTE_LEVELS)
    levels = [v for v in RECOMPUTE_LEVELS if v.max_slowdown < max_slowdown]
    return [*levels, Recompute(max_slowdown)] if max_slowdown > 1.0 else levels
