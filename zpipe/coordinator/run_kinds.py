"""What a run needs and membership does not: torch, the run kinds' controllers, the models.

The coordinator's membership path (register, heartbeat, probe, the failure
detectors, persistence of members) imports no torch, so a coordinator listens and
answers its stages within its interpreter's start-up, not after torch's (2-5 s of
imports on two loaded cores, 300 stages waiting). The first run request imports
all of this at once, on the event loop, before the request is handled:

- not on a thread: an import holds the GIL in turns with the loop for its whole
  length (a thread importing torch while the loop answered 300 messages a second
  stalled the loop 270 ms at the 99th percentile, 1.5 s at worst), and the planners
  run on threads, where a first lazy import would do exactly that;
- at a run start, which costs seconds anyway (stages load their units), and which
  the failure detectors discount: a tick of the membership that comes a heartbeat
  interval late forgives every member the coordinator's own pause
  (:meth:`~zpipe.coordinator.membership.Membership.tick`).

After it, nothing is imported on first use in a training or an inference run
(tests/cluster/test_lazy_torch.py). A coordinator restarted with a saved run
imports it before it listens: taking a run over is a run.
"""

from __future__ import annotations

import sys
import time

from zpipe.lazy_torch import COORDINATOR_LAZY_MODULES
from zpipe.log import get_logger
from zpipe.protocol.client_control import RunRequest
from zpipe.protocol.generation import GenRunRequest
from zpipe.protocol.lossy import LossyRunRequest

log = get_logger("zpipe.coordinator")

# the requests that start a run: the first of them imports the run kinds
RUN_REQUESTS = (RunRequest, LossyRunRequest, GenRunRequest)

# Every module a run kind imports at its first use (core.py, jobs.py, decisions.py,
# bulk_budget.py import these inside the functions that need them), and what the
# planners import on their first plan, on a thread (lazy_torch.py).
RUN_KIND_MODULES = (
    *COORDINATOR_LAZY_MODULES,
    "torch",
    "zpipe.models.registry",
    "zpipe.models.weights",
    "zpipe.coordinator.admission",
    "zpipe.coordinator.takeover",
    "zpipe.coordinator.runs.generation",
    "zpipe.coordinator.runs.generation_recovery",
    "zpipe.coordinator.runs.lossy",
    "zpipe.coordinator.runs.lossy_remap",
)


def run_kinds_imported() -> bool:
    return all(name in sys.modules for name in RUN_KIND_MODULES)


def import_run_kinds() -> float:
    """Import every run kind (torch with them); the seconds it took (0 when done before)."""
    if run_kinds_imported():
        return 0.0
    started = time.perf_counter()
    for name in RUN_KIND_MODULES:
        # the import statement's path, not importlib.import_module: -X importtime
        # (the test's witness) reports a module only when imported through it
        __import__(name)
    return time.perf_counter() - started


def import_at_run_request(message: object, members: int) -> bool:
    """Import the run kinds if ``message`` starts a run (logged, with the seconds it
    took, beside the ``members`` whose heartbeats waited); whether they are imported."""
    if not isinstance(message, RUN_REQUESTS):
        return False
    log.info("run_kinds_importing", members=members)
    took_s = import_run_kinds()
    log.info("run_kinds_imported", took_s=round(took_s, 3))
    return True
