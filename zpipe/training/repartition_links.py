"""Eq. 5's communication term for a live re-partition: boundary sizes and link speeds.

Pure: a profile and a cluster in, the two lists
:func:`zpipe.planner.ftpipehd.ftpipehd_partition` takes out.

- ``D_j`` (eq. 6): what unit ``j`` sends on for one micro-batch, its profiled
  output at the run's micro-batch size (the size the stages' counters time, so
  the link term and the compute term are per the same batch). The gradient that
  comes back across the same boundary is as large, as the training planners
  count it (:meth:`zpipe.planner.training_cost.TrainingCosts.transfer_s`).
- ``B_{i,i+1}``: eq. 5 charges ``2 * D_j / B`` for the activation forward and
  its gradient back; a link is measured in each direction (the coordinator's
  probes, :mod:`zpipe.coordinator.links`), so ``B`` here is the one bandwidth
  that makes ``2 * D / B`` equal ``D / B_forward + D / B_backward`` (their
  harmonic mean); equal directions give the paper's eq. 6 unchanged. A pair the
  probes did not measure is costed as the planners cost it (the sender's
  declared uplink, :meth:`zpipe.planner.cluster.ClusterSpec.bandwidth_bps`); an
  unlimited one is ``math.inf`` (eq. 6 gives 0).

Bandwidths here are in bytes per second (the unit of ``output_bytes``); the
cluster's are in bits per second.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import pairwise

from zpipe._errors import ConfigError
from zpipe.planner.cluster import ClusterSpec
from zpipe.planner.profile import ModelProfile


def boundary_bytes(profile: ModelProfile, microbatch_size: int) -> list[float]:
    """``D_j`` for every unit: its output for one micro-batch, in bytes (ConfigError
    when the profile did not measure that batch size)."""
    return [float(b) for b in profile.output_bytes(microbatch_size)]


def link_bandwidths(devices: Sequence[str], cluster: ClusterSpec) -> list[float]:
    """``B_{i,i+1}`` in bytes per second for each pair of consecutive ``devices`` (in
    stage order): both directions' bandwidths combined so that eq. 5's ``2 * D / B``
    is the activation's time forward plus its gradient's back."""
    out = []
    for a, b in pairwise(devices):
        forward, backward = cluster.bandwidth_bps(a, b), cluster.bandwidth_bps(b, a)
        for bps in (forward, backward):
            if not bps > 0:  # the cluster checks its links; this guards a hand-made one
                raise ConfigError(f"the link between {a!r} and {b!r} has bandwidth {bps!r}")
        seconds_per_bit = (1.0 / forward + 1.0 / backward) / 2.0
        out.append(math.inf if seconds_per_bit == 0 else 1.0 / seconds_per_bit / 8.0)
    return out
