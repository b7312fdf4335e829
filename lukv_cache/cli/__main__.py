"""``python -m lukv_cache.cli``: the ``lukv`` command."""

from __future__ import annotations

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
