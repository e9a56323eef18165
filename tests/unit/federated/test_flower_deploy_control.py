"""Eco-FL's wall-clock decisions on Flower's deployment engine (pure): SuperNodes
profiled into clients, tasks out and back, a SuperNode that dies mid-round dropped
out while its group's round goes on, the same client re-admitted when its SuperNode
comes back under a new node id, deadlines, the run's end, and the settings that a
Flower run config carries."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from zpipe._errors import ConfigError, ProtocolError
from zpipe.federated.flower_deploy import app_pyproject
from zpipe.federated.flower_deploy_control import (
    Command,
    DeployController,
    DeploySettings,
    Event,
    SendProfile,
    SendTrain,
    make_deploy_server,
)

SIZE = 8
COUNTS = {0: (5, 5, 0, 0), 1: (0, 0, 5, 5), 2: (5, 0, 5, 0)}


def _controller(**overrides: Any) -> DeployController:
    settings = DeploySettings(
        **{
            "clients": 2,
            "max_concurrent": 2,
            "n_groups": 1,
            "max_updates": 10,
            "task_timeout_s": 50.0,
            "profile_timeout_s": 40.0,
            "probe_interval_s": 5.0,
            **overrides,
        }
    )
    # accuracy: the mean weight, so every merge of a trained model (weights + 1) shows
    return DeployController(
        settings, make_deploy_server(settings, np.zeros(SIZE)), lambda w: float(np.mean(w))
    )


def _events(commands: list[Command], kind: str) -> list[dict[str, Any]]:
    return [dict(c.fields) for c in commands if isinstance(c, Event) and c.fields["event"] == kind]


def _trains(commands: list[Command]) -> dict[int, SendTrain]:
    """Client id -> the task command sent to it."""
    return {c.task.client_id: c for c in commands if isinstance(c, SendTrain)}


def _started(ctl: DeployController) -> dict[int, SendTrain]:
    """Nodes 100 and 101 profiled as clients 0 and 1 (latencies 10 and 12 s), then
    the run's first tasks."""
    assert ctl.profile(100, 0.0) == [SendProfile(100)]
    assert ctl.profile(101, 0.0) == [SendProfile(101)]
    assert ctl.profile(100, 1.0) == []  # one profiling out per node
    registered = ctl.on_profile(100, 0, COUNTS[0], 10.0)
    assert _events(registered, "registered")[0]["latency_s"] == 10.0
    assert not ctl.ready(10.0)
    ctl.on_profile(101, 1, COUNTS[1], 12.0)
    assert ctl.ready(12.0)
    commands = ctl.start(20.0)
    assert _events(commands, "started")[0]["groups"] == [[0, 1]]
    assert _events(commands, "eval")[0]["version"] == 0
    return _trains(commands)


def test_profiled_supernodes_become_clients_and_their_updates_are_merged() -> None:
    ctl = _controller()
    tasks = _started(ctl)
    assert {c: t.node_id for c, t in tasks.items()} == {0: 100, 1: 101}
    first = ctl.on_train_reply(tasks[0].task.task_id, np.ones(SIZE), 10, 30.0)
    update = _events(first, "update")[0]
    assert update["client"] == 0 and update["latency_s"] == 10.0
    assert not _trains(first)  # the group's round waits for client 1
    second = ctl.on_train_reply(tasks[1].task.task_id, np.ones(SIZE), 10, 31.0)
    assert _events(second, "eval")[0]["version"] == 1
    assert _events(second, "eval")[0]["accuracy"] > 0  # FedAsync mixed the group model in
    assert set(_trains(second)) == {0, 1}  # the next round
    assert ctl.log.updates == 2 and ctl.log.curve[0] == (0, 0.0)


def test_a_dead_supernode_is_dropped_mid_round_and_readmitted_under_a_new_node() -> None:
    ctl = _controller()
    tasks = _started(ctl)
    # node 101 died: Flower answers its task with an error (node unavailable)
    failed = ctl.on_train_reply(tasks[1].task.task_id, None, 0, 40.0)
    assert _events(failed, "task_failed")[0]["why"] == "error reply"
    assert _events(failed, "dropped")[0]["client"] == 1
    assert ctl.server is not None and ctl.server.is_dropped(1)
    # the round goes on without it: client 0's update ends it, the next is client 0's only
    merged = ctl.on_train_reply(tasks[0].task.task_id, np.ones(SIZE), 10, 41.0)
    assert set(_trains(merged)) == {0}
    assert ctl.server.version == 1 and _events(merged, "eval")[0]["version"] == 1
    # a late reply of the failed task changes nothing
    assert ctl.on_train_reply(tasks[1].task.task_id, np.ones(SIZE), 10, 42.0) == []
    # client 1 is profiled again on its (dead) node while it is dropped
    probes, done = ctl.tick(47.0)
    assert probes == [SendProfile(101)] and not done
    assert ctl.tick(48.0)[0] == []
    # its SuperNode starts again as node 102: the profiling names client 1, whose
    # latency fits the group's range again
    assert ctl.profile(102, 50.0) == [SendProfile(102)]
    back = ctl.on_profile(102, 1, COUNTS[1], 61.0)
    assert _events(back, "rejoined")[0]["node"] == 102
    assert _events(back, "readmitted")[0]["latency_s"] == 11.0
    assert not ctl.server.is_dropped(1) and ctl.node_of[1] == 102
    assert not ctl.profiling(101)  # the dead node's profiling is not waited for
    # the next round takes it, on its new node
    round_two = ctl.on_train_reply(_trains(merged)[0].task.task_id, np.ones(SIZE), 10, 70.0)
    assert _trains(round_two)[1].node_id == 102


def test_a_task_past_its_deadline_fails_and_its_client_is_dropped() -> None:
    ctl = _controller()
    tasks = _started(ctl)
    ctl.on_train_reply(tasks[0].task.task_id, np.ones(SIZE), 10, 30.0)
    assert ctl.tick(69.0)[0] == []
    commands, done = ctl.tick(70.0)  # 50 s after the task was sent
    assert _events(commands, "task_failed")[0] == {
        "event": "task_failed",
        "t": 70.0,
        "task": tasks[1].task.task_id,
        "client": 1,
        "why": "timed out",
    }
    assert _events(commands, "dropped")[0]["waited_s"] == 50.0
    # the failure ended the round: client 0's model is merged and evaluated
    assert _events(commands, "eval")[0]["version"] == 1
    assert set(_trains(commands)) == {0} and not done


def test_a_client_whose_node_is_replaced_mid_task_loses_the_task_at_once() -> None:
    ctl = _controller()
    tasks = _started(ctl)
    ctl.profile(105, 25.0)
    commands = ctl.on_profile(105, 1, COUNTS[1], 36.0)
    failed = _events(commands, "task_failed")[0]
    assert failed["task"] == tasks[1].task.task_id and failed["why"] == "node replaced"
    # silent (dropped), then measured at 11 s: back in its group at once
    assert _events(commands, "dropped") and _events(commands, "readmitted")
    assert ctl.outstanding_tasks() == {tasks[0].task.task_id: 100}


def test_a_profiling_that_fails_or_times_out_keeps_a_dropped_client_out() -> None:
    ctl = _controller()
    tasks = _started(ctl)
    ctl.on_train_reply(tasks[1].task.task_id, None, 0, 40.0)
    probes, _ = ctl.tick(45.0)
    assert probes == [SendProfile(101)]
    commands, _ = ctl.tick(85.0)  # the profiling's 40 s passed
    assert _events(commands, "profile_failed")[0]["client"] == 1
    assert ctl.server is not None and ctl.server.is_dropped(1)
    # a node that never answered is forgotten, not a client
    ctl.profile(999, 86.0)
    assert _events(ctl.on_profile_failed(999, 87.0), "profile_failed")[0]["client"] is None
    assert 999 not in ctl.client_of


def test_a_new_client_joins_the_started_run() -> None:
    ctl = _controller(clients=3)
    ctl.profile(100, 0.0)
    ctl.profile(101, 0.0)
    ctl.on_profile(100, 0, COUNTS[0], 10.0)
    ctl.on_profile(101, 1, COUNTS[1], 11.0)
    assert not ctl.ready(20.0)  # two of three; the nodes' deadline has not passed
    assert ctl.ready(200.0)
    ctl.start(200.0)
    ctl.profile(102, 210.0)
    commands = ctl.on_profile(102, 2, COUNTS[2], 220.0)
    assert _events(commands, "joined")[0]["client"] == 2
    assert ctl.server is not None and 2 in ctl.server.profiles


def test_the_run_ends_at_its_updates_and_evaluates_the_last_model() -> None:
    ctl = _controller(max_updates=1)
    tasks = _started(ctl)
    ctl.on_train_reply(tasks[0].task.task_id, np.ones(SIZE), 10, 30.0)
    ctl.on_train_reply(tasks[1].task.task_id, np.ones(SIZE), 10, 31.0)
    commands, done = ctl.tick(32.0)
    assert done and ctl.reason == "updates" and commands == []
    finished = ctl.finish(32.0)
    assert _events(finished, "finished")[0]["version"] == 1
    assert not _events(finished, "eval")  # version 1 was evaluated when it was made


def test_bad_replies_are_refused() -> None:
    ctl = _controller()
    with pytest.raises(ProtocolError, match="not out"):
        ctl.on_profile(100, 0, COUNTS[0], 1.0)
    tasks = _started(ctl)
    ctl.profile(100, 21.0)
    with pytest.raises(ProtocolError, match="was client 0"):
        ctl.on_profile(100, 1, COUNTS[1], 22.0)
    # weights of the wrong size: the task fails, the client is dropped, nothing crashes
    commands = ctl.on_train_reply(tasks[0].task.task_id, np.ones(3), 10, 30.0)
    assert "shape" in _events(commands, "bad_update")[0]["error"]
    assert _events(commands, "task_failed")[0]["why"] == "bad update"
    with pytest.raises(ConfigError, match="already started"):
        ctl.start(40.0)


def test_settings_travel_as_a_flower_run_config() -> None:
    settings = DeploySettings(method="fedasync", clients=5, task_timeout_s=30.0)
    assert DeploySettings.from_run_config(settings.run_config()) == settings
    read = DeploySettings.from_run_config({"max-updates": 7, "task-timeout-s": 30})
    assert read.max_updates == 7 and read.task_timeout_s == 30.0
    with pytest.raises(ConfigError, match="not a setting"):
        DeploySettings.from_run_config({"num-rounds": 3})
    with pytest.raises(ConfigError, match="not a int"):
        DeploySettings.from_run_config({"clients": 2.5})
    with pytest.raises(ConfigError, match="is True"):
        DeploySettings.from_run_config({"clients": True})
    with pytest.raises(ConfigError, match="method"):
        DeploySettings(method="fedsgd")
    with pytest.raises(ConfigError, match="stages"):
        DeploySettings(stages=3)
    with pytest.raises(ConfigError, match="timeout"):
        DeploySettings(task_timeout_s=0.0)


def test_the_flower_app_names_the_apps_and_carries_the_settings() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11
    settings = DeploySettings(clients=4, events_path="/tmp/x y.jsonl")
    project = tomllib.loads(app_pyproject(settings))
    app = project["tool"]["flwr"]["app"]
    assert app["components"] == {
        "serverapp": "zpipe.federated.flower_deploy_apps:server_app",
        "clientapp": "zpipe.federated.flower_deploy_apps:client_app",
    }
    assert DeploySettings.from_run_config(app["config"]) == settings


def test_with_probing_off_a_run_whose_clients_all_dropped_out_ends() -> None:
    ctl = _controller(probe_interval_s=0.0)
    tasks = _started(ctl)
    ctl.on_train_reply(tasks[0].task.task_id, None, 0, 30.0)
    ctl.on_train_reply(tasks[1].task.task_id, None, 0, 31.0)
    commands, done = ctl.tick(32.0)
    assert done and ctl.reason == "nothing to dispatch" and commands == []
    # with probing on, the dropped clients are profiled again instead
    ctl = _controller()
    tasks = _started(ctl)
    ctl.on_train_reply(tasks[0].task.task_id, None, 0, 30.0)
    ctl.on_train_reply(tasks[1].task.task_id, None, 0, 31.0)
    commands, done = ctl.tick(36.0)
    assert not done and commands == [SendProfile(100), SendProfile(101)]


def test_a_dropped_client_whose_node_is_not_online_is_not_profiled() -> None:
    ctl = _controller()
    tasks = _started(ctl)
    ctl.on_train_reply(tasks[1].task.task_id, None, 0, 40.0)
    ctl.set_online([100])  # the SuperLink no longer lists node 101
    assert ctl.tick(46.0)[0] == []
    ctl.set_online([100, 101])
    assert ctl.tick(47.0)[0] == [SendProfile(101)]
