"""The client takes control messages only as a coordinator sends them, and results and
failure notices on its sink only from its plan's last stage."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from zpipe._errors import ProtocolError
from zpipe.client.control import coordinator_may_send
from zpipe.client.runs.inference import _Stream
from zpipe.client.runs.sync_training import TrainingRun
from zpipe.protocol.data_plane import MicroBatchError
from zpipe.transport.roles import ROLE_KINDS


def test_the_control_channel_takes_only_what_a_coordinator_sends() -> None:
    for kind in ROLE_KINDS["coordinator"]:
        assert coordinator_may_send(kind)
    for kind in ("data", "labels", "register", "heartbeat", "run_request", "backup", "loss"):
        assert not coordinator_may_send(kind)


def _error(src: str, run: int = 5, mb: int = 2) -> MicroBatchError:
    return MicroBatchError(run=run, mb=mb, src=src, stage="a", message="boom", epoch=3)


def test_a_failure_notice_on_the_sink_must_come_from_the_last_stage() -> None:
    stream = SimpleNamespace(
        session=SimpleNamespace(epoch=3, run=5, last_stage="b"), owner={2: (0, 0)}
    )
    _Stream._check_result(stream, _error("b"))  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="'error' from 'mallory', not 'b'"):
        _Stream._check_result(stream, _error("mallory"))  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="epoch"):
        _Stream._check_result(stream, _error("b", run=6))  # type: ignore[arg-type]


def test_a_training_failure_notice_must_come_from_a_last_stage_device() -> None:
    run = SimpleNamespace(
        session=SimpleNamespace(epoch=3), run=5, last_names=("c", "d"), done_steps=0, sent_steps=1
    )
    TrainingRun._check(run, _error("d"))  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="not a last-stage device"):
        TrainingRun._check(run, _error("a"))  # type: ignore[arg-type]
