"""The bodies the endpoint returns, in OpenAI's formats (pure).

A completion (``object: text_completion``), a chat completion
(``chat.completion``), their stream chunks (``text_completion`` and
``chat.completion.chunk``), the model list, and ``usage``. Built here and only
here, so the two endpoints and the two modes (streamed or not) cannot drift.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from zpipe.generation import FinishReason
from zpipe.serve.requests import Endpoint

DONE = b"data: [DONE]\n\n"


def api_finish_reason(reason: FinishReason | None) -> str | None:
    """OpenAI knows "stop" (end of sequence or a stop string) and "length"."""
    if reason is None:
        return None
    return "length" if reason == "length" else "stop"


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    def body(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


@dataclass(frozen=True)
class ResponseHead:
    """What every body of one response shares."""

    endpoint: Endpoint
    id: str
    created: int
    model: str

    def _common(self, object_: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_, "created": self.created, "model": self.model}

    def response(self, text: str, finish: FinishReason | None, usage: Usage) -> dict[str, Any]:
        """The whole (non-streamed) response."""
        reason = api_finish_reason(finish)
        choice: dict[str, Any]
        if self.endpoint == "chat":
            body = self._common("chat.completion")
            message = {"role": "assistant", "content": text}
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": reason}
        else:
            body = self._common("text_completion")
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        body["choices"] = [choice]
        body["usage"] = usage.body()
        return body

    def chunk(
        self, text: str | None, finish: FinishReason | None = None, *, first: bool = False
    ) -> dict[str, Any]:
        """One streamed chunk: a piece of text (chat's first chunk also names the
        role), or, with ``finish``, the chunk that says why the choice ended."""
        reason = api_finish_reason(finish)
        choice: dict[str, Any]
        if self.endpoint == "chat":
            body = self._common("chat.completion.chunk")
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            body = self._common("text_completion")
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        body["choices"] = [choice]
        return body

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        """The last chunk when ``stream_options.include_usage`` asked for it."""
        object_ = "chat.completion.chunk" if self.endpoint == "chat" else "text_completion"
        body = self._common(object_)
        body["choices"] = []
        body["usage"] = usage.body()
        return body


def model_card(model_id: str, created: int) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "zpipe"}


def model_list(model_id: str, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(model_id, created)]}


def sse(body: dict[str, Any]) -> bytes:
    """One server-sent event carrying a JSON body."""
    return b"data: " + json.dumps(body, ensure_ascii=False).encode("utf-8") + b"\n\n"
