"""Tools for testing code that uses sharedmem: fault injection into a pool's backends.

``FaultInjector`` is an adaptor (``BufferPool(adaptors=[faults])``) that fails chosen
allocations, growths, shrinks or copies, so that a user can check that their own code survives
an out-of-memory error with nothing lost, as the stress runner does.
"""

from __future__ import annotations

from ._stress._faults import FaultInjector

__all__ = ["FaultInjector"]
