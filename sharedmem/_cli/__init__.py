"""The command line, ``python -m sharedmem <command>``: ``main`` (argument parsing and exit
codes), ``demo`` (the main job), ``stress`` (the stress runner's options), ``bench`` (the
benchmark suite of a source checkout).
"""

from __future__ import annotations

from .main import main

__all__ = ["main"]
