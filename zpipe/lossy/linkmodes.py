"""How a lossy run's receivers wait for partials: a choice a user makes, kept apart
from :mod:`zpipe.lossy.wire` so that command lines can offer it without importing
torch (the codec's tensors).

- ``emulated``: a receiver computes the sender's seeded drop decisions, so it stops
  waiting once every partial that can come has (at most ``wait_s``);
- ``deadline``: it waits for every partial until the end of the timeslot the
  partials were sent in (see :mod:`zpipe.stage.executors.lossy_passes`).
"""

from __future__ import annotations

from typing import Literal

WaitMode = Literal["emulated", "deadline"]
WAIT_MODES: tuple[WaitMode, ...] = ("emulated", "deadline")
