"""fl-server's controller fed events by hand: no sockets, no clock, no files.

The shell (``zpipe.federated.net_server``) only carries out what these tests
read off the returned commands; the multi-process run is in test_federated_net.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zpipe._errors import ConfigError
from zpipe.federated.grouping import GroupingPolicy
from zpipe.federated.model import MLPShape
from zpipe.federated.net_commands import (
    Abort,
    Command,
    Emit,
    Evaluate,
    LogLine,
    NetServerConfig,
    SendMessage,
    TraceLine,
)
from zpipe.federated.net_controller import FlServerController
from zpipe.federated.net_trace import replay
from zpipe.federated.server import ServerConfig
from zpipe.protocol import WireMessage
from zpipe.protocol.federated import (
    FlDone,
    FlError,
    FlProbe,
    FlProbeReply,
    FlRegister,
    FlTask,
    FlUpdate,
    FlWelcome,
)

SHAPE = MLPShape(4, 3, 2)
COUNTS = [5, 5]  # two classes, ten samples per client


def config(**changes: object) -> NetServerConfig:
    server = ServerConfig(method="fedavg", max_concurrent=2, seed=1)
    base = NetServerConfig(
        server=server,
        clients=2,
        task_timeout_s=10.0,
        probe_interval_s=0.0,
        max_updates=3,
        duration_s=100.0,
        eval_every=1,
    )
    return replace(base, **changes)  # type: ignore[arg-type]


def route(client: int) -> bytes:
    return f"peer-{client}".encode()


def register(client: int, counts: list[int] = COUNTS, latency_s: float = 0.1) -> FlRegister:
    return FlRegister(client=client, label_counts=counts, latency_s=latency_s)


def update(task: int, client: int, n_samples: int = 10, value: float = 0.5) -> FlUpdate:
    weights = torch.full((SHAPE.size,), value, dtype=torch.float64)
    return FlUpdate(task=task, client=client, n_samples=n_samples, train_s=0.1, tensors=(weights,))


def of(kind: type, commands: list[Command]) -> list:
    return [c for c in commands if isinstance(c, kind)]


def tasks_in(commands: list[Command]) -> list[SendMessage]:
    return [c for c in of(SendMessage, commands) if isinstance(c.message, FlTask)]


def events(kind: type, commands: list[Command]) -> list[str]:
    return [c.event["event"] for c in of(kind, commands)]


def registered(cfg: NetServerConfig | None = None, clients: int = 2) -> FlServerController:
    controller = FlServerController(cfg or config(), SHAPE)
    for client in range(clients):
        controller.on_registration(route(client), register(client))
    return controller


# ---------------------------------------------------------------- registration


def test_a_registration_is_welcomed_and_counted() -> None:
    controller = FlServerController(config(), SHAPE)
    assert controller.registering
    commands = controller.on_registration(route(0), register(0))
    assert [type(c) for c in commands] == [SendMessage, Emit]
    assert commands[0] == SendMessage(route(0), FlWelcome(client=0), "fl client 0")
    assert of(Emit, commands)[0].event == {"event": "registered", "client": 0, "latency_s": 0.1}
    controller.on_registration(route(1), register(1))
    assert not controller.registering and controller.routes == {0: route(0), 1: route(1)}


def test_only_registrations_count_before_the_start() -> None:
    controller = FlServerController(config(), SHAPE)
    commands = controller.on_registration(route(0), update(0, 0))
    assert of(SendMessage, commands) == [] and controller.dropped_messages == 1
    assert of(LogLine, commands)[0].fields["reason"] == "fl_update before the run started"


@pytest.mark.parametrize(
    ("peer", "message", "why"),
    [
        (route(9), register(0), "already registered by another peer"),
        (route(0), register(5), "registers once, under one client id"),
        (route(9), register(9, counts=[1, 2, 3]), "label_counts must be 2"),
        (route(9), register(9, counts=[0, 0]), "without samples"),
    ],
)
def test_a_bad_registration_is_answered_with_its_reason(
    peer: bytes, message: FlRegister, why: str
) -> None:
    controller = FlServerController(config(), SHAPE)
    controller.on_registration(route(0), register(0))
    commands = controller.on_registration(peer, message)
    (refusal,) = of(SendMessage, commands)
    assert refusal.to == peer and refusal.peer == "unregistered client"
    assert isinstance(refusal.message, FlError) and why in refusal.message.reason
    assert controller.dropped_messages == 1 and controller.routes == {0: route(0)}


def test_a_refused_key_hears_why_only_when_it_registers() -> None:
    controller = FlServerController(config(), SHAPE)
    commands = controller.refused(route(0), register(0), "the key may not act as a client")
    assert of(SendMessage, commands) == [
        SendMessage(route(0), FlError(reason="the key may not act as a client"), "refused key")
    ]
    assert of(SendMessage, controller.refused(route(0), update(0, 0), "no")) == []
    assert controller.dropped_messages == 2


# --------------------------------------------------------------------- the run


def test_the_start_records_its_inputs_evaluates_and_sends_the_first_tasks() -> None:
    controller = registered()
    commands = controller.start(now=0.0)
    assert events(TraceLine, commands) == ["config", "profiles", "dispatch", "dispatch"]
    assert of(Evaluate, commands)[0].version == 0
    sent = tasks_in(commands)
    assert [s.to for s in sent] == [route(0), route(1)] and [s.task for s in sent] == [0, 1]
    task = sent[0].message
    assert isinstance(task, FlTask)
    assert task.shape == [4, 3, 2] and task.tensors[0].numel() == SHAPE.size
    assert controller.next_deadline() == 10.0  # the first task's deadline


def test_a_server_that_cannot_start_says_goodbye_then_aborts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse(*_args: object) -> None:
        raise ConfigError("K = 1 concurrent clients cannot serve 2 groups")

    monkeypatch.setattr("zpipe.federated.net_controller.make_server", refuse)
    controller = registered()
    commands = controller.start(now=0.0)
    assert events(TraceLine, commands) == ["config", "profiles"]  # the trace says what failed
    assert isinstance(commands[-1], Abort) and isinstance(commands[-1].error, ConfigError)
    done = [c.message for c in of(SendMessage, commands)]
    reason = "server error: K = 1 concurrent clients cannot serve 2 groups"
    assert done == [FlDone(reason=reason)] * 2


def test_an_update_counts_from_when_its_task_was_sent() -> None:
    controller = registered()
    controller.start(now=0.0)
    controller.task_sent(0, 2.0)  # the shell sent task 0 two seconds late
    commands = controller.on_message(route(0), update(0, 0), now=2.5)
    (emitted,) = [c.event for c in of(Emit, commands) if c.event["event"] == "update"]
    assert emitted["latency_s"] == 0.5
    latency = [c.event for c in of(TraceLine, commands) if c.event["event"] == "latency"]
    assert latency == [{"event": "latency", "client": 0, "latency_s": 0.5}]


def test_updates_close_a_round_and_each_new_version_is_evaluated() -> None:
    controller = registered()
    controller.start(now=0.0)
    first = controller.on_message(route(0), update(0, 0), now=1.0)
    assert of(Evaluate, first) == []  # FedAvg: the round waits for client 1
    second = controller.on_message(route(1), update(1, 1), now=1.0)
    assert [e.version for e in of(Evaluate, second)] == [1]
    assert [s.task for s in tasks_in(second)] == [2, 3]  # the next round


@pytest.mark.parametrize(
    ("peer", "message", "why"),
    [
        (route(1), update(0, 1), "task 0 is not outstanding for this client"),
        (route(0), update(7, 0), "task 7 is not outstanding"),
        (route(0), update(0, 0, n_samples=3), "3 samples, registered with 10"),
        (route(9), update(0, 0), "fl_update from a peer that has not registered"),
        (route(0), FlProbeReply(probe=4, client=0, work_s=0.1), "probe 4 is not outstanding"),
    ],
)
def test_a_message_that_fits_no_task_is_dropped(
    peer: bytes, message: WireMessage, why: str
) -> None:
    controller = registered()
    controller.start(now=0.0)
    commands = controller.on_message(peer, message, now=1.0)
    (log,) = of(LogLine, commands)
    assert commands == [log] and why in log.fields["reason"]
    assert controller.dropped_messages == 1


def test_a_bad_update_leaves_its_task_to_time_out() -> None:
    controller = registered()
    controller.start(now=0.0)
    controller.on_message(route(0), update(0, 0, n_samples=3), now=1.0)
    commands, ended = controller.tick(now=10.0)
    assert not ended
    assert of(LogLine, commands)[0].event == "fl_task_timed_out"
    failed = [c.event for c in of(Emit, commands)]
    assert {"event": "task_failed", "task": 0, "client": 0} in failed
    assert {"event": "task_failed", "task": 1, "client": 1} in failed
    records = [c.event for c in of(TraceLine, commands)]
    assert {"event": "silent", "client": 0, "waited_s": 10.0} in records
    assert {"event": "failed", "task": 0} in records
    # a silence is not a measured latency: nothing records one for the client
    assert not [r for r in records if r["event"] == "latency" and r["client"] == 0]


def test_a_silent_client_drops_out_even_when_the_timeout_fits_a_range() -> None:
    # one group (centre 0.1 s) whose range, 200 times its centre, admits the 10 s timeout:
    # a timeout that counted as a latency would keep the silent client in; silence drops it
    server = ServerConfig(
        method="ecofl",
        max_concurrent=2,
        grouping=GroupingPolicy(n_groups=1, rt_floor_fraction=200.0),
    )
    controller = registered(config(server=server, probe_interval_s=0.0))
    controller.start(now=0.0)
    controller.on_message(route(1), update(1, 1), now=1.0)
    commands, ended = controller.tick(now=10.0)
    assert not ended
    assert {"event": "dropped", "client": 0, "waited_s": 10.0} in [
        c.event for c in of(Emit, commands)
    ]
    assert controller.server is not None and controller.server.is_dropped(0)
    assert not controller.server.is_dropped(1)
    # nothing goes to the dropped client until a probe re-admits it
    assert all(t.to != route(0) for t in tasks_in(commands))


def test_the_run_ends_by_updates_by_duration_or_with_nothing_to_do() -> None:
    controller = registered(config(max_updates=1))
    controller.start(now=0.0)
    controller.on_message(route(0), update(0, 0), now=1.0)
    controller.on_message(route(1), update(1, 1), now=1.0)
    assert controller.tick(now=2.0) == ([], True) and controller.reason == "updates"

    late = registered()
    late.start(now=0.0)
    assert late.tick(now=100.0) == ([], True) and late.reason == "duration"

    asleep = registered(config(server=ServerConfig(method="fedasync", max_concurrent=1)))
    asleep.start(now=0.0)
    commands, ended = asleep.tick(now=10.0)  # task 0 timed out; another is sent at once
    assert not ended and len(tasks_in(commands)) == 1


def test_the_end_evaluates_once_records_the_model_and_says_goodbye() -> None:
    controller = registered()
    controller.start(now=0.0)
    controller.tick(now=100.0)
    commands = controller.finish()
    assert of(Evaluate, commands) == []  # version 0 was evaluated at the start
    assert events(TraceLine, commands) == ["end"]
    assert [c.message for c in of(SendMessage, commands)] == [FlDone(reason="duration")] * 2


def test_a_late_client_joins_and_gets_its_tasks() -> None:
    controller = registered(config(server=ServerConfig(method="fedasync", max_concurrent=3)))
    controller.start(now=0.0)
    commands = controller.on_message(route(2), register(2), now=1.0)
    assert of(SendMessage, commands)[0] == SendMessage(route(2), FlWelcome(client=2), "fl client 2")
    assert events(TraceLine, commands)[0] == "join"
    assert [s.to for s in tasks_in(commands)] == [route(2)]
    assert events(Emit, commands) == ["joined"]


def test_a_dropped_client_is_probed_and_readmitted() -> None:
    server = ServerConfig(
        method="ecofl",
        max_concurrent=2,
        grouping=GroupingPolicy(n_groups=1, rt_floor_fraction=0.5),
    )
    controller = registered(config(server=server, probe_interval_s=1.0, probe_timeout_s=5.0))
    controller.start(now=0.0)
    # both tasks time out; 10 s is out of the group's range, so both clients drop out,
    # and a dropped client is probed at once (it was never probed before)
    commands, ended = controller.tick(now=10.0)
    assert not ended and events(Emit, commands).count("dropped") >= 1
    probes = [c for c in of(SendMessage, commands) if isinstance(c.message, FlProbe)]
    assert probes and controller.tick(now=10.5) == ([], False)  # one probe out per client
    probe = probes[0]
    assert isinstance(probe.message, FlProbe)
    client = int(probe.peer.rsplit(" ", 1)[1])
    reply = FlProbeReply(probe=probe.message.probe, client=client, work_s=0.1)
    answered = controller.on_message(probe.to, reply, now=10.1)
    assert events(Emit, answered)[:2] == ["probe", "readmitted"]
    assert controller.presence.probes.sent == len(probes)


# ---------------------------------------------------------------- properties


@dataclass
class Driven:
    sent: list[tuple[int, int, int]] = field(default_factory=list)  # (task, client, version)
    records: list[dict] = field(default_factory=list)
    answered: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)


def carry(commands: list[Command], driven: Driven) -> None:
    for command in commands:
        if isinstance(command, TraceLine):
            driven.records.append(dict(command.event))
            if command.event["event"] == "failed":
                driven.failed.append(command.event["task"])
            elif command.event["event"] == "update":
                driven.answered.append(command.event["task"])
        elif isinstance(command, SendMessage) and isinstance(command.message, FlTask):
            task = command.message
            driven.sent.append((task.task, int(command.peer.rsplit(" ", 1)[1]), task.version))


@settings(max_examples=40, deadline=None)
@given(
    method=st.sampled_from(["fedavg", "fedasync", "ecofl"]),
    steps=st.lists(
        st.tuples(st.sampled_from(["answer", "junk", "wait"]), st.integers(0, 7)), max_size=30
    ),
)
def test_the_trace_replays_to_the_same_tasks_and_model(method: str, steps: list) -> None:
    """Whatever arrives, each task ends once (answered or timed out), and the trace's
    inputs, fed to a fresh server object, dispatch the same tasks to the same model."""
    grouping = GroupingPolicy(n_groups=2)
    server = ServerConfig(method=method, max_concurrent=3, seed=2, grouping=grouping)
    controller = registered(config(server=server, clients=4, max_updates=50), clients=4)
    driven = Driven()
    now = 0.0
    carry(controller.start(now), driven)
    for action, pick in steps:
        now += 1.0
        commands, ended = controller.tick(now)
        carry(commands, driven)
        if ended:
            break
        open_tasks = [t for t in driven.sent if t[0] not in driven.answered + driven.failed]
        if action == "wait" or not open_tasks:
            now = controller.next_deadline()
            continue
        task, client, _ = open_tasks[pick % len(open_tasks)]
        samples = 10 if action == "answer" else 9  # junk: a wrong sample count
        message = update(task, client, samples, pick)
        carry(controller.on_message(route(client), message, now), driven)
    carry(controller.finish(), driven)
    ended_tasks = driven.answered + driven.failed
    assert len(ended_tasks) == len(set(ended_tasks))
    assert set(ended_tasks) <= {t[0] for t in driven.sent}
    replayed = replay(driven.records)
    assert replayed.dispatches == driven.sent
    assert controller.server is not None
    assert replayed.version == controller.server.version
    assert np.array_equal(replayed.weights, controller.server.global_weights)
