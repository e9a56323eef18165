"""A request's JSON body into a GenerationRequest: the fields OpenAI's API has,
and a 400 naming the field for each value this server cannot honour."""

from __future__ import annotations

import pytest

from zpipe.serve.errors import ApiError
from zpipe.serve.requests import ChatMessage, parse_request


def test_a_completion_request_with_every_sampling_field() -> None:
    request = parse_request(
        {
            "model": "m",
            "prompt": "hello",
            "max_tokens": 7,
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 5,
            "seed": 3,
            "stop": "\n",
            "stream": True,
            "stream_options": {"include_usage": True},
            "n": 1,
            "user": "ignored",
        },
        "completions",
    )
    assert request.prompt == "hello" and request.max_tokens == 7
    assert request.stream and request.include_usage
    params = request.params(7, seed=99)
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (0.5, 0.9, 5, 3)
    assert params.stop == ("\n",) and params.max_tokens == 7


def test_defaults_leave_the_budget_and_the_seed_to_the_server() -> None:
    request = parse_request({"model": "m", "prompt": [1, 2, 3]}, "completions")
    assert request.prompt == (1, 2, 3)
    assert request.max_tokens is None and request.seed is None
    assert request.temperature == 1.0  # OpenAI's default
    assert request.params(4, seed=11).seed == 11


def test_chat_messages_with_text_parts_and_max_completion_tokens() -> None:
    request = parse_request(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}],
                },
            ],
            "max_completion_tokens": 5,
            "stop": ["a", "b", "a"],
        },
        "chat",
    )
    assert request.messages == (ChatMessage("system", "be brief"), ChatMessage("user", "hi there"))
    assert request.max_tokens == 5 and request.stop == ("a", "b")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x"}, "model"),
        ({"model": "m", "prompt": ""}, "prompt"),
        ({"model": "m", "prompt": ["a", "b"]}, "prompt"),
        ({"model": "m", "prompt": [1, -2]}, "prompt"),
        ({"model": "m", "prompt": "x", "temperature": -1}, "temperature"),
        ({"model": "m", "prompt": "x", "temperature": 2.5}, "temperature"),
        ({"model": "m", "prompt": "x", "temperature": "hot"}, "temperature"),
        ({"model": "m", "prompt": "x", "top_p": 0}, "top_p"),
        ({"model": "m", "prompt": "x", "top_p": 1.5}, "top_p"),
        ({"model": "m", "prompt": "x", "top_k": -1}, "top_k"),
        ({"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"model": "m", "prompt": "x", "max_tokens": 1.5}, "max_tokens"),
        ({"model": "m", "prompt": "x", "seed": "s"}, "seed"),
        ({"model": "m", "prompt": "x", "stop": ["a", 1]}, "stop"),
        ({"model": "m", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"model": "m", "prompt": "x", "stop": [""]}, "stop"),
        ({"model": "m", "prompt": "x", "n": 2}, "n"),
        ({"model": "m", "prompt": "x", "echo": True}, "echo"),
        ({"model": "m", "prompt": "x", "logprobs": 3}, "logprobs"),
        ({"model": "m", "prompt": "x", "stream": "yes"}, "stream"),
        (
            {"model": "m", "prompt": "x", "response_format": {"type": "json_object"}},
            "response_format",
        ),
        (
            {"model": "m", "prompt": "x", "stream_options": {"include_usage": True}},
            "stream_options",
        ),
    ],
)
def test_bad_values_are_refused_naming_the_field(body: dict, param: str) -> None:
    with pytest.raises(ApiError) as caught:
        parse_request(body, "completions")
    assert caught.value.status == 400
    assert caught.value.param == param
    assert caught.value.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([], "messages"),
        ("hi", "messages"),
        ([{"role": "wizard", "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": 3}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content"),
    ],
)
def test_bad_chat_messages_are_refused(messages: object, param: str) -> None:
    with pytest.raises(ApiError) as caught:
        parse_request({"model": "m", "messages": messages}, "chat")
    assert caught.value.param == param


def test_a_body_that_is_not_an_object_is_refused() -> None:
    with pytest.raises(ApiError, match="JSON object"):
        parse_request([1, 2], "chat")


def test_n_other_than_one_says_so() -> None:
    with pytest.raises(ApiError, match=r"n=3 is not supported.*only 1"):
        parse_request({"model": "m", "prompt": "x", "n": 3}, "completions")
