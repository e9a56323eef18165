"""What a generation run's messages carry as plain lists and maps: read back exactly,
every misfit refused with a ProtocolError that names it."""

from __future__ import annotations

from typing import Any

import pytest

from zpipe._errors import ProtocolError
from zpipe.generation.params import SamplingParams, TokenEvent
from zpipe.generation.refusals import REFUSAL_KINDS, kind_from_wire
from zpipe.generation.sequences import Row
from zpipe.generation.wire import (
    events_from_wire,
    events_to_wire,
    params_from_map,
    params_to_map,
    rows_from_wire,
    rows_to_wire,
    sampling_from_wire,
    sampling_to_wire,
    tokens_from_wire,
)


def test_sampling_params_round_trip() -> None:
    params = SamplingParams(
        max_tokens=7,
        temperature=0.8,
        top_k=5,
        top_p=0.9,
        seed=-3,
        stop=("x", "yz"),
        stop_at_eos=False,
    )
    assert params_from_map(params_to_map(params)) == params
    assert params_from_map({}) == SamplingParams()


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ([], "must be a map"),
        ({"temprature": 1.0}, "unknown fields"),
        ({"max_tokens": 0}, "max_tokens must be at least 1"),
        ({"top_p": 1.5}, "top_p must be in"),
        ({"stop": "x"}, "stop must be a list"),
        ({"stop": [3]}, "stop strings must be non-empty strings"),
    ],
)
def test_bad_sampling_params_are_refused(body: Any, words: str) -> None:
    with pytest.raises(ProtocolError, match=words):
        params_from_map(body)


def test_rows_round_trip() -> None:
    rows = [Row(3, (1, 2, 3), 0, None, 10), Row(4, (9,), 6, 2, 12)]
    assert rows_from_wire(rows_to_wire(rows)) == [(3, 0, 3, None, 10), (4, 6, 1, 2, 12)]


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ([], "non-empty list"),
        ([[1, 0, 3, None]], r"must be \[sequence"),
        ([[-1, 0, 3, None, 5]], "sequence must be an integer >= 0"),
        ([[1, 0, 0, None, 5]], "length must be an integer >= 1"),
        ([[1, 4, 3, None, 5]], "exceed the reservation"),
        ([[1, 0, 1, True, 5]], "sample index must be an integer"),
        ([[1, 0, 1, None, 5], [1, 1, 1, 0, 5]], "appears twice"),
    ],
)
def test_bad_rows_are_refused(body: Any, words: str) -> None:
    with pytest.raises(ProtocolError, match=words):
        rows_from_wire(body)


def test_sampling_settings_round_trip_and_must_match_the_sampling_rows() -> None:
    params = [SamplingParams(), SamplingParams(temperature=0.7, top_k=3, top_p=0.5, seed=9)]
    back = sampling_from_wire(sampling_to_wire(params), 2)
    assert [(p.temperature, p.top_k, p.top_p, p.seed) for p in back] == [
        (0.0, 0, 1.0, 0),
        (0.7, 3, 0.5, 9),
    ]
    with pytest.raises(ProtocolError, match="must list 1 settings"):
        sampling_from_wire(sampling_to_wire(params), 1)
    with pytest.raises(ProtocolError, match="temperature must be a finite number"):
        sampling_from_wire([[-1.0, 0, 1.0, 0]], 1)
    with pytest.raises(ProtocolError, match="seed must be an integer"):
        sampling_from_wire([[0.0, 0, 1.0, 1.5]], 1)


def test_tokens_are_non_negative_integers() -> None:
    assert tokens_from_wire([0, 5]) == [0, 5]
    with pytest.raises(ProtocolError, match=r"tokens\[1\] must be an integer >= 0"):
        tokens_from_wire([0, -1])
    with pytest.raises(ProtocolError, match="must be a list"):
        tokens_from_wire({"a": 1})


def test_token_events_round_trip_in_order() -> None:
    events = [
        TokenEvent(3, 0, 17),
        TokenEvent(1, 4, 0, "héllo", None),
        TokenEvent(3, 1, 9, "", "stop"),
    ]
    wire = events_to_wire(events)
    assert wire[0] == [3, 0, 17, None, None]  # no text: null, as gen_token left it out
    assert events_from_wire(wire) == events


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ([], "non-empty list"),
        ({"a": 1}, "non-empty list"),
        ([[1, 0, 2, None]], "event 0 must be"),
        ([[1, 0, 2, None, None], "x"], "event 1 must be"),
        ([[-1, 0, 2, None, None]], "event 0: sequence"),
        ([[1, True, 2, None, None]], "event 0: index"),
        ([[1, 0, 2.5, None, None]], "event 0: token"),
        ([[1, 0, 2, 5, None]], "event 0: text"),
        ([[1, 0, 2, None, "tired"]], "unknown finish reason 'tired'"),
    ],
)
def test_bad_token_events_are_refused_by_name(body: Any, words: str) -> None:
    with pytest.raises(ProtocolError, match=words):
        events_from_wire(body)


def test_refusal_kinds_read_from_the_wire() -> None:
    assert [kind_from_wire(k) for k in REFUSAL_KINDS] == list(REFUSAL_KINDS)
    assert kind_from_wire(None) is None and kind_from_wire("newer") is None
