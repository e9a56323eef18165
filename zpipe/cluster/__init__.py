"""Clusters on one machine: every process of a pipeline started for you.

- :mod:`zpipe.cluster.local`: :class:`LocalCluster` (and its asyncio twin), a
  coordinator and stage processes on loopback, each able to emulate a slower
  device and a slower link; what the demo, the tests and the embedded API use.
- :mod:`zpipe.cluster.forked`: stage processes forked from this one (what
  ``LocalCluster(fork_stages=True)`` starts), for clusters of tens of stages.
- :mod:`zpipe.cluster.netlab`: network namespaces joined by veth pairs to a
  bridge, each uplink capped with ``tc tbf``, links cut and restored (real kernel
  links; needs root, ``ip`` and ``tc``); :mod:`zpipe.cluster.netlayout` lays
  hosts out on it, and :mod:`zpipe.cluster.netcluster` runs a
  :class:`LocalCluster`'s coordinator and stages each in a namespace of such a lab.
"""

from __future__ import annotations

from zpipe.cluster.local import AsyncLocalCluster, DeviceSpec, LocalCluster, StageProcess

__all__ = ["AsyncLocalCluster", "DeviceSpec", "LocalCluster", "StageProcess"]
