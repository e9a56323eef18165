"""Test and benchmark harnesses that need more than one process to mean anything.

- :mod:`zpipe.testing.netlab`: network namespaces joined by veth pairs to a bridge,
  each uplink capped with ``tc tbf``, links cut and restored (real kernel links;
  needs root, ``ip`` and ``tc``).
- :mod:`zpipe.testing.netcluster`: a :class:`~zpipe.cluster.LocalCluster` whose
  coordinator and stages each run in a namespace of such a lab.
- :mod:`zpipe.testing.forked_stages`: stage processes forked from this one (what
  ``LocalCluster(fork_stages=True)`` starts), for clusters of tens of stages.
- :mod:`zpipe.testing.fake_peers`: hundreds of heartbeat-only stages in one asyncio
  process, for a coordinator at scale.
"""

from __future__ import annotations
