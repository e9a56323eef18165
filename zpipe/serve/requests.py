"""A request's JSON body, validated once into a typed :class:`GenerationRequest`.

OpenAI's fields: ``model``, ``prompt`` (completions: a string, one string in a
list, or a list of token ids) or ``messages`` (chat), ``max_tokens`` /
``max_completion_tokens``, ``temperature`` (0 to 2), ``top_p`` (0 exclusive to
1), ``seed``, ``stop`` (a string or up to 4 strings), ``stream`` and
``stream_options.include_usage``, ``n`` (only 1), plus ``top_k`` as an
extension (0: off). Fields that would change the answer in a way this server
cannot honour (``n`` > 1, ``logprobs``, ``echo``, ``suffix``, ``logit_bias``,
penalties, tools, a JSON ``response_format``) are refused with a 400 naming
the field, never silently ignored; other unknown fields are ignored, as most
OpenAI-compatible servers do.
Pure: no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from zpipe._errors import ConfigError
from zpipe.generation import SamplingParams
from zpipe.serve.errors import ApiError, bad_value

Endpoint = Literal["completions", "chat"]

MAX_STOP = 4  # OpenAI's limit
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

# field -> the one value this server honours (anything else is refused)
_ONLY = {
    "n": 1,
    "best_of": 1,
    "echo": False,
    "logprobs": None,
    "top_logprobs": None,
    "suffix": None,
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "logit_bias": None,
    "tools": None,
    "functions": None,
}


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True)
class GenerationRequest:
    """One validated request of either endpoint; ``max_tokens`` None means "as
    many as the context allows" (chat's default)."""

    endpoint: Endpoint
    model: str
    prompt: str | tuple[int, ...] | None = None
    messages: tuple[ChatMessage, ...] = ()
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False

    def params(self, max_tokens: int, seed: int) -> SamplingParams:
        """The sampling settings, with the token budget and seed the caller settled
        (``seed`` is used only when the request gave none)."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            seed=self.seed if self.seed is not None else seed,
            stop=self.stop,
        )


def parse_request(body: object, endpoint: Endpoint) -> GenerationRequest:
    """Validate a decoded JSON body; raises :class:`ApiError` (400) naming the field."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_value("model", "you must provide a model parameter (a string)")
    for field, allowed in _ONLY.items():
        value = body.get(field)
        if value is None or value == allowed or (allowed is None and value in (False, {}, [])):
            continue
        raise bad_value(
            field,
            f"{field}={value!r} is not supported by this server"
            + (f" (only {allowed!r})" if allowed is not None else ""),
            code="unsupported_value",
        )
    response_format = body.get("response_format")
    if response_format not in (None, {"type": "text"}):
        raise bad_value(
            "response_format",
            "only plain text responses are supported (response_format type 'text')",
            code="unsupported_value",
        )
    prompt: str | tuple[int, ...] | None = None
    messages: tuple[ChatMessage, ...] = ()
    if endpoint == "completions":
        prompt = _prompt(body.get("prompt"))
    else:
        messages = _messages(body.get("messages"))
    max_tokens = _max_tokens(body)
    temperature = _number(body, "temperature", 1.0, low=0.0, high=MAX_TEMPERATURE)
    top_p = _number(body, "top_p", 1.0, low=0.0, high=1.0)
    if top_p == 0:
        raise bad_value("top_p", "top_p must be greater than 0 and at most 1")
    top_k = _integer(body, "top_k", 0, low=0)
    seed_value = body.get("seed")
    seed = None if seed_value is None else _integer(body, "seed", 0)
    stop = _stop(body.get("stop"))
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise bad_value("stream_options", "stream_options must be an object")
        if not stream:
            raise bad_value("stream_options", "stream_options is only allowed with stream=true")
        include_usage = _flag(options, "include_usage")
    request = GenerationRequest(
        endpoint=endpoint,
        model=model,
        prompt=prompt,
        messages=messages,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        stop=stop,
        stream=stream,
        include_usage=include_usage,
    )
    try:  # the shared rules of SamplingParams, checked once here too
        request.params(max_tokens or 1, 0)
    except ConfigError as exc:
        raise ApiError(str(exc)) from exc
    return request


def _prompt(value: object) -> str | tuple[int, ...]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # one prompt given as a batch of one
    if isinstance(value, str):
        if not value:
            raise bad_value("prompt", "prompt must not be empty")
        return value
    if isinstance(value, list) and value and all(_is_int(t) and t >= 0 for t in value):
        return tuple(int(t) for t in value)
    if isinstance(value, list) and len(value) > 1:
        raise bad_value("prompt", "only one prompt per request is supported (got a batch)")
    raise bad_value("prompt", "prompt must be a non-empty string or a non-empty list of token ids")


def _messages(value: object) -> tuple[ChatMessage, ...]:
    if not isinstance(value, list) or not value:
        raise bad_value("messages", "messages must be a non-empty array")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_value(where, f"{where} must be an object with role and content")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise bad_value(f"{where}.role", f"{where}.role must be one of {', '.join(CHAT_ROLES)}")
        out.append(ChatMessage(role=str(role), content=_content(message.get("content"), where)))
    return tuple(out)


def _content(value: object, where: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # content parts: only text parts can be honoured
        texts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise bad_value(f"{where}.content", "only text content parts are supported")
            text = part.get("text")
            if not isinstance(text, str):
                raise bad_value(f"{where}.content", "a text content part needs a string text")
            texts.append(text)
        return "".join(texts)
    raise bad_value(f"{where}.content", f"{where}.content must be a string or text parts")


def _max_tokens(body: dict[str, Any]) -> int | None:
    for field in ("max_completion_tokens", "max_tokens"):
        if body.get(field) is not None:
            return _integer(body, field, 0, low=1)
    return None


def _stop(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_value("stop", "stop must be a string or an array of strings")
    if len(stops) > MAX_STOP:
        raise bad_value("stop", f"at most {MAX_STOP} stop sequences, got {len(stops)}")
    if any(not s for s in stops):
        raise bad_value("stop", "stop sequences must not be empty")
    return tuple(dict.fromkeys(stops))


def _flag(body: dict[str, Any], field: str) -> bool:
    value = body.get(field)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_value(field, f"{field} must be a boolean, got {value!r}")
    return value


def _number(body: dict[str, Any], field: str, default: float, *, low: float, high: float) -> float:
    value = body.get(field)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_value(field, f"{field} must be a number, got {value!r}")
    if not low <= value <= high:
        raise bad_value(
            field, f"{value} is not a valid {field}: it must be between {low:g} and {high:g}"
        )
    return float(value)


def _integer(body: dict[str, Any], field: str, default: int, *, low: int | None = None) -> int:
    value = body.get(field)
    if value is None:
        return default
    if not _is_int(value):
        raise bad_value(field, f"{field} must be an integer, got {value!r}")
    if low is not None and value < low:
        raise bad_value(field, f"{field} must be at least {low}, got {value}")
    return int(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
