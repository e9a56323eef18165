"""What a generation run's messages carry as plain lists and maps, read and written.

The protocol (zpipe.protocol.generation) checks each field's msgpack type; this
module gives the nested values their meaning and checks every one, so a stage
or client never indexes a peer's list blindly:

    params     SamplingParams <-> map (gen_submit)
    rows       Row <-> [sequence, position, length, sample_index or null, reserved]
    sampling   a sampling row's settings <-> [temperature, top_k, top_p, seed]
    tokens     a list of token ids >= 0
    events     TokenEvent <-> [sequence, index, token, text or null, finish or null]
               (gen_token_batch)

Every misfit is a ProtocolError that names the field.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from zpipe._errors import ConfigError, ProtocolError
from zpipe.generation.params import FinishReason, SamplingParams, TokenEvent
from zpipe.generation.sequences import Row
from zpipe.protocol.generation import GenSetup

# The dtypes a generation run's stages may compute in, and their bytes per element
# (the KV cache's size).
DTYPE_BYTES = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2}

_PARAM_FIELDS = tuple(f.name for f in fields(SamplingParams))


def check_dtype(dtype: str | None) -> None:
    """ConfigError unless ``dtype`` (None: float32) is one a generation run computes in."""
    if dtype is not None and dtype not in DTYPE_BYTES:
        raise ConfigError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")


def check_setup(setup: GenSetup) -> None:
    """ProtocolError unless a ``gen_setup`` describes a place in a ring this stage can take."""
    if not 0 <= setup.index < setup.num_stages:
        raise ProtocolError(f"gen_setup: index {setup.index} of {setup.num_stages} stages")
    if setup.num_stages > 1 and not (setup.upstream and setup.downstream):
        raise ProtocolError("gen_setup: a stage of a ring needs its upstream and downstream")
    if setup.index == 0 and not setup.sink_endpoint:
        raise ProtocolError("gen_setup: the first stage needs the client's sink")
    if setup.dtype is not None and setup.dtype not in DTYPE_BYTES:
        raise ProtocolError(f"gen_setup: unknown dtype {setup.dtype!r}")


def _int(value: Any, what: str, *, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ProtocolError(f"{what} must be an integer >= {low}, got {value!r}")
    return value


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProtocolError(f"{what} must be a number, got {value!r}")
    return float(value)


def params_to_map(params: SamplingParams) -> dict[str, Any]:
    out: dict[str, Any] = {name: getattr(params, name) for name in _PARAM_FIELDS}
    out["stop"] = list(params.stop)
    return out


def params_from_map(body: Any) -> SamplingParams:
    """The SamplingParams a ``gen_submit`` carries; ProtocolError if a key is unknown
    or a value is refused (its ConfigError's words)."""
    if not isinstance(body, dict):
        raise ProtocolError("params must be a map")
    unknown = sorted(set(body) - set(_PARAM_FIELDS))
    if unknown:
        raise ProtocolError(f"params: unknown fields {unknown}")
    values = dict(body)
    if "stop" in values:
        stop = values["stop"]
        if not isinstance(stop, list):
            raise ProtocolError("params: stop must be a list of strings")
        values["stop"] = tuple(stop)
    try:
        return SamplingParams(**values)
    except (ConfigError, TypeError) as exc:
        raise ProtocolError(f"params: {exc}") from None


def rows_to_wire(rows: Sequence[Row]) -> list[list[Any]]:
    return [
        [r.sequence, r.position, len(r.tokens), r.sample_index, r.reserved_tokens] for r in rows
    ]


def rows_from_wire(body: Any) -> list[tuple[int, int, int, int | None, int]]:
    """``[(sequence, position, length, sample_index, reserved)]``, each checked: a
    sequence appears once, a row feeds at least one token within its reservation."""
    if not isinstance(body, list) or not body:
        raise ProtocolError("rows must be a non-empty list")
    out = []
    seen: set[int] = set()
    for i, row in enumerate(body):
        if not isinstance(row, list) or len(row) != 5:
            raise ProtocolError(f"row {i} must be [sequence, position, length, sample, reserved]")
        sequence = _int(row[0], f"row {i}: sequence")
        position = _int(row[1], f"row {i}: position")
        length = _int(row[2], f"row {i}: length", low=1)
        sample = None if row[3] is None else _int(row[3], f"row {i}: sample index")
        reserved = _int(row[4], f"row {i}: reserved", low=1)
        if position + length > reserved:
            raise ProtocolError(
                f"row {i}: positions {position}..{position + length - 1} exceed the "
                f"reservation of {reserved} tokens"
            )
        if sequence in seen:
            raise ProtocolError(f"row {i}: sequence {sequence} appears twice in one step")
        seen.add(sequence)
        out.append((sequence, position, length, sample, reserved))
    return out


def sampling_to_wire(params: Sequence[SamplingParams]) -> list[list[Any]]:
    return [[p.temperature, p.top_k, p.top_p, p.seed] for p in params]


def sampling_from_wire(body: Any, count: int) -> list[SamplingParams]:
    """The settings of ``count`` sampling rows (what the last stage samples with)."""
    if not isinstance(body, list) or len(body) != count:
        raise ProtocolError(f"sampling must list {count} settings, one per sampling row")
    out = []
    for i, item in enumerate(body):
        if not isinstance(item, list) or len(item) != 4:
            raise ProtocolError(f"sampling {i} must be [temperature, top_k, top_p, seed]")
        temperature = _number(item[0], f"sampling {i}: temperature")
        top_p = _number(item[2], f"sampling {i}: top_p")
        top_k = _int(item[1], f"sampling {i}: top_k")
        seed = item[3]
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ProtocolError(f"sampling {i}: seed must be an integer, got {seed!r}")
        try:
            out.append(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed))
        except ConfigError as exc:
            raise ProtocolError(f"sampling {i}: {exc}") from None
    return out


def tokens_from_wire(body: Any, what: str = "tokens") -> list[int]:
    if not isinstance(body, list):
        raise ProtocolError(f"{what} must be a list")
    return [_int(t, f"{what}[{i}]") for i, t in enumerate(body)]


_FINISH_REASONS: tuple[FinishReason, ...] = ("length", "eos", "stop", "cancelled")


def finish_from_wire(value: Any, what: str = "finish") -> FinishReason | None:
    """A finish reason this version knows, or None; ProtocolError for any other."""
    if value is None:
        return None
    for reason in _FINISH_REASONS:
        if value == reason:
            return reason
    raise ProtocolError(f"{what}: unknown finish reason {value!r}")


def events_to_wire(events: Sequence[TokenEvent]) -> list[list[Any]]:
    return [[e.sequence, e.index, e.token, e.text or None, e.finish_reason] for e in events]


def events_from_wire(body: Any) -> list[TokenEvent]:
    """A ``gen_token_batch``'s events, in order, each checked."""
    if not isinstance(body, list) or not body:
        raise ProtocolError("events must be a non-empty list")
    out = []
    for i, item in enumerate(body):
        if not isinstance(item, list) or len(item) != 5:
            raise ProtocolError(f"event {i} must be [sequence, index, token, text, finish]")
        sequence = _int(item[0], f"event {i}: sequence")
        index = _int(item[1], f"event {i}: index")
        token = _int(item[2], f"event {i}: token")
        text = item[3]
        if text is not None and not isinstance(text, str):
            raise ProtocolError(f"event {i}: text must be a string or null, got {text!r}")
        finish = finish_from_wire(item[4], f"event {i}: finish")
        out.append(TokenEvent(sequence, index, token, text or "", finish))
    return out
