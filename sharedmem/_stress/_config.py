"""What a stress run does (``StressConfig``) and what it found (``StressResult``, ``Failure``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .._backends import Backend
from .._pool import BufferPool

__all__ = ["Failure", "StressConfig", "StressResult"]


@dataclass(frozen=True)
class StressConfig:
    """What a stress run does. ``seconds`` and ``ops`` both bound it (default: 10 seconds).

    Attributes:
        device: the pool's device.
        backend: one backend of the device, or ``None`` for each in turn, round by round.
        seconds, ops: stop after this long, or after this many operations.
        seed: everything random follows from it.
        threads: workers sharing each round's pool.
        buffers: private buffers per worker (with threads, half as many more are shared).
        max_bytes: the largest buffer.
        limit: the pool's cap on reserved device bytes.
        faults: the chance that an operation runs with an injected fault armed.
        round_ops: operations per round (a fresh pool each round).
        check_every: operations between whole-pool checks.
        shrink_seconds: time allowed for shrinking a failure.
        self_check: break the pool on purpose (``CorruptingBackend``): the run must fail.
        adaptors: extra backend adaptors (the tests' deliberately broken backends).
    """

    device: str = "emulated"
    backend: str | None = None
    seconds: float | None = None
    ops: int | None = None
    seed: int = 0
    threads: int = 1
    buffers: int = 8
    max_bytes: int = 64 << 10
    limit: int | None = None
    faults: float = 0.0
    round_ops: int = 2000
    check_every: int = 256
    shrink_seconds: float = 60.0
    self_check: bool = False
    adaptors: tuple[Callable[[Backend], Backend], ...] = ()

    def command(self, ops: int | None = None) -> str:
        """The command line that runs this configuration (for ``ops`` operations)."""
        parts = ["python -m sharedmem stress", f"--device {self.device}", f"--seed {self.seed}"]
        if ops is not None:
            parts.append(f"--ops {ops}")
        if self.backend is not None:
            parts.append(f"--backend {self.backend}")
        defaults = StressConfig()
        for flag, value, default in (
            ("--threads", self.threads, defaults.threads),
            ("--buffers", self.buffers, defaults.buffers),
            ("--max-bytes", self.max_bytes, defaults.max_bytes),
            ("--limit", self.limit, defaults.limit),
            ("--faults", self.faults, defaults.faults),
        ):
            if value != default:
                parts.append(f"{flag} {value}")
        if self.self_check:
            parts.append("--self-check")
        return " ".join(parts)


@dataclass
class Failure:
    """Where a run failed, and the shortest operation sequence that still fails."""

    op_number: int  # 1-based over the whole run
    during: bool  # the operation failed; False: a check after it did
    round: int
    backend: str
    category: str
    message: str
    original: int  # operations of the failing round up to the failure
    shrunk: list[str] = field(default_factory=list)  # described, one per line
    shrunk_message: str = ""
    replays: int = 0
    reproduced: bool = True

    @property
    def where(self) -> str:
        return f"{'at' if self.during else 'in the check after'} op {self.op_number:,}"


@dataclass
class StressResult:
    ops: int = 0  # verified operations
    mismatches: int = 0
    faults: int = 0  # injected failures that surfaced as they should
    refusals: int = 0  # growths the limit refused
    rounds: int = 0
    seconds: float = 0.0
    failure: Failure | None = None
    pool: BufferPool | None = None
    interrupted: bool = False  # stopped by Ctrl-C: the figures are those verified until then

    @property
    def per_minute(self) -> float:
        return self.ops / self.seconds * 60 if self.seconds else 0.0
