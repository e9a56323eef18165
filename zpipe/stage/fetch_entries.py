"""What a unit fetch's optional fields mean at either end (:mod:`zpipe.stage.snapshots`).

- ``restart`` (an asynchronous run's fast recovery): the fetched units are put at
  that weight version (:func:`restarted_units`);
- ``wait_s`` (a live move's fetch, sent while its holder may still drain): how long
  the holder waits for its own snapshot before it answers that it holds none
  (:func:`holder_wait_s`), within the holder's own deadline.
"""

from __future__ import annotations

import math

import torch

from zpipe._errors import ProtocolError
from zpipe.training.async_fast_state import restart_state_at


def holder_wait_s(asked: float | None, most_s: float) -> float:
    """How long a holder waits for a snapshot it is still to keep: what the requester
    asked (``wait_s``), within ``most_s`` (the holder's result timeout, which its own
    flush waits no longer than); a missing, negative or non-finite value: not at all."""
    if asked is None or not math.isfinite(asked) or asked <= 0:
        return 0.0
    return min(float(asked), most_s)


def restarted_units(units: dict[str, torch.Tensor], restart: object) -> dict[str, torch.Tensor]:
    """``units`` at the weight version a fast recovery's fetch entry names (``restart``:
    ``{"version", "depth"}``), or as they are without one."""
    if restart is None:
        return units
    if not isinstance(restart, dict):
        raise ProtocolError("a fetch entry's restart must be a map")
    try:
        version, depth = int(restart["version"]), int(restart["depth"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"a malformed restart in a fetch entry: {exc!r}") from None
    return restart_state_at(units, version=version, depth=depth)
