"""The invariant of DESIGN §3, checked against a byte-level reference model.

Any sequence of set_size, reads and writes (of the whole view or a part of it) on either side,
asynchronous pushes and pulls, shrink_to_fit and release: every byte below the largest size
ever written reads back the last value written to it, from either side. The model is the
simplest thing that states this: the last bytes written, and how far they reach. Two drivers
push a memory and the model through the same operations: hypothesis (which shrinks a failure
to a short sequence) and a seeded random walk (which covers far more operations per second,
with a distribution tilted toward shrink-then-grow-back).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import ALL_PLACEMENTS, STATEFUL_EXAMPLES
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

import sharedmem as sm

SIDES = ("host", "device")


class Checker:
    """A memory and its reference model, driven together; every step asserts the invariant."""

    def __init__(self, device: str, backend: str) -> None:
        self.memory = sm.SyncedMemory(device=device, backend=backend)
        self.single = device == "cpu"
        self.content = np.zeros(0, dtype=np.uint8)  # the last value written to each byte
        self.capacities = (0, 0)

    def resize(self, size: int) -> None:
        m = self.memory
        before = (m.head, m.host_capacity, m.device_capacity)
        m.set_size(size)
        assert m.size == size
        assert before == (m.head, m.host_capacity, m.device_capacity)  # set_size is only a number

    def _access(self, side: str, write: bool) -> torch.Tensor:
        name = ("mutable_" if write else "") + f"{side}_data"
        view: torch.Tensor = getattr(self.memory, name)()
        assert view.dtype == torch.uint8 and view.numel() == self.memory.size
        return view

    def write(self, side: str, data: np.ndarray) -> None:
        self.resize(len(data))
        self._access(side, write=True).copy_(torch.from_numpy(data))
        if len(data) >= len(self.content):
            self.content = data.copy()
        else:
            self.content[: len(data)] = data
        at_side = sm.Head.SYNCED if self.single else getattr(sm.Head, f"AT_{side.upper()}")
        assert self.memory.head is at_side

    def write_part(self, side: str, size: int, start: int, data: np.ndarray) -> None:
        """Write ``data`` at ``start`` of a ``size``-byte mutable view; the rest stays."""
        self.resize(size)
        view = self._access(side, write=True)
        start = min(start, size)
        data = data[: size - start]
        # The access wrote the whole view as far as the invariant goes: bytes never written
        # before now hold whatever the view shows, and must read back so from now on.
        if size > len(self.content):
            tail = view[len(self.content) :].cpu().numpy()
            self.content = np.concatenate([self.content, tail])
        view[start : start + len(data)].copy_(torch.from_numpy(data))
        self.content[start : start + len(data)] = data

    def transfer(self, direction: str) -> None:
        """``push_async`` or ``pull_async``: the copy may still run when the next step comes."""
        getattr(self.memory, f"{direction}_async")()

    def read(self, side: str, size: int) -> None:
        self.resize(size)
        m = self.memory
        traffic = m.host_to_device_bytes + m.device_to_host_bytes
        view = self._access(side, write=False).cpu().numpy()
        known = min(size, len(self.content))
        np.testing.assert_array_equal(view[:known], self.content[:known])
        copied = m.host_to_device_bytes + m.device_to_host_bytes - traffic
        assert copied <= known  # a read copies at most the bytes it returns

    def shrink_to_fit(self) -> None:
        before = self.memory.reserved_bytes
        freed = self.memory.shrink_to_fit()
        assert freed == before - self.memory.reserved_bytes >= 0
        self.content = self.content[: self.memory.size].copy()
        self.capacities = (self.memory.host_capacity, self.memory.device_capacity)

    def release(self) -> None:
        before = self.memory.reserved_bytes
        assert self.memory.release() == before
        assert self.memory.head is sm.Head.UNINITIALIZED
        self.content = np.zeros(0, dtype=np.uint8)
        self.capacities = (0, 0)

    def release_side(self, side: str) -> None:
        getattr(self.memory, f"release_{side}")()
        self.capacities = (self.memory.host_capacity, self.memory.device_capacity)

    def check(self) -> None:
        """What holds between any two operations."""
        m = self.memory
        now = (m.host_capacity, m.device_capacity)
        grew = all(n >= c for n, c in zip(now, self.capacities, strict=True))
        assert grew, (now, self.capacities)
        self.capacities = now
        if self.single:
            assert m.host_capacity == m.device_capacity == m.reserved_bytes
        # White-box: what the head promises, checked on the raw blocks without syncing.
        holders = {
            sm.Head.AT_HOST: [m._host],
            sm.Head.AT_DEVICE: [m._device],
            sm.Head.SYNCED: [m._host, m._device],
            sm.Head.UNINITIALIZED: [],
        }[m.head]
        written = len(self.content)
        assert written == 0 or holders, (m.head, written)
        for side in holders if written else []:
            assert side.block is not None
            if side.fence is not None:
                continue  # a copy into it may still run; the next access waits for it
            np.testing.assert_array_equal(side.block.tensor[:written].cpu().numpy(), self.content)


# ---- hypothesis ------------------------------------------------------------------------------

# Sizes around page boundaries find the off-by-one mistakes.
SIZES = st.one_of(
    st.integers(0, 64), st.sampled_from([4095, 4096, 4097, 8192, 12_289]), st.integers(0, 20_000)
)
# Fractions of the written extent make shrink-then-grow-back common: that is where a side
# synced at a small size could leak its stale tail.
FRACTIONS = st.sampled_from([0.0, 0.25, 0.5, 1.0, 1.5])


def machine_for(device: str, backend: str) -> type[RuleBasedStateMachine]:
    class SyncedMemoryMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.checker = Checker(device, backend)

        def _size(self, absolute: int, fraction: float | None) -> int:
            if fraction is None:
                return absolute
            return int(len(self.checker.content) * fraction)

        @rule(size=SIZES)
        def set_size(self, size: int) -> None:
            self.checker.resize(size)

        @rule(
            side=st.sampled_from(SIDES),
            size=SIZES,
            fraction=st.none() | FRACTIONS,
            seed=st.integers(0, 2**32 - 1),
        )
        def write(self, side: str, size: int, fraction: float | None, seed: int) -> None:
            n = self._size(size, fraction)
            self.checker.write(side, np.random.default_rng(seed).integers(0, 256, n, np.uint8))

        @rule(
            side=st.sampled_from(SIDES),
            size=SIZES,
            fraction=st.none() | FRACTIONS,
            start=st.integers(0, 20_000),
            length=st.integers(0, 4097),
            seed=st.integers(0, 2**32 - 1),
        )
        def write_part(
            self, side: str, size: int, fraction: float | None, start: int, length: int, seed: int
        ) -> None:
            data = np.random.default_rng(seed).integers(0, 256, length, np.uint8)
            self.checker.write_part(side, self._size(size, fraction), start, data)

        @rule(side=st.sampled_from(SIDES), size=SIZES, fraction=st.none() | FRACTIONS)
        def read(self, side: str, size: int, fraction: float | None) -> None:
            self.checker.read(side, self._size(size, fraction))

        @rule(direction=st.sampled_from(("push", "pull")))
        def transfer(self, direction: str) -> None:
            self.checker.transfer(direction)

        @rule()
        def shrink_to_fit(self) -> None:
            self.checker.shrink_to_fit()

        @rule()
        def release(self) -> None:
            self.checker.release()

        @rule(side=st.sampled_from(SIDES))
        def release_side(self, side: str) -> None:
            self.checker.release_side(side)

        @invariant()
        def holds(self) -> None:
            self.checker.check()

    SyncedMemoryMachine.__name__ = f"SyncedMemoryMachine[{device}-{backend}]"
    return SyncedMemoryMachine


@pytest.mark.parametrize("placement", ALL_PLACEMENTS)
def test_invariant_holds_under_any_sequence(placement: tuple[str, str]) -> None:
    run_state_machine_as_test(
        machine_for(*placement),
        settings=settings(stateful_step_count=40, max_examples=STATEFUL_EXAMPLES),
    )


# ---- seeded random walk -------------------------------------------------------------------


def random_walk(checker: Checker, rng: np.random.Generator, steps: int, log: list[str]) -> None:
    """Drive ``checker`` through ``steps`` random operations, appending each to ``log``."""

    def pick_size() -> int:
        written = len(checker.content)
        if written and rng.random() < 0.6:
            return int(written * rng.choice([0.0, 0.1, 0.5, 0.9, 1.0, 1.3]))
        return int(rng.choice([rng.integers(0, 64), rng.integers(0, 3 * 4096 + 2)]))

    for _ in range(steps):
        op = rng.choice(
            ["write", "write_part", "read", "transfer", "shrink", "release", "release_side"],
            p=[0.25, 0.1, 0.4, 0.08, 0.07, 0.03, 0.07],
        )
        side = str(rng.choice(SIDES))
        if op == "write":
            size = pick_size()
            log.append(f"write {side} {size}")
            checker.write(side, rng.integers(0, 256, size, dtype=np.uint8))
        elif op == "write_part":
            size, start = pick_size(), pick_size()
            data = rng.integers(0, 256, int(rng.integers(0, 4097)), dtype=np.uint8)
            log.append(f"write {side} [{start}:{start + len(data)}] of {size}")
            checker.write_part(side, size, start, data)
        elif op == "transfer":
            direction = str(rng.choice(["push", "pull"]))
            log.append(f"{direction}_async")
            checker.transfer(direction)
        elif op == "read":
            size = pick_size()
            log.append(f"read {side} {size}")
            checker.read(side, size)
        elif op == "shrink":
            log.append("shrink_to_fit")
            checker.shrink_to_fit()
        elif op == "release":
            log.append("release")
            checker.release()
        else:
            log.append(f"release_{side}")
            checker.release_side(side)
        checker.check()


@pytest.mark.parametrize("placement", ALL_PLACEMENTS)
def test_invariant_holds_on_a_long_random_walk(placement: tuple[str, str], seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(20):  # fresh memories now and then: early states are the interesting ones
        log: list[str] = []
        try:
            random_walk(Checker(*placement), rng, 150, log)
        except AssertionError as failure:
            steps = "\n  ".join(log[-12:])
            raise AssertionError(f"seed {seed}, after operations:\n  {steps}") from failure
