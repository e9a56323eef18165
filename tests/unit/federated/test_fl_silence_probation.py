"""Released for silence twice: no task again before a probe's answer (issue 33).

A silent peer got its address's ids back every ``--release-after`` seconds and held
one task slot with each for up to ``--task-timeout``. Here the controller is fed a
run by hand: client 0 answers every task at once; client 1 (or a fresh id from its
address) never answers. On the old code a silence-released id registered again was
readmitted by its registered latency and given a task every time; now its second
release puts it (and every id of its address) on probation.
"""

from __future__ import annotations

from tests._support.fl_raw import SHAPE, controller_config, of, register, route, update
from zpipe.federated.net_commands import Command, Emit, SendMessage, TraceLine
from zpipe.federated.net_controller import FlServerController
from zpipe.federated.net_limits import SilenceStrikes
from zpipe.federated.net_trace import replay
from zpipe.federated.server import ServerConfig
from zpipe.protocol.federated import FlProbe, FlProbeReply, FlTask

LIVE, SILENT = "10.0.0.9", "10.0.0.1"
RELEASE_AFTER_S = 30.0


def events(commands: list[Command], name: str) -> list[dict]:
    return [c.event for c in of(Emit, commands) if c.event["event"] == name]


def tasks_for(commands: list[Command], client: int) -> list[int]:
    return [
        c.message.task
        for c in of(SendMessage, commands)
        if isinstance(c.message, FlTask) and c.peer == f"fl client {client}"
    ]


def probes_for(commands: list[Command], client: int) -> list[int]:
    return [
        c.message.probe
        for c in of(SendMessage, commands)
        if isinstance(c.message, FlProbe) and c.peer == f"fl client {client}"
    ]


class Run:
    """FedAsync with K=2: client 0 (its own address) answers every task as soon as it
    holds one; the test speaks for the silent side."""

    def __init__(self) -> None:
        cfg = controller_config(
            server=ServerConfig(method="fedasync", max_concurrent=2, seed=3),
            clients=2,
            release_after_s=RELEASE_AFTER_S,
            probe_interval_s=2.0,
            probe_timeout_s=3.0,
        )
        self.controller = FlServerController(cfg, SHAPE)
        self.controller.on_registration(route(0), register(0), LIVE)
        self.controller.on_registration(route(1), register(1), SILENT)
        self.now = 0.0
        self.log: list[Command] = list(self.controller.start(now=0.0))

    def until(self, end: float) -> list[Command]:
        """Ticks every second up to ``end``; what they sent and emitted."""
        seen: list[Command] = []
        controller = self.controller
        while self.now < end:
            self.now += 1.0
            held = [t for t, o in controller._outstanding.items() if o.client == 0]
            for task in held:
                seen += controller.on_message(route(0), update(task, 0), self.now, LIVE)
            commands, ended = controller.tick(self.now)
            assert not ended
            seen += commands
        self.log += seen
        return seen

    def next_probe(self, client: int) -> int:
        """Ticks on until ``client`` is probed; that probe's id (answered at once)."""
        for _ in range(30):
            sent = probes_for(self.until(self.now + 1), client)
            if sent:
                return sent[0]
        raise AssertionError(f"client {client} was never probed")

    def answer(self, client: int, connection: int, probe: int) -> list[Command]:
        reply = FlProbeReply(probe=probe, client=client, work_s=0.05)
        route_ = route(client, connection)
        commands = self.controller.on_message(route_, reply, self.now + 0.1, SILENT)
        self.log += commands
        return commands

    def register(self, client: int, connection: int) -> list[Command]:
        commands = self.controller.on_message(
            route(client, connection), register(client), self.now + 0.5, SILENT
        )
        self.log += commands
        return commands


def test_one_release_for_silence_costs_an_honest_client_nothing() -> None:
    run = Run()
    released = run.until(RELEASE_AFTER_S + 1)
    assert [e["client"] for e in events(released, "released")] == [1]
    back = run.register(1, 1)
    assert events(back, "rejoined")[0]["set_aside"] is False
    assert tasks_for(back, 1)  # readmitted by its registration, as before


def test_an_id_released_for_silence_twice_gets_no_task_until_it_answers_a_probe() -> None:
    run = Run()
    run.until(RELEASE_AFTER_S + 1)  # released once (silent since the start)
    assert tasks_for(run.register(1, 1), 1)  # back, and silent again with its task
    second = run.until(2 * RELEASE_AFTER_S + 15)
    assert [e["client"] for e in events(second, "released")] == [1]
    assert run.controller.presence.strikes.of(1, SILENT) == 2
    back = run.register(1, 2)
    assert events(back, "rejoined")[0]["set_aside"] is True
    assert tasks_for(back, 1) == []  # the old code gave it a task here
    waiting = run.until(run.now + 20)
    assert tasks_for(waiting, 1) == [] and probes_for(waiting, 1)  # probed, unanswered
    # it answers a probe: measured, readmitted, and given a task
    answered = run.answer(1, 2, run.next_probe(1))
    assert events(answered, "readmitted") and tasks_for(answered, 1)


def test_a_new_id_from_an_address_released_for_silence_twice_is_held_until_probed() -> None:
    run = Run()
    run.until(RELEASE_AFTER_S + 1)
    run.register(1, 1)
    run.until(2 * RELEASE_AFTER_S + 15)  # the address's second release for silence
    fresh = run.register(5, 0)  # another id from the same address
    assert [e["client"] for e in events(fresh, "held")] == [5]
    assert events(fresh, "joined") == [] and tasks_for(fresh, 5) == []
    controller = run.controller
    server = controller._running()
    assert 5 not in server.profiles  # not in the run: it holds no slot
    waiting = run.until(run.now + 6)
    assert tasks_for(waiting, 5) == [] and probes_for(waiting, 5)  # probed, unanswered
    answered = run.answer(5, 0, run.next_probe(5))
    (joined,) = events(answered, "joined")
    assert joined["held"] is True and 5 in server.profiles
    # its latency is what the probe measured, not what it claimed (0.1 s)
    assert server.profiles[5].latency_s == joined["latency_s"] != 0.1
    # the trace replays the held client's join to the same decisions
    run.log += controller.finish()
    replayed = replay([c.event for c in of(TraceLine, run.log)])
    assert replayed.version == server.version


def test_a_held_id_that_stays_silent_is_released_again_and_its_close_is_harmless() -> None:
    run = Run()
    run.until(RELEASE_AFTER_S + 1)
    run.register(1, 1)
    run.until(2 * RELEASE_AFTER_S + 15)
    run.register(5, 0)
    later = run.until(run.now + RELEASE_AFTER_S + 1)
    assert 5 in [e["client"] for e in events(later, "released")]
    assert run.controller.presence.strikes.of(5, SILENT) == 3
    # a held id whose connection closes: released, and no server-object call fails
    run.register(6, 0)
    gone = run.controller.on_gone(route(6, 0), run.now + 1.0)
    assert [e["client"] for e in events(gone, "released")] == [6]
    assert 6 in run.controller.presence.released


def test_strikes_count_per_id_and_per_address() -> None:
    strikes = SilenceStrikes(probation_after=2)
    strikes.record(1, "a")
    assert not strikes.on_probation(1, "a") and not strikes.on_probation(2, "a")
    strikes.record(2, "a")
    assert strikes.on_probation(3, "a")  # the address's second: every id of it
    assert not strikes.on_probation(3, "b")
    strikes.record(7, None)  # a keyed server names no address: the id counts
    strikes.record(7, None)
    assert strikes.on_probation(7, None) and not strikes.on_probation(8, None)
