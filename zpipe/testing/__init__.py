"""Fakes for tests and benchmarks, in the spirit of trio's ``testing`` package.

- :mod:`zpipe.testing.fake_peers`: hundreds of heartbeat-only stages in one asyncio
  process, for a coordinator at scale.

Clusters of real processes (local, forked, in network namespaces) live in
:mod:`zpipe.cluster`.
"""

from __future__ import annotations
