"""``python -m arena_loader.bench``: the same as ``arena-loader bench``."""

from .cli import main

raise SystemExit(main())
