"""Which fl clients are present: silence, set-aside clients, released ids, probes (sans-IO).

:class:`ClientPresence` is the part of
:class:`zpipe.federated.net_controller.FlServerController` that decides about a
client's presence rather than its tasks: when a client was last heard from, which
set-aside client has been silent long enough to be released (its address may then
register another id), when a released id is reclaimed, whom to probe, and what a
latency, a silence or a probe's result tells the server object. It never touches
a socket or a clock; the tasks its decisions free are returned for the controller
to dispatch.

Releases for silence are counted (:class:`~zpipe.federated.net_limits.SilenceStrikes`):
an id released for silence twice, or any id of an address whose ids were, is on
probation when it registers again. A known id then stays set aside (its registered
latency is a claim, not a measurement); a new id is *held*: welcomed, but kept out of
the server object. Either is given tasks only once it answers a probe (or, set aside,
returns a task's update late), so a silent peer that wins its ids back every
``--release-after`` seconds no longer holds a task slot with each.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from zpipe.federated.grouping import ClientProfile
from zpipe.federated.net_commands import (
    Command,
    Emit,
    LogLine,
    NetServerConfig,
    SendMessage,
    TraceLine,
    client_peer,
)
from zpipe.federated.net_limits import IdsPerAddress, LastHeard, SilenceStrikes
from zpipe.federated.probing import ProbeResult, ProbeSchedule
from zpipe.federated.server import FederatedServer, TrainTask
from zpipe.protocol.federated import FlProbe

# a decision's commands, then the tasks it lets the server object dispatch
Outcome = tuple[list[Command], list[TrainTask]]


@dataclass(frozen=True)
class _Late:
    client: int
    sent_at: float
    until: float


class ClientPresence:
    """Who is heard from, set aside, released or probed, over one run."""

    def __init__(self, config: NetServerConfig) -> None:
        self.probes = ProbeSchedule(config.probe_interval_s, config.probe_timeout_s)
        self.origins = IdsPerAddress(config.ids_per_address)
        self.last_heard = LastHeard(config.release_after_s)
        # ids whose client is gone (connection closed, or silent past --release-after):
        # not counted against their address, not probed; a registration may take one
        self.released: set[int] = set()
        # tasks taken back from a silent client, until --task-timeout after their send:
        # an answer meanwhile is late (measured, never merged)
        self._late: dict[int, _Late] = {}
        self.strikes = SilenceStrikes()
        # new ids on probation: welcomed, not yet in the server object; a probe's
        # answer adds them (with the latency it measured)
        self.held: dict[int, ClientProfile] = {}

    def release(self, client: int, reason: str, *, for_silence: bool = False) -> list[Command]:
        self.released.add(client)
        origin = self.origins.release(client)
        if for_silence:
            self.strikes.record(client, origin)
        fields = {"client": client, "reason": reason}
        return [
            LogLine("info", "fl_client_released", {**fields, "address": origin}),
            Emit({"event": "released", **fields}),
        ]

    def reclaim(self, client: int, origin: str | None) -> list[Command]:
        """A released id whose peer speaks again on the same connection (it was only
        silent): it counts against its address again. Raises ProtocolError if the
        address has no room (the id stays released)."""
        self.origins.check(origin, client)
        self.origins.add(origin, client)
        self.released.discard(client)
        return [Emit({"event": "reclaimed", "client": client})]

    def probe_candidates(self, server: FederatedServer) -> list[int]:
        """Whom to probe: the server object's candidates whose ids are not released."""
        if not self.probes.enabled:
            return []
        candidates = [*server.probe_candidates(), *sorted(self.held)]
        return [c for c in candidates if c not in self.released]

    def set_aside(self, server: FederatedServer, routes: Iterable[int]) -> list[int]:
        """The live ids the server object has set aside (or dropped) for silence or
        slowness, and the held ones: the only ones whose silence can release them."""
        return [
            c for c in routes if c not in self.released and (c in self.held or server.is_dropped(c))
        ]

    def on_probation(self, client: int, origin: str | None) -> bool:
        """Whether a registration of ``client`` from ``origin`` must answer a probe
        before it is given a task (see the module notes)."""
        return self.strikes.on_probation(client, origin)

    def hold(self, profile: ClientProfile, origin: str | None) -> list[Command]:
        """A new id on probation: kept out of the server object until a probe's answer."""
        self.held[profile.client_id] = profile
        strikes = self.strikes.of(profile.client_id, origin)
        fields = {"client": profile.client_id, "releases_for_silence": strikes}
        return [
            LogLine("info", "fl_client_on_probation", {**fields, "address": origin}),
            Emit({"event": "held", **fields}),
        ]

    def admit_held(self, server: FederatedServer, client: int, latency_s: float) -> Outcome:
        """A held client answered a probe: it joins the run with the latency it
        measured (eq. 4 for groups), as a late registration does."""
        profile = replace(self.held.pop(client), latency_s=latency_s)
        fields = {"client": client, "latency_s": latency_s}
        commands: list[Command] = [
            TraceLine({"event": "join", **fields, "label_counts": list(profile.label_counts)})
        ]
        tasks = server.add_client(profile)
        dropped = server.is_dropped(client)
        commands.append(Emit({"event": "joined", **fields, "dropped": dropped, "held": True}))
        return commands, tasks

    def due(
        self, server: FederatedServer, routes: Mapping[int, bytes], now: float
    ) -> tuple[list[Command], list[int]]:
        """Set-aside clients silent past --release-after released, and the probes now
        due; with the probe candidates (none left may end the run)."""
        for task_id in [t for t, late in self._late.items() if late.until <= now]:
            del self._late[task_id]  # an answer now would be no news: it is only dropped
        commands: list[Command] = []
        for client in self.last_heard.silent_past(now, self.set_aside(server, routes)):
            waited = round(now - self.last_heard.last(client), 6)
            commands += self.release(client, f"silent for {waited:g} s", for_silence=True)
        candidates = self.probe_candidates(server)
        for probe_id, client in self.probes.due(now, candidates):
            # an unsendable probe (the client is gone) times out like an unanswered one
            probe = FlProbe(probe=probe_id)
            commands.append(SendMessage(routes[client], probe, client_peer(client)))
        return commands, candidates

    def next_event(self, server: FederatedServer, routes: Iterable[int]) -> float:
        """When a probe is next due or times out, a silent client is released, or a
        task taken back stops waiting for a late answer."""
        return min(
            min((late.until for late in self._late.values()), default=math.inf),
            self.probes.next_event(self.probe_candidates(server)),
            self.last_heard.next_release(self.set_aside(server, routes)),
        )

    def took_back(self, task_id: int, client: int, sent_at: float, until: float) -> None:
        """A task taken back from ``client``: its answer until ``until`` is late."""
        self._late[task_id] = _Late(client, sent_at, until)

    def late_latency(self, task_id: int, client: int, now: float) -> float | None:
        """The latency of ``client``'s late answer to ``task_id`` (no longer awaited),
        or None if that task is not awaited late from that client."""
        late = self._late.get(task_id)
        if late is None or late.client != client:
            return None
        del self._late[task_id]
        return now - late.sent_at

    def late_answer(
        self, server: FederatedServer, task_id: int, client: int, latency_s: float
    ) -> Outcome:
        """An answer to a task taken back from its client: the task went to another
        client, so this model is never merged (no double update); but the client is
        alive, and its latency (the controller measures it for its deadline) brings
        back a client a flat method set aside. A grouped method's dropped client is
        left to its probes (Algorithm 1 regroups on what they measure, as before)."""
        fields = {"task": task_id, "client": client, "latency_s": round(latency_s, 4)}
        commands: list[Command] = [
            LogLine("info", "fl_late_update_dropped", fields),
            Emit({"event": "late_update", **fields}),
        ]
        if client not in server.sidelined:
            return commands, []
        observed, tasks = self.observe(server, client, latency_s)
        return [*commands, *observed], tasks

    def observe(self, server: FederatedServer, client: int, latency_s: float) -> Outcome:
        commands: list[Command] = [
            TraceLine({"event": "latency", "client": client, "latency_s": latency_s})
        ]
        was_dropped = server.is_dropped(client)
        tasks = server.observe_latency(client, latency_s)
        if server.is_dropped(client) != was_dropped:
            kind = "readmitted" if was_dropped else "dropped"
            event = {"event": kind, "client": client, "latency_s": round(latency_s, 4)}
            commands.append(Emit(event))
        return commands, tasks

    def silent(self, server: FederatedServer, client: int, waited_s: float) -> Outcome:
        commands: list[Command] = [
            TraceLine({"event": "silent", "client": client, "waited_s": waited_s})
        ]
        was_dropped = server.is_dropped(client)
        tasks = server.observe_silence(client, waited_s)
        if server.is_dropped(client) and not was_dropped:
            commands.append(Emit({"event": "dropped", "client": client, "waited_s": waited_s}))
        return commands, tasks

    def probed(self, server: FederatedServer, result: ProbeResult) -> Outcome:
        probe = Emit(
            {
                "event": "probe",
                "client": result.client_id,
                "latency_s": round(result.latency_s, 4),
                "answered": result.answered,
            }
        )
        if result.client_id in self.held:
            if not result.answered:
                return [probe], []  # still held: nothing to tell the server object
            commands, tasks = self.admit_held(server, result.client_id, result.latency_s)
            return [probe, *commands], tasks
        if not result.answered and result.client_id in server.sidelined:
            # a flat method's set-aside client that still does not answer stays aside: a
            # latency (even the timeout's lower bound) would bring it back. A grouped
            # method measures the timeout, which keeps it out of every group's range.
            commands, tasks = self.silent(server, result.client_id, result.latency_s)
        else:
            commands, tasks = self.observe(server, result.client_id, result.latency_s)
        return [probe, *commands], tasks
