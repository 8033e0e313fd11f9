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

from ._stress._faults import FaultInjector

__all__ = ["FaultInjector", "allocator_peak", "raw_allocator_peak"]


def allocator_peak(step: Callable[[], object]) -> int:
    """The peak of the running sum of the allocator's events while ``step()`` runs, relative
    to what was live when it began (``torch.profiler``'s memory timeline, in order; plain
    ``[memory]`` events miss what an op allocates inside itself)."""
    from torch.profiler import ProfilerActivity, profile  # the profiler only when measuring
    from torch.profiler._memory_profiler import Action

    with profile(
        activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
    ) as prof:
        step()
    live = peak = 0
    for _, action, _, size in prof._memory_profile().timeline:
        if action == Action.CREATE:
            live += size
        elif action == Action.DESTROY:
            live -= size
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
