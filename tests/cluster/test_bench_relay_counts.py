"""bench/_relay_counts.py: the stage relay's counts cover exactly the measured messages
(a real relay and its feeder process on loopback)."""

from __future__ import annotations

import re

import pytest

from bench import _relay_counts


def test_calls_are_counted_over_exactly_the_measured_messages(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--calls", "--size", "4K", "--count", "7", "--warm", "3", "--tail", "2", "--top", "400"]
    assert _relay_counts.main(argv) == 0
    out = capsys.readouterr().out
    per_message = {
        name: float(count) for count, name in re.findall(r"^\s+([\d.]+)\s+(\S+)$", out, re.M)
    }
    assert re.search(r"^size 4096: [\d.]+ calls per message$", out, re.M)
    # each relayed message is decoded once and checked once by the data port: the
    # marks bracket the measured messages, not the warm-up's or the tail's
    assert per_message["codec.py:decode"] == 1.0
    assert per_message["dataport.py:accept"] == 1.0
