"""The sampler keeps only the tokens transformers' generate would keep: its
temperature, top-k and top-p warpers, in generate's order."""

from __future__ import annotations

import pytest
import torch

from zpipe.generation import SamplingParams
from zpipe.generation.sampling import sample_token

logits_process = pytest.importorskip("transformers.generation.logits_process")


@pytest.mark.parametrize(("top_k", "top_p"), [(0, 0.5), (5, 1.0), (20, 0.8), (1, 0.3)])
def test_sampling_keeps_the_tokens_hf_warpers_keep(top_k: int, top_p: float) -> None:
    logits = torch.randn(300, generator=torch.Generator().manual_seed(top_k))
    scores = logits_process.TemperatureLogitsWarper(0.7)(None, logits[None].clone())
    if top_k:
        scores = logits_process.TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = logits_process.TopPLogitsWarper(top_p)(None, scores)
    allowed = set(torch.isfinite(scores[0]).nonzero().flatten().tolist())
    params = SamplingParams(temperature=0.7, top_k=top_k, top_p=top_p)
    drawn = {sample_token(logits, params, index) for index in range(300)}
    assert drawn <= allowed
    assert len(drawn) > 1 or len(allowed) == 1
