"""``python -m zpipe serve``: an OpenAI-compatible HTTP endpoint over a generation backend.

One job per module:

- :mod:`~zpipe.serve.backend`: the interface the endpoint talks to
  (:class:`GenerationBackend`): a model id, a tokenizer, a context length and an
  async stream of :class:`~zpipe.generation.TokenEvent` per prompt. The
  single-process :class:`~zpipe.serve.transformers_backend.TransformersBackend`
  and :class:`~zpipe.serve.cluster_backend.ClusterBackend` (one long-lived
  generation run on a cluster's stages) implement it.
- :mod:`~zpipe.serve.errors`: :class:`ApiError`, OpenAI's error shape and status.
- :mod:`~zpipe.serve.requests`: a request's JSON body, validated into
  :class:`~zpipe.generation.SamplingParams` and a prompt (pure).
- :mod:`~zpipe.serve.chat`: a chat's messages into prompt tokens with the
  tokenizer's chat template.
- :mod:`~zpipe.serve.responses`: the response and stream-chunk bodies (pure).
- :mod:`~zpipe.serve.app`: the Starlette application (routes, streaming, timeouts).

The web stack (Starlette, uvicorn) is the optional ``serve`` extra; importing
this package does not import it.
"""

from __future__ import annotations

from zpipe.serve.backend import GenerationBackend
from zpipe.serve.errors import ApiError

__all__ = ["ApiError", "GenerationBackend"]
