"""fl-server releases the ids of clients that are gone, and probes the ones it set aside.

Issue 33: an address that had reached ``--ids-per-address`` stayed refused after its
clients left, and FedAvg and FedAsync used a client they had set aside only when it
happened to speak again. Here the pure bounds (net_limits) and the controller, fed
by hand: a closed connection or silence past ``--release-after`` releases an id (the
limit counts live ids), and a set-aside client is probed: an answer brings it back,
silence keeps it aside.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests._support.fl_raw import SHAPE, controller_config, of, register, route, update
from zpipe._errors import ProtocolError
from zpipe.federated.grouping import ClientProfile
from zpipe.federated.net_admission import KeyIdentities
from zpipe.federated.net_commands import (
    Command,
    Emit,
    NetServerConfig,
    SendMessage,
    TraceLine,
)
from zpipe.federated.net_controller import FlServerController
from zpipe.federated.net_limits import Connections, IdsPerAddress, LastHeard
from zpipe.federated.net_trace import replay
from zpipe.federated.server import ServerConfig, make_server
from zpipe.protocol.federated import (
    FlError,
    FlProbe,
    FlProbeReply,
    FlTask,
    FlWelcome,
)

HOST = "10.0.0.1"


def config(**changes: object) -> NetServerConfig:
    return controller_config(**{"release_after_s": 1_000.0, "ids_per_address": 2, **changes})


def answers(commands: list[Command]) -> list[type]:
    return [type(c.message) for c in of(SendMessage, commands)]


def events(commands: list[Command]) -> list[str]:
    return [c.event["event"] for c in of(Emit, commands)]


def tasks_in(commands: list[Command]) -> list[tuple[int, int]]:
    return [
        (c.message.task, int(c.peer.removeprefix("fl client ")))
        for c in of(SendMessage, commands)
        if isinstance(c.message, FlTask)
    ]


def probes_in(commands: list[Command]) -> list[tuple[int, int]]:
    return [
        (c.message.probe, int(c.peer.removeprefix("fl client ")))
        for c in of(SendMessage, commands)
        if isinstance(c.message, FlProbe)
    ]


# ------------------------------------------------------------------ pure bounds


def test_a_released_id_no_longer_counts_against_its_address() -> None:
    ids = IdsPerAddress(2)
    ids.add(HOST, 0)
    ids.add(HOST, 1)
    try:
        ids.check(HOST, 2)
        raise AssertionError("a third id was admitted")
    except Exception as exc:  # ProtocolError, naming the limit
        assert "--ids-per-address 2" in str(exc)
    assert ids.release(1) == HOST and ids.held(HOST) == 1
    ids.check(HOST, 2)  # room again
    assert ids.release(1) is None  # released twice: nothing more
    ids.add("10.0.0.2", 0)  # an id registered again from elsewhere moves
    assert ids.held(HOST) == 0 and ids.held("10.0.0.2") == 1


def test_only_candidates_silent_past_the_bound_are_released() -> None:
    heard = LastHeard(10.0)
    heard.heard(0, 0.0)
    heard.heard(1, 5.0)
    assert heard.silent_past(9.9, [0, 1]) == []
    assert heard.silent_past(10.0, [0, 1]) == [0]
    assert heard.silent_past(20.0, [1]) == [1]  # only the candidates count
    assert heard.next_release([0, 1]) == 10.0 and heard.next_release([]) == float("inf")


def test_a_closed_connection_names_only_the_routes_it_carried() -> None:
    connections = Connections()
    connections.seen(13, b"a")
    connections.seen(14, b"b")
    assert connections.closed(13) == [b"a"]
    assert connections.closed(13) == []  # once
    connections.seen(13, b"c")  # the descriptor reused by a new connection
    assert connections.closed(13) == [b"c"] and connections.closed(14) == [b"b"]


# ------------------------------------------------------------------ releases


def test_an_address_whose_clients_left_may_register_again() -> None:
    controller = FlServerController(config(clients=5), SHAPE)
    for client in (0, 1):
        assert answers(controller.on_registration(route(client), register(client), HOST)) == [
            FlWelcome
        ]
    assert answers(controller.on_registration(route(2), register(2), HOST)) == [FlError]
    gone = controller.on_gone(route(1), 1.0)
    assert events(gone) == ["released"] and controller.presence.released == {1}
    assert controller.on_gone(route(1), 1.5) == []  # once
    assert controller.on_gone(b"never-registered", 1.5) == []
    assert answers(controller.on_registration(route(2), register(2), HOST)) == [FlWelcome]
    assert controller.presence.origins.held(HOST) == 2


def test_a_gone_client_loses_its_task_at_once_and_is_set_aside() -> None:
    controller = FlServerController(config(), SHAPE)
    controller.on_registration(route(0), register(0), HOST)
    controller.start(now=0.0)
    (task,) = tasks_in(controller.on_message(route(1), register(1), 0.1, HOST))  # a join
    assert task[1] == 1 and controller.presence.origins.held(HOST) == 2
    gone = controller.on_gone(route(1), 0.5)  # well before its 10 s deadline
    assert events(gone)[:3] == ["released", "task_failed", "dropped"]
    # it waited 0.4 s, not its deadline's 10 s: the silence the trace records
    (silent,) = [c.event for c in of(TraceLine, gone) if c.event["event"] == "silent"]
    assert silent["waited_s"] == 0.4
    server = controller._running()
    assert server.is_dropped(1) and server.outstanding() == 1
    # its address holds one live id: another client from it is admitted
    assert answers(controller.on_message(route(2), register(2), 0.6, HOST))[0] is FlWelcome
    assert sorted(controller.routes) == [0, 1, 2] and controller.presence.origins.held(HOST) == 2
    # a released id is not probed (its connection is gone)
    assert 1 not in controller.presence.probe_candidates(server)


def live(controller: FlServerController, client: int, now: float) -> list[Command]:
    """``client`` answers every task it holds at ``now``."""
    held = [t for t, o in controller._outstanding.items() if o.client == client]
    commands: list[Command] = []
    for task in held:
        commands += controller.on_message(route(client), update(task, client), now, HOST)
    return commands


def run_with_a_silent_client(until: float) -> tuple[FlServerController, list[str], int]:
    """Clients 0 (silent from the start) and 1 (answers within 1 s), FedAsync, K=2,
    ids released after 30 s of silence; ticks every second up to ``until``."""
    cfg = config(release_after_s=30.0, ids_per_address=2, clients=2)
    controller = FlServerController(cfg, SHAPE)
    controller.on_registration(route(0), register(0), HOST)
    controller.on_registration(route(1), register(1), HOST)
    first = {c: t for t, c in tasks_in(controller.start(now=0.0))}
    seen: list[str] = []
    now = 0.0
    while now < until:
        now += 1.0
        seen += [f"{e}@{now:g}" for e in events(live(controller, 1, now))]
        commands, ended = controller.tick(now)
        assert not ended
        seen += [f"{e}@{now:g}" for e in events(commands)]
        if now == 29.0:
            assert controller.next_deadline() <= 30.0  # a release is a deadline too
    return controller, seen, first[0]


def test_a_set_aside_client_silent_past_the_bound_is_released() -> None:
    controller, seen, _ = run_with_a_silent_client(until=40.0)
    assert "dropped@10" in seen  # its task taken back at --task-timeout
    # released 30 s after it was last heard from (the start); once
    assert [e for e in seen if e.startswith("released")] == ["released@30"]
    assert controller.presence.released == {0} and controller.presence.origins.held(HOST) == 1
    # client 1, answering, is never released: only set-aside clients' silence counts
    assert controller.presence.last_heard.silent_past(1_000.0, [1]) == [1]
    assert controller.presence.set_aside(controller._running(), controller.routes) == []


def test_a_released_client_speaking_again_reclaims_its_id_where_there_is_room() -> None:
    controller, _, task = run_with_a_silent_client(until=31.0)
    late = controller.on_message(route(0), update(task, 0), 32.0, HOST)
    assert events(late) == ["reclaimed"] and not controller.presence.released
    assert controller.presence.origins.held(HOST) == 2
    # with no room left at its address, it is dropped and stays released
    controller, _, task = run_with_a_silent_client(until=31.0)
    assert answers(controller.on_message(route(2), register(2), 31.5, HOST))[0] is FlWelcome
    dropped = controller.dropped_messages
    assert events(controller.on_message(route(0), update(task, 0), 32.0, HOST)) == []
    assert controller.presence.released == {0} and controller.dropped_messages == dropped + 1


def test_a_released_id_registered_again_on_a_new_connection_rejoins() -> None:
    controller = FlServerController(config(clients=1), SHAPE)
    controller.on_registration(route(0), register(0), HOST)
    controller.start(now=0.0)
    # while its connection lives, another connection may not take the id
    taken = controller.on_message(route(0, 1), register(0), 0.5, HOST)
    assert answers(taken) == [FlError]
    controller.on_gone(route(0), 1.0)
    server = controller._running()
    assert server.is_dropped(0) and server.outstanding() == 1  # another try, on the old route
    back = controller.on_message(route(0, 1), register(0), 2.0, HOST)
    assert answers(back)[0] is FlWelcome and "rejoined" in events(back)
    assert controller.routes[0] == route(0, 1) and route(0) not in controller.clients
    assert not controller.presence.released and not server.is_dropped(0)
    # the task its old connection held was taken back; it holds one on the new route
    (held,) = [t for t, o in controller._outstanding.items() if o.client == 0]
    assert any(
        isinstance(c.message, FlTask) and c.message.task == held and c.to == route(0, 1)
        for c in of(SendMessage, back)
    )


# ------------------------------------------------------------------ probes


def test_the_flat_methods_name_their_set_aside_idle_clients_as_probe_candidates() -> None:
    profiles = [ClientProfile(i, 0.1, (5, 5)) for i in range(3)]
    for method in ("fedavg", "fedasync"):
        cfg = ServerConfig(method=method, max_concurrent=1, seed=0, sideline_silent=True)
        server = make_server(profiles, torch.zeros(SHAPE.size).numpy(), cfg)
        (task,) = server.start()
        assert server.probe_candidates() == []
        server.observe_silence(task.client_id, 5.0)
        server.on_task_failed(task.task_id)
        assert server.probe_candidates() == [task.client_id]
        server.observe_latency(task.client_id, 0.2)  # an answer: back
        assert server.probe_candidates() == []
        plain_cfg = replace(cfg, sideline_silent=False)
        plain = make_server(profiles, torch.zeros(SHAPE.size).numpy(), plain_cfg)
        (task,) = plain.start()
        plain.observe_silence(task.client_id, 5.0)
        assert plain.probe_candidates() == []  # fl-sim: a failed client stays in the pool


def test_a_set_aside_client_is_probed_an_answer_brings_it_back_silence_keeps_it_aside() -> None:
    cfg = config(clients=2, probe_interval_s=2.0, probe_timeout_s=3.0, ids_per_address=4)
    controller = FlServerController(cfg, SHAPE)
    trace: list[dict] = []

    def carry(commands: list[Command]) -> list[Command]:
        trace.extend(c.event for c in of(TraceLine, commands))
        return commands

    def tick(now: float) -> list[Command]:
        commands = carry(live(controller, 1, now))  # client 1 answers within 1 s
        return commands + carry(controller.tick(now)[0])

    controller.on_registration(route(0), register(0), HOST)
    controller.on_registration(route(1), register(1), HOST)
    carry(controller.start(now=0.0))
    server = controller._running()
    for now in range(1, 10):
        assert probes_in(tick(float(now))) == []  # nobody set aside: no probe
    commands = tick(10.0)  # client 0's task: taken back at --task-timeout, set aside
    assert "dropped" in events(commands) and server.is_dropped(0)
    (probe,) = probes_in(commands)  # probed at once: never probed before
    assert probe[1] == 0
    # unanswered within 3 s: it stays aside, and is probed again 2 s later
    for now in (11.0, 12.0):
        assert probes_in(tick(now)) == []
    expired = tick(13.0)
    assert "probe" in events(expired) and "readmitted" not in events(expired)
    assert server.is_dropped(0) and probes_in(expired) == []
    assert probes_in(tick(14.0)) == []
    (second,) = probes_in(tick(15.0))
    reply = FlProbeReply(probe=second[0], client=0, work_s=0.1)
    back = carry(controller.on_message(route(0), reply, 15.4, HOST))
    assert events(back)[:2] == ["probe", "readmitted"] and not server.is_dropped(0)
    # and used again at once: FedAsync's free slot goes to it
    assert [c for _, c in tasks_in(back)] == [0]
    carry(controller.finish())
    replayed = replay(trace)
    assert replayed.version == server.version
    assert [(t, c) for t, c, _ in replayed.dispatches] == [
        (e["task"], e["client"]) for e in trace if e["event"] == "dispatch"
    ]


def test_with_keys_a_released_id_comes_back_only_with_its_own_key() -> None:
    """A released id may be registered again; with --keys only by the key that held it
    (the controller sees no address there, so the key is what names the client)."""
    identities = KeyIdentities()
    alice, bob = b"A" * 40, b"B" * 40
    identities.check(alice, 0)
    identities.check(alice, 0)  # its own key again: fine
    with pytest.raises(ProtocolError, match="client 0 was registered with another key"):
        identities.check(bob, 0)
    identities.check(bob, 1)  # bob's own id is unaffected by the refusal
