"""The single-process backend: greedy tokens equal transformers' generate, seeded
sampling repeats, stop strings and end of sequence end the stream, and closing the
stream releases the sequence. (Its sampler and stop rules are the generation core's,
tested in tests/unit/generation/.)"""

from __future__ import annotations

import asyncio

import pytest
import torch

from zpipe._errors import ConfigError
from zpipe.generation import SamplingParams
from zpipe.generation.sampling import sample_token
from zpipe.serve.backend import GenerationBackend
from zpipe.serve.transformers_backend import TransformersBackend
from zpipe.testing.tiny_lm import save_tiny_lm

transformers = pytest.importorskip("transformers")

PROMPTS = ["hello world the pipeline", "a", "each stage keeps the cache of its own blocks"]


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def checkpoint(request, tmp_path_factory):
    return save_tiny_lm(tmp_path_factory.mktemp(request.param), family=request.param)


@pytest.fixture(scope="module")
def backend(checkpoint):
    backend = TransformersBackend.from_pretrained(checkpoint)
    yield backend
    backend.close()


def _events(backend, ids, params):
    async def run():
        return [e async for e in backend.generate(ids, params)]

    return asyncio.run(run())


def test_it_is_a_generation_backend(backend) -> None:
    assert isinstance(backend, GenerationBackend)
    assert backend.max_context == 128 and backend.tokenizer is not None


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_and_text_equal_transformers_generate(backend, checkpoint, prompt) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint)
    ids = backend.tokenizer(prompt)["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=30, do_sample=False)
    expected = out[0, len(ids) :].tolist()
    events = _events(backend, ids, SamplingParams(max_tokens=30))
    assert [e.token for e in events] == expected
    assert [e.index for e in events] == list(range(len(events)))
    text = "".join(e.text for e in events)
    assert text == backend.tokenizer.decode(expected, skip_special_tokens=True)
    assert all(e.finish_reason is None for e in events[:-1])
    assert events[-1].finish_reason == ("eos" if expected[-1] == 0 else "length")
    assert backend.live_sequences == 0


def test_seeded_sampling_repeats_and_another_seed_differs(backend) -> None:
    ids = backend.tokenizer("hello")["input_ids"]
    params = SamplingParams(max_tokens=20, temperature=1.5, top_k=50, top_p=0.95, seed=7)
    first = [e.token for e in _events(backend, ids, params)]
    again = [e.token for e in _events(backend, ids, params)]
    other = [
        e.token for e in _events(backend, ids, SamplingParams(**{**params.__dict__, "seed": 8}))
    ]
    assert first == again
    assert first != other


def test_sampled_tokens_follow_the_cores_seed_rule(backend, checkpoint) -> None:
    """Each sampled token is the core's draw for (seed, index) on the model's
    logits, as the pipeline's last stage would draw it (recomputed here without
    a cache, so the backend's cache is checked too)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint)
    ids = backend.tokenizer("hello")["input_ids"]
    params = SamplingParams(max_tokens=12, temperature=1.5, top_k=50, top_p=0.95, seed=11)
    tokens = [e.token for e in _events(backend, ids, params)]
    for index, token in enumerate(tokens):
        with torch.no_grad():
            logits = model(torch.tensor([ids + tokens[:index]])).logits[0, -1]
        assert token == sample_token(logits, params, index)


def test_a_stop_string_ends_the_stream_and_is_not_emitted(backend) -> None:
    ids = backend.tokenizer("hello world")["input_ids"]
    whole = "".join(e.text for e in _events(backend, ids, SamplingParams(max_tokens=30)))
    stop = whole[6:8]
    events = _events(backend, ids, SamplingParams(max_tokens=30, stop=(stop,)))
    assert "".join(e.text for e in events) == whole[: whole.find(stop)]
    assert events[-1].finish_reason == "stop"
    assert backend.live_sequences == 0


def test_closing_the_stream_cancels_the_sequence(backend) -> None:
    ids = backend.tokenizer("hello")["input_ids"]

    async def run():
        events = backend.generate(ids, SamplingParams(max_tokens=50))
        got = [await anext(events), await anext(events)]
        assert backend.live_sequences == 1
        await events.aclose()
        return got

    assert len(asyncio.run(run())) == 2
    assert backend.live_sequences == 0


def test_a_prompt_past_the_context_is_refused(backend) -> None:
    with pytest.raises(ConfigError, match="context length 128"):
        _events(backend, [1] * 120, SamplingParams(max_tokens=9))


def test_concurrent_sequences_interleave_and_each_equals_its_run_alone(backend) -> None:
    prompts = [backend.tokenizer(p)["input_ids"] for p in PROMPTS]
    params = SamplingParams(max_tokens=12, stop_at_eos=False)
    alone = [[e.token for e in _events(backend, ids, params)] for ids in prompts]
    order: list[int] = []

    async def one(ids):
        tokens = []
        async for event in backend.generate(ids, params):
            order.append(event.sequence)
            tokens.append(event.token)
        return tokens

    async def run():
        return await asyncio.gather(*(one(ids) for ids in prompts))

    together = asyncio.run(run())
    assert together == alone
    # token by token, not one sequence after another
    assert len({order[i] for i in range(len(prompts))}) > 1
    assert backend.live_sequences == 0
