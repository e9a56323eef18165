"""An fl client registers again after its connection dropped (issue 33), pure parts.

The client's :class:`ServerLink` is fed monitor events and the time; the server's
controller is fed a registration from a route it already knows (the client's own
routing id, kept across libzmq's reconnection), and its :class:`Connections` a
reconnection whose old connection closes late. Each fails on the code before the
fix: the client never registered again, the controller dropped the registration
("fl_register is not expected"), and the old connection's close released the id
the new connection carried.
"""

from __future__ import annotations

import math

import pytest

from tests._support.fl_raw import SHAPE, controller_config, of, register, route, update
from zpipe._errors import ConfigError
from zpipe.federated.net_commands import Command, Emit, SendMessage
from zpipe.federated.net_controller import FlServerController
from zpipe.federated.net_limits import Connections
from zpipe.federated.net_rejoin import Backoff, ServerLink
from zpipe.federated.server import ServerConfig
from zpipe.protocol.federated import FlTask, FlWelcome

HOST = "10.0.0.1"


def events(commands: list[Command]) -> list[str]:
    return [c.event["event"] for c in of(Emit, commands)]


def tasks_for(commands: list[Command], client: int) -> list[int]:
    return [
        c.message.task
        for c in of(SendMessage, commands)
        if isinstance(c.message, FlTask) and c.peer == f"fl client {client}"
    ]


# ------------------------------------------------------------------ back-off


def test_the_backoff_doubles_is_jittered_and_bounded() -> None:
    backoff = Backoff(base_s=0.5, cap_s=8.0)
    assert [backoff.delay_s(n, 0.999999) for n in range(6)] == pytest.approx(
        [0.5, 1.0, 2.0, 4.0, 8.0, 8.0], rel=1e-5
    )
    assert backoff.delay_s(3, 0.0) == 0.0 and backoff.delay_s(3, 0.5) == 2.0
    assert backoff.delay_s(10_000, 1.0) == 8.0  # no overflow, however many attempts
    with pytest.raises(ConfigError):
        Backoff(base_s=2.0, cap_s=1.0)


# ------------------------------------------------------------------ the client's link


def link(draws: list[float] | None = None) -> ServerLink:
    values = iter(draws or [0.5] * 100)
    return ServerLink(reply_timeout_s=5.0, gone_timeout_s=60.0, draw=lambda: next(values))


def test_a_dropped_connection_is_registered_again_once_it_is_back() -> None:
    state = link()
    state.connected(0.0)  # the first connection's handshake: nothing to do
    assert state.state == "registered" and state.next_event() == math.inf
    state.disconnected(10.0)
    assert not state.register_due(10.0) and state.next_event() == 70.0  # gives up then
    state.connected(12.0)
    # the first registration after a random share of the base back-off (0.5 x 0.5 s)
    assert not state.register_due(12.2) and state.register_due(12.25)
    state.registration_sent(12.25)
    # unanswered: again after the reply timeout and the next, doubled, back-off
    assert state.next_event() == pytest.approx(12.25 + 5.0 + 0.5)
    assert not state.register_due(17.7) and state.register_due(17.75)
    state.registration_sent(17.75)
    assert state.next_event() == pytest.approx(17.75 + 5.0 + 1.0)
    assert state.gone_for(20.0) == 10.0
    assert state.welcomed() is True
    assert state.state == "registered" and state.gone_for(30.0) == 0.0
    assert state.attempts == 0 and state.next_event() == math.inf
    assert state.welcomed() is False  # a welcome without a drop ends no rejoin


def test_a_server_gone_past_the_reconnect_timeout_ends_the_wait() -> None:
    state = link()
    state.disconnected(5.0)
    state.connected(6.0)
    state.disconnected(7.0)  # dropped again while registering: the clock runs on
    assert state.state == "down" and state.gone_since == 5.0
    assert not state.register_due(50.0)  # nothing is sent without a connection
    assert not state.expired(64.9) and state.expired(65.0)


# ------------------------------------------------------------------ the server


def test_a_reconnection_is_not_released_by_its_old_connections_late_close() -> None:
    connections = Connections()
    connections.seen(13, b"client-7")
    connections.seen(13, b"client-8")
    connections.seen(21, b"client-7")  # client 7 came back on a new connection
    assert connections.closed(13) == [b"client-8"]  # 7 is not gone: it moved
    assert connections.closed(21) == [b"client-7"]
    assert connections.closed(21) == []


def test_a_client_registering_again_on_its_route_is_welcomed_back_and_given_tasks() -> None:
    controller = FlServerController(controller_config(clients=1), SHAPE)
    controller.on_registration(route(0), register(0), HOST)
    assert tasks_for(controller.start(now=0.0), 0) == [0]
    gone = controller.on_gone(route(0), 1.0)  # the server saw the connection close
    assert events(gone)[:2] == ["released", "task_failed"]
    server = controller._running()
    assert server.is_dropped(0)
    # libzmq reconnected under the same routing id; the client registers again
    back = controller.on_message(route(0), register(0), 2.0, HOST)
    assert isinstance(of(SendMessage, back)[0].message, FlWelcome)
    assert "rejoined" in events(back) and not controller.presence.released
    assert not server.is_dropped(0) and tasks_for(back, 0)
    (task,) = tasks_for(back, 0)
    answered = controller.on_message(route(0), update(task, 0), 2.5, HOST)
    assert "update" in events(answered) and server.version == 1


def test_a_registration_is_no_way_back_for_a_set_aside_client_that_was_not_released() -> None:
    """A silent client set aside must answer a probe: registering again on its live
    route (which the old controller dropped) must not readmit it."""
    cfg = controller_config(
        server=ServerConfig(method="fedasync", max_concurrent=1, seed=3),
        probe_interval_s=2.0,
        probe_timeout_s=3.0,
    )
    controller = FlServerController(cfg, SHAPE)
    controller.on_registration(route(0), register(0), HOST)
    assert tasks_for(controller.start(now=0.0), 0) == [0]
    controller.on_message(route(1), register(1), 0.5, "10.0.0.2")  # joins; K=1 is taken
    taken, _ = controller.tick(10.0)  # client 0's task taken back: set aside; 1 trains
    server = controller._running()
    assert server.is_dropped(0) and tasks_for(taken, 1) == [1]
    again = controller.on_message(route(0), register(0), 11.0, HOST)
    assert "rejoined" in events(again) and tasks_for(again, 0) == []
    assert server.is_dropped(0)
    assert 0 in controller.presence.probe_candidates(server)
    # client 1's answer frees the slot: it goes to client 1 again, not to client 0
    answered = controller.on_message(route(1), update(1, 1), 11.5, "10.0.0.2")
    assert tasks_for(answered, 0) == [] and len(tasks_for(answered, 1)) == 1
