"""The pool layer: named buffers (``pool``), the adaptors that account and limit what the
backends do (``adaptors``), and the figures a pool keeps about itself: the ledger of reserved
bytes and traffic (``ledger``), per-phase totals (``phases``), the sampled timeline
(``timeline``), and the table a person reads (``report``, ``figures``).
"""

from __future__ import annotations

from .pool import BufferPool

__all__ = ["BufferPool"]
