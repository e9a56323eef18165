from __future__ import annotations

from collections.abc import Sequence

import pytest

from zpipe._errors import ConfigError
from zpipe.generation import SamplingParams
from zpipe.generation.stopping import SkipSpecialTokens, StopChecker, eos_ids_from

EOS = 0


class ByteTokenizer:
    """A toy tokenizer: each id is a byte string; text is their UTF-8 decoding, so a
    character may span tokens (like byte-level BPE)."""

    def __init__(self, pieces: dict[int, bytes]) -> None:
        self.pieces = pieces
        self.ids = {v: k for k, v in pieces.items()}

    def decode(self, ids: Sequence[int]) -> str:
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")

    def encode(self, *pieces: bytes) -> list[int]:
        return [self.ids[p] for p in pieces]


TOK = ByteTokenizer(
    {
        1: b"Hello",
        2: b" wor",
        3: b"ld",
        4: b"!",
        5: b"\n",
        6: b"\nUser",
        7: b":",
        8: b"\xc3",  # the two bytes of "é"
        9: b"\xa9",
        10: b"caf",
        11: b"END",
        12: b"EN",
        13: b"x",
    }
)


def _run(params: SamplingParams, ids: list[int]) -> tuple[list[str], str | None, StopChecker]:
    checker = StopChecker(params, eos_ids={EOS}, detokenizer=TOK)
    deltas: list[str] = []
    for token in ids:
        decision = checker.push(token)
        deltas.append(decision.text)
        if decision.finish_reason is not None:
            return deltas, decision.finish_reason, checker
    return deltas, None, checker


def test_max_tokens_stops_with_length_and_all_text() -> None:
    deltas, reason, checker = _run(SamplingParams(max_tokens=3), [1, 2, 3, 4])
    assert reason == "length" and deltas == ["Hello", " wor", "ld"]
    assert checker.tokens == (1, 2, 3) and checker.text == "Hello world"


def test_eos_stops_and_adds_no_text() -> None:
    deltas, reason, checker = _run(SamplingParams(max_tokens=10), [1, 2, EOS, 3])
    assert reason == "eos" and deltas == ["Hello", " wor", ""]
    assert checker.tokens == (1, 2, EOS)
    # stop_at_eos=False runs on to max_tokens
    _, reason, checker = _run(SamplingParams(max_tokens=4, stop_at_eos=False), [1, EOS, 2, 3])
    assert reason == "length" and checker.tokens == (1, EOS, 2, 3)


def test_stop_string_is_never_emitted_and_its_possible_start_is_held_back() -> None:
    params = SamplingParams(max_tokens=20, stop=("\nUser:",))
    deltas, reason, checker = _run(params, [1, 5, 2, 6, 7, 1])
    # "\n" could start "\nUser:": held; " wor" shows it was not; "\nUser" held; ":" stops
    assert deltas == ["Hello", "", "\n wor", "", ""]
    assert reason == "stop" and checker.text == "Hello\n wor"
    assert checker.tokens == (1, 5, 2, 6, 7)


def test_a_stop_string_inside_one_token_cuts_the_text_there() -> None:
    params = SamplingParams(max_tokens=20, stop=("ld",))
    deltas, reason, _ = _run(params, [1, 2, 3])
    assert deltas == ["Hello", " wor", ""] and reason == "stop"
    params = SamplingParams(max_tokens=20, stop=("o w",))
    deltas, reason, checker = _run(params, [1, 2])
    # "Hello" ends with "o", the start of "o w": held, then the stop cuts before it
    assert deltas == ["Hell", ""] and reason == "stop" and checker.text == "Hell"


def test_the_earliest_of_several_stop_strings_wins() -> None:
    params = SamplingParams(max_tokens=20, stop=("!", "wor"))
    deltas, reason, checker = _run(params, [1, 2, 4])
    assert reason == "stop" and checker.text == "Hello " and "".join(deltas) == "Hello "


def test_held_text_is_flushed_when_the_sequence_ends_otherwise() -> None:
    params = SamplingParams(max_tokens=3, stop=("END",))
    deltas, reason, checker = _run(params, [1, 2, 12])
    assert reason == "length" and deltas == ["Hello", " wor", "EN"]
    params = SamplingParams(max_tokens=9, stop=("END",))
    deltas, reason, checker = _run(params, [1, 12, EOS])
    assert reason == "eos" and deltas == ["Hello", "", "EN"] and checker.text == "HelloEN"
    deltas, reason, checker = _run(params, [1, 12, 13, 11])
    assert deltas == ["Hello", "", "ENx", ""] and reason == "stop"


def test_a_character_split_across_tokens_streams_once_whole() -> None:
    params = SamplingParams(max_tokens=10)
    deltas, reason, checker = _run(params, [10, 8, 9, 4])
    assert deltas == ["caf", "", "é", "!"] and reason is None
    # a stop string that ends in a multi-byte character
    params = SamplingParams(max_tokens=10, stop=("é",))
    deltas, reason, checker = _run(params, [10, 8, 9, 4])
    assert deltas == ["caf", "", ""] and reason == "stop" and checker.text == "caf"


def test_without_a_tokenizer_there_is_no_text_and_stop_strings_are_refused() -> None:
    checker = StopChecker(SamplingParams(max_tokens=2), eos_ids={EOS})
    assert checker.push(5).text == "" and checker.push(6).finish_reason == "length"
    with pytest.raises(ValueError, match="already finished"):
        checker.push(7)
    with pytest.raises(ConfigError, match="need a tokenizer"):
        StopChecker(SamplingParams(stop=("x",)))


def test_a_tokenizer_that_rewrites_streamed_text_does_not_repeat_it() -> None:
    class Respacing:
        def decode(self, ids: Sequence[int]) -> str:
            # a merge that changes text already streamed: "a" then "A b"
            return {1: "a", 2: "A b", 3: "A bc"}[len(ids)]

    checker = StopChecker(SamplingParams(max_tokens=3), detokenizer=Respacing())
    assert [checker.push(t).text for t in (5, 6, 7)] == ["a", " b", "c"]


def test_eos_ids_from_config_values() -> None:
    assert eos_ids_from(None) == frozenset()
    assert eos_ids_from(2) == {2}
    assert eos_ids_from([128001, 128009]) == {128001, 128009}
    with pytest.raises(ConfigError, match="eos_token_id"):
        eos_ids_from(["2"])  # type: ignore[list-item]


def test_a_transformers_tokenizer_streams_without_its_special_tokens() -> None:
    class HfLike:  # transformers' decode keeps special tokens unless told
        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            return "".join(
                "<eos>" if i == EOS and not skip_special_tokens else "ab"[i - 1]
                for i in ids
                if not (i == EOS and skip_special_tokens)
            )

    params = SamplingParams(max_tokens=3, stop_at_eos=False)
    checker = StopChecker(params, eos_ids=set(), detokenizer=SkipSpecialTokens(HfLike()))
    assert [checker.push(t).text for t in (1, EOS, 2)] == ["a", "", "b"]


def test_streamed_text_is_the_decoded_text_cut_at_the_first_stop_string() -> None:
    """Random byte-token streams (characters split across tokens) and random stop
    strings: what streams, concatenated, is always the whole decoded text up to the
    first stop string, and each piece arrives once."""
    import random

    words = ["a", "b", "ab", " ", "é", "日本", "\n", "ba", "🙂"]
    pieces = sorted({p for w in words for p in (w.encode(), *_split(w.encode()))})
    tok = ByteTokenizer({i + 1: p for i, p in enumerate(pieces)})
    rng = random.Random(1234)
    stopped = 0
    for _ in range(300):
        ids = [rng.randrange(1, len(pieces) + 1) for _ in range(rng.randrange(1, 14))]
        stops = tuple(
            {
                "".join(rng.choices(["a", "b", " ", "é", "本", "\n"], k=rng.randrange(1, 4)))
                for _ in range(rng.randrange(0, 3))
            }
        )
        checker = StopChecker(SamplingParams(max_tokens=len(ids), stop=stops), detokenizer=tok)
        streamed = ""
        for n in range(1, len(ids) + 1):
            decision = checker.push(ids[n - 1])
            streamed += decision.text
            if decision.finish_reason is not None:
                break
        full = tok.decode(ids[:n])
        hits = [i for s in stops if (i := full.find(s)) >= 0]
        assert streamed == full[: min(hits)] if hits else streamed == full, (ids, stops)
        assert decision.finish_reason == ("stop" if hits else "length")
        stopped += bool(hits)
    assert 20 < stopped < 280  # both endings were exercised


def _split(data: bytes) -> list[bytes]:
    return [data[i : i + 1] for i in range(len(data))] if len(data) > 1 else []
