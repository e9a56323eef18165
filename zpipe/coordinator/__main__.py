"""``python -m zpipe.coordinator``: a thin forward to ``python -m zpipe coordinator``.

The command is :mod:`zpipe.cli.coordinator`; it runs by its module name, as a spawned
``python -m`` would, so this package never imports the command layer above it.
"""

from __future__ import annotations

import gc
import runpy

if __name__ == "__main__":
    # No collections while the command's imports run: they build some 200,000 objects
    # that live as long as the process, and the collector walked them again and again
    # (10-12 % of the start-up's CPU, before anyone can register). The command
    # collects once, freezes what is left and turns the collector back on before it
    # listens (zpipe.cli.coordinator.main).
    gc.disable()
    runpy.run_module("zpipe.cli.coordinator", run_name="__main__", alter_sys=True)
