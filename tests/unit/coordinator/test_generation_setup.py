"""A generation run's set-up, fed to the coordinator's core: bounds, each stage's
gen_setup (its neighbours, the ring, the client's sink), the answer to the client."""

from __future__ import annotations

from typing import Any

import pytest

from tests._support.coordinator_harness import Harness
from zpipe._errors import ConfigError
from zpipe.coordinator.runs.generation import (
    blocks_in,
    generation_bounds,
    kv_budget_tokens,
)
from zpipe.models import ModelSpec
from zpipe.models.causal_lm import kv_bytes_per_token_per_block, read_causal_lm_config
from zpipe.protocol.generation import GenSetup

SPEC = ModelSpec.preset("llama-tiny")
CONFIG = read_causal_lm_config(SPEC.config)


def _request(**changes: Any) -> dict[str, Any]:
    return {
        "model": SPEC.to_dict(),
        "sink_endpoint": "tcp://client:9",
        "max_context": 32,
        "max_sequences": 4,
        "steps_in_flight": 3,
        "chunk_tokens": 8,
        "wait_for_stages_s": 0.0,
        **changes,
    }


def _started(names: list[str], **changes: Any) -> Harness:
    h = Harness()
    for name in names:
        h.register(name)
    h.client("gen_run_request", **_request(**{"stage_names": names, **changes}))
    return h


def test_every_stage_gets_its_units_and_neighbours_and_the_ring_closes() -> None:
    names = ["a", "b", "c"]
    h = _started(names)
    setups = [GenSetup.from_message(h.to(name, "gen_setup")[0]) for name in names]
    n = CONFIG.num_units
    assert [(s.start, s.end) for s in setups] == generation_bounds(n, 3)
    assert setups[0].start == 0 and setups[-1].end == n
    assert [s.upstream for s in setups] == ["c", "a", "b"]  # the first hears the last
    assert [s.downstream for s in setups] == ["b", "c", "a"]  # the last sends to the first
    assert [s.downstream_endpoint for s in setups] == ["tcp://b:1", "tcp://c:1", "tcp://a:1"]
    # only the first stage takes the client's sequences and streams to its sink
    assert [s.sink_endpoint for s in setups] == ["tcp://client:9", None, None]
    assert len({s.run for s in setups}) == 1 and len({s.epoch for s in setups}) == 1
    assert not h.to_client("gen_run_ready")  # not before every stage is built
    run = setups[0].run
    h.answer_all("gen_ready", names, run=run)
    (ready,) = h.to_client("gen_run_ready")
    assert ready.body["stages"] == names
    assert ready.body["first_endpoint"] == "tcp://a:1"
    assert ready.body["bounds"] == [[s.start, s.end] for s in setups]


def test_one_stage_is_its_own_ring() -> None:
    h = _started(["solo"])
    setup = GenSetup.from_message(h.to("solo", "gen_setup")[0])
    assert (setup.start, setup.end) == (0, CONFIG.num_units)
    assert setup.upstream == setup.downstream == ""
    assert setup.downstream_endpoint is None


def test_a_stage_that_refuses_fails_the_run_with_its_reason() -> None:
    h = _started(["a", "b"])
    run = GenSetup.from_message(h.to("a", "gen_setup")[0]).run
    h.stage("a", "gen_ready", run=run)
    h.stage("b", "gen_ready", run=run, error="KvCacheFullError: no room")
    assert not h.to_client("gen_run_ready")
    (failed,) = h.to_client("run_failed")
    assert "no room" in failed.body["error"] and "'b'" in failed.body["error"]


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"partition": [1, 1]}, "covers 2 units"),
        ({"max_context": 10_000}, "exceeds the model's"),
        ({"steps_in_flight": 0}, "steps_in_flight must be >= 1"),
        ({"dtype": "int8"}, "dtype must be one of"),
        ({"model": ModelSpec("mlp", {"dims": [4, 4]}).to_dict()}, "needs a 'causal_lm' model"),
        ({"stage_names": None, "stages": -1}, "at least one stage"),
        ({"stage_names": ["a", "a"]}, "name each stage once"),
    ],
)
def test_a_bad_request_fails_before_any_stage_hears_of_it(
    changes: dict[str, Any], words: str
) -> None:
    h = _started(["a", "b"], **changes)
    assert not h.to("a", "gen_setup") and not h.to("b", "gen_setup")
    (failed,) = h.to_client("run_failed")
    assert words in failed.body["error"]


def test_even_bounds_split_the_units_the_first_stages_take_the_rest() -> None:
    assert generation_bounds(5, 1) == [(0, 5)]
    assert generation_bounds(5, 2) == [(0, 3), (3, 5)]
    assert generation_bounds(5, 3) == [(0, 2), (2, 4), (4, 5)]
    assert generation_bounds(5, 3, [1, 3, 1]) == [(0, 1), (1, 4), (4, 5)]
    with pytest.raises(ConfigError, match="cannot split"):
        generation_bounds(2, 3)
    with pytest.raises(ConfigError, match="positive unit counts"):
        generation_bounds(5, 2, [0, 5])
    with pytest.raises(ConfigError, match="has 2 stages, the run 3"):
        generation_bounds(5, 3, [2, 3])


def test_the_token_budget_is_the_stage_with_the_most_blocks() -> None:
    per_block = kv_bytes_per_token_per_block(CONFIG)
    n = CONFIG.num_units
    bounds = generation_bounds(n, 2, [1, n - 1])  # the second stage holds every block
    blocks = blocks_in(CONFIG, *bounds[1])
    assert blocks == n - 2 and blocks_in(CONFIG, *bounds[0]) == 0
    budget = 100 * per_block * blocks + 1  # room for 100 tokens, and a byte
    assert kv_budget_tokens(CONFIG, bounds, budget, None) == 100
    # half the bytes per element: twice the tokens
    assert kv_budget_tokens(CONFIG, bounds, budget, "bfloat16") == 200
    assert kv_budget_tokens(CONFIG, bounds, None, None) is None
    with pytest.raises(ConfigError, match="holds no token"):
        kv_budget_tokens(CONFIG, bounds, per_block, None)
