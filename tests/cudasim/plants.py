"""Bugs planted in the CUDA backends, to prove that the tests on the stand-in catch them.

Each plant rewrites one line of one function's source (which must occur exactly once, so a
plant cannot silently stop applying when the code changes) and swaps the function in. As a
pytest plugin (``-p cudasim.plants``) it plants ``$CUDASIM_PLANT`` before the tests run.
``test_every_planted_bug_fails_a_cuda_test`` runs each plant's tests with it and fails when one
survives.
"""

from __future__ import annotations

import importlib
import inspect
import os
import textwrap
from collections.abc import Callable
from typing import Any, NamedTuple


class Plant(NamedTuple):
    module: str  # where the function is
    owner: str  # the class that holds it ("" for a module-level function)
    function: str
    old: str  # the correct line (a substring of it)
    new: str  # the bug
    catches: str  # the tests (a pytest -k expression) that must fail with it
    where: str = "tests/test_cuda.py"  # the file those tests are in


class _Blind:
    """The fence of a planted current-stream copy: it waits for nothing on one side."""

    def __init__(self, fence: Any, side: str) -> None:
        self.fence, self.side = fence, side

    def wait_host(self) -> None:
        if self.side != "host":
            self.fence.wait_host()

    def wait_device(self) -> None:
        if self.side != "device":
            self.fence.wait_device()


def blind(fence: Any, side: str) -> _Blind:
    return _Blind(fence, side)


_FENCE = "return EventFence(event, self.index)"
_BLIND = '__import__("cudasim.plants").plants.blind(EventFence(event, self.index), "{}")'


PLANTS = {
    # Pages mapped but never given access: the first touch is an illegal address.
    "map-without-access": Plant(
        "sharedmem._backends.cuda_vmm",
        "_Reservation",
        "map",
        "grant = driver.cuMemSetAccess(start, size, self.access, len(self.access))",
        "grant = (driver.CUresult.CUDA_SUCCESS,)",
        "test_vmm_growth_keeps_the_address_and_copies_nothing",
    ),
    # Unmapping from the front while handles are popped from the back: the kept part of a
    # shrunk buffer is unmapped, and chunks beyond it stay mapped.
    "unmap-in-the-wrong-order": Plant(
        "sharedmem._backends.cuda_vmm",
        "_Reservation",
        "unmap",
        "at = self.address + (len(self.handles) - 1) * self.chunk",
        "at = self.address + (len(self.handles) - 1 - keep) * self.chunk",
        "test_vmm_shrink_unmaps_and_release_waits_for_the_last_view",
    ),
    # One chunk too few mapped for a growth.
    "off-by-one-chunk-count": Plant(
        "sharedmem._backends.cuda_vmm",
        "_Reservation",
        "map",
        "first, last = len(self.handles), -(-nbytes // self.chunk)",
        "first, last = len(self.handles), -(-nbytes // self.chunk) - 1",
        "test_vmm_growth_keeps_the_address_and_copies_nothing",
    ),
    # The host reads the pulled bytes without waiting for the copy's event.
    "missed-event-wait": Plant(
        "sharedmem._backends.cuda_streams",
        "EventFence",
        "wait_host",
        "self._event.synchronize()",
        "pass",
        "test_async_copies_on_a_side_stream_wait_for_the_producer and vmm",
    ),
    # Device work is not ordered after a push: it reads the bytes from before.
    "missed-device-wait": Plant(
        "sharedmem._backends.cuda_streams",
        "EventFence",
        "wait_device",
        "ops().current_stream(self._index).wait_event(self._event)",
        "pass",
        "test_async_copies_on_a_side_stream_wait_for_the_producer and torch",
    ),
    # A copy on the current stream whose fence waits for nothing on the host: the host reads
    # (or overwrites) pinned bytes before the copy has landed (or read them).
    "current-copy-no-host-wait": Plant(
        "sharedmem._backends.cuda_streams",
        "CudaBackend",
        "_copy",
        _FENCE,
        f"{_FENCE} if chosen != current else {_BLIND.format('host')}",
        "test_current_stream_copies_are_waited_for",
        "tests/test_cuda_streams.py",
    ),
    # The same on the device side: a device view is handed out before the upload has run.
    "current-copy-no-device-wait": Plant(
        "sharedmem._backends.cuda_streams",
        "CudaBackend",
        "_copy",
        _FENCE,
        f"{_FENCE} if chosen != current else {_BLIND.format('device')}",
        "test_current_stream_copies_are_waited_for",
        "tests/test_cuda_streams.py",
    ),
    # Unmapping waits for another device's work only: work of the memory's own device still
    # queued over the pages touches an unmapped address.
    "free-waits-for-another-device": Plant(
        "sharedmem._backends.cuda_vmm",
        "_Reservation",
        "unmap",
        'check(driver.cuCtxSynchronize(), "cuCtxSynchronize")',
        "ops().synchronize((self.index + 1) % ops().device_count())",
        "test_giving_memory_back_waits_for_work_of_its_own_device",
        "tests/test_cuda_streams.py",
    ),
    # Unpinning waits for the memory's own device only: a copy of another device still
    # reading the (portable) pinned pages meets unregistered memory.
    "unpin-waits-for-its-own-device-only": Plant(
        "sharedmem._backends.cuda_pinned",
        "_Pins",
        "unpin",
        "ops().synchronize(device)",
        "ops().synchronize(self.index)",
        "test_unpinning_waits_for_a_copy_of_any_device",
        "tests/test_cuda_streams.py",
    ),
    # Access granted to the owning device only: a peer's copy faults.
    "missing-peer-grant": Plant(
        "sharedmem._backends.cuda_vmm",
        "VmmBackend",
        "__init__",
        "self.access = [access_desc(each) for each in accessors(index)]",
        "self.access = [access_desc(index)]",
        "test_vmm_memory_is_granted_to_the_peers_that_can_reach_it",
        "tests/test_cuda_streams.py",
    ),
    # An upload's host source is not fenced: a host write before the copy ran changes what
    # it carries.
    "source-overwritten-before-copy": Plant(
        "sharedmem._synced",
        "SyncedMemory",
        "upload_async",
        "self._host.fence = fence  # the copy reads the host bytes",
        "pass",
        "test_a_source_is_not_overwritten_before_its_copy_ran",
        "tests/test_cuda_streams.py",
    ),
}


def plant(name: str) -> Callable[[], None]:
    """Plant the bug ``name``; returns the function that takes it out again."""
    spec = PLANTS[name]
    module = importlib.import_module(spec.module)
    owner: Any = getattr(module, spec.owner) if spec.owner else module
    original = inspect.unwrap(getattr(owner, spec.function))
    source = textwrap.dedent(inspect.getsource(original))
    count = source.count(spec.old)
    if count != 1:
        raise AssertionError(f"cudasim: plant {name!r} finds its line {count} times, not once")
    namespace: dict[str, Any] = {}
    code = compile(source.replace(spec.old, spec.new), inspect.getfile(original), "exec")
    exec(code, vars(module), namespace)
    setattr(owner, spec.function, namespace[spec.function])
    return lambda: setattr(owner, spec.function, original)


def pytest_configure(config: Any) -> None:
    name = os.environ.get("CUDASIM_PLANT")
    if name:
        plant(name)
