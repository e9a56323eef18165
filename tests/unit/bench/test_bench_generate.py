"""bench/generate.py's pieces that need no process: its model and prompts, the
transformers baseline (run in this process on a tiny model), the decode-rate and
memory arithmetic (the timed comparison itself runs only in the bench)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from bench._generate_hf import run as hf_run
from bench._generate_memory import cpu_s, reset_peak, status_kib
from bench.generate import (
    _cpu_per_token,
    _decode_rate,
    _even,
    _model,
    _phases_over_base,
    _predicted,
    _prompts,
    _ratio,
)
from zpipe.models import ModelSpec
from zpipe.models.causal_lm import read_causal_lm_config
from zpipe.planner.memory import runtime_bytes


def _args(**changes: object) -> argparse.Namespace:
    base = {
        "hidden": 32,
        "intermediate": 48,
        "layers": 2,
        "heads": 4,
        "kv_heads": 2,
        "vocab": 50,
        "sequences": 3,
        "steps_in_flight": 3,
        "prompt_tokens": 5,
        "new_tokens": 4,
        "repeats": 1,
        "seed": 0,
        "hf_threads": 1,
    }
    return argparse.Namespace(**{**base, **changes})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ModelSpec]:
    directory = tmp_path_factory.mktemp("bench-generate")
    return directory, _model(_args(), directory)


def test_the_model_and_prompts_are_seeded_and_the_baseline_generates_greedily(
    checkpoint: tuple[Path, ModelSpec],
) -> None:
    args = _args()
    tmp_path, spec = checkpoint
    config = read_causal_lm_config(spec.config)
    assert (config.num_kv_heads, config.num_heads, config.num_layers) == (2, 4, 2)
    assert config.max_positions == args.prompt_tokens + args.new_tokens
    prompts = _prompts(args)
    assert prompts == _prompts(args) != _prompts(_args(seed=1))
    assert [len(p) for p in prompts] == [5, 5, 5]  # equal lengths: no padding
    assert all(1 <= t < args.vocab for p in prompts for t in p)
    out = hf_run(
        {
            "directory": str(tmp_path),
            "prompts": prompts,
            "new_tokens": 3,
            "repeats": 2,
            "threads": 1,
        }
    )
    assert len(out["times_1"]) == len(out["times_n"]) == len(out["cpu_n"]) == 2
    assert sum(out["cpu_n"]) > 0
    assert [len(t) for t in out["tokens_single"]] == [3, 3, 3]
    assert out["tokens_batched"] == out["tokens_single"]
    assert out["peak_kib"] >= out["rss_before_kib"] > 0


def test_the_decode_rate_counts_every_token_after_the_first() -> None:
    # 3 sequences, 11 new tokens: 30 decode tokens in the 2 s between the two medians
    assert _decode_rate(3, 11, [1.0, 5.0, 1.0], [3.0, 3.0, 9.0]) == pytest.approx(15.0)
    assert _decode_rate(3, 11, [2.0], [2.0]) is None
    assert _cpu_per_token(3, 11, [0.5], [3.5]) == pytest.approx(100.0)  # ms per token
    assert _ratio(1.0, 4.0) == 0.25 and _ratio(None, 1.0) is None and _ratio(1.0, 0.0) is None
    assert _even(7, 3) == [3, 2, 2] and sum(_even(10, 3)) == 10


def test_predicted_memory_grows_with_the_sequences_and_counts_the_runtime(
    checkpoint: tuple[Path, ModelSpec],
) -> None:
    args = _args()
    spec = checkpoint[1]
    bounds = [[0, 2], [2, 3], [3, 4]]
    one = _predicted(spec, args, 1, bounds)
    three = _predicted(spec, args, 3, bounds)
    assert len(one) == 3 and all(p.total > 0 for p in one)
    assert three[1].kv_cache > one[1].kv_cache  # a stage with a block keeps a cache per sequence
    assert three[2].kv_cache == one[2].kv_cache == 0  # the head keeps none
    # what the bench compares with a stage's memory beyond its base: the model's part
    # and the runtime's, which a stage's room leaves out as it leaves out the base
    assert all(p.above_base == p.total + runtime_bytes(False) for p in three)


def test_phases_are_shown_over_each_stages_base() -> None:
    phases = {
        "ready": {"s0": {"VmRSS": 2048, "RssAnon": 1024, "RssFile": 1024, "VmHWM": 3072}},
        "warm": {"s0": {"VmRSS": 4096, "RssAnon": 2048, "RssFile": 2048, "VmHWM": None}},
    }
    got = _phases_over_base(phases, {"s0": 1024})
    assert got == {
        "s0": {
            "ready": {"VmRSS": 1.0, "RssAnon": 1.0, "RssFile": 1.0, "VmHWM": 2.0},
            "warm": {"VmRSS": 3.0, "RssAnon": 2.0, "RssFile": 2.0},
        }
    }
    assert _phases_over_base(None, {}) is None


def test_resident_memory_and_cpu_time_are_read_and_the_peak_reset() -> None:
    before = cpu_s()
    assert before is not None
    sum(i * i for i in range(2_000_000))  # some CPU: the ticks move
    after = cpu_s()
    assert after is not None and after > before
    rss = status_kib("VmRSS")
    assert rss is not None and rss > 0
    assert status_kib("NoSuchKey") is None
    if reset_peak():  # Linux 4.0+: the peak is the resident set again
        peak = status_kib("VmHWM")
        assert peak is not None and peak <= rss * 2
