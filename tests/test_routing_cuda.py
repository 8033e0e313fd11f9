"""The CUDA half of the routing allocator: a step's allocations on its stream served from the
pool's arena (record, plan, replay), every other allocation upstream, kept bytes never handed
out twice, and a clear error where it cannot be installed.

On the stand-in (CI) the router is called through the C ABI exactly as PyTorch's pluggable
allocator calls it (``tests/cudasim/allocator.py``), in the order a step's kernels would
allocate; on a GPU the last test runs a real pooled step with the router installed."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
import threading
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from conftest import requires_gpu
from cudasim.allocator import Block, PluggableAllocator, overlapping

import sharedmem as sm
from sharedmem._routing import Route, cuda_router, native, routes_on

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(native() is None, reason="no C++ compiler: the routers cannot be built"),
]


def _install(cuda_sim: Any) -> PluggableAllocator:
    assert sm.install_cuda_router()
    allocator = cuda_sim.ops.allocator
    assert allocator is not None
    return allocator


def _arena(pool: sm.BufferPool, name: str = "act.0") -> tuple[int, int]:
    memory = pool.blob(name).data_memory
    base = pool.tensor(name, (memory.device_capacity,), torch.uint8).data_ptr()
    return base, base + memory.device_capacity


def _inside(block: Block, arena: tuple[int, int]) -> bool:
    return arena[0] <= block.ptr and block.ptr + block.size <= arena[1]


def _fill(block: Block, byte: int) -> None:
    ctypes.memset(block.ptr, byte, block.size)


def _holds(block: Block, byte: int) -> bool:
    return bytes(ctypes.string_at(block.ptr, block.size)) == bytes([byte]) * block.size


def _recorded(cuda_sim: Any) -> tuple[PluggableAllocator, sm.BufferPool, Route]:
    """The router installed, a CUDA pool, and a route whose step was recorded once (its
    gradient freed after): the next call replays. The arena is grown to the recording's plan
    when that call begins (not beside what the recording call left held): read it after."""
    allocator = _install(cuda_sim)
    pool = sm.BufferPool("cuda")
    route = Route(pool, "act.0", training=True)
    with route.scope():
        first = _step(allocator)
    first.free()
    assert _arena(pool) == (0, 0) or pool.stats()["reserved_bytes"] == 0
    return allocator, pool, route


def _step(allocator: PluggableAllocator, **stream: Any) -> Block:
    """A training step's shape: activations that die inside it (170,000 bytes), a gradient
    that outlives it (8,192)."""
    a = allocator.allocate(40_000, **stream)
    b = allocator.allocate(100_000, **stream)
    _fill(a, 1)
    _fill(b, 2)
    a.free()
    c = allocator.allocate(30_000, **stream)
    grad = allocator.allocate(8192, **stream)
    _fill(c, 3)
    b.free()
    c.free()
    return grad


class TestServedFromTheArena:
    def test_the_second_call_of_a_step_is_served_from_the_arena_and_its_result_is_not(
        self, cuda_sim: Any
    ) -> None:
        pool = sm.BufferPool("cuda")
        assert not routes_on(pool)  # not installed: PyTorch's allocator, as before
        allocator = _install(cuda_sim)
        assert routes_on(pool) and cuda_router() is not None
        route = Route(pool, "act.0", training=True)
        with route.scope():  # recorded: every allocation upstream
            first = _step(allocator)
        assert route.plan is not None and pool.stats()["recorded_calls"] == 1
        served: list[Block] = []
        real_allocate = allocator.allocate

        def watching(size: int, **kw: Any) -> Block:
            block = real_allocate(size, **kw)
            served.append(block)
            return block

        allocator.allocate = watching  # type: ignore[method-assign]
        with route.scope():
            grad = _step(allocator)
        allocator.allocate = real_allocate  # type: ignore[method-assign]
        arena = _arena(pool)  # grown as this call began
        activations, kept = served[:3], served[3]
        # the gradient outlives the call: planned into the arena too, fenced while held; the
        # first call's ran upstream (the arena was empty then)
        assert kept is grad and _inside(grad, arena) and not _inside(first, arena)
        assert all(_inside(b, arena) for b in activations)
        stats = pool.stats()
        assert stats["arena_served_bytes"] == 178_192 and stats["arena_kept_bytes"] == 8192
        # PyTorch served the first call's activations only (the arena was empty then)
        assert stats["arena_fallback_bytes"] == 170_000 and stats.get("diverged_calls", 0) == 0
        # The arena is the plan's, at most max-live rounded to the pool's granule.
        assert route.plan.lower_bound <= route.plan.need
        first.free()
        grad.free()

    def test_a_scope_set_aside_leaves_its_streams_allocations_upstream_until_put_back(
        self, cuda_sim: Any
    ) -> None:
        # What an optimizer step that makes its state runs in (``_routing/optimizer.py``).
        from sharedmem._routing.route import _scopes

        allocator, pool, route = _recorded(cuda_sim)
        with route.scope():
            scopes = _scopes(pool)
            token = scopes.suspend()
            assert token and not scopes.active()
            state = allocator.allocate(40_000)
            scopes.resume(token)
            assert scopes.active()
            grad = _step(allocator)
        arena = _arena(pool)
        assert not _inside(state, arena) and _inside(grad, arena)
        assert route.last["served_bytes"] == 178_192 and route.last["diverged_at"] == -1
        for block in (state, grad):
            block.free()

    def test_allocations_on_other_streams_and_outside_a_scope_are_never_the_arenas(
        self, cuda_sim: Any
    ) -> None:
        allocator, pool, route = _recorded(cuda_sim)
        side = cuda_sim.ops.new_stream(0)
        with route.scope():
            other = [allocator.allocate(40_000, stream=side) for _ in range(3)]
            grad = _step(allocator)
        outside = allocator.allocate(40_000)
        arena = _arena(pool)
        assert not any(_inside(b, arena) for b in [*other, outside])
        assert route.last["served_bytes"] == 178_192 and route.last["diverged_at"] == -1
        for block in [*other, outside, grad]:
            block.free()

    def test_allocations_on_the_steps_stream_from_another_thread_are_routed(
        self, cuda_sim: Any
    ) -> None:
        # On CUDA the autograd engine runs backward on a device thread of its own, on the
        # forward's stream: a scope by thread would miss it, a scope by stream does not.
        allocator = _install(cuda_sim)
        pool = sm.BufferPool("cuda")
        route = Route(pool, "act.0", training=True)
        results: list[Block] = []

        def backward_thread() -> None:
            results.append(_step(allocator))

        for _ in range(2):
            with route.scope():
                thread = threading.Thread(target=backward_thread)
                thread.start()
                thread.join()
        assert route.last["served_bytes"] == 178_192 and route.last["fell_back"] == 0
        for block in results:
            block.free()


class TestKeptBytes:
    def test_an_activation_kept_past_its_step_is_fenced_off_and_never_overwritten(
        self, cuda_sim: Any
    ) -> None:
        allocator, pool, route = _recorded(cuda_sim)
        with pytest.warns(RuntimeWarning, match="still referenced"), route.scope():
            kept = allocator.allocate(40_000)  # like a hook that stores an activation
            _fill(kept, 7)
            allocator.allocate(100_000).free()
            allocator.allocate(30_000).free()
            grad = allocator.allocate(8192)
        assert _inside(kept, _arena(pool))
        # Every later step, recorded anew or replayed, leaves the kept bytes alone.
        for _ in range(3):
            with route.scope():
                later = _step(allocator)
            later.free()
            assert _holds(kept, 7)
        assert pool.stats()["arena_escaped_bytes"] >= 40_000
        kept.free()
        grad.free()

    def test_random_steps_never_hand_out_live_bytes(self, cuda_sim: Any, seed: int) -> None:
        # A reference model: every live block's bytes are its own (no two overlap), every
        # block kept across calls holds what was written into it, whatever the calls do
        # (other sizes, other counts, kept activations, allocations on another stream).
        allocator = _install(cuda_sim)
        pool = sm.BufferPool("cuda")
        rng = np.random.default_rng(seed)
        route = Route(pool, "act.0", training=True)
        side = cuda_sim.ops.new_stream(0)
        kept: list[tuple[Block, int]] = []
        sizes = [int(s) for s in rng.integers(1, 60_000, size=12)]
        for call in range(12):
            live: list[tuple[Block, int]] = []
            with warnings.catch_warnings(), route.scope():
                warnings.simplefilter("ignore", RuntimeWarning)  # kept blocks escape
                for i, size in enumerate(sizes):
                    if rng.random() < 0.1:
                        size = int(rng.integers(1, 60_000))  # this call diverges
                    stream = {"stream": side} if rng.random() < 0.1 else {}
                    block = allocator.allocate(size, **stream)
                    byte = (call * 31 + i) % 251 + 1
                    _fill(block, byte)
                    live.append((block, byte))
                    assert overlapping(allocator.ranges()) == [], f"seed {seed}"
                    if rng.random() < 0.5:
                        done, _ = live.pop(int(rng.integers(0, len(live))))
                        done.free()
                keep = int(rng.integers(0, 3))
                kept.extend(live[:keep])
                for block, _ in live[keep:]:
                    block.free()
            for block, byte in kept:
                assert _holds(block, byte), f"seed {seed}: a kept block was overwritten"
        stats = pool.stats()
        assert stats["recorded_calls"] + stats["replayed_calls"] == 12
        for block, _ in kept:
            block.free()


class TestInstalling:
    def test_installing_after_pytorch_allocated_on_cuda_says_to_install_first(
        self, cuda_sim: Any
    ) -> None:
        _install(cuda_sim).allocate(64).free()
        from sharedmem._routing import cuda_native

        cuda_native._forget()  # as a new process whose allocator was used first
        with pytest.raises(sm.SharedMemError, match="before any CUDA tensor"):
            sm.install_cuda_router()
        assert cuda_router() is None

    def test_an_upstream_refusal_is_an_out_of_memory_error_that_names_the_fix(
        self, cuda_sim: Any
    ) -> None:
        _install(cuda_sim)
        router = cuda_router()
        stream = cuda_sim.ops.current_stream(0).cuda_stream
        with pytest.raises(torch.OutOfMemoryError, match=r"sharedmem: .*budget"):
            router.alloc(1 << 50, 0, stream)


@requires_gpu
def test_a_pooled_step_on_the_gpu_is_served_from_the_arena_bit_for_bit() -> None:
    # In a process of its own: the router must be PyTorch's allocator before its first CUDA
    # allocation, which this test process made long ago.
    script = textwrap.dedent(
        """
        import torch, sharedmem as sm
        from torch import nn
        assert sm.install_cuda_router()
        def model():
            torch.manual_seed(0)
            return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                 nn.Flatten(), nn.Linear(16 * 32 * 32, 10)).cuda()
        x = torch.randn(8, 3, 32, 32, device="cuda")
        y = torch.randint(0, 10, (8,), device="cuda")
        eager, pooled = model(), model()
        nn.functional.cross_entropy(eager(x), y).backward()
        pool = sm.BufferPool("cuda")
        step = sm.pooled_train_step(pooled, nn.functional.cross_entropy, pool=pool)
        for _ in range(3):
            pooled.zero_grad(set_to_none=True)
            loss = step(x, y)
        torch.cuda.synchronize()
        for a, b in zip(eager.parameters(), pooled.parameters()):
            assert torch.equal(a.grad, b.grad)
        stats = pool.stats()
        assert stats["arena_served_bytes"] > 0, stats
        print("served", stats["arena_served_bytes"], "beside", stats["arena_fallback_bytes"])
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=dict(os.environ)
    )
    assert done.returncode == 0, done.stdout + done.stderr
