"""A chat's messages into prompt tokens, with the chat template of the tokenizer's
configuration (``tokenizer_config.json`` or ``chat_template.jinja``).

A model without a template gets a clear 400 rather than a made-up format: the
format a model was trained on is part of the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from zpipe.serve.errors import ApiError
from zpipe.serve.requests import ChatMessage


def chat_prompt_ids(tokenizer: Any | None, messages: Sequence[ChatMessage]) -> list[int]:
    """The prompt of a chat: the template rendered with the assistant's turn opened,
    then tokenized without adding special tokens again (the template has them)."""
    if tokenizer is None:
        raise ApiError(
            "this model has no tokenizer, so it cannot serve chat completions; "
            "use /v1/completions with a list of token ids",
            param="messages",
            code="no_tokenizer",
        )
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError(
            "this model's tokenizer configuration has no chat template, so it cannot "
            "serve chat completions; use /v1/completions",
            param="messages",
            code="no_chat_template",
        )
    conversation = [{"role": m.role, "content": m.content} for m in messages]
    try:
        text = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=False
        )
    except Exception as exc:  # a template may raise on a conversation it refuses
        raise ApiError(
            f"the chat template refused these messages: {exc}", param="messages"
        ) from exc
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
