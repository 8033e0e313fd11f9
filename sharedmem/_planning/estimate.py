"""``sm.estimate``: a step's memory before running it, eager and pooled, by category.

The eager figures come from running the step on fake tensors (no memory is allocated) under a
dispatch mode that counts the bytes every op creates while they are alive (``live``); the
optimizer's state and its step's temporaries come from running a copy of the optimizer, of the
same class and hyperparameters, on the fake parameters: the optimizer's own rules, not a table.
The pooled figures are the executor's own plan for the same signature (``memory_plan``),
planned as the routing allocator would serve it without building or installing it: an
estimate changes nothing in the process.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call

from .._backends import backend_names
from .._errors import quiet_fake_tensor_failures
from .._executor import PooledForward, PooledTrainStep
from .._executor.calling import OwnLoss, model_arguments, plain_mapping
from .._executor.distributed import bucket_bytes, unwrap
from .._executor.executor import MemoryPlan
from .._executor.policy import Recompute
from .._pool import BufferPool
from .._pool.report import human_bytes
from .._routing import loaded, native
from .._validate import call_loss_fn, check_loss_fn
from .budget import parse_bytes
from .counting import faker as _faker
from .counting import nbytes as _nbytes
from .counting import optimizer_bytes as _optimizer_bytes
from .counting import tensors as _tensors
from .live import LiveBytes, round_for
from .sharded import default_units, sharded_train

__all__ = ["CATEGORIES", "MemoryEstimate", "ShardedEstimate", "estimate"]

CATEGORIES = ("parameters", "gradients", "optimizer_state", "inputs", "activations", "temporaries")
Loss = Callable[[Any, Any], torch.Tensor]


@dataclass(frozen=True)
class ShardedEstimate:
    """One rank's memory in the train step of the model sharded with FSDP2 (``fully_shard``
    applied to each of ``units``, the model last) over ``world_size`` ranks: rank 0's, whose
    shards are the largest (a first dimension the world size does not divide is padded, as
    FSDP2 pads it). Figures for FSDP2's defaults (``reshard_after_forward=True``, no mixed
    precision policy); the step inside ``pool.step()`` (``sm.prepare_fsdp``) replays the same
    allocations from its arena.

    Attributes:
        world_size: the ranks the parameters are sharded over.
        units: the modules ``fully_shard`` is applied to (``""``: the model).
        train_peak: everything a rank holds at its busiest, as ``MemoryEstimate``'s peaks.
        step_peak: the step's own peak, beyond the sharded parameters, inputs and optimizer
            state (what a budget counts).
        train_bytes: by category (``CATEGORIES``): sharded parameters (and the buffers, not
            sharded), sharded gradients, the optimizer's state on the shards; ``temporaries``
            is the rest of the peak (all-gather and reduce-scatter buffers, unsharded
            gradients, results that die within the step).
        gathered_bytes: the most unsharded parameter bytes alive at once (all-gather outputs).
        largest_unit, largest_unit_bytes: the unit with the most unsharded bytes, and those.
    """

    world_size: int
    units: tuple[str, ...]
    train_peak: int
    step_peak: int
    train_bytes: dict[str, int]
    gathered_bytes: int
    largest_unit: str
    largest_unit_bytes: int


@dataclass(frozen=True)
class MemoryEstimate:
    """What a train step and an evaluation of one signature need, in bytes, before running.

    A peak is a total: everything live at that moment, parameters and inputs included (and,
    with an optimizer, its state after the first step), for a step that starts with no
    ``.grad``: what ``torch.cuda.max_memory_allocated()`` shows for that step in a fresh
    process. ``*_pooled`` are the same for ``sm.pooled_train_step`` / ``sm.pooled_forward``
    on a fresh pool: the pool's planned bytes plus what runs beside the pool.

    A budget has one meaning wherever one is taken (``fits``, a step's ``budget=``, the
    command line's ``--budget``): what the step itself holds beyond what exists before it (the
    pool's buffers, what runs beside the pool, the gradients), not the parameters, inputs and
    optimizer state; ``step_peak_eager`` / ``step_peak_pooled`` are those figures. Whether a
    whole train step fits a device's memory, everything included, is
    ``train_peak_pooled <= memory`` (``fits_memory``, which said so, is deprecated).

    Attributes:
        device: the device the figures are for (its allocator's rounding is applied).
        train_peak_eager, train_peak_pooled, eval_peak_eager, eval_peak_pooled: peaks.
        step_peak_eager, step_peak_pooled: the train step's own peak, beyond the parameters,
            inputs and optimizer state (what a budget counts).
        train_bytes: the train step's bytes by category (``CATEGORIES``): ``temporaries`` is
            the rest of the eager peak (results that die within the step).
        module_activation_bytes: per module path (``""`` is the model), the bytes saved for
            backward while that module ran; a container counts its children's.
        time_for_memory: what recomputation offers the pooled train step, bit for bit:
            ``(modelled time added, step_peak_pooled)`` pairs, the time as a fraction of the
            step's own (0.35: +35%, a ``max_slowdown`` of 1.35), for
            ``Recompute.within(1.35)`` and ``Recompute.MOST`` (what ``recompute=`` and a
            budget choose from). Without an optimizer, the last pair's peak is the figure a
            budgeted step's ``report()`` gives for what recomputation reaches.
        kernels_measured: whether kernels' scratch was measured on this CPU (else modelled;
            see ``estimate``'s ``measure_kernels``).
        sharded: with ``world_size``, one rank's figures for the step sharded with FSDP2
            (``ShardedEstimate``); else ``None``.
    """

    device: str
    train_peak_eager: int
    train_peak_pooled: int
    eval_peak_eager: int
    eval_peak_pooled: int
    train_bytes: dict[str, int]
    module_activation_bytes: dict[str, int] = field(default_factory=dict)
    step_peak_eager: int = 0
    step_peak_pooled: int = 0
    time_for_memory: tuple[tuple[float, int], ...] = ()
    kernels_measured: bool = False
    sharded: ShardedEstimate | None = None

    def fits(self, budget: int | str, *, pooled: bool = True) -> bool:
        """Whether the train step (pooled unless ``pooled=False``) fits ``budget`` (bytes, or
        a size such as ``"8G"``) as a step's ``budget=`` counts it: what the step holds
        beyond the parameters, inputs and optimizer state."""
        nbytes = parse_bytes(budget)
        return (self.step_peak_pooled if pooled else self.step_peak_eager) <= nbytes

    def fits_memory(self, memory: int | str, *, pooled: bool = True) -> bool:
        """Deprecated: ``train_peak_pooled <= memory`` (or ``train_peak_eager``). Whether a
        whole train step, parameters, inputs and optimizer state included, fits a device
        with ``memory`` bytes (or a size such as ``"8G"``). ``fits`` is the one question a
        budget asks."""
        warnings.warn(
            "sharedmem: MemoryEstimate.fits_memory is deprecated: fits(budget) is the one "
            "question a budget asks; for a whole device compare est.train_peak_pooled (or "
            "train_peak_eager) with its memory",
            DeprecationWarning,
            stacklevel=2,
        )
        nbytes = parse_bytes(memory, "memory")
        return (self.train_peak_pooled if pooled else self.train_peak_eager) <= nbytes

    def report(self) -> str:
        """A table a person reads: the peaks, the categories, the biggest modules."""
        rows = [f"memory estimate on {self.device} (nothing was allocated to make it)"]
        if self.device == "cpu" and not self.kernels_measured:
            rows.append(
                "  kernels' scratch modelled, not measured (measure_kernels=True measures it, "
                "installing the routing allocator)"
            )
        rows.append(f"  {'':<22}{'eager':>16}{'pooled':>16}")
        for label, eager, pooled in (
            ("train step peak", self.train_peak_eager, self.train_peak_pooled),
            ("evaluation peak", self.eval_peak_eager, self.eval_peak_pooled),
        ):
            rows.append(f"  {label:<22}{eager:>16,}{pooled:>16,}   ({human_bytes(eager)} eager)")
        rows.append("  train step by category:")
        for key in CATEGORIES:
            rows.append(f"    {key:<20}{self.train_bytes[key]:>16,}")
        modules = sorted(
            ((p, n) for p, n in self.module_activation_bytes.items() if p),
            key=lambda item: -item[1],
        )
        if modules:
            rows.append("  activations saved for backward, biggest modules:")
            rows += [f"    {path:<20}{n:>16,}" for path, n in modules[:10]]
        if self.time_for_memory and self.step_peak_pooled:
            rows.append("  time for memory (pooled step's own peak, recomputation, bit for bit):")
            rows.append(f"    {'default':<20}{self.step_peak_pooled:>16,}")
            for slowdown, peak in self.time_for_memory:
                share = peak / self.step_peak_pooled
                rows.append(f"    {f'+{slowdown:.0%} time':<20}{peak:>16,}   ({share:.2f}x)")
        if self.sharded is not None:
            rows += _sharded_rows(self.sharded)
        return "\n".join(rows)


def _sharded_rows(sharded: ShardedEstimate) -> list[str]:
    units = ", ".join(repr(u) for u in sharded.units if u) or "none"
    rows = [
        f"  sharded with fully_shard over {sharded.world_size} ranks, per rank (units: {units}, "
        "then the model):",
        f"    {'train step peak':<20}{sharded.train_peak:>16,}   "
        f"({human_bytes(sharded.train_peak)})",
        f"    {'its own peak':<20}{sharded.step_peak:>16,}",
    ]
    rows += [f"    {key:<20}{sharded.train_bytes[key]:>16,}" for key in CATEGORIES]
    rows.append(f"    {'all-gathered at once':<20}{sharded.gathered_bytes:>16,}")
    rows.append(
        f"    {'largest unit':<20}{sharded.largest_unit_bytes:>16,}   "
        f"({sharded.largest_unit or 'the model'!r} unsharded)"
    )
    return rows


def estimate(
    model: nn.Module,
    inputs: object,
    targets: object = None,
    *,
    loss_fn: Loss | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    device: object = "cpu",
    measure_kernels: bool | None = None,
    world_size: int | None = None,
    fsdp_units: Sequence[str] | None = None,
) -> MemoryEstimate:
    """Estimate a train step's and an evaluation's memory without running them.

    Runs ``loss_fn(model(inputs), targets)``, its backward and ``optimizer.step()`` on fake
    tensors (no memory), counting every byte while it is alive, and plans the pooled step
    for the same signature. ``inputs`` are given to the model as a step gives them (a tuple
    as positional arguments, a dict as keyword arguments, anything else as the one
    argument). Without ``loss_fn`` the loss is the model's own (``out.loss``,
    ``out["loss"]``, a scalar output), or the sum of a tensor output. Figures are for
    ``device`` (any device string, usable here or not: ``"cuda"`` on a machine without a
    GPU works); the model and inputs stay where they are.

    A ``DistributedDataParallel`` model is estimated for one rank: its module, plus the
    reducer's gradient buckets (the bytes of the parameters it reduces, held for the whole
    run) in the peaks and under ``gradients``.

    With ``world_size``, ``sharded`` also gives one rank's figures for the same step with the
    model sharded by FSDP2 over that many ranks (``fully_shard`` applied to each module of
    ``fsdp_units``, then to the model): the sharded parameters, gradients and optimizer state,
    the all-gathered (unsharded) parameters of the units running and prefetched, the
    reduce-scatter buffers and the activations, each where FSDP2 allocates and frees it (on
    ``"cpu"``, with the copies gloo makes). Pass the model before sharding it and the inputs
    one rank sees. Measured against eager FSDP2 with gloo on 2 and 4 CPU ranks
    (``tests/test_fsdp.py``; the least of nine steps, gloo's worker thread freeing its copies
    at a time of its own), the step's own peak is within 1% under and 3% over.

    ``kernels_measured`` says whether kernels' scratch was measured or modelled
    (``measure_kernels``). Not modelled: cuDNN/cuBLAS workspaces, the CUDA context,
    fragmentation of the caching allocator (blocks are rounded to 512 bytes, nothing more),
    the vmm backend's 2 MiB chunk granularity, and memory a custom autograd function or a
    hook allocates outside ATen ops.

    Args:
        model: the module (training mode is used for the train step, eval for evaluation).
        inputs: the model's input: a tensor, a tuple of positional or a dict of keyword
            arguments (tensors or pytrees of them); their shapes are what counts.
        targets: the loss's second argument.
        loss_fn: ``loss_fn(output, targets)`` returns the scalar loss.
        optimizer: its class and hyperparameters give the state and step temporaries.
        device: the device the figures are for.
        measure_kernels: on ``"cpu"``, measure what kernels hold beyond their results
            (oneDNN's scratch, an RNN's workspace) by running each configuration once under
            the routing allocator. ``None`` (the default): where the router is installed in
            this process already (a pooled step ran), else modelled; an estimate never
            builds or installs it on its own, so it changes nothing in the process.
            ``True``: build and install it now to measure (process-wide, as a pooled step
            would); ``False``: modelled.
        world_size: the ranks the model would be sharded over with FSDP2 (``sharded``).
        fsdp_units: module paths ``fully_shard`` would be applied to before the model itself;
            default: each direct child holding parameters (the items of a ``ModuleList`` or
            ``ModuleDict`` child), as torchtitan shards a transformer's blocks.

    Example::

        >>> import torch, sharedmem as sm
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
        ...                             torch.nn.Linear(256, 10))
        >>> est = sm.estimate(model, torch.randn(32, 64), torch.randint(0, 10, (32,)),
        ...                   loss_fn=torch.nn.functional.cross_entropy,
        ...                   optimizer=torch.optim.Adam(model.parameters()))
        >>> est.train_bytes["optimizer_state"] == 2 * est.train_bytes["parameters"] + 4 * 4
        True
        >>> est.fits("1G"), est.train_peak_pooled < 1 << 30
        (True, True)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"sharedmem: model must be a torch.nn.Module, got {type(model).__name__}")
    check_loss_fn(loss_fn)
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"sharedmem: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    name = _device_name(device)
    units = _fsdp_units(model, world_size, fsdp_units)
    measure = measures_kernels(name, measure_kernels)
    rounding = round_for(name)
    inputs = plain_mapping(inputs)
    # Under DistributedDataParallel: this rank's module, plus the reducer's gradient buckets
    # (a second copy of the gradients, held for the whole run; the pooled step keeps them in
    # its pool).
    model, ddp = unwrap(model)
    buckets = 0 if ddp is None else rounding(bucket_bytes(ddp))
    loss = loss_fn if loss_fn is not None else _output_as_loss
    was_training = model.training
    try:
        model.train()
        train = eager_train(
            model, inputs, targets, loss, optimizer, rounding, measure=measure,
            keep_output=True,
        )  # fmt: skip
        if any(p.requires_grad for p in model.parameters()):
            pooled = _planning_only(PooledTrainStep(model, loss, BufferPool("cpu")), measure)
            train_plan = pooled.memory_plan(_real(inputs), _real(targets))
            recomputed = _time_for_memory(
                pooled,
                _real(inputs),
                _real(targets),
                train_plan,
                _own_peak(train, buckets, rounding),
            )
        else:  # a frozen model: its "train step" is a training-mode forward and the loss
            forward = _planning_only(PooledForward(model, BufferPool("cpu")), measure)
            train_plan = forward.memory_plan(_real(inputs))
            recomputed = []
        sharded = None
        if world_size is not None:
            sharded = _sharded(
                model, inputs, targets, loss, optimizer, rounding, world_size, units,
                measure=measure, gloo=name == "cpu",
            )  # fmt: skip
        model.eval()
        eval_peak, out_bytes = _eager_eval(model, inputs, rounding, measure=measure)
        evaluation = _planning_only(PooledForward(model, BufferPool("cpu")), measure)
        eval_plan = evaluation.memory_plan(_real(inputs))
    finally:
        model.train(was_training)
    static = train.parameters + train.inputs + buckets
    grads, state = train.gradients, train.optimizer_state

    train_peak_eager = static + state + max(train.forward_backward, grads + train.step_temporaries)
    # The plan's own timeline: what runs beside the pool (unpooled results, their scratch,
    # the new gradients) at its busiest node; then the optimizer's step beside the gradients.
    step_peak_pooled = _own_peak(train, buckets, rounding)(train_plan)
    train_peak_pooled = static - buckets + state + step_peak_pooled
    eval_static = train.parameters + train.model_inputs
    categories = {
        "parameters": train.parameters,
        "gradients": grads + buckets,
        "optimizer_state": state,
        "inputs": train.inputs,
        "activations": train.activations,
    }
    categories["temporaries"] = max(0, train_peak_eager - sum(categories.values()))
    return MemoryEstimate(
        device=name,
        train_peak_eager=train_peak_eager,
        train_peak_pooled=train_peak_pooled,
        eval_peak_eager=eval_static + eval_peak,
        eval_peak_pooled=(
            eval_static + rounding(eval_plan.pooled_bytes) + max(eval_plan.beside_peak, out_bytes)
        ),
        train_bytes={key: categories[key] for key in CATEGORIES},
        module_activation_bytes=train.modules,
        step_peak_eager=train_peak_eager - static + buckets - state,
        step_peak_pooled=step_peak_pooled,
        time_for_memory=tuple(recomputed),
        kernels_measured=measure,
        sharded=sharded,
    )


def _fsdp_units(model: nn.Module, world_size: object, units: Sequence[str] | None) -> list[str]:
    """The modules ``fully_shard`` is applied to, the model last; ``[]`` without a world size.
    Refuses what a sharded estimate cannot take, naming the fix."""
    from .._executor.fsdp import fsdp_modules

    # Only where FSDP2 was imported can the model be sharded by it (importing it costs seconds).
    if "torch.distributed.fsdp" in sys.modules and fsdp_modules(model):
        raise TypeError(
            "sharedmem: estimate a model before fully_shard is applied to it: pass the plain "
            "model with world_size=N (and fsdp_units= the modules you shard) for one rank's "
            "figures under FSDP2"
        )
    if world_size is None:
        if units is not None:
            raise ValueError("sharedmem: fsdp_units needs world_size= (the ranks to shard over)")
        return []
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(
            f"sharedmem: world_size must be a positive int (the ranks the model is sharded "
            f"over), got {world_size!r}"
        )
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise TypeError(
            "sharedmem: world_size estimates a model sharded with fully_shard (FSDP2); a "
            "DistributedDataParallel model is estimated per rank without it"
        )
    if units is None:
        return default_units(model)
    if isinstance(units, str):
        raise TypeError("sharedmem: fsdp_units must be a list of module paths, not one str")
    known = dict(model.named_modules())
    unknown = [u for u in units if u not in known]
    if unknown:
        raise ValueError(
            f"sharedmem: fsdp_units names no module of the model: {unknown!r}; give paths as "
            "model.named_modules() names them"
        )
    containers = [u for u in units if isinstance(known[u], (nn.ModuleList, nn.ModuleDict))]
    if containers:
        raise ValueError(
            f"sharedmem: fsdp_units names {containers!r}, a container whose forward never runs "
            "(FSDP2's hooks would not fire); name its items (blocks.0, blocks.1, ...)"
        )
    return [*dict.fromkeys(u for u in units if u), ""]


def _sharded(
    model: nn.Module,
    inputs: object,
    targets: object,
    loss: Loss,
    optimizer: torch.optim.Optimizer | None,
    rounding: Callable[[int], int],
    world_size: int,
    units: list[str],
    *,
    measure: bool,
    gloo: bool,
) -> ShardedEstimate:
    train = sharded_train(
        model, inputs, targets, loss, optimizer, rounding, world_size=world_size, units=units,
        measure=measure, gloo=gloo,
    )  # fmt: skip
    static = train.parameters + train.inputs
    own = max(train.forward_backward, train.gradients + train.step_temporaries)
    peak = static + train.optimizer_state + own
    categories = {
        "parameters": train.parameters,
        "gradients": train.gradients,
        "optimizer_state": train.optimizer_state,
        "inputs": train.inputs,
        "activations": train.activations,
    }
    categories["temporaries"] = max(0, peak - sum(categories.values()))
    largest = max(train.unit_bytes, key=lambda u: train.unit_bytes[u])
    return ShardedEstimate(
        world_size=world_size,
        units=tuple(units),
        train_peak=peak,
        step_peak=own,
        train_bytes={key: categories[key] for key in CATEGORIES},
        gathered_bytes=train.gathered,
        largest_unit=largest,
        largest_unit_bytes=train.unit_bytes[largest],
    )


def measures_kernels(device: str, ask: bool | None) -> bool:
    """Whether kernels' scratch is measured for ``device`` (``ask``: as ``estimate``'s
    ``measure_kernels``): on CPU, by the router where it is installed already, or where
    asked for (installed now)."""
    if device != "cpu" or ask is False:
        return False
    if ask:
        return native() is not None
    return loaded() is not None


def _own_peak(
    train: _Train, buckets: int, rounding: Callable[[int], int]
) -> Callable[[MemoryPlan], int]:
    """A pooled train step's own peak (what a budget counts) from its plan: the pool's planned
    bytes and the most beside it, or the optimizer's step beside the gradients."""

    def peak(plan: MemoryPlan) -> int:
        grads_and_step = train.gradients + train.step_temporaries
        return rounding(plan.pooled_bytes) + max(plan.beside_peak, grads_and_step) + buckets

    return peak


def _time_for_memory(
    step: PooledTrainStep,
    inputs: object,
    targets: object,
    default: MemoryPlan,
    own_peak: Callable[[MemoryPlan], int],
) -> list[tuple[float, int]]:
    """The pooled step's own peak (``own_peak`` of its plan) with recomputation at +35%
    modelled time and at as much as lowers the peak, each with its modelled cost; a setting
    that lowers nothing below the one before it (first: ``default``, the step's own plan) is
    left out."""
    found: list[tuple[float, int]] = []
    lowest = own_peak(default)
    for level in (Recompute.within(1.35), Recompute.MOST):
        plan = step.memory_plan(inputs, targets, recompute=level)
        peak = own_peak(plan)
        if peak < lowest and plan.recompute_cost > 0:
            lowest = peak
            found.append((plan.recompute_cost, peak))
    return found


_Planned = TypeVar("_Planned", PooledTrainStep, PooledForward)


def _planning_only(step: _Planned, measure: bool) -> _Planned:
    """``step``, planning as the router would serve it without building or installing it,
    kernels measured where ``measure`` says."""
    step.planning_only = True
    step.measure_kernels = measure
    return step


@dataclass
class _Train:
    parameters: int = 0
    inputs: int = 0  # inputs and targets
    model_inputs: int = 0  # inputs alone
    forward_backward: int = 0  # peak of what forward and backward create
    gradients: int = 0
    activations: int = 0
    optimizer_state: int = 0
    step_temporaries: int = 0
    modules: dict[str, int] = field(default_factory=dict)


def _device_name(device: object) -> str:
    if isinstance(device, torch.device):
        text = str(device)
    elif isinstance(device, str):
        text = device.strip()
    else:
        raise TypeError(
            f"sharedmem: device must be a str or torch.device, got {type(device).__name__}"
        )
    backend_names(text)  # an unknown device is refused here, usable or not
    return text


def _output_as_loss(output: Any, targets: Any) -> torch.Tensor:
    # The model's own loss, as a step without loss_fn takes it; for an estimate, any other
    # tensor output stands for a loss by its sum.
    if isinstance(output, torch.Tensor) and output.dim() > 0:
        return output.sum()
    return OwnLoss()(output, targets)


def _real(tree: object) -> object:
    # The pooled plan traces the real module on the CPU: inputs of another device (meta, a
    # GPU) are stood in for by CPU tensors of the same shapes.
    def convert(value: object) -> object:
        if isinstance(value, torch.Tensor) and value.device.type != "cpu":
            return torch.zeros(value.shape, dtype=value.dtype)
        return value

    return pytree.tree_map(convert, tree)


def eager_train(
    model: nn.Module,
    inputs: object,
    targets: object,
    loss_fn: Loss,
    optimizer: torch.optim.Optimizer | None,
    rounding: Callable[[int], int],
    *,
    measure: bool = False,
    keep_output: bool = False,
) -> _Train:
    """The eager step's figures from a fake-tensor run. ``measure``: kernels' scratch and real
    result sizes measured on this machine's CPU (``LiveBytes``). ``keep_output``: the model's
    output stays alive through backward, as in ``out = model(x); loss_fn(out, y).backward()``
    (a logits tensor can be a tenth of a language model's peak); otherwise it is dropped once
    the loss is computed, as in ``loss_fn(model(x), y).backward()``."""
    result = _Train()
    named = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    result.parameters = _nbytes(iter(named.values()), rounding)
    result.model_inputs = _nbytes(_tensors(inputs), rounding)
    result.inputs = result.model_inputs + _nbytes(_tensors(targets), rounding)
    with quiet_fake_tensor_failures(), FakeTensorMode(allow_non_fake_inputs=True) as fake:
        state: dict[str, torch.Tensor] = {k: fake.from_tensor(t) for k, t in named.items()}
        trainable = [state[key] for key, p in model.named_parameters() if p.requires_grad]
        fake_in = pytree.tree_map(_faker(fake), inputs)
        fake_targets = pytree.tree_map(_faker(fake), targets)
        existing = [*state.values(), *_tensors(fake_in), *_tensors(fake_targets)]
        static = {id(t.untyped_storage()) for t in existing}
        live = LiveBytes(rounding, existing, measure=measure)
        saved: dict[int, int] = {}
        modules: dict[str, int] = {}
        with _module_stack(model) as stack, live:

            def pack(t: torch.Tensor) -> torch.Tensor:
                storage = t.untyped_storage()
                key = id(storage)
                if key not in static and key not in saved:
                    saved[key] = rounding(storage.nbytes())
                    for path in stack:  # a container counts what its children save
                        modules[path] = modules.get(path, 0) + saved[key]
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                args, kwargs = model_arguments(fake_in)
                output = functional_call(model, state, args, kwargs)
                loss = call_loss_fn(loss_fn, output, fake_targets)
            if not keep_output:
                del output
            grads: tuple[torch.Tensor | None, ...] = ()
            if trainable and loss.requires_grad:  # a frozen model has no backward to run
                grads = torch.autograd.grad(loss, trainable, allow_unused=True)
            del loss
            if keep_output:
                del output
            result.forward_backward = live.peak
        result.gradients = _nbytes((g for g in grads if g is not None), rounding)
        result.activations = sum(saved.values())
        result.modules = modules
        if optimizer is not None:
            result.optimizer_state, result.step_temporaries = _optimizer_bytes(
                optimizer, model, state, grads, rounding
            )
    return result


def _eager_eval(
    model: nn.Module, inputs: object, rounding: Callable[[int], int], *, measure: bool
) -> tuple[int, int]:
    """The peak of what an evaluation forward creates, and its output's bytes."""
    named = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    with quiet_fake_tensor_failures(), FakeTensorMode(allow_non_fake_inputs=True) as fake:
        state: dict[str, torch.Tensor] = {k: fake.from_tensor(t) for k, t in named.items()}
        fake_in = pytree.tree_map(_faker(fake), inputs)
        live = LiveBytes(rounding, [*state.values(), *_tensors(fake_in)], measure=measure)
        with live, torch.no_grad():
            args, kwargs = model_arguments(fake_in)
            output = functional_call(model, state, args, kwargs)
        return live.peak, _nbytes(_tensors(output), rounding)


@contextlib.contextmanager
def _module_stack(model: nn.Module) -> Iterator[list[str]]:
    """The paths of the modules whose forward is running, outermost first."""
    stack: list[str] = []
    handles = []
    for path, module in model.named_modules():

        def enter(_m: nn.Module, _args: object, path: str = path) -> None:
            stack.append(path)

        def leave(_m: nn.Module, _args: object, _out: object) -> None:
            stack.pop()

        handles.append(module.register_forward_pre_hook(enter))
        handles.append(module.register_forward_hook(leave))
    try:
        yield stack
    finally:
        for handle in handles:
            handle.remove()
