"""The stress runner (``python -m sharedmem stress``): random operations over a pool, checked
byte for byte against a reference model of the invariant (DESIGN §3), with fault injection,
threads, and shrinking of any failure to the shortest sequence that still fails.

Modules: ``_model`` (the numpy model), ``_ops`` (operations as records), ``_gen`` (drawing
them), ``_exec`` (running them on pool and model, checking each), ``_judge`` (whether an error
an operation raised was the right one), ``_checks`` (white-box checks of sizes, blocks and
ledger, the final read-back), ``_shrink`` (delta debugging), ``_config`` (what a run does and
found), ``_rounds`` (replaying and recording a failure), ``_threads`` (workers sharing a pool),
``_runner`` (rounds on one thread, the output).
"""

from __future__ import annotations

from ._config import Failure, StressConfig, StressResult
from ._runner import run_stress

__all__ = ["Failure", "StressConfig", "StressResult", "run_stress"]
