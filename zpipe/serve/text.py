"""Generated token ids into text, piece by piece, with stop strings (pure).

Two things make this more than ``decode`` per token: a token may end in the
middle of a multi-byte character (its text is held back until the character
is complete), and a stop string may span tokens (text that could be the start
of a stop string is held back until it is known not to be one). A matched stop
string and everything after it are never emitted. Concatenated, the pieces
equal ``tokenizer.decode(ids, skip_special_tokens=True)`` cut at the first stop
string.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_INCOMPLETE = "\ufffd"  # what a decoder writes for bytes of an unfinished character


class TextStream:
    """Feed token ids one at a time; each :meth:`push` returns the text that is now
    safe to show; :attr:`stopped` turns true when a stop string matched."""

    def __init__(self, tokenizer: Any | None, stop: Sequence[str] = ()) -> None:
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._ids: list[int] = []
        self._emitted = 0  # characters of the decoded text already returned
        self.stopped = False

    def push(self, token: int) -> str:
        if self.stopped:
            return ""
        self._ids.append(token)
        if self._tokenizer is None:
            return ""
        text = self._decode()
        cut = self._stop_at(text)
        if cut is not None:
            self.stopped = True
            return self._take(text, cut)
        safe = len(text) - self._held_back(text)
        return self._take(text, safe)

    def flush(self) -> str:
        """The rest of the text, once the sequence has ended (no more tokens)."""
        if self.stopped or self._tokenizer is None:
            return ""
        text = self._decode()
        cut = self._stop_at(text)
        return self._take(text, len(text) if cut is None else cut)

    def _decode(self) -> str:
        assert self._tokenizer is not None
        return str(self._tokenizer.decode(self._ids, skip_special_tokens=True))

    def _take(self, text: str, end: int) -> str:
        piece = text[self._emitted : end] if end > self._emitted else ""
        self._emitted = max(self._emitted, end)
        return piece

    def _stop_at(self, text: str) -> int | None:
        # a stop string may end inside the held-back tail, so search from just
        # before what was emitted (the longest stop string back)
        start = max(0, self._emitted - max((len(s) for s in self._stop), default=0))
        found = [i for s in self._stop if (i := text.find(s, start)) != -1]
        return min(found) if found else None

    def _held_back(self, text: str) -> int:
        """How many trailing characters to keep back: an unfinished character, or
        the longest tail that is the start of a stop string."""
        complete = text.rstrip(_INCOMPLETE)
        longest = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(complete)), longest, -1):
                if complete.endswith(stop[:n]):
                    longest = n
                    break
        return len(text) - len(complete) + longest
