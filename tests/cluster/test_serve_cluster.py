"""``zpipe serve`` backed by a 3-stage cluster, driven by the official ``openai``
client: the endpoint (uvicorn in a thread of this process) renders prompts with the
checkpoint's tokenizer and chat template, and one long-lived generation run on the
session's shared cluster (three stage processes, tests/cluster/conftest.py)
generates every request's tokens.

The text equals the single-process endpoint's (``TransformersBackend``) and
transformers' greedy ``generate``; concurrent requests join the one run; the
cluster's refusals get the API's error shape; a client that leaves mid-stream
cancels its sequence on the cluster.
"""

from __future__ import annotations

import json
import platform
import threading
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from tests._support.serve import serving, wait_until  # noqa: E402
from zpipe.cluster import LocalCluster  # noqa: E402
from zpipe.serve.app import build_app  # noqa: E402
from zpipe.serve.cluster_backend import ClusterBackend  # noqa: E402
from zpipe.serve.transformers_backend import TransformersBackend  # noqa: E402
from zpipe.testing.tiny_lm import save_tiny_lm  # noqa: E402

pytestmark = pytest.mark.timeout(900)

# the openai client runs `uname -p` on its first request; ask here, once
platform.platform()

MODEL = "tiny"
STAGES = ["s0", "s1", "s2"]
CONTEXT = 1024
TOKENS = 24
# the run's KV cache holds 700 tokens at each stage (GPT-2 tiny: 2 x 32 float32 per
# token per block, one block per stage holding any): a request reserving more is
# refused by the first stage, though the context would allow it
KV_TOKENS = 700
KV_BUDGET_BYTES = KV_TOKENS * 2 * 32 * 4
TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_lm(tmp_path_factory.mktemp("tiny-lm"), max_context=CONTEXT)


def _backend(cluster: LocalCluster, checkpoint: Path, max_sequences: int = 4) -> ClusterBackend:
    return ClusterBackend.from_checkpoint(
        checkpoint,
        cluster.client(),
        model_id=MODEL,
        stage_names=STAGES,
        max_sequences=max_sequences,
        kv_budget_bytes=KV_BUDGET_BYTES,
        token_timeout_s=TIMEOUT_S,
    )


@pytest.fixture(scope="module")
def module_endpoint() -> Iterator[ExitStack]:
    """What keeps the module's endpoint up. A coordinator runs one run at a time, so
    a test that starts a run of its own on the stages closes this first."""
    with ExitStack() as stack:
        yield stack


@pytest.fixture(scope="module")
def served(cluster: LocalCluster, checkpoint: Path, module_endpoint: ExitStack) -> Any:
    """The endpoint over the cluster: (base URL, backend). Its lifespan starts the run."""
    backend = _backend(cluster, checkpoint)
    app = build_app(backend, token_timeout=TIMEOUT_S)
    url = module_endpoint.enter_context(serving(app, timeout=300))
    return url, backend


@pytest.fixture(scope="module")
def direct_url(checkpoint: Path) -> Any:
    """The single-process endpoint over the same checkpoint: the direct API."""
    backend = TransformersBackend.from_pretrained(checkpoint, model_id=MODEL)
    with serving(build_app(backend, token_timeout=TIMEOUT_S)) as url:
        yield url
    backend.close()


def _client(url: str) -> Any:
    return openai.OpenAI(base_url=url, api_key="unused", timeout=TIMEOUT_S, max_retries=0)


def _hf_tokens(checkpoint: Path, ids: list[int], tokens: int) -> list[int]:
    """transformers' greedy ``generate``: the new tokens (it stops at the end of
    sequence, as the endpoint does)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False)
    return [int(t) for t in out[0, len(ids) :]]


def _hf_greedy(checkpoint: Path, ids: list[int], tokens: int) -> str:
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    return str(tokenizer.decode(_hf_tokens(checkpoint, ids, tokens), skip_special_tokens=True))


def _chat(url: str, messages: list[dict[str, str]], *, stream: bool) -> tuple[str, Any]:
    with _client(url) as client:
        reply = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=TOKENS, temperature=0, stream=stream
        )
        if not stream:
            return reply.choices[0].message.content, reply
        pieces, reasons = [], []
        for chunk in reply:
            for choice in chunk.choices:
                pieces.append(choice.delta.content or "")
                reasons.append(choice.finish_reason)
        return "".join(pieces), reasons[-1]


def test_streamed_chat_equals_the_direct_api_and_transformers(
    served: Any, direct_url: str, checkpoint: Path
) -> None:
    url, backend = served
    messages = [{"role": "user", "content": "tell me a story about edge devices"}]
    streamed, last_reason = _chat(url, messages, stream=True)
    whole, reply = _chat(url, messages, stream=False)
    direct, _ = _chat(direct_url, messages, stream=True)
    tokenizer = backend.tokenizer
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    expected = _hf_greedy(checkpoint, ids, TOKENS)
    assert expected  # the comparison means something
    assert streamed == whole == direct == expected
    assert last_reason == reply.choices[0].finish_reason
    assert reply.usage.prompt_tokens == len(ids)
    assert backend.runs_started == 1  # both requests rode the run the lifespan started


def test_concurrent_requests_share_the_run_and_each_gets_its_own_text(
    served: Any, direct_url: str
) -> None:
    url, backend = served
    prompts = ["hello world the pipeline", "each stage keeps", "the planner counts weights"]
    stop = {1: "a"}  # one request ends at a stop string, the others at their length

    def complete(base: str, i: int, out: dict[int, str]) -> None:
        with _client(base) as client:
            reply = client.completions.create(
                model=MODEL,
                prompt=prompts[i],
                max_tokens=TOKENS,
                temperature=0,
                stop=[stop[i]] if i in stop else None,
            )
            out[i] = reply.choices[0].text

    got: dict[int, str] = {}
    threads = [threading.Thread(target=complete, args=(url, i, got)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S)
    expected: dict[int, str] = {}
    for i in range(3):
        complete(direct_url, i, expected)
    assert got == expected
    assert backend.runs_started == 1


def test_the_clusters_refusal_gets_the_api_error_and_the_endpoint_keeps_serving(
    served: Any,
) -> None:
    url, backend = served
    with _client(url) as client:
        # within the context (1024) but past the KV cache the run holds (700 tokens)
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as refused:
                client.completions.create(
                    model=MODEL, prompt="hello", max_tokens=900, temperature=0, stream=stream
                )
            assert refused.value.code == "capacity_exceeded"
            assert "KV cache" in refused.value.message
        with pytest.raises(openai.BadRequestError) as too_long:
            client.completions.create(model=MODEL, prompt="hello", max_tokens=CONTEXT)
        assert too_long.value.code == "context_length_exceeded"
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="nope", prompt="hello", max_tokens=4)
        reply = client.completions.create(model=MODEL, prompt="hello", max_tokens=4)
        assert reply.choices[0].finish_reason in ("length", "stop")
    assert backend.runs_started == 1  # a refused sequence leaves the run serving


def _events(log: str, event: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.splitlines() if f'"event": "{event}"' in line]


def test_a_client_leaving_mid_stream_cancels_its_sequence_on_the_cluster(
    cluster: LocalCluster, checkpoint: Path, module_endpoint: ExitStack
) -> None:
    """A run that admits one sequence at a time. A sequence of 650 tokens is left
    after its first text; a second request then completes, which it can only do
    once the first sequence's slot is free. When the run closes, the first stage
    has fed far fewer than the 650 tokens an uncancelled first sequence feeds
    before the second one is admitted. Last in the module: the module's endpoint
    closes its run first (another client's run in flight would be refused)."""
    module_endpoint.close()
    backend = _backend(cluster, checkpoint, max_sequences=1)
    max_tokens = 650
    with serving(build_app(backend, token_timeout=TIMEOUT_S), timeout=300) as url:
        run = backend.run
        assert run is not None
        with _client(url) as client:
            prompt = "hello world"
            ids = backend.tokenizer(prompt)["input_ids"]
            # uncancelled, it would run to max_tokens (no end of sequence on the way)
            assert len(_hf_tokens(checkpoint, ids, max_tokens)) == max_tokens
            stream = client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
            )
            for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    break
            stream.close()  # the HTTP connection goes away mid-stream
            wait_until(lambda: backend.cancelled == 1, TIMEOUT_S, "the backend to cancel")
            after = client.completions.create(model=MODEL, prompt="each", max_tokens=4)
            assert after.usage.completion_tokens >= 1
            after_ids = backend.tokenizer("each")["input_ids"]
        assert backend.live_sequences == 0
    # the server stopped: its lifespan closed the run, and every stage logged its close
    wait_until(
        lambda: all(
            any(e["run"] == run for e in _events(cluster.logs(s), "generation_closed"))
            for s in STAGES
        ),
        TIMEOUT_S,
        "the stages to close the run",
    )
    closed = [e for e in _events(cluster.logs("s0"), "generation_closed") if e["run"] == run]
    fed = closed[0]["tokens"]  # prompt and generated tokens fed into the first stage
    assert len(ids) + len(after_ids) < fed < len(ids) + max_tokens // 2, fed
