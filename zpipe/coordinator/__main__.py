"""``python -m zpipe.coordinator``: a thin forward to ``python -m zpipe coordinator``.

The command is :mod:`zpipe.cli.coordinator`; it runs by its module name, as a spawned
``python -m`` would, so this package never imports the command layer above it.
"""

from __future__ import annotations

import runpy

if __name__ == "__main__":
    runpy.run_module("zpipe.cli.coordinator", run_name="__main__", alter_sys=True)
