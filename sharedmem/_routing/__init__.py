"""The routing allocator: a step's allocations served from one arena of a pool.

``router.cpp`` (compiled at first use, ``native``) replaces c10's CPU allocator and, inside a
step's scope on the calling thread only, hands the n-th allocation the address its plan
chose; everywhere else PyTorch's own allocator serves as usual. ``cuda_router.cpp``
(``cuda_native``, installed on request by ``install_cuda_router``) does the same for CUDA as
PyTorch's pluggable allocator, with scopes by stream; ``route_core.h`` is what both share.
``plan`` places a recorded sequence at offsets of one arena; ``route`` records, plans and
replays one signature. Routing imports nothing of the pool: ``host`` says what it needs of
the object that owns the arenas (``ArenaHost``), and ``Arenas`` is the routing state that
object creates and keeps.
"""

from __future__ import annotations

from .cuda_native import cuda_router, install_cuda_router
from .host import ArenaHost, Arenas, lane_name
from .native import loaded, native, routing_enabled
from .plan import Recording, RoutePlan, choose_plan, plan_offsets
from .route import COUNTERS, CallPeak, Route, arena_live_bytes, routes_on

__all__ = [
    "COUNTERS",
    "ArenaHost",
    "Arenas",
    "CallPeak",
    "Recording",
    "Route",
    "RoutePlan",
    "arena_live_bytes",
    "choose_plan",
    "cuda_router",
    "install_cuda_router",
    "lane_name",
    "loaded",
    "native",
    "plan_offsets",
    "routes_on",
    "routing_enabled",
]
