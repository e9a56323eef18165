from __future__ import annotations

import pytest

from zpipe._errors import ConfigError
from zpipe.generation import SamplingParams


def test_defaults_are_greedy_and_valid() -> None:
    params = SamplingParams()
    assert params.greedy and params.max_tokens == 16 and params.stop == ()
    assert not SamplingParams(temperature=0.7).greedy


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("max_tokens", 0, "at least 1"),
        ("max_tokens", 2.0, "integer"),
        ("max_tokens", True, "integer"),
        ("temperature", -0.1, ">= 0"),
        ("temperature", float("nan"), "finite"),
        ("top_k", -1, "top_k"),
        ("top_p", 0.0, "(0, 1]"),
        ("top_p", 1.5, "(0, 1]"),
        ("seed", "7", "seed"),
        ("stop", ("",), "non-empty"),
        ("stop", tuple("x" * (i + 1) for i in range(17)), "at most 16"),
    ],
)
def test_bad_values_are_refused_with_what_to_fix(field: str, value: object, words: str) -> None:
    with pytest.raises(ConfigError, match=r".*" + words.replace("(", r"\(").replace("]", r"\]")):
        SamplingParams(**{field: value})  # type: ignore[arg-type]
