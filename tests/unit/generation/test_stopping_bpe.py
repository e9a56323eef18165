"""StopChecker over a real byte-level BPE tokenizer (the tiny LM's, through
SkipSpecialTokens): the streamed pieces add up to transformers' own decode, cut
at the first stop string, whatever merges and re-spacing the tokenizer does."""

from __future__ import annotations

import random

import pytest

from zpipe.generation import SamplingParams, SkipSpecialTokens, StopChecker, eos_ids_from

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tokenizer():
    from zpipe.testing.tiny_lm import build_tokenizer

    return build_tokenizer()


def _stream(tokenizer, ids, stop=()):
    checker = StopChecker(
        SamplingParams(max_tokens=len(ids), stop=tuple(stop)),
        eos_ids_from(tokenizer.eos_token_id),
        SkipSpecialTokens(tokenizer),
    )
    pieces = []
    for token in ids:
        decision = checker.push(token)
        pieces.append(decision.text)
        if decision.finish_reason is not None:
            return pieces, decision.finish_reason
    raise AssertionError("the checker did not finish at max_tokens")


@pytest.mark.parametrize("seed", range(20))
def test_pieces_add_up_to_the_decode_cut_at_the_first_stop_string(tokenizer, seed: int) -> None:
    rng = random.Random(seed)
    eos = tokenizer.eos_token_id
    ids = [t for t in (rng.randrange(len(tokenizer)) for _ in range(30)) if t != eos]
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    pieces, reason = _stream(tokenizer, ids)
    assert reason == "length"
    assert "".join(pieces) == whole
    start = rng.randrange(1, len(whole) - 4)
    stop = whole[start : start + rng.randrange(1, 4)]
    pieces, reason = _stream(tokenizer, ids, stop=(stop, "never-there"))
    assert reason == "stop"
    assert "".join(pieces) == whole[: whole.find(stop)]


def test_a_multibyte_character_waits_until_it_is_complete(tokenizer) -> None:
    ids = tokenizer("é€ ok", add_special_tokens=False)["input_ids"]
    pieces, _ = _stream(tokenizer, ids)
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == "é€ ok"


def test_a_stop_string_across_tokens_is_held_back_and_never_shown(tokenizer) -> None:
    ids = tokenizer("the pipeline stage", add_special_tokens=False)["input_ids"]
    pieces, reason = _stream(tokenizer, ids, stop=("line st",))
    # what streamed cannot be taken back: "li" was never shown early
    assert reason == "stop" and "".join(pieces) == "the pipe"


def test_end_of_sequence_adds_no_text(tokenizer) -> None:
    ids = [*tokenizer("ok", add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
    pieces, reason = _stream(tokenizer, [*ids, 5])  # one more: eos ends it, not length
    assert reason == "eos" and "".join(pieces) == "ok"
