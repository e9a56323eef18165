"""Fakes for tests and benchmarks, in the spirit of trio's ``testing`` package.

- :mod:`zpipe.testing.fake_peers`: hundreds of heartbeat-only stages in one asyncio
  process, for a coordinator at scale.
- :mod:`zpipe.testing.tiny_lm`: a tiny causal language model checkpoint (tokenizer
  with a chat template, random-initialised GPT-2 or Llama weights) built in code.

Clusters of real processes (local, forked, in network namespaces) live in
:mod:`zpipe.cluster`.
"""

from __future__ import annotations
