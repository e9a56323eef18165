"""Membership: who is alive, suspect or dead, as a pure state machine.

The coordinator feeds it what it hears (registrations, heartbeats, probe
answers) and the time, and asks it on each tick which stages to probe and
which to declare dead. No sockets, no clock of its own, so it is tested with
plain numbers.

    alive --(silent past its suspect deadline)--> suspect
    alive --(a send to it found its connection gone)--> suspect
    suspect --(anything heard)--> alive
    suspect --(no answer to the probe by its probe deadline)--> dead

A send that finds a member's connection gone (a killed process's TCP connection
drops at once, and the ROUTER refuses to route to it) is news that cannot wait for
the heartbeat deadline: the member is suspect at once, so no new run is planned
onto it and a process registering under its name replaces it without a claim
(:mod:`~zpipe.coordinator.registration`). It is still declared dead only once it
was also silent for its suspect deadline: a stage reconnecting after a link cut
keeps its name.

The deadlines are each member's own and adapt to what it showed
(:class:`~zpipe.recovery.detection.HeartbeatWatch`): the suspect deadline is
``max(suspect_after_intervals x interval, median + k MAD of its heartbeat gaps,
1.5 x its longest recent gap)``, the probe deadline ``max(probe_intervals x
interval, the same over its probe round trips and heartbeat lateness)``. A member
starved of CPU whose heartbeats come late but come is suspected less and waited
for longer; a punctual one keeps the configured times, so its death is found as
fast as with fixed deadlines.

A tick that comes more than ``local_pause_s`` (a heartbeat interval) after the
one before means this process itself was paused (starved of CPU, as Cassandra's
detector checks for too): nobody could be heard meanwhile, so the pause is not
held against the members (their silence clocks move on by it).

Silence that several members share (each past its own suspect deadline at once)
is more often this process's, the machine's or the network's trouble than
simultaneous deaths: while another member is silent too, a suspect is given its
suspect deadline once more before it is declared dead (simultaneous deaths are
found after about twice their deadlines; a lone death is not delayed).

At scale (hundreds of members, a tick a few times per heartbeat interval) a tick
costs one comparison per member: only members silent for at least the configured
suspect time (every deadline's floor) or already suspect have their adaptive
deadlines computed, and a message finds its sender by routing id in a dict.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from zpipe._errors import ConfigError
from zpipe.recovery.detection import DEFAULT_HEARTBEAT_GAPS, DeadlinePolicy, HeartbeatWatch


class MemberState(enum.Enum):
    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"


@dataclass
class Member:
    name: str
    routing_id: bytes
    data_endpoint: str
    info: Mapping[str, Any]
    public_key: str | None
    joined_at: float
    last_seen: float
    state: MemberState = MemberState.ALIVE
    suspect_since: float | None = None
    probe_nonce: int = 0
    # suspected because its run's results stalled, not because its heartbeats lapsed
    stall_suspect: bool = False
    # a send to it found its connection gone (until it is heard from again)
    unreachable: bool = False
    metrics: Mapping[str, Any] = field(default_factory=dict)
    dead_reason: str = ""
    # its adaptive deadlines (None only for a Member built outside Membership)
    liveness: HeartbeatWatch | None = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "state": self.state.value,
            "data_endpoint": self.data_endpoint,
            "info": dict(self.info),
            "last_seen": self.last_seen,
            "metrics": dict(self.metrics),
        }


@dataclass(frozen=True)
class ProbeDue:
    """A probe to send now (the wire's is :class:`zpipe.protocol.stage_control.Probe`)."""

    name: str
    nonce: int


@dataclass(frozen=True)
class Death:
    name: str
    reason: str
    silent_s: float
    # the deadlines it was judged by (for logs and the recovery bench)
    suspect_deadline_s: float = 0.0
    probe_deadline_s: float = 0.0


class Membership:
    def __init__(
        self,
        *,
        heartbeat_interval_s: float,
        suspect_after_intervals: int,
        probe_intervals: int,
        gap_policy: DeadlinePolicy = DEFAULT_HEARTBEAT_GAPS,
        local_pause_s: float | None = None,
    ) -> None:
        self.interval = heartbeat_interval_s
        # the floors of every member's deadlines (the configured, fixed times)
        self.suspect_after_s = suspect_after_intervals * heartbeat_interval_s
        self.probe_timeout_s = probe_intervals * heartbeat_interval_s
        self.gap_policy = gap_policy
        self.local_pause_s = heartbeat_interval_s if local_pause_s is None else local_pause_s
        self._last_tick: float | None = None
        self._members: dict[str, Member] = {}
        # live members by the routing id of their control connection (every message
        # a stage sends is looked up here: a scan would cost O(members) each)
        self._by_route: dict[bytes, Member] = {}
        self._next_nonce = 1

    def _watch(self) -> HeartbeatWatch:
        return HeartbeatWatch(
            interval_s=self.interval,
            suspect_floor_s=self.suspect_after_s,
            probe_floor_s=self.probe_timeout_s,
            policy=self.gap_policy,
        )

    def deadlines(self, name: str) -> tuple[float, float]:
        """``name``'s (suspect, probe) deadlines now; the floors for an unknown name."""
        member = self._members.get(name)
        watch = None if member is None else member.liveness
        if watch is None:
            return self.suspect_after_s, self.probe_timeout_s
        return watch.deadlines()

    def __contains__(self, name: str) -> bool:
        return name in self._members

    def get(self, name: str) -> Member | None:
        return self._members.get(name)

    def by_routing_id(self, routing_id: bytes) -> Member | None:
        member = self._by_route.get(routing_id)
        if member is None or member.state is MemberState.DEAD:
            return None
        return member

    def live(self) -> list[Member]:
        """Members that are not dead, in no particular order (:meth:`alive` sorts)."""
        return [m for m in self._members.values() if m.state is not MemberState.DEAD]

    def alive(self) -> list[Member]:
        """Members that can take work, in the order they joined."""
        members = [m for m in self._members.values() if m.state is not MemberState.DEAD]
        return sorted(members, key=lambda m: m.joined_at)

    def all(self) -> list[Member]:
        return list(self._members.values())

    def register(
        self,
        *,
        name: str,
        routing_id: bytes,
        data_endpoint: str,
        info: Mapping[str, Any],
        public_key: str | None,
        now: float,
    ) -> Member:
        """Add or refresh a member; a live name held by another connection is refused."""
        current = self._members.get(name)
        if (
            current is not None
            and current.state is not MemberState.DEAD
            and current.routing_id != routing_id
            and now - current.last_seen < self.deadlines(name)[0]
        ):
            raise ConfigError(f"a live stage is already registered as {name!r}")
        member = Member(
            name=name,
            routing_id=routing_id,
            data_endpoint=data_endpoint,
            info=info,
            public_key=public_key,
            joined_at=current.joined_at if current is not None else now,
            last_seen=now,
            # a new connection is a new process (or a restored one): a cold start
            liveness=self._watch(),
        )
        if current is not None and self._by_route.get(current.routing_id) is current:
            del self._by_route[current.routing_id]
        self._members[name] = member
        self._by_route[routing_id] = member
        return member

    def heard_from(
        self,
        name: str,
        now: float,
        metrics: Mapping[str, Any] | None = None,
        *,
        heartbeat: bool = False,
        probe_answer: bool = False,
    ) -> bool:
        """Record life from ``name`` (any message; a ``heartbeat`` times its gaps, a
        ``probe_answer`` its probe's round trip); False if it is unknown or already dead."""
        member = self._members.get(name)
        if member is None or member.state is MemberState.DEAD:
            return False
        watch = member.liveness
        if watch is not None:
            if heartbeat:
                watch.heartbeat(now)
            elif probe_answer and member.suspect_since is not None:
                watch.probe_answered(now - member.suspect_since)
        member.last_seen = now
        member.state = MemberState.ALIVE
        member.suspect_since = None
        member.stall_suspect = False
        member.unreachable = False
        if metrics is not None:
            member.metrics = metrics
        return True

    def declare_dead(self, name: str, reason: str, now: float) -> Death | None:
        member = self._members.get(name)
        if member is None or member.state is MemberState.DEAD:
            return None
        member.state = MemberState.DEAD
        member.dead_reason = reason
        if self._by_route.get(member.routing_id) is member:
            del self._by_route[member.routing_id]
        suspect_s, probe_s = self.deadlines(name)
        return Death(name, reason, now - member.last_seen, suspect_s, probe_s)

    def suspect(self, name: str, now: float) -> ProbeDue | None:
        """Suspect ``name`` now, before its heartbeats lapse (its work stalled at the
        data source): the probe to send, or None if it is not alive or already probed."""
        member = self._members.get(name)
        if member is None or member.state is not MemberState.ALIVE:
            return None
        member.state = MemberState.SUSPECT
        member.suspect_since = now
        member.stall_suspect = True
        member.probe_nonce = self._next_nonce
        self._next_nonce += 1
        return ProbeDue(name, member.probe_nonce)

    def connection_lost(
        self, name: str, now: float, *, routing_id: bytes | None = None
    ) -> ProbeDue | None:
        """A send to ``name`` (on ``routing_id``, when known) failed because its
        connection is gone: suspect it now. The probe to send, or None when it is not
        alive, already suspect, or the failed send was to a connection it no longer
        uses (it registered again meanwhile)."""
        member = self._members.get(name)
        if member is None or member.state is MemberState.DEAD:
            return None
        if routing_id is not None and routing_id != member.routing_id:
            return None  # an older connection's send: this one may be fine
        member.unreachable = True
        if member.state is not MemberState.ALIVE:
            return None  # suspect already: its probe is out
        member.state = MemberState.SUSPECT
        member.suspect_since = now
        member.probe_nonce = self._next_nonce
        self._next_nonce += 1
        return ProbeDue(name, member.probe_nonce)

    def tick(self, now: float) -> tuple[list[ProbeDue], list[Death]]:
        """Advance time: the probes to send now and the members now declared dead."""
        probes: list[ProbeDue] = []
        deaths: list[Death] = []
        self._forgive_local_pause(now)
        # Every suspect deadline is at least the floor: a member heard from more recently
        # than that is neither suspected nor judged now, and costs one comparison.
        floor = self.suspect_after_s
        candidates = [
            m
            for m in self._members.values()
            if m.state is MemberState.SUSPECT
            or (m.state is MemberState.ALIVE and now - m.last_seen >= floor)
        ]
        if not candidates:
            return probes, deaths
        silent_names = {
            m.name for m in candidates if now - m.last_seen >= self.deadlines(m.name)[0]
        }
        for member in candidates:
            suspect_s, probe_s = self.deadlines(member.name)
            if len(silent_names) > (member.name in silent_names):
                probe_s += suspect_s  # the silence is shared: wait once more
            if member.state is MemberState.ALIVE and now - member.last_seen >= suspect_s:
                member.state = MemberState.SUSPECT
                member.suspect_since = now
                member.probe_nonce = self._next_nonce
                self._next_nonce += 1
                probes.append(ProbeDue(member.name, member.probe_nonce))
            elif (
                member.state is MemberState.SUSPECT
                and member.suspect_since is not None
                and now - member.suspect_since >= probe_s
                # A stall probe can reach a stage just after its last heartbeat: it is
                # dead only once silent for the probe's time and an interval more (a
                # live one, however loaded, has sent a heartbeat in that time).
                and (not member.stall_suspect or now - member.last_seen >= probe_s + self.interval)
                # Suspected when a send found its connection gone: dead once silent for
                # its suspect deadline too, so a stage whose link flapped (it reconnects
                # and heartbeats) is not declared dead sooner than a silent one would be.
                and (not member.unreachable or now - member.last_seen >= suspect_s)
            ):
                silent = now - member.last_seen
                waited = now - member.suspect_since
                gone = ", its connection gone" if member.unreachable else ""
                death = self.declare_dead(
                    member.name,
                    f"no heartbeat for {silent:.1f} s (its deadline {suspect_s:.1f} s) "
                    f"and no answer to a probe in {waited:.1f} s{gone}",
                    now,
                )
                if death is not None:
                    deaths.append(death)
        return probes, deaths

    def hold(self, now: float) -> None:
        """Let time pass without judging anyone (the coordinator suspects itself of being
        cut off): the clock moves on, so the hold is not later forgiven as a pause of
        this process, and members silent through it are judged by their real silence."""
        self._last_tick = now

    def _forgive_local_pause(self, now: float) -> None:
        last, self._last_tick = self._last_tick, now
        if last is None:
            return
        paused = now - last - self.local_pause_s
        if paused <= 0:
            return
        for member in self._members.values():
            if member.state is MemberState.DEAD:
                continue
            member.last_seen = min(now, member.last_seen + paused)
            if member.liveness is not None:
                member.liveness.forgive(paused)
            if member.suspect_since is not None:
                member.suspect_since = min(now, member.suspect_since + paused)
