"""``zpipe serve``'s application under uvicorn on loopback, driven by the official
``openai`` client: streamed text equals non-streamed text equals transformers'
greedy ``generate``; bad requests get the API's errors and the server keeps
serving; a client that leaves mid-stream cancels the backend's sequence."""

from __future__ import annotations

import platform
import socket

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from tests._support.serve import FakeBackend, RecordingBackend, serving, tiny_lm, wait_until  # noqa: E402
from zpipe.serve.app import build_app  # noqa: E402
from zpipe.serve.transformers_backend import TransformersBackend  # noqa: E402

# The openai client names the OS in a header via platform.platform(), which runs
# `uname -p` once (a process, which this lane forbids while a test runs); Python
# caches the answer, so ask for it here, at collection.
platform.platform()

MODEL = "tiny"
TOKENS = 24


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_lm(tmp_path_factory.mktemp("tiny-lm"))


@pytest.fixture(scope="module")
def backend(checkpoint):
    inner = TransformersBackend.from_pretrained(checkpoint, model_id=MODEL)
    yield RecordingBackend(inner)
    inner.close()


@pytest.fixture(scope="module")
def base_url(backend):
    with serving(build_app(backend, token_timeout=60)) as url:
        yield url


@pytest.fixture
def client(base_url):
    with openai.OpenAI(base_url=base_url, api_key="unused", timeout=60, max_retries=0) as c:
        yield c


def _hf_greedy(checkpoint, ids: list[int], tokens: int) -> str:
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False)
    return tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)


def test_models_lists_the_model(client) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_streamed_chat_equals_non_streamed_equals_transformers(client, backend, checkpoint):
    messages = [{"role": "user", "content": "tell me a story about edge devices"}]
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=TOKENS, temperature=0
    )
    streamed = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=TOKENS, temperature=0, stream=True
    )
    pieces, reasons = [], []
    for chunk in streamed:
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            reasons.append(choice.finish_reason)
    tokenizer = backend.tokenizer
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    expected = _hf_greedy(checkpoint, ids, TOKENS)
    assert whole.choices[0].message.content == expected
    assert "".join(pieces) == expected
    assert reasons[-1] == whole.choices[0].finish_reason
    assert whole.usage.prompt_tokens == len(ids)


def test_streamed_completion_equals_non_streamed_equals_transformers(client, backend, checkpoint):
    prompt = "hello world the pipeline"
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=TOKENS, temperature=0)
    streamed = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=TOKENS, temperature=0, stream=True
    )
    text = "".join(chunk.choices[0].text for chunk in streamed)
    expected = _hf_greedy(checkpoint, backend.tokenizer(prompt)["input_ids"], TOKENS)
    assert whole.choices[0].text == expected == text
    assert whole.usage.completion_tokens <= TOKENS


def test_a_stop_string_ends_the_stream_and_is_not_emitted(client) -> None:
    prompt = "hello world"
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=TOKENS, temperature=0)
    text = whole.choices[0].text
    stop = text[5:7]
    streamed = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=TOKENS, temperature=0, stop=[stop], stream=True
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == text[: text.find(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(client) -> None:
    def sample(seed: int) -> str:
        reply = client.completions.create(
            model=MODEL,
            prompt="a",
            max_tokens=16,
            temperature=1.2,
            top_p=0.9,
            seed=seed,
            extra_body={"top_k": 40},
        )
        return reply.choices[0].text

    assert sample(3) == sample(3)


@pytest.mark.parametrize(
    ("kwargs", "error", "param"),
    [
        ({"model": "nope"}, "NotFoundError", "model"),
        ({"prompt": "x " * 200}, "BadRequestError", "prompt"),
        ({"temperature": -1}, "BadRequestError", "temperature"),
        ({"n": 2}, "BadRequestError", "n"),
    ],
)
def test_bad_requests_get_the_api_errors_and_the_server_keeps_serving(
    client, kwargs, error, param
) -> None:
    request = {"model": MODEL, "prompt": "hello", "max_tokens": 4, **kwargs}
    with pytest.raises(getattr(openai, error)) as caught:
        client.completions.create(**request)
    assert caught.value.body["param"] == param
    if "prompt" in kwargs:
        assert caught.value.code == "context_length_exceeded"
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices


def test_bad_json_gets_the_error_shape(base_url) -> None:
    import httpx

    response = httpx.post(
        f"{base_url}/chat/completions",
        content=b"{bad json",
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert response.status_code == 400
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_a_client_that_leaves_mid_stream_cancels_the_backend(base_url, backend, client) -> None:
    host, port = base_url.removeprefix("http://").removesuffix("/v1").split(":")
    closed_before = backend.closed
    backend.first_token.clear()
    backend.delay_s = 0.1  # 100 tokens take 10 s: the client surely leaves mid-stream
    body = (
        b'{"model": "tiny", "prompt": "hello", "max_tokens": 100, "temperature": 0, "stream": true}'
    )
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    try:
        with socket.create_connection((host, int(port)), timeout=30) as conn:
            conn.sendall(request)
            assert conn.recv(4096).startswith(b"HTTP/1.1 200")
            wait_until(backend.first_token.is_set, 30, "the first token")
        # the connection is closed: the endpoint must close the backend's stream
        wait_until(lambda: backend.closed > closed_before, 8, "the backend stream to be closed")
    finally:
        backend.delay_s = 0.0
    assert backend.inner.live_sequences == 0
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices


def test_a_client_that_leaves_a_non_streamed_request_cancels_it() -> None:
    # 600 tokens take 30 s: the client surely leaves before the end
    backend = FakeBackend(pieces=["x"] * 600, delay_s=0.05, max_context=1000)
    with serving(build_app(backend, token_timeout=30)) as url:
        host, port = url.removeprefix("http://").removesuffix("/v1").split(":")
        body = b'{"model": "fake", "prompt": [1], "max_tokens": 600}'
        request = (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        with socket.create_connection((host, int(port)), timeout=30) as conn:
            conn.sendall(request)
            wait_until(backend.first_token.is_set, 30, "the first token")
        wait_until(lambda: backend.closed == 1, 20, "the backend stream to be closed")
    assert backend.finished == 0
