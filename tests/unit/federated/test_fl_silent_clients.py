"""fl-server against silent clients (issue 33 finding 4), its controller fed by hand.

One peer registered 300 silent client ids over an open fl-server and FedAsync
made one global update in 20 s: the ids took its slots. These tests check the
two bounds: client ids per peer address, and tasks taken back from a client
silent past its own measured latency (set aside until heard from again; a late
answer is measured, never merged).
"""

from __future__ import annotations

from tests._support.fl_raw import SHAPE, controller_config, of, register, route, update
from zpipe.federated.grouping import GroupingPolicy
from zpipe.federated.net_commands import (
    Command,
    Emit,
    LogLine,
    SendMessage,
    TraceLine,
)
from zpipe.federated.net_controller import FlServerController
from zpipe.federated.net_trace import replay
from zpipe.federated.server import ServerConfig
from zpipe.protocol.federated import FlError, FlTask, FlWelcome

config = controller_config


def tasks_in(commands: list[Command]) -> list[tuple[int, int]]:
    """(task, client) of every task message, in order (the peer names the client)."""
    return [
        (c.message.task, int(c.peer.removeprefix("fl client ")))
        for c in of(SendMessage, commands)
        if isinstance(c.message, FlTask)
    ]


# ---------------------------------------------------------------- ids per address


def test_an_address_holds_at_most_its_ids_and_is_told_why() -> None:
    controller = FlServerController(config(clients=10, ids_per_address=3), SHAPE)
    for client in range(3):
        commands = controller.on_registration(route(client), register(client), "10.0.0.1")
        assert isinstance(of(SendMessage, commands)[0].message, FlWelcome)
    commands = controller.on_registration(route(3), register(3), "10.0.0.1")
    (refusal,) = of(SendMessage, commands)
    assert isinstance(refusal.message, FlError)
    assert "--ids-per-address 3" in refusal.message.reason
    assert 3 not in controller.routes and controller.dropped_messages == 1
    # another address, and a reconnection of an id the address holds, still register
    other = controller.on_registration(route(4), register(4), "10.0.0.2")
    assert isinstance(of(SendMessage, other)[0].message, FlWelcome)
    again = controller.on_registration(route(0), register(0), "10.0.0.1")
    assert isinstance(of(SendMessage, again)[0].message, FlWelcome)
    assert sorted(controller.routes) == [0, 1, 2, 4]


def test_a_late_registration_is_bounded_too_and_a_key_is_not_an_address() -> None:
    controller = FlServerController(config(ids_per_address=1), SHAPE)
    controller.on_registration(route(0), register(0), "10.0.0.1")
    controller.start(now=0.0)
    refused = controller.on_message(route(1), register(1), 1.0, "10.0.0.1")
    assert isinstance(of(SendMessage, refused)[0].message, FlError)
    assert sorted(controller.routes) == [0]
    # with --keys the shell names no address: a key's own rule (one id) bounds it
    keyed = controller.on_message(route(2), register(2), 2.0, None)
    assert isinstance(of(SendMessage, keyed)[0].message, FlWelcome)


# ---------------------------------------------------------------- deadlines


def test_a_task_deadline_follows_its_clients_measured_latency() -> None:
    controller = FlServerController(config(), SHAPE)
    controller.on_registration(route(0), register(0))
    assert controller.task_deadline_s(0) == 10.0  # never measured: --task-timeout
    (first,) = tasks_in(controller.start(now=0.0))
    commands = controller.on_message(route(0), update(first[0], 0), 0.5)
    assert controller.task_deadline_s(0) == 2.0  # 4 x 0.5 s
    (second,) = tasks_in(commands)
    controller.task_sent(second[0], 1.0)
    held, _ = controller.tick(2.9)
    assert events(held) == []
    taken, _ = controller.tick(3.0)
    assert "task_failed" in events(taken)
    assert of(LogLine, taken)[0].fields["waited_s"] == 2.0
    # the floor: a client measured at 10 ms still has --task-floor
    controller.deadlines.measured(0, 0.01)
    assert controller.task_deadline_s(0) == 2.0  # the slowest of its recent latencies
    for _ in range(8):
        controller.deadlines.measured(0, 0.01)
    assert controller.task_deadline_s(0) == 1.0


def events(commands: list[Command]) -> list[str]:
    return [c.event["event"] for c in of(Emit, commands)]


def test_silent_ids_do_not_starve_the_live_client_in_fedasync() -> None:
    """One live client (answers in 0.2 s) and 20 silent ids, two slots: once each
    silent id has been taken back, every task goes to the live client."""
    cfg = config(clients=21, ids_per_address=100)
    controller = FlServerController(cfg, SHAPE)
    for client in range(21):
        controller.on_registration(route(client), register(client), "127.0.0.1")
    now = 0.0
    sent = tasks_in(controller.start(now))
    open_live = [t for t, c in sent if c == 0]
    dispatched: list[tuple[float, int]] = [(now, c) for _, c in sent]
    updates: list[float] = []
    while now < 400.0:
        now = round(now + 0.2, 6)
        commands, ended = controller.tick(now)
        assert not ended
        if open_live:
            commands += controller.on_message(route(0), update(open_live.pop(), 0), now)
            updates.append(now)
        new = tasks_in(commands)
        open_live += [t for t, c in new if c == 0]
        dispatched += [(now, c) for _, c in new]
    silent_last = max(at for at, c in dispatched if c != 0)
    # every silent id held a slot once (a never-measured client waits --task-timeout)
    assert {c for _, c in dispatched if c != 0} <= set(range(1, 21))
    assert silent_last < 400.0 - 100.0, "silent ids were still picked late in the run"
    late_rate = sum(1 for at in updates if at > silent_last) / (400.0 - silent_last)
    assert late_rate > 3.0  # answers every 0.2 s: only the live client trains


def test_a_late_answer_is_measured_never_merged_and_brings_its_client_back() -> None:
    controller = FlServerController(config(clients=2), SHAPE)
    for client in range(2):
        controller.on_registration(route(client), register(client))
    trace: list[dict] = []

    def carry(commands: list[Command]) -> list[tuple[int, int]]:
        trace.extend(c.event for c in of(TraceLine, commands))
        return tasks_in(commands)

    first = carry(controller.start(now=0.0))
    task_of = {c: t for t, c in first}
    # client 1 is measured at 1 s (deadline 4 s), client 0 at 0.5 s (deadline 2 s)
    again = carry(controller.on_message(route(0), update(task_of[0], 0), 0.5))
    again += carry(controller.on_message(route(1), update(task_of[1], 1), 1.0))
    task_of = {c: t for t, c in again}
    version = controller._running().version
    commands, _ = controller.tick(2.5)  # client 0's task is 2 s old: taken back
    carry(commands)
    assert "task_failed" in events(commands) and "dropped" in events(commands)
    late = controller.on_message(route(0), update(task_of[0], 0), 4.0)
    carry(late)
    assert controller._running().version == version  # measured, never merged
    assert "late_update" in events(late) and "readmitted" in events(late)
    assert controller.dropped_messages == 0
    assert controller.task_deadline_s(0) == 10.0  # 4 x its 3.5 s answer, at most the timeout
    # the same answer again is no longer news: dropped
    repeated = controller.on_message(route(0), update(task_of[0], 0), 4.5)
    assert controller.dropped_messages == 1 and events(repeated) == []
    carry(controller.finish())
    replayed = replay(trace)
    assert replayed.version == controller._running().version
    assert [(t, c) for t, c, _ in replayed.dispatches] == [
        (e["task"], e["client"]) for e in trace if e["event"] == "dispatch"
    ]


def test_a_grouped_methods_late_answer_is_left_to_its_probes() -> None:
    """Eco-FL regroups on what its probes measure: a late answer lengthens its client's
    deadline but is not fed to Algorithm 1 (it moved clients between groups)."""
    grouping = GroupingPolicy(n_groups=1)
    server = ServerConfig(method="ecofl", max_concurrent=2, seed=3, grouping=grouping)
    controller = FlServerController(config(server=server), SHAPE)
    controller.on_registration(route(0), register(0))
    (first,) = tasks_in(controller.start(now=0.0))
    (second,) = tasks_in(controller.on_message(route(0), update(first[0], 0), 0.5))
    commands, _ = controller.tick(2.5)  # 4 x 0.5 s: taken back
    assert "task_failed" in events(commands)
    late = controller.on_message(route(0), update(second[0], 0), 3.0)
    assert events(late) == ["late_update"] and of(TraceLine, late) == []
    assert controller.task_deadline_s(0) == 10.0  # 4 x 2.5 s
