"""``python -m zpipe COMMAND``: every zpipe command (see :mod:`zpipe.cli`)."""

from __future__ import annotations

import sys

from zpipe.cli import main

if __name__ == "__main__":
    sys.exit(main())
