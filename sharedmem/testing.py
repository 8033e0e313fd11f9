"""Tools for testing code that uses sharedmem: fault injection into a pool's backends, and
the allocator-event measure of a step's peak memory (DESIGN §8).

``FaultInjector`` is an adaptor (``BufferPool(adaptors=[faults])``) that fails chosen
allocations, growths, shrinks or copies, so that a user can check that their own code survives
an out-of-memory error with nothing lost, as the stress runner does. ``allocator_peak`` is the
figure the benchmarks and the estimate's tests compare against; ``raw_allocator_peak`` the
same read from the raw events, for steps whose memory timeline PyTorch cannot build.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from ._stress._faults import FaultInjector

if TYPE_CHECKING:
    from torch.profiler import profile

__all__ = [
    "FaultInjector",
    "allocator_peak",
    "memory_timeline",
    "raw_allocator_peak",
    "timeline_allocator_peak",
]


def allocator_peak(step: Callable[[], object]) -> int:
    """The peak of the running sum of the allocator's events while ``step()`` runs, relative
    to what was live when it began: the figure of PyTorch's memory timeline
    (``timeline_allocator_peak``), read in one pass over the profiler's events
    (``memory_timeline``) instead of through the data-flow graph of every op that the timeline
    builds first (seconds on a large step; plain ``[memory]`` events miss what an op
    allocates inside itself), and without the Python frames the timeline needs recorded
    (``with_stack``: a step's Python calls cost about three times as much under it)."""
    with _profile(with_stack=False) as prof:
        step()
    return _peak(memory_timeline(prof))


def memory_timeline(prof: profile) -> list[int]:
    """The allocator's events of a finished ``profile(profile_memory=True, record_shapes=True)``,
    as signed byte counts in time order: exactly the CREATE and DESTROY entries of the
    profiler's memory timeline (``prof._memory_profile().timeline``, which needs
    ``with_stack=True`` too), in its order, without the data-flow graph it builds to tell
    their categories apart.

    The timeline keys an event by its tensor's identity where the profiler recorded one (an
    allocation a recorded op's inputs reveal; ``record_shapes`` records them): each such
    allocation is one CREATE, each such free one DESTROY, of the size first seen for it. An
    event without one is keyed by its address, read in the event tree's depth-first order: an
    allocation at an address already live there is no CREATE, a free always a DESTROY. Ties
    in time put CREATE before DESTROY.

    ``with_stack`` adds Python frames to the tree around the ops of their thread: the
    depth-first order of one thread's events is their time order with or without them, so
    on one thread's events (every step the tests measure) the result is the same either way.
    """
    from torch._C._profiler import _EventType, _ExtraFields_Allocation

    allocation = _EventType.Allocation
    unkeyed: list[tuple[int, int, int]] = []  # (time, 0 create / 1 destroy, signed bytes)
    keyed: list[tuple[tuple[object, ...], bool, int, int]] = []  # (key, allocates, time, bytes)
    live_unkeyed: set[tuple[int, object]] = set()
    results = prof.profiler.kineto_results if prof.profiler is not None else None
    if results is None:
        raise ValueError(
            "sharedmem: memory_timeline reads a finished profile: call it after the `with`"
        )
    stack = list(reversed(results.experimental_event_tree()))
    while stack:  # depth first, children in order, as torch.profiler._utils.traverse_dfs
        event = stack.pop()
        children = event.children
        if children:
            stack.extend(reversed(children))
        if event.tag != allocation:
            continue
        fields = cast("_ExtraFields_Allocation", event.typed[1])
        size, time = fields.alloc_size, event.start_time_ns
        if fields.id is not None and fields.ptr is not None and fields.allocation_id is not None:
            keyed.append(((fields.id, fields.allocation_id, fields.device), size > 0, time, size))
        elif size > 0:
            address = (fields.ptr, fields.device)
            if address not in live_unkeyed:
                live_unkeyed.add(address)
                unkeyed.append((time, 0, size))
        else:
            live_unkeyed.discard((fields.ptr, fields.device))
            unkeyed.append((time, 1, size))
    # A keyed event's size is the first one seen in time order; its time the last seen.
    sizes: dict[tuple[object, ...], int] = {}
    for key, _, _, size in sorted(keyed, key=lambda k: k[2]):
        sizes.setdefault(key, abs(size))
    times: dict[tuple[tuple[object, ...], bool], int] = {}
    for key, allocates, time, _ in keyed:
        times[key, allocates] = time
    events = unkeyed + [
        (time, 0, sizes[key]) if allocates else (time, 1, -sizes[key])
        for (key, allocates), time in sorted(times.items(), key=lambda kv: kv[1])
    ]
    events.sort(key=lambda e: (e[0], e[1]))
    return [size for _, _, size in events]


def timeline_allocator_peak(step: Callable[[], object]) -> int:
    """``allocator_peak`` read from PyTorch's own memory timeline
    (``prof._memory_profile().timeline``): the reference ``allocator_peak`` is tested
    against, far slower (it builds a data-flow graph of every op)."""
    from torch.profiler._memory_profiler import Action

    with _profile() as prof:
        step()
    live = peak = 0
    for _, action, _, size in prof._memory_profile().timeline:
        if action == Action.CREATE:
            live += size
        elif action == Action.DESTROY:
            live -= size
        peak = max(peak, live)
    return peak


def _profile(with_stack: bool = True) -> profile:
    """The profile the readers read: ``record_shapes`` records the op inputs that give
    allocations their tensor identities; the timeline refuses one without ``with_stack``."""
    from torch.profiler import ProfilerActivity, profile  # the profiler only when measuring

    return profile(
        activities=[ProfilerActivity.CPU],
        profile_memory=True,
        record_shapes=True,
        with_stack=with_stack,
        # Each profile runs once: nothing accumulates. Without it torch 2.11 warns on stderr
        # that events of earlier cycles are dropped (there are none).
        acc_events=True,
    )


def _peak(timeline: list[int]) -> int:
    live = peak = 0
    for size in timeline:
        live += size
        peak = max(peak, live)
    return peak


def raw_allocator_peak(step: Callable[[], object]) -> int:
    """``allocator_peak`` read from the raw allocation events of every thread, in time order.

    The profiler's memory timeline builds a data-flow graph first, which asserts ("duplicate
    outputs") on some distributed steps (eager DDP, FSDP2); the raw events have no such graph,
    and they include other threads' allocations (gloo's worker copies buffers).
    """
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events, allocations = list(prof.profiler.kineto_results.experimental_event_tree()), []
    while events:
        event = events.pop()
        events.extend(event.children)
        if event.typed[0] == _EventType.Allocation:
            allocations.append((event.start_time_ns, event.typed[1].alloc_size))
    live = peak = 0
    for _, size in sorted(allocations, key=lambda a: a[0]):
        live += size
        peak = max(peak, live)
    return peak
