"""``python -m sharedmem``: see ``sharedmem._cli``."""

from ._cli import main

raise SystemExit(main())
