"""Bugs planted in the CUDA backends, to prove that the tests on the stand-in catch them.

Each plant rewrites one line of one function's source (which must occur exactly once, so a
plant cannot silently stop applying when the code changes) and swaps the function in. As a
pytest plugin (``-p cudasim.plants``) it plants ``$CUDASIM_PLANT`` before the tests run.
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


PLANTS = {
    # Pages mapped but never given access: the first touch is an illegal address.
    "map-without-access": Plant(
        "sharedmem._backends.cuda_vmm",
        "_Reservation",
        "map",
        'check(driver.cuMemSetAccess(start, size, [self.access], 1), "cuMemSetAccess")',
        "pass",
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
