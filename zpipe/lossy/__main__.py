"""``python -m zpipe.lossy``: a thin forward to ``python -m zpipe lossy``.

The command is :mod:`zpipe.cli.lossy`; it runs by its module name, as a spawned
``python -m`` would, so this package never imports the command layer above it.
"""

from __future__ import annotations

import runpy

if __name__ == "__main__":
    runpy.run_module("zpipe.cli.lossy", run_name="__main__", alter_sys=True)
