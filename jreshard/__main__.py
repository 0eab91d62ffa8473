"""``python -m jreshard``: see :mod:`jreshard.cli`."""

from jreshard.cli import main

raise SystemExit(main())
