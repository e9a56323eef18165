"""fl-server's decisions between the socket and the server object, without I/O (sans-IO).

:class:`FlServerController` decides everything the networked server decides
besides what the server object (:mod:`zpipe.federated.server`) does: who
registers and who is refused, whether an update answers a task that is
outstanding for its sender, when a task or a probe has timed out, what a task
message holds, when the run ends, when the global model is evaluated, and what
goes to the trace and to the output. It never touches a socket, a clock or a
file: the shell (:class:`zpipe.federated.net_server.FederatedShell`) feeds it
typed messages and the time, and carries out the commands it returns
(:mod:`zpipe.federated.net_commands`), in order:

- :class:`SendMessage`: a protocol message to a peer (a task's send also starts
  the task's clock: the shell calls :meth:`FlServerController.task_sent` first);
- :class:`Emit`: a line of the run's output; :class:`TraceLine`: a line of the
  trace; :class:`LogLine`: a log line;
- :class:`Evaluate`: the global model (the shell owns the test set);
- :class:`Abort`: the run cannot start; the shell raises the error.

Whether a client is present (silence, set-aside clients, released ids, probes) is
decided by its :class:`~zpipe.federated.net_presence.ClientPresence`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from zpipe._errors import ConfigError, ProtocolError
from zpipe.federated.grouping import ClientProfile
from zpipe.federated.model import MLPShape, init_weights
from zpipe.federated.net_admission import profile_from_register
from zpipe.federated.net_commands import (
    Abort,
    Command,
    Emit,
    Evaluate,
    LogLine,
    NetServerConfig,
    SendMessage,
    TraceLine,
    client_peer,
)
from zpipe.federated.net_limits import TaskDeadlines
from zpipe.federated.net_presence import ClientPresence, Outcome
from zpipe.federated.net_trace import config_to_json, dispatch_events
from zpipe.federated.net_wire import weights_from, weights_tensor
from zpipe.federated.server import (
    ClientUpdate,
    FederatedServer,
    TrainTask,
    make_server,
)
from zpipe.protocol import WireMessage
from zpipe.protocol.federated import (
    FlDone,
    FlError,
    FlProbeReply,
    FlRegister,
    FlTask,
    FlUpdate,
    FlWelcome,
)


@dataclass
class _Outstanding:
    client: int
    sent_at: float
    deadline: float


class FlServerController:
    """One federated run's decisions: registration, then the server object's tasks."""

    def __init__(self, config: NetServerConfig, shape: MLPShape) -> None:
        self.config = config
        self.shape = shape
        self.clients: dict[bytes, ClientProfile] = {}  # routing id -> profile
        self.routes: dict[int, bytes] = {}  # client id -> routing id
        # silence, set-aside and released ids, probes
        self.presence = ClientPresence(config)
        self.server: FederatedServer | None = None
        self.dropped_messages = 0
        self.reason = "updates"  # why the run ended
        self._outstanding: dict[int, _Outstanding] = {}
        self.deadlines = TaskDeadlines(config.task_floor_s, config.task_timeout_s)
        self._end_at = math.inf
        self._evaluated: int | None = None  # the version last evaluated

    # ------------------------------------------------------------- drops

    def drop(self, routing_id: bytes, reason: str) -> list[Command]:
        """A message that is not acted on: counted and logged, never answered."""
        self.dropped_messages += 1
        client = self.clients.get(routing_id)
        fields = {"client": None if client is None else client.client_id, "reason": reason}
        return [LogLine("warning", "fl_message_dropped", fields)]

    def refused(self, routing_id: bytes, message: WireMessage, reason: str) -> list[Command]:
        """A message whose sender's key may not send its kind (``roles.txt``)."""
        self.dropped_messages += 1
        commands: list[Command] = [LogLine("warning", "role_refused", {"error": reason})]
        if isinstance(message, FlRegister):  # tell a would-be client why, once
            commands.append(SendMessage(routing_id, FlError(reason=reason), "refused key"))
        return commands

    # ------------------------------------------------------------ registration

    @property
    def registering(self) -> bool:
        """Whether registrations are still awaited before the run starts."""
        return len(self.clients) < self.config.clients

    def on_registration(
        self, routing_id: bytes, message: WireMessage, origin: str | None = None
    ) -> list[Command]:
        """A message before the run started: only registrations count. ``origin``: the
        peer's address on a server without keys (None with keys: a key holds one id)."""
        if not isinstance(message, FlRegister):
            return self.drop(routing_id, f"{message.KIND} before the run started")
        profile, commands = self._admit(routing_id, message, "unregistered client", origin)
        if profile is not None:
            event = {"event": "registered", "client": profile.client_id}
            commands.append(Emit({**event, "latency_s": profile.latency_s}))
        return commands

    def _admit(
        self, routing_id: bytes, message: FlRegister, refused_peer: str, origin: str | None
    ) -> tuple[ClientProfile | None, list[Command]]:
        """The client a registration adds and its welcome, or why it is refused."""
        try:
            profile = _profile_of(self, routing_id, message)
            self.presence.origins.check(origin, profile.client_id)
        except ProtocolError as exc:
            refusal = SendMessage(routing_id, FlError(reason=str(exc)), refused_peer)
            return None, [*self.drop(routing_id, str(exc)), refusal]
        old_route = self.routes.get(profile.client_id)
        if old_route is not None and old_route != routing_id:
            del self.clients[old_route]  # a released id taken by its new connection
        self.clients[routing_id] = profile
        self.routes[profile.client_id] = routing_id
        self.presence.origins.add(origin, profile.client_id)
        self.presence.released.discard(profile.client_id)
        welcome = FlWelcome(client=profile.client_id)
        return profile, [SendMessage(routing_id, welcome, client_peer(profile.client_id))]

    # ----------------------------------------------------------------- the run

    def start(self, now: float) -> list[Command]:
        """The server object over the registered clients, and its first tasks."""
        config = self.config
        self._end_at = now + config.duration_s
        initial = init_weights(self.shape, np.random.default_rng([config.seed, 3]))
        # a silent client is set aside until heard from (the flat methods; the grouped
        # ones drop it out of its group): it must not keep a slot from live clients
        server_config = replace(config.server, sideline_silent=True)
        profiles = sorted(self.clients.values(), key=lambda p: p.client_id)
        listed = [[p.client_id, p.latency_s, list(p.label_counts)] for p in profiles]
        shape = [self.shape.n_in, self.shape.n_hidden, self.shape.n_out]
        commands: list[Command] = [
            TraceLine(
                {
                    "event": "config",
                    "server": config_to_json(server_config),
                    "shape": shape,
                    "initial_weights": initial.tolist(),
                }
            ),
            TraceLine({"event": "profiles", "profiles": listed}),
        ]
        try:
            server = make_server(profiles, initial, server_config)
        except ConfigError as exc:
            # the clients would otherwise wait for tasks until their idle timeout
            return [*commands, *self.farewell(f"server error: {exc}"), Abort(exc)]
        self.server = server
        for profile in profiles:
            self.presence.last_heard.heard(profile.client_id, now)
        commands.append(self._evaluate(server))
        return [*commands, *self._dispatch(server.start(), now)]

    def _running(self) -> FederatedServer:
        if self.server is None:
            raise ConfigError("the federated run has not started")
        return self.server

    def tick(self, now: float) -> tuple[list[Command], bool]:
        """Time passed: tasks and probes that timed out, probes now due; and
        whether the run ends here (:attr:`reason` says why)."""
        server = self._running()
        if server.version >= self.config.max_updates:
            self.reason = "updates"
            return [], True
        if now >= self._end_at:
            self.reason = "duration"
            return [], True
        commands: list[Command] = []
        for task_id in [t for t, o in self._outstanding.items() if o.deadline <= now]:
            commands += self._fail(server, task_id, now)
        for result in self.presence.probes.expired(now):
            commands += self._then(self.presence.probed(server, result), now)
        due, candidates = self.presence.due(server, self.routes, now)
        commands += due
        if server.outstanding() == 0 and self.presence.probes.outstanding() == 0 and not candidates:
            self.reason = "nothing to dispatch"  # every client dropped out or failed
            return commands, True
        return commands, False

    def next_deadline(self) -> float:
        """When :meth:`tick` next has something to do, at the latest the run's end."""
        server = self._running()
        return min(
            min((o.deadline for o in self._outstanding.values()), default=self._end_at),
            self.presence.next_event(server, self.routes),
            self._end_at,
        )

    # ------------------------------------------------------------ gone clients

    def on_gone(self, routing_id: bytes, now: float) -> list[Command]:
        """The connection that carried ``routing_id`` closed (the shell's socket monitor
        saw it): its client id is released, and during the run its task is taken back
        at once and the client set aside, as a silent one is (no answer can come)."""
        profile = self.clients.get(routing_id)
        if profile is None or profile.client_id in self.presence.released:
            return []
        client = profile.client_id
        commands = self.presence.release(client, "its connection closed")
        if self.server is None or client in self.presence.held:
            return commands  # only its address's count changes: the server object lacks it
        server = self.server
        held = [t for t, o in self._outstanding.items() if o.client == client]
        for task_id in held:
            commands += self._fail(server, task_id, now, at_deadline=False)
        if not held and not server.is_dropped(client):
            silent = self.presence.silent(server, client, self.config.task_timeout_s)
            commands += self._then(silent, now)
        return commands

    def task_sent(self, task_id: int, now: float) -> None:
        """A task's message is about to be sent: its latency and deadline count from now."""
        outstanding = self._outstanding.get(task_id)
        if outstanding is not None:
            outstanding.sent_at = now
            outstanding.deadline = now + self.task_deadline_s(outstanding.client)

    def task_deadline_s(self, client: int) -> float:
        """How long a task of ``client`` may stay unanswered before it is taken back."""
        return self.deadlines.deadline_s(client)

    def on_message(
        self, routing_id: bytes, message: WireMessage, now: float, origin: str | None = None
    ) -> list[Command]:
        """A valid message during the run (``origin``: as for :meth:`on_registration`)."""
        server = self._running()
        before = server.version
        commands = self._handle(server, routing_id, message, now, origin)
        every = self.config.eval_every
        if server.version // every > before // every:
            commands.append(self._evaluate(server))
        return commands

    def finish(self) -> list[Command]:
        """The run ended: its last evaluation, the trace's end and every client's fl_done."""
        server = self._running()
        commands: list[Command] = []
        if self._evaluated != server.version:
            commands.append(self._evaluate(server))
        end = {"event": "end", "version": server.version}
        commands.append(TraceLine({**end, "weights": server.global_weights.tolist()}))
        return [*commands, *self.farewell(self.reason)]

    def farewell(self, reason: str) -> list[Command]:
        return [
            SendMessage(routing_id, FlDone(reason=reason), client_peer(profile.client_id))
            for routing_id, profile in self.clients.items()
        ]

    def _evaluate(self, server: FederatedServer) -> Evaluate:
        self._evaluated = server.version
        return Evaluate(server.version, server.global_weights.copy())

    def _dispatch(self, tasks: Sequence[TrainTask], now: float) -> list[Command]:
        config = self.config
        commands: list[Command] = [TraceLine(event) for event in dispatch_events(tasks)]
        for task in tasks:
            # until the shell sends it (task_sent), the task counts from now
            self._outstanding[task.task_id] = _Outstanding(
                task.client_id, now, now + self.task_deadline_s(task.client_id)
            )
            message = FlTask(
                task=task.task_id,
                version=task.version,
                shape=[self.shape.n_in, self.shape.n_hidden, self.shape.n_out],
                local_steps=config.local_steps,
                batch_size=config.batch_size,
                lr=config.lr,
                mu=config.mu,
                seed=config.seed,
                tensors=(weights_tensor(task.weights.copy()),),
            )
            # a task that cannot be sent (the client is gone) is left to time out like
            # one whose answer is lost: one rule for every silent client
            route = self.routes[task.client_id]
            commands.append(
                SendMessage(route, message, client_peer(task.client_id), task=task.task_id)
            )
        return commands

    def _fail(
        self, server: FederatedServer, task_id: int, now: float, *, at_deadline: bool = True
    ) -> list[Command]:
        """Take a task back from its silent client (``at_deadline``) or from one whose
        connection closed (at ``now``): the method goes on without it."""
        outstanding = self._outstanding.pop(task_id)
        until = outstanding.deadline if at_deadline else now
        waited = round(max(until - outstanding.sent_at, 0.0), 6)
        fields = {"task": task_id, "client": outstanding.client}
        commands: list[Command] = [
            LogLine("warning", "fl_task_timed_out", {**fields, "waited_s": waited}),
            Emit({"event": "task_failed", **fields}),
        ]
        # a slow client's answer may still come (for one more --task-timeout): measured,
        # never merged
        late_until = now + self.config.task_timeout_s
        self.presence.took_back(task_id, outstanding.client, outstanding.sent_at, late_until)
        # the silence first: a client that it drops out must not be picked again by the
        # new round its failure may start
        commands += self._then(self.presence.silent(server, outstanding.client, waited), now)
        commands.append(TraceLine({"event": "failed", "task": task_id}))
        return [*commands, *self._dispatch(server.on_task_failed(task_id), now)]

    def _then(self, outcome: Outcome, now: float) -> list[Command]:
        """A presence decision's commands, then the tasks it lets the server dispatch."""
        commands, tasks = outcome
        return [*commands, *self._dispatch(tasks, now)]

    def _join(
        self,
        server: FederatedServer,
        routing_id: bytes,
        message: FlRegister,
        now: float,
        origin: str | None,
    ) -> list[Command]:
        """A registration after the start: the client joins the run (eq. 4 for groups),
        or registers again (its connection dropped, or its id was released)."""
        was_released = message.client in self.presence.released
        profile, commands = self._admit(routing_id, message, "late client", origin)
        if profile is None:
            return commands
        self.presence.last_heard.heard(profile.client_id, now)
        client = {"client": profile.client_id, "latency_s": profile.latency_s}
        probation = self.presence.on_probation(profile.client_id, origin)
        if profile.client_id in server.profiles:
            # registered again (the client came back on a new connection, or on its own
            # after a drop): a task sent to its old connection cannot be answered, and
            # its registered latency is news, as a probe's answer is
            # ... unless it was set aside and not released (a registration must not be a
            # way back past the probes) or is on probation: then only a probe's answer
            # (or a late update) brings it back
            aside = server.is_dropped(profile.client_id)
            stays_aside = aside and (probation or not was_released)
            held = [t for t, o in self._outstanding.items() if o.client == profile.client_id]
            for task_id in held:
                commands += self._fail(server, task_id, now, at_deadline=False)
            commands.append(Emit({"event": "rejoined", **client, "set_aside": stays_aside}))
            if stays_aside:
                return commands
            observed = self.presence.observe(server, profile.client_id, profile.latency_s)
            return [*commands, *self._then(observed, now)]
        if probation:
            return [*commands, *self.presence.hold(profile, origin)]
        commands.append(
            TraceLine({"event": "join", **client, "label_counts": list(profile.label_counts)})
        )
        tasks = server.add_client(profile)
        dropped = server.is_dropped(profile.client_id)
        commands.append(Emit({"event": "joined", **client, "dropped": dropped}))
        return [*commands, *self._dispatch(tasks, now)]

    def _handle(
        self,
        server: FederatedServer,
        routing_id: bytes,
        message: WireMessage,
        now: float,
        origin: str | None,
    ) -> list[Command]:
        if isinstance(message, FlRegister):  # a new client, or one registering again
            return self._join(server, routing_id, message, now, origin)
        profile = self.clients.get(routing_id)
        if profile is None:
            return self.drop(routing_id, f"{message.KIND} from a peer that has not registered")
        commands: list[Command] = []
        if profile.client_id in self.presence.released:
            try:
                commands = self.presence.reclaim(profile.client_id, origin)
            except ProtocolError as exc:  # no room at its address: dropped
                reason = f"client {profile.client_id} was released: {exc}"
                return self.drop(routing_id, reason)
        self.presence.last_heard.heard(profile.client_id, now)
        return [*commands, *self._act(server, routing_id, profile, message, now)]

    def _act(
        self,
        server: FederatedServer,
        routing_id: bytes,
        profile: ClientProfile,
        message: WireMessage,
        now: float,
    ) -> list[Command]:
        match message:
            case FlProbeReply():
                result = self.presence.probes.answered(message.probe, profile.client_id, now)
                if result is None:
                    reason = f"probe {message.probe} is not outstanding for this client"
                    return self.drop(routing_id, reason)
                self.deadlines.measured(profile.client_id, result.latency_s)
                return self._then(self.presence.probed(server, result), now)
            case FlUpdate():
                return self._update(server, routing_id, profile, message, now)
            case _:
                return self.drop(routing_id, f"{message.KIND} is not expected from a client now")

    def _update(
        self,
        server: FederatedServer,
        routing_id: bytes,
        profile: ClientProfile,
        message: FlUpdate,
        now: float,
    ) -> list[Command]:
        client = profile.client_id
        outstanding = self._outstanding.get(message.task)
        late_s = None if outstanding else self.presence.late_latency(message.task, client, now)
        if late_s is not None:
            self.deadlines.measured(client, late_s)  # a longer deadline for its next task
            return self._then(self.presence.late_answer(server, message.task, client, late_s), now)
        if outstanding is None or outstanding.client != profile.client_id:
            return self.drop(routing_id, f"task {message.task} is not outstanding for this client")
        try:
            if message.n_samples != profile.n_samples:
                # the weight of its model in every average: the count it registered with
                raise ProtocolError(
                    f"fl_update: {message.n_samples} samples, registered with {profile.n_samples}"
                )
            weights = weights_from(message.tensors, self.shape.size, what="fl_update")
            update = ClientUpdate(message.task, profile.client_id, weights, message.n_samples)
            tasks = server.on_update(update)
        except ProtocolError as exc:
            return self.drop(routing_id, str(exc))  # the task stays outstanding until its deadline
        del self._outstanding[message.task]
        latency = now - outstanding.sent_at
        self.deadlines.measured(profile.client_id, latency)
        task = {"event": "update", "task": message.task, "client": profile.client_id}
        return [
            TraceLine({**task, "n_samples": message.n_samples, "weights": weights.tolist()}),
            Emit({**task, "latency_s": round(latency, 4), "global_updates": server.version}),
            *self._dispatch(tasks, now),
            *self._then(self.presence.observe(server, profile.client_id, latency), now),
        ]


def _profile_of(
    controller: FlServerController, routing_id: bytes, message: FlRegister
) -> ClientProfile:
    """The profile a registration claims, refused when its id is another live peer's or
    the peer already holds another id."""
    profile = profile_from_register(message, controller.shape.n_out)
    known = controller.routes.get(profile.client_id)
    if (
        known is not None
        and known != routing_id
        and profile.client_id not in controller.presence.released
    ):
        raise ProtocolError(f"client id {profile.client_id} is already registered by another peer")
    held = controller.clients.get(routing_id)
    if held is not None and held.client_id != profile.client_id:
        raise ProtocolError("a peer registers once, under one client id")
    return profile
