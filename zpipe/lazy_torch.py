"""Import, up front, what torch would import on a compute thread in the middle of a run.

torch imports ``torch._dynamo`` (and with it sympy, mpmath and several hundred
other modules) lazily, the first time a function wrapped by its internal
``_disable_dynamo`` runs: an optimizer's first ``step``, a forward under a
dispatch mode such as the stage's memory profiler. That import is seconds of
pure Python work, holding the GIL; on a stage's compute thread it starves the
event loop that answers heartbeats. On a loaded machine (two cores, fifteen busy
processes) a live stage then went silent for 2-3 s at its first profile or
training step, long enough for a stall probe to find it "dead".

A process that will run torch work beside an event loop calls
:func:`import_lazy_torch_modules` before it starts the loop and registers, when
nobody is judging its silence yet; the coordinator imports
:data:`COORDINATOR_LAZY_MODULES`, what its planners import on first use, with torch
and its run kinds at its first run request (zpipe/coordinator/run_kinds.py).
"""

from __future__ import annotations

import importlib

# What torch imports on first use rather than at ``import torch``.
LAZY_TORCH_MODULES = ("torch._dynamo",)

# What the coordinator would import on first use once it serves: numpy's masked
# arrays, which ``np.unique`` imports the first time the PipeEdge planner prunes
# its states (95 ms of imports under load). The planner runs on a thread, but an
# import there holds the GIL in turns with the loop for as long (a thread that
# imported torch itself stalled an asyncio loop for 0.3-4 s). They, torch and the
# run kinds are imported on the loop at the first run request; nothing else is
# imported after that in a training or an inference run (tests/cluster/test_lazy_torch.py).
COORDINATOR_LAZY_MODULES = ("numpy.ma",)


def import_lazy_torch_modules() -> None:
    for name in LAZY_TORCH_MODULES:
        importlib.import_module(name)
