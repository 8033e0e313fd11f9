"""The names of activation offload's pool buffers: which ones live saved tensors lease."""

from __future__ import annotations

import threading
import weakref

from .._pool import BufferPool
from .._synced import SyncedMemory

__all__ = ["Names", "names_of"]

# Per pool, the buffer numbers leased by live saved tensors, shared by every save_on_pool on
# that pool, so that two graphs alive at once never share a buffer.
_names: weakref.WeakKeyDictionary[BufferPool, dict[str, Names]] = weakref.WeakKeyDictionary()
_names_lock = threading.Lock()


def names_of(pool: BufferPool, prefix: str) -> Names:
    """The one ``Names`` of ``pool`` for buffers called ``<prefix>.<n>``."""
    with _names_lock:
        per_pool = _names.setdefault(pool, {})
        return per_pool.setdefault(prefix, Names(prefix))


class Names:
    """Which buffers ``<prefix>.<n>`` of a pool are leased by live saved tensors."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._busy: set[tuple[int, int]] = set()
        self.memories: dict[str, SyncedMemory] = {}  # name -> its memory, once looked up
        # Re-entrant: a collection inside lease() may drop another step's graph, whose
        # handles give their names back from the same thread.
        self._lock = threading.RLock()

    def lease(self, number: int) -> tuple[str, tuple[int, int]]:
        """The buffer for the step's tensor ``number``: ``<prefix>.<number>``, or when a graph
        still alive holds that one, ``<prefix>.<number>.<k>``. Either way a buffer is used for
        the same place in the step every time, so it meets the same sizes and stops growing.

        Returns the name and the key to give back to ``release``.
        """
        with self._lock:
            key = (number, 0)
            while key in self._busy:
                key = (number, key[1] + 1)
            self._busy.add(key)
        suffix = "" if key[1] == 0 else f".{key[1]}"
        return f"{self.prefix}.{number}{suffix}", key

    def release(self, key: tuple[int, int]) -> None:
        with self._lock:
            self._busy.discard(key)
