"""The deployment ServerApp's shell against a Grid that answers at once (no
SuperLink): SuperNodes profiled into clients by their replies, Flower's typed
messages out, a SuperNode whose tasks come back as errors dropped out while the
run goes on with the other, and the result the run config asks for."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from zpipe.federated.flower_deploy import _DeployShell, federation_of
from zpipe.federated.flower_deploy_control import DeploySettings
from zpipe.federated.flower_messages import (
    PROFILE,
    TRAIN,
    FlowerProfileReply,
    TrainReply,
    TrainRequest,
)

pytest.importorskip("flwr.app")


class _Grid:
    """Nodes 10 and 11 are clients 0 and 1; node 11 fails every task (its home died)."""

    def __init__(self, settings: DeploySettings) -> None:
        self.settings = settings
        self.ids = itertools.count()
        self.replies: dict[str, Any] = {}
        self.sent: list[tuple[int, str]] = []

    def get_node_ids(self) -> list[int]:
        return [10, 11]

    def push_messages(self, messages: list[Any]) -> list[str]:
        ids = []
        for msg in messages:
            msg_id = f"m{next(self.ids)}"
            node, kind = msg.metadata.dst_node_id, msg.metadata.message_type
            self.sent.append((node, kind))
            self.replies[msg_id] = self._answer(msg_id, node, kind, msg.content)
            ids.append(msg_id)
        return ids

    def _answer(self, msg_id: str, node: int, kind: str, content: Any) -> Any:
        client = node - 10
        meta = SimpleNamespace(reply_to_message_id=msg_id)
        if kind == PROFILE:
            shard = federation_of(self.settings).shards[client]
            counts = shard.label_counts(10)
            reply = FlowerProfileReply(client, 1.0, counts).to_content()
            return SimpleNamespace(metadata=meta, content=reply, has_error=lambda: False)
        assert kind == TRAIN
        request = TrainRequest.from_content(content)
        if node == 11:
            error = SimpleNamespace(reason="node unavailable")
            return SimpleNamespace(metadata=meta, error=error, has_error=lambda: True)
        weights = request.weights + 0.01  # "trained"
        reply = TrainReply(request.task_id, weights, 100, 0.1).to_content()
        return SimpleNamespace(metadata=meta, content=reply, has_error=lambda: False)

    def pull_messages(self, ids: list[str]) -> list[Any]:
        return [self.replies.pop(i) for i in ids if i in self.replies]


@pytest.fixture
def in_a_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a ServerApp process has when Flower runs it: its run's id (a Message
    takes it on creation)."""
    from flwr.supercore.task_identity import TaskIdentity

    monkeypatch.setattr(TaskIdentity, "_run_id", 7)
    monkeypatch.setattr(TaskIdentity, "_node_id", 1)
    monkeypatch.setattr(TaskIdentity, "_task_id", 3)


@pytest.mark.usefixtures("in_a_run")
def test_the_shell_runs_the_controller_over_flower_messages(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    settings = DeploySettings(
        clients=2,
        max_concurrent=2,
        max_updates=3,
        probe_interval_s=0.0,
        # the fake's round trips are milliseconds and a poll apart: a wide RT^g keeps
        # client 0 in its group whatever the machine's load
        rt_floor_fraction=1000.0,
        events_path=str(events),
    )
    grid = _Grid(settings)
    result = _DeployShell(grid, settings).run()
    assert result["reason"] == "updates" and result["version"] == 3
    assert result["dropped"] == [1] and result["dropped_now"] == [1]
    assert result["failed_tasks"] == 1 and result["updates"] == 3
    assert [v for v, _ in result["curve"]] == [0, 1, 2, 3]
    # both nodes profiled, both tasked once; then client 0 alone (the round that the
    # third update starts is left when the run ends)
    assert grid.sent[:2] == [(10, PROFILE), (11, PROFILE)]
    trains = [s for s in grid.sent if s[1] == TRAIN]
    assert trains == [(10, TRAIN), (11, TRAIN)] + [(10, TRAIN)] * 3
    logged = [json.loads(line)["event"] for line in events.read_text().splitlines()]
    assert logged[:3] == ["registered", "registered", "started"]
    assert "dropped" in logged and logged[-1] == "finished"
    assert np.isfinite(result["final_acc"])
