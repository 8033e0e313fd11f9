"""The pool's report: a table a person reads, biggest buffers first, totals last."""

from __future__ import annotations

from collections.abc import Mapping

from .._blob import Blob
from .._synced import SyncedMemory
from .ledger import COUNTERS

__all__ = [
    "CORE_KEYS",
    "biggest_buffers",
    "figure_label",
    "figure_text",
    "format_report",
    "human_bytes",
    "is_bytes",
]

# The keys every pool has; any other counter in stats() is a layer's, shown when not zero.
CORE_KEYS = frozenset(
    {
        "num_buffers",
        "reserved_bytes",
        "device_reserved_bytes",
        "host_reserved_bytes",
        "active_bytes",
        "peak_reserved_bytes",
        "high_water_bytes",
        *COUNTERS,
    }
)


# How the report names the pool's own figures; a layer's counters are named by their key.
_LABELS = {
    "reserved_bytes": "reserved",
    "host_reserved_bytes": "host",
    "device_reserved_bytes": "device",
    "peak_reserved_bytes": "peak",
    "active_bytes": "active",
    "num_grows": "grows",
    "grow_copy_bytes": "copied",
    "host_to_device_bytes": "host->device",
    "device_to_host_bytes": "device->host",
}


def is_bytes(key: str) -> bool:
    """Whether the figure ``key`` of ``stats()`` is bytes, rather than a count.

    A figure's unit is written once, in its name: one with the word ``bytes`` counts bytes
    (``reserved_bytes``, ``arena_served_bytes``, ``offloaded_bytes_total``), any other counts
    events (``num_buffers``, ``num_grows``, ``recorded_calls``). Layers name their counters
    so too.

    >>> is_bytes("unpooled_bytes_per_call"), is_bytes("replayed_calls")
    (True, False)
    """
    return "bytes" in key.split("_")


def figure_label(key: str) -> str:
    """The words the report puts before the figure ``key``: ``'recorded calls'``."""
    return _LABELS.get(key) or " ".join(word for word in key.split("_") if word != "bytes")


def figure_text(key: str, value: int) -> str:
    """The figure ``key`` as the report shows it, with its unit: ``'arena served 960
    bytes'``, ``'recorded calls 2'``."""
    return f"{figure_label(key)} {value:,}" + (" bytes" if is_bytes(key) else "")


def human_bytes(n: int) -> str:
    """``1536`` -> ``'1.5 KiB'``; exact counts go in ``{:,}`` elsewhere."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _rows(blobs: Mapping[str, Blob]) -> list[tuple[str, Blob, SyncedMemory]]:
    rows = []
    # A snapshot: other threads may add names while a report (or an error message) is made.
    for name, blob in list(blobs.items()):
        rows.append((name, blob, blob.data_memory))
        if blob.grad_memory.reserved_bytes:  # gradients show only where they hold memory
            rows.append((f"{name}.grad", blob, blob.grad_memory))
    return sorted(rows, key=lambda row: (-row[2].reserved_bytes, row[0]))


def biggest_buffers(blobs: Mapping[str, Blob], count: int = 3) -> str:
    """The ``count`` buffers holding the most device bytes, the side a pool's limit caps, as
    ``'a' 1,024 bytes, 'b' ...`` (or ``none``): the ones worth trimming when a growth fails."""
    rows = sorted(
        (row for row in _rows(blobs) if row[2].device_capacity),
        key=lambda row: (-row[2].device_capacity, row[0]),
    )[:count]
    if not rows:
        return "none"
    return ", ".join(f"{name!r} {memory.device_capacity:,} bytes" for name, _, memory in rows)


def format_report(device: str, blobs: Mapping[str, Blob], stats: Mapping[str, int]) -> str:
    """Every buffer (name, shape, dtype, sizes, capacities, head, grows), totals last."""
    header = (
        "name",
        "shape",
        "dtype",
        "size",
        "high-water",
        "host cap",
        "device cap",
        "head",
        "grows",
    )
    table = [header]
    for name, blob, memory in _rows(blobs):
        table.append(
            (
                name,
                "x".join(str(d) for d in blob.shape) or "()",
                str(blob.dtype).removeprefix("torch."),
                f"{memory.size:,}",
                f"{memory.peak_size:,}",  # the largest size any view of it ever had
                f"{memory.host_capacity:,}",
                f"{memory.device_capacity:,}",
                memory.head.name,
                f"{memory.num_grows:,}",
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    numeric = {3, 4, 5, 6, 8}

    def line(row: tuple[str, ...]) -> str:
        cells = (
            cell.rjust(widths[i]) if i in numeric else cell.ljust(widths[i])
            for i, cell in enumerate(row)
        )
        return "  ".join(cells).rstrip()

    rule = "-" * len(line(header))
    rows = len(table) - 1
    title = f"BufferPool on {device}: {len(blobs)} buffer{'' if len(blobs) == 1 else 's'}"
    if rows > len(blobs):
        title += f" ({rows} rows: a gradient holding memory has a row of its own)"
    out = [title, line(header), rule]
    out += [line(row) for row in table[1:]]
    out.append(rule)
    reserved = stats["reserved_bytes"]
    if device == "cpu":  # one memory serves both sides: say so rather than list it twice
        sides = "one memory, host and device alike"
    else:
        sides = ", ".join(
            figure_text(key, stats[key]) for key in ("host_reserved_bytes", "device_reserved_bytes")
        )
    totals = ("peak_reserved_bytes", "active_bytes")
    out.append(
        f"{figure_text('reserved_bytes', reserved)} ({human_bytes(reserved)}: {sides}), "
        + ", ".join(figure_text(key, stats[key]) for key in totals)
    )
    out.append(
        f"{figure_text('num_grows', stats['num_grows'])} "
        f"({figure_text('grow_copy_bytes', stats['grow_copy_bytes'])}), "
        + ", ".join(
            figure_text(key, stats[key]) for key in ("host_to_device_bytes", "device_to_host_bytes")
        )
    )
    extra = [
        figure_text(key, value) for key, value in stats.items() if key not in CORE_KEYS and value
    ]
    if extra:
        out.append(", ".join(extra))
    return "\n".join(out)
