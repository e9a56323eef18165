from __future__ import annotations

import pytest
import torch

from zpipe._errors import PipelineError
from zpipe.generation import SamplingParams
from zpipe.generation.sampling import draw_seed, sample_token, sample_tokens

LOGITS = torch.tensor([1.0, 2.5, 0.3, 2.0, -1.0, 0.9])


def _counts(params: SamplingParams, draws: int, logits: torch.Tensor = LOGITS) -> torch.Tensor:
    batch = logits.expand(draws, -1)
    tokens = sample_tokens(batch, [params] * draws, list(range(draws)))
    return torch.bincount(torch.tensor(tokens), minlength=logits.shape[0]).double()


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "drew a token of probability 0"
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum())


def test_greedy_is_argmax_with_ties_to_the_lowest_id() -> None:
    torch.manual_seed(0)
    logits = torch.randn(7, 50)
    logits[3, 10] = logits[3, 20] = logits[3].max() + 1.0  # a tie: 10 wins
    assert sample_tokens(logits, [SamplingParams()] * 7, [0] * 7) == logits.argmax(-1).tolist()
    assert sample_tokens(logits, [SamplingParams()] * 7, [0] * 7)[3] == 10


@pytest.mark.parametrize("temperature", [0.1, 1.0, 5.0])
def test_top_k_one_is_greedy_at_any_temperature(temperature: float) -> None:
    torch.manual_seed(1)
    logits = torch.randn(20, 30)
    params = SamplingParams(temperature=temperature, top_k=1, seed=3)
    assert sample_tokens(logits, [params] * 20, list(range(20))) == logits.argmax(-1).tolist()
    logits[0, 4] = logits[0, 9] = logits[0].max() + 1.0
    assert sample_token(logits[0], params, 0) == 4


def test_tiny_top_p_is_greedy() -> None:
    torch.manual_seed(2)
    logits = torch.randn(20, 30)
    params = SamplingParams(temperature=2.0, top_p=1e-6, seed=5)
    assert sample_tokens(logits, [params] * 20, list(range(20))) == logits.argmax(-1).tolist()


def test_draws_follow_the_softmax() -> None:
    params = SamplingParams(temperature=0.8, seed=11)
    counts = _counts(params, 4000)
    # 5 degrees of freedom: 20.5 is the 0.999 quantile; the seed makes it deterministic
    assert _chi_square(counts, torch.softmax(LOGITS / 0.8, 0)) < 20.5
    # and the test can fail: the draws do not follow the untempered softmax
    assert _chi_square(counts, torch.softmax(LOGITS, 0)) > 50


def test_top_k_and_top_p_cut_and_renormalise() -> None:
    probs = torch.softmax(LOGITS, 0)  # order by probability: ids 1, 3, 0, 5, 2, 4
    top3 = torch.zeros(6)
    top3[[1, 3, 0]] = probs[[1, 3, 0]]
    counts = _counts(SamplingParams(temperature=1.0, top_k=3, seed=2), 2500)
    assert _chi_square(counts, top3 / top3.sum()) < 20.5
    # top_p: ids 1 and 3 hold less than 0.8, so id 0 (which crosses 0.8) stays too
    assert probs[1] + probs[3] < 0.8 < probs[1] + probs[3] + probs[0]
    counts = _counts(SamplingParams(temperature=1.0, top_p=0.8, seed=4), 2500)
    assert _chi_square(counts, top3 / top3.sum()) < 20.5


def test_a_sequences_tokens_do_not_depend_on_its_micro_batch() -> None:
    torch.manual_seed(3)
    mine = torch.randn(40)
    params = SamplingParams(temperature=1.3, top_k=20, top_p=0.9, seed=42)
    alone = [sample_token(mine, params, i) for i in range(30)]
    for i in range(30):
        others = torch.randn(4, 40)
        batch = torch.cat([others[:2], mine[None], others[2:]])
        other_params = [SamplingParams(temperature=0.5, seed=i), SamplingParams()]
        got = sample_tokens(batch, [*other_params, params, *other_params], [7, 0, i, 3, 1])
        assert got[2] == alone[i]
    assert len(set(alone)) > 3  # it did sample: not one token over and over


def test_seeded_draws_reproduce_and_differ_by_seed_and_index() -> None:
    torch.manual_seed(4)
    logits = torch.randn(64, 1000)
    params = SamplingParams(temperature=1.0, seed=9)
    first = sample_tokens(logits, [params] * 64, list(range(64)))
    assert sample_tokens(logits, [params] * 64, list(range(64))) == first
    other = SamplingParams(temperature=1.0, seed=10)
    assert sample_tokens(logits, [other] * 64, list(range(64))) != first
    assert draw_seed(9, 0) != draw_seed(9, 1) != draw_seed(10, 0)
    assert 0 <= draw_seed(-1, 5) < 2**63


def test_masked_tokens_are_never_drawn_and_logits_on_any_dtype() -> None:
    logits = torch.full((1, 8), float("-inf"))
    logits[0, 2], logits[0, 6] = 0.0, 0.0
    params = SamplingParams(temperature=1.0, seed=1)
    got = {sample_token(logits[0].half(), params, i) for i in range(200)}
    assert got == {2, 6}


def test_nan_logits_and_bad_shapes_are_refused() -> None:
    logits = torch.zeros(2, 5)
    logits[1, 3] = float("nan")
    with pytest.raises(PipelineError, match=r"NaN logits \(rows \[1\]\)"):
        sample_tokens(logits, [SamplingParams()] * 2, [0, 0])
    with pytest.raises(ValueError, match="rows x vocabulary"):
        sample_tokens(torch.zeros(5), [SamplingParams()], [0])
    with pytest.raises(ValueError, match="as many"):
        sample_tokens(torch.zeros(2, 5), [SamplingParams()], [0, 0])
    assert sample_tokens(torch.zeros(0, 5), [], []) == []


def _plain_sample(row: torch.Tensor, params: SamplingParams, index: int) -> int:
    """The sampler's rule written the slow way: sort everything, cut, draw."""
    values, ids = torch.sort(row.double() / params.temperature, descending=True, stable=True)
    if params.top_k:
        values, ids = values[: params.top_k], ids[: params.top_k]
    probs = torch.softmax(values, 0)
    keep = int(((torch.cumsum(probs, 0) - probs) < params.top_p).sum())
    cdf = torch.cumsum(probs[:keep], 0)
    gen = torch.Generator().manual_seed(draw_seed(params.seed, index))
    u = float(torch.rand((), generator=gen, dtype=torch.float64))
    return int(ids[int(torch.searchsorted(cdf, torch.tensor(u * float(cdf[-1])), right=True))])


@pytest.mark.parametrize(("top_k", "top_p"), [(0, 0.5), (0, 0.9), (0, 0.999), (40, 0.9), (7, 1.0)])
def test_the_fast_cuts_equal_sorting_the_whole_vocabulary(top_k: int, top_p: float) -> None:
    torch.manual_seed(5)
    logits = torch.randn(24, 5000) * 4  # peaked, like a language model's
    logits[:, 100] = logits[:, 200] = logits.max() + 0.5  # a tie at the top of every row
    params = SamplingParams(temperature=0.9, top_k=top_k, top_p=top_p, seed=13)
    got = sample_tokens(logits, [params] * 24, list(range(24)))
    assert got == [_plain_sample(logits[i], params, i) for i in range(24)]
