"""Token ids into text piece by piece: the pieces add up to the whole decode, an
unfinished character is held back, and a stop string is never emitted."""

from __future__ import annotations

import random

import pytest

from zpipe.serve.text import TextStream
from zpipe.testing.tiny_lm import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _run(tokenizer, ids, stop=()):
    stream = TextStream(tokenizer, stop)
    pieces = []
    for token in ids:
        pieces.append(stream.push(token))
        if stream.stopped:
            break
    pieces.append(stream.flush())
    return pieces, stream.stopped


@pytest.mark.parametrize("seed", range(20))
def test_pieces_add_up_to_the_whole_decode(tokenizer, seed: int) -> None:
    rng = random.Random(seed)
    ids = [rng.randrange(1, len(tokenizer)) for _ in range(30)]  # 0 is end of sequence
    pieces, stopped = _run(tokenizer, ids)
    assert not stopped
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)


def test_a_multibyte_character_waits_until_it_is_complete(tokenizer) -> None:
    ids = tokenizer("é€ ok", add_special_tokens=False)["input_ids"]
    stream = TextStream(tokenizer)
    shown = [stream.push(t) for t in ids]
    assert all("\ufffd" not in piece for piece in shown)
    assert "".join(shown) + stream.flush() == "é€ ok"


@pytest.mark.parametrize("seed", range(20))
def test_a_stop_string_ends_the_text_and_is_not_emitted(tokenizer, seed: int) -> None:
    rng = random.Random(seed)
    ids = [rng.randrange(1, len(tokenizer)) for _ in range(30)]
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    start = rng.randrange(1, len(whole) - 4)
    stop = whole[start : start + rng.randrange(1, 4)]
    pieces, stopped = _run(tokenizer, ids, stop=(stop, "never-there"))
    assert stopped
    assert "".join(pieces) == whole[: whole.find(stop)]


def test_a_stop_string_across_tokens_is_held_back_until_it_is_decided(tokenizer) -> None:
    ids = tokenizer("the pipeline stage", add_special_tokens=False)["input_ids"]
    stream = TextStream(tokenizer, stop=("line st",))
    shown = ""
    for token in ids:
        shown += stream.push(token)
        assert "line st"[:2] not in shown[len("the pipe") :]
    assert stream.stopped and shown == "the pipe"


def test_end_of_sequence_adds_no_text(tokenizer) -> None:
    stream = TextStream(tokenizer)
    text = "".join(stream.push(t) for t in tokenizer("ok", add_special_tokens=False)["input_ids"])
    text += stream.push(tokenizer.eos_token_id) + stream.flush()
    assert text == "ok"


def test_without_a_tokenizer_there_is_no_text() -> None:
    stream = TextStream(None, stop=("x",))
    assert stream.push(5) == "" and stream.flush() == "" and not stream.stopped
