"""The HTTP application against a scripted backend, in memory (no sockets):
OpenAI's bodies and chunks, its error shape and statuses, deadlines on a stalled
backend, and the backend's stream closed whenever a response ends early."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("starlette")
from starlette.testclient import TestClient

from tests._support.serve import FakeBackend
from zpipe.serve.app import build_app
from zpipe.testing.tiny_lm import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _client(backend, **kwargs) -> TestClient:
    return TestClient(build_app(backend, **kwargs), raise_server_exceptions=False)


def _sse(response) -> list:
    lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def _error(response, status: int, param=None, code=None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


def test_models_lists_the_backend_model() -> None:
    client = _client(FakeBackend(model_id="tiny"))
    listed = client.get("/v1/models").json()
    assert listed["object"] == "list"
    assert [m["id"] for m in listed["data"]] == ["tiny"]
    assert client.get("/v1/models/tiny").json()["id"] == "tiny"
    _error(client.get("/v1/models/other"), 404, "model", "model_not_found")


def test_a_completion_with_usage() -> None:
    backend = FakeBackend()
    body = (
        _client(backend)
        .post("/v1/completions", json={"model": "fake", "prompt": [5, 6], "max_tokens": 3})
        .json()
    )
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"] == [
        {"index": 0, "text": "Hello, ", "logprobs": None, "finish_reason": "length"}
    ]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    assert backend.finished == 1 and backend.params[0].max_tokens == 3


def test_a_streamed_completion_ends_with_done() -> None:
    client = _client(FakeBackend())
    with client.stream(
        "POST", "/v1/completions", json={"model": "fake", "prompt": [1], "stream": True}
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        chunks = _sse(response)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Hello, world"
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "stop"  # eos
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert len({c["id"] for c in chunks}) == 1


def test_a_streamed_chat_names_the_role_first_and_can_add_usage(tokenizer) -> None:
    client = _client(FakeBackend(tokenizer=tokenizer, max_context=128))
    request = {
        "model": "fake",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with client.stream("POST", "/v1/chat/completions", json=request) as response:
        chunks = _sse(response)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "Hello, world"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == []
    rendered = tokenizer.apply_chat_template(
        request["messages"], add_generation_prompt=True, tokenize=False
    )
    prompt = len(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    assert chunks[-1]["usage"] == {
        "prompt_tokens": prompt,
        "completion_tokens": 4,
        "total_tokens": prompt + 4,
    }


def test_chat_budget_defaults_to_what_the_context_leaves(tokenizer) -> None:
    backend = FakeBackend(tokenizer=tokenizer, max_context=100)
    messages = [{"role": "user", "content": "hi"}]
    body = (
        _client(backend)
        .post("/v1/chat/completions", json={"model": "fake", "messages": messages})
        .json()
    )
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello, world"}
    prompt = body["usage"]["prompt_tokens"]
    assert backend.params[0].max_tokens == 100 - prompt


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "code"),
    [
        ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "model", "model_not_found"),
        (
            "/v1/completions",
            {"model": "fake", "prompt": [1] * 60},
            400,
            "prompt",
            "context_length_exceeded",
        ),
        (
            "/v1/completions",
            {"model": "fake", "prompt": [1], "max_tokens": 64},
            400,
            "prompt",
            "context_length_exceeded",
        ),
        (
            "/v1/completions",
            {"model": "fake", "prompt": [1], "temperature": -1},
            400,
            "temperature",
            None,
        ),
        ("/v1/completions", {"model": "fake", "prompt": [1], "n": 2}, 400, "n", None),
        ("/v1/completions", {"model": "fake", "prompt": "text"}, 400, "prompt", "no_tokenizer"),
        (
            "/v1/completions",
            {"model": "fake", "prompt": [1], "stop": "x"},
            400,
            "stop",
            "no_tokenizer",
        ),
        (
            "/v1/chat/completions",
            {"model": "fake", "messages": [{"role": "user", "content": "x"}]},
            400,
            "messages",
            "no_tokenizer",
        ),
    ],
)
def test_bad_requests_get_the_api_error_shape(path, body, status, param, code) -> None:
    backend = FakeBackend()
    client = _client(backend)
    _error(client.post(path, json=body), status, param, code)
    assert backend.started == 0
    ok = client.post("/v1/completions", json={"model": "fake", "prompt": [1]})
    assert ok.status_code == 200  # and the server keeps serving


def test_a_chat_without_a_template_is_refused_clearly() -> None:
    client = _client(FakeBackend(tokenizer=build_tokenizer(chat_template=None)))
    messages = [{"role": "user", "content": "x"}]
    error = _error(
        client.post("/v1/chat/completions", json={"model": "fake", "messages": messages}),
        400,
        "messages",
        "no_chat_template",
    )
    assert "chat template" in error["message"]


def test_bad_json_wrong_method_unknown_path_and_a_huge_body() -> None:
    client = _client(FakeBackend())
    _error(client.post("/v1/completions", content=b"{not json"), 400)
    _error(
        client.post("/v1/completions", content=b" " * (9 * 2**20)), 413, None, "request_too_large"
    )
    _error(client.get("/v1/completions"), 405)
    _error(client.post("/v1/embeddings", json={}), 404)


def test_a_stalled_backend_gets_a_504_and_its_stream_is_closed() -> None:
    backend = FakeBackend(stall_after=0)
    client = _client(backend, token_timeout=0.3)
    error = _error(
        client.post("/v1/completions", json={"model": "fake", "prompt": [1]}),
        504,
        None,
        "backend_timeout",
    )
    assert "0.3 s" in error["message"]
    assert backend.closed == 1


def test_a_backend_stalled_mid_stream_ends_it_with_an_error_event() -> None:
    backend = FakeBackend(stall_after=2)
    client = _client(backend, token_timeout=0.3)
    with client.stream(
        "POST", "/v1/completions", json={"model": "fake", "prompt": [1], "stream": True}
    ) as response:
        assert response.status_code == 200
        chunks = _sse(response)
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == "Hello"
    assert chunks[-1]["error"]["code"] == "backend_timeout"
    assert backend.closed == 1


def test_a_failing_backend_is_a_server_error_and_the_server_keeps_serving() -> None:
    class Broken(FakeBackend):
        async def generate(self, prompt_ids, params):
            raise RuntimeError("boom")
            yield  # an async generator

    client = _client(Broken())
    error = _error(client.post("/v1/completions", json={"model": "fake", "prompt": [1]}), 500)
    assert error["type"] == "server_error" and "boom" in error["message"]
    assert client.get("/v1/models").status_code == 200
