"""``python -m zpipe.stage``: a thin forward to ``python -m zpipe stage``.

The command is :mod:`zpipe.cli.stage`; it runs by its module name, as a spawned
``python -m`` would, so this package never imports the command layer above it.
"""

from __future__ import annotations

import runpy

if __name__ == "__main__":
    runpy.run_module("zpipe.cli.stage", run_name="__main__", alter_sys=True)
