"""A generation run's client settings are checked before anything is sent."""

from __future__ import annotations

from typing import Any

import pytest

from zpipe._errors import ConfigError
from zpipe.client.runs.generation import GenerateOptions, params_for
from zpipe.generation.params import SamplingParams


@pytest.mark.parametrize(
    ("keywords", "words"),
    [
        ({}, "stages, stage_names or partition"),
        ({"stages": 0}, "stages must be a positive integer"),
        ({"stages": 2, "max_sequences": 0}, "max_sequences must be a positive integer"),
        ({"stages": 2, "chunk_tokens": True}, "chunk_tokens must be a positive integer"),
        ({"stages": 2, "dtype": "int8"}, "dtype must be one of"),
        ({"stages": 2, "token_timeout_s": 0}, "token_timeout_s must be > 0"),
        ({"stages": 2, "microbatch_size": 4}, "unknown generate settings"),
    ],
)
def test_bad_settings_are_refused(keywords: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        GenerateOptions.from_keywords(None, keywords)


def test_the_stage_count_comes_from_whichever_setting_names_the_stages() -> None:
    assert GenerateOptions(stages=3).stage_count == 3
    assert GenerateOptions(stage_names=["a", "b"]).stage_count == 2
    assert GenerateOptions(partition=[1, 2, 1, 1]).stage_count == 4
    base = GenerateOptions(stages=3)
    assert GenerateOptions.from_keywords(base, {"chunk_tokens": 4}).chunk_tokens == 4


def test_one_sampling_setting_for_all_prompts_or_one_each() -> None:
    hot = SamplingParams(temperature=0.5)
    assert params_for(None, 2) == [SamplingParams()] * 2
    assert params_for(hot, 3) == [hot] * 3
    assert params_for([hot, SamplingParams()], 2) == [hot, SamplingParams()]
    with pytest.raises(ConfigError, match="one for each of the 3 prompts"):
        params_for([hot], 3)
