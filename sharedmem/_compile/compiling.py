"""Compilation is not the step: a routed scope is set aside while ``torch.compile`` compiles.

A compiled region compiles on its first call, inside whatever scope is open on the thread
(the step's span of ``compile_backend(span="step")``, a ``pool.step()`` block): Dynamo's
tracing, AOTAutograd's and the backend's compilation, and the backward graph's compilation,
which AOTAutograd defers to the first backward pass. What they allocate (scalar constants,
guard state, the graphs' example values) is made once and is not the step's: recorded with it,
it would make the first call's sequence differ from every later call's, and the second call
would leave the plan made from the first (and be served by PyTorch beside an arena reserved
for the whole step: twice eager's peak), the third record again, and only the fourth replay.

Dynamo calls its compilation callbacks around each compilation (``CallbackTrigger.DYNAMO``)
and around a deferred backward's (``LAZY_BACKWARD``), on the compiling thread, outermost only;
a pair installed by the backend sets aside that thread's innermost open scope for the
compilation (every allocation of it PyTorch's, as without the pool) and puts it back after.
The call that compiled is still not the step's steady sequence (a compiled region's first
call makes more than its compilation does), so it is not planned: the second call records
the step's own sequence, and the third replays its plan.
``torch._dynamo.reset()`` clears every callback: the backend installs the pair again when it
is made, when it compiles a graph and when a step's span opens.
"""

from __future__ import annotations

import threading
from typing import Any

from .._routing import optimizer

__all__ = ["install"]

_local = threading.local()
_install_lock = threading.Lock()


def install() -> None:
    """Install the pair of compilation callbacks, where they are not: once per process, and
    again after ``torch._dynamo.reset()``, which clears every callback."""
    from torch._dynamo.callback import callback_handler

    if _start in callback_handler.start_callbacks:
        return
    with _install_lock:
        if _start not in callback_handler.start_callbacks:
            callback_handler.register_start_callback(_start)
            callback_handler.register_end_callback(_end)


def _tokens() -> list[tuple[Any, Any]]:
    tokens: list[tuple[Any, Any]] | None = getattr(_local, "tokens", None)
    if tokens is None:
        tokens = _local.tokens = []
    return tokens


def _start(_args: object) -> None:
    # The innermost open scope of this thread (none, or one an optimizer's first step set
    # aside already: nothing to do, but the end still pops a pair).
    frames = optimizer._frames()
    frame = frames[-1] if frames and frames[-1].token is None else None
    router = None if frame is None else frame.router
    if frame is not None:
        # Not the step's steady sequence either: a compiled region's first call makes what
        # later calls reuse outside the compilation too (ResNet-18's: 20 scalars of 8 bytes
        # that no later call makes), and a plan of it is left by the second call at its
        # tenth allocation, which is then served beside the arena at 1.96x eager's peak.
        # The next call records the sequence instead (PyTorch's, or the arena's by best fit).
        frame.suspended = True
    _tokens().append((router, None if router is None else router.suspend()))


def _end(_args: object) -> None:
    tokens = _tokens()
    if tokens:
        router, token = tokens.pop()
        if router is not None:
            router.resume(token)
