"""``python -m zpipe.lossy``: the lossy-link experiment (``python -m zpipe lossy``)."""

from __future__ import annotations

import sys

from zpipe.lossy.experiment import main

if __name__ == "__main__":
    sys.exit(main())
