"""bench/_transport_counts.py: each phase moves its messages through both paths and
counts the Python bytecodes of the measured messages only."""

from __future__ import annotations

import re

import pytest

from bench import _transport_counts


def test_every_phase_runs_and_counts_only_its_measured_messages(
    capsys: pytest.CaptureFixture[str],
) -> None:
    phases = "raw:echo:4K,zpipe:echo:4K,raw:stream:4K,zpipe:stream:4K,asyncio:echo:4K"
    argv = ["--count", "4", "--warm", "2", "--opcodes", "--top", "3", "--phases", phases]
    assert _transport_counts.main(argv) == 0
    out = capsys.readouterr()
    per_message = {
        phase: float(count)
        for phase, count in re.findall(r"^(\S+): ([\d.]+) bytecodes per message$", out.out, re.M)
    }
    assert set(per_message) == set(phases.split(","))
    # zpipe's encode, decode and validation are Python; raw pyzmq's path barely is
    assert per_message["zpipe:echo:4K"] > per_message["raw:echo:4K"] > 0
    assert per_message["zpipe:stream:4K"] > 0
    # zmq.asyncio's futures and event handling are Python, raw's blocking receive is not
    assert per_message["asyncio:echo:4K"] > per_message["raw:echo:4K"]
    # the phase order callgrind's dumps follow, on stderr
    assert "phase 1: zpipe:echo:4K: dump 4" in out.err
