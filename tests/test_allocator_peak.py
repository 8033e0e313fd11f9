"""sharedmem.testing.allocator_peak: the figure of PyTorch's memory timeline, read without it.

``allocator_peak`` reads the allocator's events in one pass over the event tree of a profile
without Python frames; the reference is the timeline PyTorch builds from a profile with them
(``prof._memory_profile().timeline``, its CREATE and DESTROY entries in order), which builds
a data-flow graph of every op first. On random programs (allocations, views, in-place and
out-of-place ops, an op's own scratch, tensors from before the profile freed in it,
autograd, another thread's allocations) the two give the same events in the same order, and
so the same peak: read from the same profile, and from the same program run again without
the Python frames.
"""

from __future__ import annotations

import gc
import random
import threading
from collections.abc import Callable

import torch
from torch.nn import functional as F
from torch.profiler import ProfilerActivity, profile
from torch.profiler._memory_profiler import Action

from sharedmem.testing import allocator_peak, memory_timeline, timeline_allocator_peak

PROGRAMS = 12  # per test run, each of about 30 ops
OPS = 30


def reference(prof: profile) -> list[int]:
    """The timeline's CREATE and DESTROY entries, as signed bytes in its order."""
    out = []
    for _, action, _, size in prof._memory_profile().timeline:
        if action == Action.CREATE:
            out.append(size)
        elif action == Action.DESTROY:
            out.append(-size)
    return out


def _allocate(out: list[torch.Tensor], n: int) -> None:
    out.append(torch.randn(n) + 1)  # on another thread: a temporary and a result


def program(
    rng: random.Random, held: list[torch.Tensor], before: list[torch.Tensor]
) -> Callable[[], None]:
    """A random program over a few live tensors, starting from ``held`` (made before the
    profile and kept after it, as a model's parameters); it frees ``before`` (made before the
    profile too: memory the profile did not see allocated) one by one on the way."""

    def run() -> None:
        live = list(held)
        kept = []
        for _ in range(OPS):
            if before and rng.random() < 0.1:
                del before[rng.randrange(len(before))]
            n = rng.randrange(1, 3000)
            op = rng.randrange(16)
            a = live[rng.randrange(len(live))].reshape(-1) if live else torch.ones(4)
            if op == 0 or not live:
                live.append(torch.randn(n))
            elif op == 1:
                live.append(torch.empty(n, dtype=rng.choice([torch.float32, torch.int64])))
            elif op == 2:
                live.append(a * 2 + 1)  # a temporary freed inside the expression
            elif op == 3:
                live.append(torch.cat([a, a.float()[: rng.randrange(1, a.numel() + 1)]]))
            elif op == 4:
                live.append(a.view(-1)[: max(1, a.numel() // 2)])  # a view: no allocation
            elif op == 5:
                a.add_(1)
            elif op == 6:
                live.append(a.float().sort().values)  # its indices freed at once
            elif op == 7:
                live.append(a.float().expand(2, -1).t().contiguous())  # a copy of a view
            elif op == 8:
                del live[rng.randrange(len(live))]
            elif op == 9:
                kept.append(a.clone())  # outlives the step
            elif op == 10:
                w = torch.randn(4, 1, 3, requires_grad=True)
                loss = F.conv1d(F.pad(a.float().reshape(1, 1, -1)[..., :64], (2, 2)), w)
                loss.sum().backward()
                live.append(w.grad)
            elif op == 11:
                m = int(min(a.numel(), 64) ** 0.5) or 1
                b = a.float()[: m * m].reshape(m, m)
                live.append(b @ b)
            elif op == 12:
                out: list[torch.Tensor] = []
                worker = threading.Thread(target=_allocate, args=(out, n))
                worker.start()
                worker.join()
                live.extend(out)
            elif op == 13:
                live.append(a.float().cumsum(0).std(0, correction=0, keepdim=True))
            elif op == 14:
                live.append(torch.stack([a.float()] * rng.randrange(1, 4)))
            else:
                live.clear()
        before.extend(kept)

    return run


def profiled(program_seed: int, with_stack: bool) -> profile:
    """Program ``program_seed`` (the same ops and sizes each time) run under the profiler;
    what it made and kept is freed after the profile."""
    rng = random.Random(program_seed)
    gc.collect()  # nothing of an earlier program freed in this one's profile
    # Made under a profile of their own: a block made outside every profile and freed in one
    # is reported at the size last recorded at its address, if any (run to run, another).
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True):
        held, before = (
            [torch.randn(rng.randrange(1, 5000)) for _ in range(rng.randrange(4))] for _ in range(2)
        )
    run = program(rng, held, before)
    with profile(
        activities=[ProfilerActivity.CPU],
        profile_memory=True,
        record_shapes=True,
        with_stack=with_stack,
    ) as prof:
        run()
    held.clear()
    before.clear()
    return prof


def test_the_timeline_events_are_pytorchs_on_random_programs(seed: int) -> None:
    draw = random.Random(seed)
    profiled(0, False)  # a process's first profile misses the frees of blocks made before it
    for i in range(PROGRAMS):
        program_seed = draw.randrange(2**31)
        what = f"seed {seed}, program {i} (random.Random({program_seed}))"
        prof = profiled(program_seed, with_stack=True)
        want = reference(prof)
        # From the profile the timeline reads, and from one without the Python frames (as
        # allocator_peak records it) of the same program run again.
        assert memory_timeline(prof) == want, what
        assert memory_timeline(profiled(program_seed, with_stack=False)) == want, what


def test_the_peak_is_the_timelines_on_a_train_step() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    opt = torch.optim.Adam(model.parameters())
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))

    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    step()  # the optimizer's state made: each step after it allocates the same
    # (A process's first profile misses the frees of what was allocated before it: after.)
    allocator_peak(step)
    peaks = [allocator_peak(step), timeline_allocator_peak(step), allocator_peak(step)]
    assert len(set(peaks)) == 1 and peaks[0] > 0, peaks
