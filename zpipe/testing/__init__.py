"""Test and benchmark harnesses that need more than one process to mean anything.

- :mod:`zpipe.testing.netlab`: network namespaces joined by veth pairs to a bridge,
  each uplink capped with ``tc tbf``, links cut and restored (real kernel links;
  needs root, ``ip`` and ``tc``).
- :mod:`zpipe.testing.netcluster`: a :class:`~zpipe.cluster.LocalCluster` whose
  coordinator and stages each run in a namespace of such a lab.
"""

from __future__ import annotations
