"""Pick each sequence's next token from its logits row: greedy or seeded sampling.

The randomness rule (what makes a seeded request reproducible): the draw for the
token at generated index ``i`` of a sequence whose request has seed ``s`` comes
from a fresh ``torch.Generator`` seeded with ``draw_seed(s, i)``, one uniform number
per draw, on the CPU. Nothing else feeds it: not the other rows of the
micro-batch, not how many tokens were drawn before, not the device that holds the
logits. So

- a sequence's tokens do not depend on which sequences share its micro-batch or
  in which order they were admitted;
- a run that lost a stage and rebuilt its caches by prefilling prompt plus
  generated tokens samples the token at index ``len(generated)`` exactly as the
  uninterrupted run would have (given the same logits);
- two requests with the same seed and the same prompt get the same tokens.

Greedy (``temperature == 0``) is ``torch.argmax``: ties go to the lowest id. The
cut-offs of a sampled row follow ``transformers``: divide by the temperature,
keep the ``top_k`` largest logits (ties to the lowest ids), then the smallest set
of the most likely tokens whose probability reaches ``top_p``; the draw is an
inverse-CDF lookup of the uniform number, on the CPU in float64 (the same draw
whatever device computed the logits; a greedy row stays on its device).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from zpipe._errors import PipelineError
from zpipe.generation.params import SamplingParams

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """One step of splitmix64: a bijective 64-bit mixer, so nearby (seed, index)
    pairs give unrelated generator seeds."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def draw_seed(seed: int, index: int) -> int:
    """The generator seed of the draw for generated token `index` of a request
    seeded with `seed` (any int; negative seeds wrap to 64 bits)."""
    if index < 0:
        raise ValueError(f"a generated token's index is >= 0, got {index}")
    # 63 bits: torch.Generator.manual_seed takes any of them on every build
    return _splitmix64(_splitmix64(seed & _MASK64) ^ index) >> 1


def sample_tokens(
    logits: torch.Tensor, params: Sequence[SamplingParams], indices: Sequence[int]
) -> list[int]:
    """The next token of each row of `logits` (rows x vocabulary, any float dtype,
    any device): row ``r`` follows ``params[r]`` and is the sequence's generated
    token number ``indices[r]`` (0-based; see the module's randomness rule)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be rows x vocabulary, got shape {tuple(logits.shape)}")
    rows = logits.shape[0]
    if len(params) != rows or len(indices) != rows:
        raise ValueError(
            f"{rows} logits rows need as many sampling settings and indices, "
            f"got {len(params)} and {len(indices)}"
        )
    if rows == 0:
        return []
    if logits.shape[1] == 0:
        raise ValueError("logits have an empty vocabulary")
    # a NaN anywhere in a row makes its maximum NaN: one reduction finds them
    nan_rows = torch.isnan(logits.amax(dim=-1))
    if bool(nan_rows.any()):
        bad = [int(r) for r in nan_rows.nonzero().flatten()]
        raise PipelineError(f"the model produced NaN logits (rows {bad}); cannot pick a token")
    out: list[int] = [0] * rows
    greedy = [r for r in range(rows) if params[r].greedy]
    if greedy:
        # one batched argmax; torch.argmax returns the first (lowest) maximal id
        picks = torch.argmax(logits[greedy], dim=-1).tolist()
        for r, token in zip(greedy, picks, strict=True):
            out[r] = int(token)
    for r in range(rows):
        if not params[r].greedy:
            out[r] = _sample_row(logits[r], params[r], indices[r])
    return out


def sample_token(logits: torch.Tensor, params: SamplingParams, index: int) -> int:
    """`sample_tokens` for one sequence: `logits` is its vocabulary row."""
    return sample_tokens(logits.reshape(1, -1), [params], [index])[0]


def _sample_row(row: torch.Tensor, params: SamplingParams, index: int) -> int:
    # on the CPU in float64: the same draw whatever device computed the logits
    # (and MPS has no float64)
    scaled = row.detach().to("cpu", torch.float64) / params.temperature
    vocab = scaled.shape[0]
    k = params.top_k if 0 < params.top_k < vocab else vocab
    ids: torch.Tensor | None = None
    if k < vocab:
        # top-k first (transformers' order); top-p then applies to its renormalised mass
        values, ids = _largest(scaled, k)
        probs = torch.softmax(values, dim=0)
    elif params.top_p < 1.0:
        # the nucleus without sorting the whole vocabulary: the largest n logits,
        # n growing until they hold top_p of the mass (exact: the nucleus is a prefix)
        total = torch.logsumexp(scaled, dim=0)
        n = min(64, vocab)
        while True:
            values, ids = _largest(scaled, n)
            probs = torch.exp(values - total)
            if n == vocab or float(probs.sum()) >= params.top_p:
                break
            n = min(4 * n, vocab)
    else:
        probs = torch.softmax(scaled, dim=0)
    if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0:
        raise PipelineError("the model produced logits with no finite maximum; cannot sample")
    if params.top_p < 1.0:
        # keep a token while the mass before it is below top_p: the smallest
        # prefix whose mass reaches top_p (the first token always stays)
        before = torch.cumsum(probs, dim=0) - probs
        keep = int((before < params.top_p).sum())
        probs = probs[: max(keep, 1)]
    cdf = torch.cumsum(probs, dim=0)
    generator = torch.Generator(device="cpu").manual_seed(draw_seed(params.seed, index))
    u = float(torch.rand((), generator=generator, dtype=torch.float64))
    target = torch.tensor(u * float(cdf[-1]), dtype=torch.float64)
    # right=True: the first token whose cumulative mass exceeds the target, so a
    # token of probability 0 (a masked logit) is never drawn
    pos = int(torch.searchsorted(cdf, target, right=True))
    if pos >= cdf.shape[0]:  # u * total rounded up to the total: the last token with mass
        pos = int((probs > 0).nonzero().max())
    return pos if ids is None else int(ids[pos])


def _largest(values: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `n` largest values, descending, equal values in id order: ties go to
    the lowest id, at the cut too (so top_k=1 is exactly greedy)."""
    if n < values.shape[0]:
        # everything at least the n-th largest value, in id order (nonzero sorts)
        cut = torch.topk(values, n, sorted=False).values.min()
        ids = (values >= cut).nonzero().flatten()
        candidates = values[ids]
    else:
        ids, candidates = torch.arange(values.shape[0]), values
    order = torch.sort(candidates, descending=True, stable=True).indices[:n]
    return candidates[order], ids[order]
