"""An optimizer's state stays where the optimizer puts it.

``optimizer.step()`` inside a routed block serves its temporaries from the arena (foreach
Adam's per-step buffers the size of the parameters, a fused kernel's scratch). Its state
(``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``, step counters) is made lazily by the step
that first sees a parameter's gradient and lives across steps: placed in the arena it would
stay fenced there for good (the signature's first call records by best fit, and nothing frees
it), and a plan made from that call would grow the arena for bytes no later call needs.

PyTorch calls its global optimizer-step hooks around every ``Optimizer.step``; routing adds a
pair once, at its first scope. A step that begins inside a scope of its thread while one of
its parameters holds a gradient and no state yet runs with the scope set aside: every
allocation of that step is PyTorch's, as without the pool (the state included; its peak is
eager's), and the block is recorded anew on its next call, whose sequence is the steady one.
An optimizer whose step leaves such parameters without state (SGD without momentum) keeps no
state to protect and is never set aside again.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

__all__ = ["Frame", "enter", "leave"]


@dataclass
class Frame:
    """One open scope of this thread, as the hooks see it.

    Attributes:
        router: the scope's router (``suspend()`` sets it aside, ``resume(token)`` back).
        stepped: an optimizer stepped inside the scope.
        suspended: the scope was set aside during the call (an optimizer step made its
            state, or ``torch.compile`` compiled): the call's sequence is not the steady
            one, and the next call records it.
    """

    router: Any
    stepped: bool = False
    suspended: bool = False
    token: Any = None  # the scope set aside while an optimizer step makes its state
    optimizer: torch.optim.Optimizer | None = None
    fresh: list[torch.Tensor] = field(default_factory=list)


_local = threading.local()
_stateless: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_install_lock = threading.Lock()
_installed = False


def enter(router: Any) -> Frame:
    """A scope of ``router`` opens on this thread: optimizer steps inside it are watched."""
    _install()
    frame = Frame(router)
    _frames().append(frame)
    return frame


def leave(frame: Frame) -> None:
    """The scope of ``frame`` closes: put back a scope an optimizer step set aside and did not
    put back (the step raised), before the caller closes it."""
    frames = _frames()
    if frames and frames[-1] is frame:
        frames.pop()
    _resume(frame)


def _frames() -> list[Frame]:
    frames: list[Frame] | None = getattr(_local, "frames", None)
    if frames is None:
        frames = _local.frames = []
    return frames


def _install() -> None:
    global _installed
    if _installed:
        return
    with _install_lock:
        if not _installed:
            register_optimizer_step_pre_hook(_before_step)
            register_optimizer_step_post_hook(_after_step)
            _installed = True


def _fresh(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters this step will make state for: a gradient, and no state yet."""
    state = optimizer.state  # a defaultdict: ``get`` adds nothing
    return [
        p
        for group in optimizer.param_groups
        for p in group["params"]
        if p.grad is not None and not state.get(p)
    ]


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    frames = _frames()
    if not frames:
        return
    frame = frames[-1]
    frame.stepped = True
    if frame.token is not None or optimizer in _stateless:
        return  # set aside already (a step inside a step), or an optimizer without state
    fresh = _fresh(optimizer)
    if not fresh:
        return
    frame.token = frame.router.suspend()
    frame.optimizer, frame.fresh, frame.suspended = optimizer, fresh, True


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    frames = _frames()
    if not frames or frames[-1].optimizer is not optimizer:
        return
    frame = frames[-1]
    _resume(frame)
    state = optimizer.state
    if not any(state.get(p) for p in frame.fresh):
        _stateless.add(optimizer)  # its step made no state: nothing to keep out of the arena
    frame.fresh = []


def _resume(frame: Frame) -> None:
    if frame.token is not None:
        token, frame.token, frame.optimizer = frame.token, None, None
        frame.router.resume(token)
