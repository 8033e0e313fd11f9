"""When a step captures again, and what a capture must not do: one executor's guard, its
recapture count, the hooks a trace cannot honour and the traced values it must not leave
in the user's state.

Every trace runs through ``Capture.trace``: it takes the guard's snapshot first (see
``guards``), runs the model's hooks through a probe that notices a hook that computes
nothing the step uses (it exists for what it does beside the step: storing, printing,
counting, none of which a replayed graph repeats), and afterwards looks for a traced tensor
stored where the user would find it. Either refuses the step, with the state put back.
``stale`` drops the guard when a value it watched changed; ``stats()["recaptures"]`` of the
pool counts the captures this caused, and past ``RECAPTURE_LIMIT`` of one step a warning
names the value that keeps changing.
"""

from __future__ import annotations

import collections
import functools
import os
import signal
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.nn.modules import module as _module

from .._errors import SharedMemError
from .._pool import BufferPool
from .binding import Binding
from .guards import Guard, user_code

__all__ = ["RECAPTURE_LIMIT", "Capture"]

# Captures again of one step caused by changed values, past which one warning names the value.
RECAPTURE_LIMIT = 8
_T = TypeVar("_T")
# The hook dictionaries that hold callables (the others hold flags keyed alike).
_CALLED = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_GLOBAL_CALLED = tuple(f"_global{kind}" for kind in _CALLED)
_FIX = (
    "remove it while the pooled step runs (handle.remove()), or run the step eagerly inside "
    "`with pool.step():`"
)


class Capture:
    """One executor's guard and recapture count.

    Args:
        model: the model traced.
        pool: where ``stats()["recaptures"]`` is counted.
        functions: the callables a trace runs besides the model, named (asked at each
            capture: a train step's loss function).
    """

    def __init__(
        self,
        model: nn.Module,
        pool: BufferPool,
        functions: Callable[[], list[tuple[str, object]]],
    ) -> None:
        self._model = model
        self._pool = pool
        self._functions = functions
        self._guard: Guard | None = None
        self._binding: Binding | None = None
        self.recaptures = 0
        self._changes: collections.Counter[str] = collections.Counter()
        self._warned = False
        pool.count("recaptures", 0)  # in stats() from the start
        pool.count("captures", 0)

    def stale(self, binding: Binding) -> bool:
        """Whether the graphs traced so far are stale: a value the guard watches changed, or
        the model's structure (a new binding). The guard is then dropped."""
        guard = self._guard
        if guard is None:
            return False
        if binding is not self._binding:
            what = "the model's structure"
        else:
            change = guard.changed()
            if change is None:
                return False
            what = change
        self._guard = None
        self.recaptures += 1
        self._pool.count("recaptures", 1)
        key = what.split(" changed (")[0]
        self._changes[key] += 1
        if self.recaptures > RECAPTURE_LIMIT and not self._warned:
            self._warned = True
            most, times = self._changes.most_common(1)[0]
            warnings.warn(
                f"sharedmem: the pooled step of {type(self._model).__name__} was captured "
                f"again {self.recaptures} times (RECAPTURE_LIMIT is {RECAPTURE_LIMIT}), "
                f"{times} of them because {most} keeps changing (last: {what}); each "
                "capture traces and plans the step anew. Keep that value fixed, or pass it "
                "to the model as a tensor input",
                UserWarning,
                stacklevel=4,
            )
        return True

    def trace(self, binding: Binding, trace: Callable[[], _T]) -> _T:
        """``trace()``, guarded: the snapshot is taken first (if there is none), user hooks
        run through a probe, and a capture that leaves a traced tensor in user state or
        runs a hook it cannot repeat is refused."""
        _tracing_ready()
        if self._guard is None:
            self._guard = Guard(binding.unique, self._functions())
            self._binding = binding
        guard = self._guard
        self._pool.count("captures", 1)
        idle: list[str] = []
        before = guard.fakes()
        try:
            with _probing(binding, idle):
                traced = trace()
        finally:  # a failed trace leaves no traced tensor behind either
            what = _take_out(guard, before)
        if what is not None:
            raise SharedMemError(
                f"sharedmem: {what} was given a tensor the trace computed (a fake tensor, "
                "with no values): a pooled step replays a traced graph, so code that stores "
                "a call's tensors (a hook or a forward appending to a list) never sees the "
                "real ones. Return what you need from the model, or "
                + _FIX.replace("it", "that code", 1)
            )
        if idle:
            raise SharedMemError(
                f"sharedmem: {idle[0]} returns nothing and adds nothing to the step, so it "
                "is there for what it does beside it (storing, printing or counting what it "
                "is given); a pooled step runs hooks once, while it traces, on tensors with "
                f"no values, and cannot repeat that on each call: {_FIX}"
            )
        return traced


def _take_out(guard: Guard, before: frozenset[int]) -> str | None:
    """Take every traced tensor out of the user state the guard watches; where the first
    was, in words (``None``: there was none)."""
    first = None
    for _ in range(1000):  # each round takes one holder's out
        leak = guard.leaks(before)
        if leak is None:
            break
        what, take_out = leak
        first = first or what
        take_out()
    return first


_READY: list[bool] = []


def _tracing_ready() -> None:
    """Import what tracing imports lazily (torch._dynamo, torch._inductor, torch.export,
    ...: seconds of imports) once per process, by tracing a tiny step, with Ctrl-C held
    until it is done: an interrupt in the middle of those imports would leave modules
    partially initialized, and every later trace in the process failing on them."""
    if _READY:
        return
    # The tiny model is made without drawing from the global generator (the first step's
    # random ops, dropout, then draw what eager's would), and without forking it: a fork
    # saves the generator's state, 5,056 bytes beside the first step's arena (an LSTM's
    # first call past eager's peak by more than a page).
    with _interrupts_held():
        from .binding import Binding
        from .trace import flatten, trace_train

        linear = nn.Linear(2, 2, device="meta").to_empty(device="cpu")  # nothing drawn
        with torch.no_grad():
            linear.weight.fill_(0.5)
            linear.bias.zero_()
        model = nn.Sequential(linear, nn.ReLU())
        binding = Binding(model)
        state = binding.state()
        assert state is not None
        x, y = flatten(torch.ones(1, 2), "inputs"), flatten(torch.ones(1, 2), "targets")
        trace_train(model, nn.functional.mse_loss, binding, state, x, y)
        _READY.append(True)


@contextmanager
def _interrupts_held() -> Iterator[None]:
    """Hold SIGINT (Ctrl-C) inside, raising ``KeyboardInterrupt`` after where one came;
    only the main thread receives signals, so elsewhere this holds nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[object] = []
    try:
        previous = signal.signal(signal.SIGINT, lambda *args: received.append(args))
    except ValueError:  # not in the main interpreter
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received and callable(previous):
            previous(signal.SIGINT, None)  # Python's own handler raises KeyboardInterrupt
        elif received and previous == signal.SIG_DFL:
            os.kill(os.getpid(), signal.SIGINT)


@contextmanager
def _probing(binding: Binding, idle: list[str]) -> Iterator[None]:
    """Run the user's module hooks (and torch.nn's global ones) through a probe while a
    trace runs, putting every hook back after."""
    replaced: list[tuple[dict[int, Any], int, Any]] = []
    holders: list[tuple[str, dict[int, Any]]] = [
        (f"{kind.strip('_').replace('_', ' ')[:-1]}{_of(path, m)}", getattr(m, kind))
        for path, m in binding.unique
        for kind in _CALLED
    ]
    holders += [
        (f"global module {kind[8:].replace('_', ' ')[:-1]}", getattr(_module, kind))
        for kind in _GLOBAL_CALLED
    ]
    try:
        for what, hooks in holders:
            for key, hook in list(hooks.items()):
                if user_code(hook) or user_code(type(hook)):
                    name = getattr(hook, "__qualname__", type(hook).__name__)
                    hooks[key] = functools.partial(_probe, hook, f"the {what} {name!r}", idle)
                    replaced.append((hooks, key, hook))
        yield
    finally:
        for hooks, key, hook in replaced:
            if key in hooks:
                hooks[key] = hook


def _of(path: str, module: nn.Module) -> str:
    return f" of {type(module).__name__} {path!r}" if path else " of the model"


def _probe(hook: Callable[..., Any], what: str, idle: list[str], *args: Any, **kwargs: Any) -> Any:
    """Call ``hook``; note it in ``idle`` where it returned nothing and recorded no op."""
    mode = get_proxy_mode()
    before = -1 if mode is None else len(mode.tracer.graph.nodes)
    result = hook(*args, **kwargs)
    if result is None and mode is not None and len(mode.tracer.graph.nodes) == before:
        idle.append(what)
    return result
