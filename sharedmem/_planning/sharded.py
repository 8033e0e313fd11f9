"""A rank's memory in an FSDP2 (``fully_shard``) train step, before sharding or running it.

The step runs on fake tensors as ``estimate``'s eager figure does (``LiveBytes`` counts what
every op creates while it is alive), with FSDP2's own buffers added at the points where FSDP2
allocates and frees them, from its source (``torch.distributed.fsdp._fully_shard``):

- a unit's pre-forward all-gathers its parameters: one flat output of the unit's padded
  unsharded bytes, copied out into one buffer per parameter (the unsharded parameters), the
  flat output kept until the next unit's is copied out (the root's post-forward drops the
  last; in backward it is freed at once); its post-forward frees the unsharded parameters
  again (``reshard_after_forward``, FSDP2's default), but the root's, kept until backward ends;
- backward: a unit's pre-backward (the gradient of one of its outputs) all-gathers it again and
  prefetches the unit that ran before it in the forward; its post-backward (once the gradients
  of its inputs are computed, or at the end of backward where no input needs one) frees the
  unsharded parameters, drops the previous unit's reduce-scatter input, allocates its own (the
  unit's padded unsharded bytes), copies the gradients in (a gradient whose first dimension
  the world size does not divide through a padded copy) and frees them (``.grad = None``, as
  FSDP2 does), and allocates the reduce-scatter output: the unit's sharded gradients, kept;
- after backward the last reduce-scatter input is freed.

On CPU the process group is gloo's, which copies a reduce-scatter's input while the collective
runs (one more unit's unsharded bytes for a moment; NCCL makes no copy). The copy gloo's worker
thread makes of an all-gather's output is freed as the collective ends, and is not counted.

Parameters are split on their first dimension, padded to a multiple of the world size: rank 0
holds ``ceil(d0 / N)`` rows of each (the most of any rank), and its figures are the estimate.
Buffers are not sharded. The optimizer's state and step are its own, run on fake tensors of
rank 0's shard shapes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.utils.stateless import _reparametrize_module

from .._errors import quiet_fake_tensor_failures
from .._executor.calling import model_arguments
from .._validate import call_loss_fn
from .counting import faker as _faker
from .counting import nbytes as _nbytes
from .counting import optimizer_bytes as _optimizer_bytes
from .counting import tensors as _tensors
from .live import LiveBytes

__all__ = ["ShardedTrain", "default_units", "sharded_train"]

Loss = Callable[[Any, Any], torch.Tensor]


@dataclass
class ShardedTrain:
    """One rank's figures for an FSDP2 train step (bytes, rank 0: the largest shards)."""

    parameters: int = 0  # sharded parameters and the (unsharded) buffers
    inputs: int = 0
    gradients: int = 0  # sharded gradients, after the step
    optimizer_state: int = 0
    step_temporaries: int = 0
    activations: int = 0
    forward_backward: int = 0  # peak of what forward and backward create
    gathered: int = 0  # the most unsharded parameter bytes alive at once
    unit_bytes: dict[str, int] = field(default_factory=dict)  # each unit's unsharded bytes


def default_units(model: nn.Module) -> list[str]:
    """The modules ``fully_shard`` is applied to, as torchtitan and FSDP2's examples do: each
    direct child holding parameters (the items of a ``ModuleList`` / ``ModuleDict`` child, one
    level down), then the model itself (``""``)."""
    units: list[str] = []
    for name, child in model.named_children():
        if not any(True for _ in child.parameters()):
            continue
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            units += [
                f"{name}.{item}"
                for item, module in child.named_children()
                if any(True for _ in module.parameters())
            ]
        else:
            units.append(name)
    return [*units, ""]


def _padded(p: torch.Tensor, world: int) -> tuple[int, ...]:
    """A parameter's rank-0 shard shape: ``ceil(d0 / world)`` rows."""
    if p.dim() == 0:
        return (1,)
    return (-(-p.shape[0] // world), *p.shape[1:])


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class _Unit:
    def __init__(self, path: str, names: list[str], world: int, model: nn.Module) -> None:
        self.path = path
        self.names = names
        params = dict(model.named_parameters())
        shards = [_numel(_padded(params[n], world)) * params[n].element_size() for n in names]
        self.per_param = [world * s for s in shards]  # one all-gather output per parameter
        self.unsharded = sum(self.per_param)  # the flat all-gather output, the RS input
        self.shards = dict(zip(names, shards, strict=True))
        # A gradient whose first dimension the world size does not divide is padded by a copy
        # while it is copied into the reduce-scatter input.
        self.uneven = {n for n in names if params[n].dim() == 0 or params[n].shape[0] % world}
        self.world = world
        self.gathered = False
        self.deferred = True  # post-backward at the end of backward (no input needs a grad)
        self.post_forward: list[int] = []


class _Simulation:
    """FSDP2's buffers, added to ``live``'s count where FSDP2 allocates and frees them."""

    def __init__(
        self,
        live: LiveBytes,
        units: list[_Unit],
        grads_of: Callable[[_Unit], _Freeing],
        rounding: Callable[[int], int],
        copies: bool,
    ) -> None:
        self.live, self.units, self.grads_of, self.rounding = live, units, grads_of, rounding
        self.copies = copies  # gloo copies a reduce-scatter's input while it runs
        self.order: list[_Unit] = []  # post-forward order, for the backward prefetch
        self.reduce_input = 0  # the reduce-scatter input FSDP2 holds until the next one
        self.held = 0  # the last flat all-gather output of the forward, held
        self.sharded_grads = 0  # the reduce-scatter outputs made
        self.gathered = 0
        self.most_gathered = 0
        self.backward_started: set[int] = set()

    def add(self, nbytes: int) -> None:
        self.live.live += nbytes
        self.live.peak = max(self.live.peak, self.live.live)

    def unshard(self, unit: _Unit, forward: bool = False) -> None:
        if unit.gathered or not unit.names:
            return
        flat = self.rounding(unit.unsharded)
        self.add(flat)  # the all-gather's flat output
        self.add(sum(self.rounding(n) for n in unit.per_param))  # copied out per parameter
        if forward:  # FSDP2 keeps the flat output until the next unit's is copied out
            self.add(-self.held)
            self.held = flat
        else:
            self.add(-flat)
        unit.gathered = True
        self.gathered += unit.unsharded
        self.most_gathered = max(self.most_gathered, self.gathered)

    def reshard(self, unit: _Unit) -> None:
        if unit.gathered:
            self.add(-sum(self.rounding(n) for n in unit.per_param))
            unit.gathered = False
            self.gathered -= unit.unsharded

    def post_forward(self, unit: _Unit, root: bool) -> None:
        if root:  # the root's post-forward drops the last flat all-gather output
            self.add(-self.held)
            self.held = 0
        else:
            self.reshard(unit)
        unit.post_forward.append(len(self.order))
        self.order.append(unit)

    def pre_backward(self, unit: _Unit) -> None:
        if id(unit) in self.backward_started:
            return
        self.backward_started.add(id(unit))
        self.unshard(unit)
        if unit.post_forward:
            index = unit.post_forward.pop()
            if index > 0:
                self.unshard(self.order[index - 1])

    def post_backward(self, unit: _Unit) -> None:
        grads = self.grads_of(unit)  # FSDP2 takes the gradients, then reshards
        self.reshard(unit)
        self.add(-self.reduce_input)  # the previous reduce-scatter input, dropped
        self.reduce_input = 0
        if not grads:
            return
        # Only the parameters with a gradient are reduced (frozen ones are not).
        shards = [unit.shards[n] for n in grads.names]
        self.reduce_input = self.rounding(unit.world * sum(shards))
        self.add(self.reduce_input)
        padding = sum(
            self.rounding(unit.world * unit.shards[n]) for n in grads.names if n in unit.uneven
        )
        self.live.peak = max(self.live.peak, self.live.live + padding)
        grads.clear()  # copied in: the unsharded gradients are freed (the caller's .grad)
        output = self.rounding(sum(shards))
        self.add(output)  # the sharded gradients, kept
        self.sharded_grads += output
        if self.copies:
            self.live.peak = max(self.live.peak, self.live.live + self.reduce_input)

    def finish(self) -> None:
        self.add(-self.reduce_input)
        self.reduce_input = 0


class _PostBackward(torch.autograd.Function):
    """FSDP2's ``RegisterPostBackwardFunction``: the identity, whose backward calls
    ``hook`` once the gradients of the unit's inputs are computed."""

    @staticmethod
    def forward(ctx: Any, hook: Callable[[], None], *inputs: torch.Tensor) -> Any:
        ctx.hook = hook
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        ctx.hook()
        return (None, *grads)


def sharded_train(
    model: nn.Module,
    inputs: object,
    targets: object,
    loss_fn: Loss,
    optimizer: torch.optim.Optimizer | None,
    rounding: Callable[[int], int],
    *,
    world_size: int,
    units: Sequence[str],
    measure: bool = False,
    gloo: bool = False,
) -> ShardedTrain:
    """Rank 0's figures for ``model`` sharded over ``world_size`` ranks, ``fully_shard``
    applied to each module of ``units`` (paths; ``""`` is the model, the root) in the order
    given, as FSDP2 runs its train step (see the module's docstring). ``gloo``: the process
    group copies a reduce-scatter's input while it runs, as gloo does on CPU."""

    result = ShardedTrain()
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    owner: dict[str, str] = {}
    for path in sorted(units, key=len):  # the deepest unit holding a parameter owns it
        prefix = f"{path}." if path else ""
        for name in params:
            if name.startswith(prefix):
                owner[name] = path
    sim_units = {
        path: _Unit(path, [n for n in params if owner.get(n) == path], world_size, model)
        for path in units
    }
    result.unit_bytes = {path: u.unsharded for path, u in sim_units.items()}
    shard_shapes = {n: _padded(p, world_size) for n, p in params.items()}
    result.parameters = sum(
        rounding(_numel(shape) * params[n].element_size()) for n, shape in shard_shapes.items()
    ) + _nbytes(iter(buffers.values()), rounding)
    result.inputs = _nbytes(_tensors(inputs), rounding) + _nbytes(_tensors(targets), rounding)
    modules = dict(model.named_modules())
    with quiet_fake_tensor_failures(), FakeTensorMode(allow_non_fake_inputs=True) as fake:
        state: dict[str, torch.Tensor] = {
            k: _fake_of(fake, t) for k, t in {**params, **buffers}.items()
        }
        fake_in = pytree.tree_map(_faker(fake), inputs)
        fake_targets = pytree.tree_map(_faker(fake), targets)
        existing = [*state.values(), *_tensors(fake_in), *_tensors(fake_targets)]
        static = {id(t.untyped_storage()) for t in existing}
        live = LiveBytes(rounding, existing, measure=measure)

        def grads_of(unit: _Unit) -> _Freeing:
            names = [n for n in unit.names if state[n].grad is not None]
            return _Freeing([state[n] for n in names], names)

        sim = _Simulation(live, list(sim_units.values()), grads_of, rounding, gloo)
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            key = id(t.untyped_storage())
            if key not in static and key not in saved:
                saved[key] = rounding(t.untyped_storage().nbytes())
            return t

        with (
            live,
            _hooks(modules, sim_units, sim),
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
            # The fakes stay the module's through backward, where a checkpointed forward
            # (a pooled FSDP2 step's budget asks about one) is computed again.
            _reparametrize_module(model, state, tie_weights=True),
        ):
            args, kwargs = model_arguments(fake_in)
            output = model(*args, **kwargs)
            loss = call_loss_fn(loss_fn, output, fake_targets)
            if loss.requires_grad:
                loss.backward()
            del loss, output
            for unit in reversed(list(sim_units.values())):  # FSDP2's final callback
                if unit.deferred or unit.gathered:
                    sim.post_backward(unit)
            sim.finish()
            result.forward_backward = live.peak
        result.activations = sum(saved.values())
        result.gathered = sim.most_gathered
        shards = {  # fake tensors of rank 0's shard shapes (made under the fake mode)
            n: torch.empty(shard_shapes[n], dtype=p.dtype, device=state[n].device)
            for n, p in params.items()
        }
        trainable = [n for n, p in params.items() if p.requires_grad]
        result.gradients = sim.sharded_grads
        if optimizer is not None:
            grads = tuple(torch.zeros_like(shards[n]) for n in trainable)
            result.optimizer_state, result.step_temporaries = _optimizer_bytes(
                optimizer, model, {**shards}, grads, rounding
            )
        for t in state.values():
            t.grad = None
    return result


def _fake_of(fake: FakeTensorMode, t: torch.Tensor) -> torch.Tensor:
    """A fake of ``t``; of a parameter ``fully_shard`` already sharded (a DTensor), a plain
    fake of its full shape (a pooled FSDP2 step's budget estimates the sharded model)."""
    if hasattr(t, "full_tensor"):
        with fake:
            full = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
        return full.requires_grad_(t.requires_grad)
    return fake.from_tensor(t)


class _Freeing(list[torch.Tensor]):
    """The gradients FSDP2 takes from a unit's unsharded parameters: clearing the list sets
    each ``.grad`` to ``None``, so the count frees them when FSDP2 does."""

    def __init__(self, tensors: list[torch.Tensor], names: list[str]) -> None:
        super().__init__(tensors)
        self.names = names

    def clear(self) -> None:
        for t in self:
            t.grad = None
        super().clear()


@contextlib.contextmanager
def _hooks(
    modules: dict[str, nn.Module], units: dict[str, _Unit], sim: _Simulation
) -> Iterator[None]:
    """FSDP2's forward and backward hooks on each unit, calling ``sim``."""
    handles = []
    for path, unit in units.items():
        module = modules[path]
        root = path == ""

        def pre(_m: nn.Module, args: tuple[Any, ...], unit: _Unit = unit) -> Any:
            sim.unshard(unit, forward=True)
            flat, spec = pytree.tree_flatten(args)
            wanted = [
                k for k, v in enumerate(flat) if isinstance(v, torch.Tensor) and v.requires_grad
            ]
            if not wanted:
                return None
            unit.deferred = False
            passed = _PostBackward.apply(  # type: ignore[no-untyped-call]
                lambda unit=unit: sim.post_backward(unit), *(flat[k] for k in wanted)
            )
            for k, v in zip(wanted, passed, strict=True):
                flat[k] = v
            return pytree.tree_unflatten(flat, spec)

        def post(
            _m: nn.Module, _args: object, output: Any, unit: _Unit = unit, root: bool = root
        ) -> None:
            sim.post_forward(unit, root)
            for t in pytree.tree_leaves(output):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(  # type: ignore[no-untyped-call]
                        lambda g, unit=unit: sim.pre_backward(unit)
                    )

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
