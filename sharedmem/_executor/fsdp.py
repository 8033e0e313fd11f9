"""FSDP2 (``fully_shard``) models in ``pool.step()`` blocks.

An eager FSDP2 step inside ``with pool.step(...)`` is served from the pool's arena like any
eager block: FSDP2's all-gather outputs, unsharded parameters and reduce-scatter inputs are
allocations of the step's own thread, recorded once and planned. Two things made those
recordings differ from call to call, and with them the plan: a gloo process group's ``Work``
holds references to the tensors of its collective (and to copies it makes of them on the
step's thread), and gloo's worker thread drops its ``Work`` a moment after the collective has
completed, while the step's thread goes on. Where that reference was the last, the buffer died
on the worker thread, before or after the step's next allocation as the two threads happened
to run: a replay met bytes still held where its plan put a new allocation (the router refuses
those; the call ran beside the arena and was recorded anew), a rank's plan differed from the
others', and a test that checked each rank's plan stopped one rank while the others waited in
a collective, which looked like a hang.

``prepare_fsdp`` gives each FSDP2 module collectives (``Comm`` objects, FSDP2's own hook:
``set_custom_all_gather`` / ``set_custom_reduce_scatter``) that hand the process group aliases
of the buffers that own nothing, and call it with the step's scope set aside, so that what the
process group allocates for itself is not the step's. The buffers then live exactly as long as
FSDP2's own references, which it drops on the step's thread after waiting for the collective:
every call frees them at the same point and every replay follows its plan.

On CPU they also leave out gloo's copies. Gloo's all-gather gathers into a flat tensor of the
output's size that its worker thread allocates and copies out; its reduce-scatter clones the
input, all-reduces the clone and copies this rank's chunk out, the clone freed when the worker
thread drops its work. Both sat beside the step's arena, at times of the worker thread's
choosing (a step's peak moved by up to one unit's parameters, two where they overlapped). Here
the all-gather broadcasts each rank's chunk of FSDP2's output from that rank, in place, and the
reduce-scatter all-reduces FSDP2's input in place (FSDP2 reads it no more) and copies this
rank's chunk out: nothing is allocated beside the step's plan. The bytes moved are the same,
and the reduction is gloo's all-reduce on the same values, as in its reduce-scatter, so losses
and gradients equal eager FSDP2's bit for bit.

What a plan cannot honour yet is refused before anything runs: HSDP meshes (their all-reduce
does not pass through the hook), a CPU offload policy, several parameter groups (FSDP2 refuses
the hook there) and a collective of the user's own.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from .._routing import loaded, native

__all__ = ["fsdp_modules", "param_groups", "prepare_fsdp"]


def prepare_fsdp(model: nn.Module) -> nn.Module:
    """Prepare a model sharded with ``fully_shard`` (FSDP2) for ``pool.step()`` blocks.

    Checks every FSDP2 module of ``model`` and gives it collectives whose buffers die on the
    step's own thread and that copy nothing beside them on CPU (see the module's docstring),
    so that each rank's step is recorded once and then served from its pool's arena, FSDP2's
    all-gather and reduce-scatter buffers included. Installs the routing allocator now, so
    that the unsharded parameters FSDP2 makes at its first all-gather are routed too. Calling
    it again changes nothing.

    A step without it still gives eager FSDP2's results, but its plan breaks whenever a
    collective's buffer outlives the step's next allocation, and is recorded anew.
    ``sm.pooled_train_step`` on an FSDP2 model calls it and runs the ``pool.step()`` block for
    you (with a budget, in chunks and checkpointing units). Blocks compiled with the pool's
    ``torch.compile`` backend and then sharded need it as well: a training step's span there
    holds FSDP2's collectives between the compiled blocks.

    Args:
        model: the model, after ``fully_shard`` was applied to it (and its layers).

    Returns:
        ``model``.

    Raises:
        TypeError: ``model`` has no FSDP2 module, or one that ``pool.step()`` cannot plan yet
            (an HSDP mesh, a CPU offload policy, several parameter groups, a collective of
            its own); the message names the alternative.

    Example::

        >>> # on each rank, after dist.init_process_group and fully_shard(model):
        >>> # sm.prepare_fsdp(model)
        >>> # with pool.step("train", x, y):
        >>> #     loss_fn(model(x), y).backward()
    """
    modules = fsdp_modules(model)
    if not modules:
        raise TypeError(
            "sharedmem: prepare_fsdp needs a model sharded with fully_shard (FSDP2), and "
            f"{type(model).__name__} has no such module; a plain or DistributedDataParallel "
            "model needs no preparation (use pooled_train_step or pool.step directly)"
        )
    for name, module in modules:
        _check(name, module)
    native()  # installs the router: FSDP2's buffers made from here on are routed
    for _, module in modules:
        if param_groups(module):  # FSDP2 keeps no collectives for a module without params
            all_gather, reduce_scatter = _comms()
            module.set_custom_all_gather(all_gather())  # type: ignore[operator]
            module.set_custom_reduce_scatter(reduce_scatter())  # type: ignore[operator]
    return model


def fsdp_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules of ``model`` (itself included) that ``fully_shard`` wrapped, by name."""
    import torch.distributed as dist

    if not dist.is_available():
        return []
    from torch.distributed.fsdp import FSDPModule

    return [(n, m) for n, m in model.named_modules() if isinstance(m, FSDPModule)]  # type: ignore[misc]


def param_groups(module: nn.Module) -> list[Any]:
    """The parameter groups of a module ``fully_shard`` wrapped (torch 2.11 and older keep
    at most one, as ``_fsdp_param_group``)."""
    state = module._get_fsdp_state()  # type: ignore[operator]
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


def _check(name: str, module: nn.Module) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        DefaultAllGather,
        DefaultReduceScatter,
    )
    from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo

    where = f"the submodule {name!r}" if name else "the model"
    groups = param_groups(module)
    reason = alternative = ""
    if len(groups) > 1:
        reason = f"{len(groups)} parameter groups (shard_placement_fn over several meshes)"
        alternative = "shard each module over one mesh"
    elif any(isinstance(g.mesh_info, DDPMeshInfo) for g in groups):
        reason = "an HSDP mesh (replicated and sharded dimensions)"
        alternative = "shard over a 1-D mesh"
    elif any(isinstance(g.offload_policy, CPUOffloadPolicy) for g in groups):
        reason = "a CPU offload policy"
        alternative = "shard without offload_policy (sm.save_on_pool offloads activations)"
    else:
        own = (DefaultAllGather, DefaultReduceScatter, *_comms())
        for g in groups:
            for comm in (g._all_gather_comm, g._reduce_scatter_comm):
                if not isinstance(comm, own):
                    reason = f"a collective of its own ({type(comm).__name__})"
                    alternative = "keep FSDP2's default collectives"
    if reason:
        raise TypeError(
            f"sharedmem: {where} is sharded with {reason}, which pool.step() cannot plan "
            f"yet; {alternative}, or run this model's step eagerly, outside pool.step()"
        )


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s bytes that owns nothing: freeing it frees nothing."""
    storage = t.untyped_storage()
    view = torch._C._construct_storage_from_data_pointer(
        storage.data_ptr(), t.device, storage.nbytes()
    )
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(
        view, t.storage_offset(), t.shape, t.stride()
    )


def _routed_cpu(t: torch.Tensor) -> Any | None:
    """The router, where ``t`` is a CPU tensor and the router is loaded; else ``None``."""
    router = loaded()
    return router if t.device.type == "cpu" and router is not None else None


def _collective(run: Callable[..., Any], output: torch.Tensor, input: torch.Tensor) -> Any:
    """``run(output, input)`` as the step's planning needs it: the process group sees aliases
    of the buffers, and what it allocates itself is allocated outside the step's scope. On
    CUDA the process group's references are what keeps a buffer alive on its stream: left as
    they are."""
    router = _routed_cpu(output)
    if router is None:
        return run(output, input)
    with _scope_set_aside(router):
        return run(_alias(output), _alias(input))


@contextlib.contextmanager
def _scope_set_aside(router: Any) -> Iterator[None]:
    """This thread's routed scope set aside while the process group runs: what it allocates
    for itself is not the step's."""
    scope = router.suspend()
    try:
        yield
    finally:
        if scope:
            router.resume(scope)


def _all_gather_in_place(
    output: torch.Tensor, input: torch.Tensor, group: Any, async_op: bool
) -> Any:
    """Gloo's all-gather without its copies: gloo gathers into a flat tensor of the output's
    size that its worker thread allocates, then copies it out, so beside the step's arena sat
    a second output at a time of gloo's choosing. Here each rank's chunk of ``output`` is
    broadcast from that rank in place (FSDP2 copied this rank's shard into its chunk: the
    input is a view of it). Data moves, nothing is computed: the bytes are gloo's. Done when
    it returns (FSDP2 then waits on no work)."""
    import torch.distributed as dist

    router = _routed_cpu(output)
    if router is None or not output.is_contiguous():

        def run(out: torch.Tensor, inp: torch.Tensor) -> Any:
            return dist.all_gather_single(out, inp, group=group, async_op=async_op)

        return _collective(run, output, input)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    chunks = output.chunk(world)
    if chunks[rank].data_ptr() != input.data_ptr():
        chunks[rank].copy_(input.view_as(chunks[rank]))
    with _scope_set_aside(router):
        works = [
            dist.broadcast(_alias(chunk), group=group, group_src=r, async_op=True)
            for r, chunk in enumerate(chunks)
        ]
        for work in works:
            work.wait()
    return None


def _reduce_scatter_in_place(
    output: torch.Tensor, input: torch.Tensor, group: Any, op: Any, async_op: bool
) -> Any:
    """Gloo's reduce-scatter without its copy: gloo clones the input, all-reduces the clone
    and copies this rank's chunk out, the clone freed when gloo's worker thread drops its
    work. Here the input itself is all-reduced (FSDP2 reads its reduce-scatter input no more:
    it keeps it only to free it later) and this rank's chunk copied out: the same all-reduce
    on the same values, so the same bits. Done when it returns."""
    import torch.distributed as dist

    router = _routed_cpu(output)
    if router is None or not input.is_contiguous():

        def run(out: torch.Tensor, inp: torch.Tensor) -> Any:
            return dist.reduce_scatter_single(
                output=out, input=inp, group=group, op=op, async_op=async_op
            )

        return _collective(run, output, input)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    with _scope_set_aside(router):
        dist.all_reduce(_alias(input), op=op, group=group)
    output.copy_(input.chunk(world)[rank].view_as(output))
    return None


def _allocate(
    size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A collective's buffer, from the allocator in scope (the router inside a step): FSDP2's
    own default, written out because its ``Comm`` base leaves ``allocate`` abstract."""
    return torch.empty(*size, dtype=dtype, device=device)


@functools.cache
def _comms() -> tuple[type, type]:
    """FSDP2's default collectives, handing the process group aliases that own nothing, and
    on CPU without gloo's copies (made at first use: importing FSDP2 costs seconds that
    ``import sharedmem`` should not)."""
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    class AliasedAllGather(AllGather):
        allocate = staticmethod(_allocate)

        def __call__(
            self,
            output_tensor: torch.Tensor,
            input_tensor: torch.Tensor,
            group: dist.ProcessGroup,
            async_op: bool = False,
        ) -> Any:
            return _all_gather_in_place(output_tensor, input_tensor, group, async_op)

    class AliasedReduceScatter(ReduceScatter):
        allocate = staticmethod(_allocate)

        def __call__(
            self,
            output_tensor: torch.Tensor,
            input_tensor: torch.Tensor,
            group: dist.ProcessGroup,
            op: Any,
            async_op: bool = False,
        ) -> Any:
            return _reduce_scatter_in_place(output_tensor, input_tensor, group, op, async_op)

    return AliasedAllGather, AliasedReduceScatter
