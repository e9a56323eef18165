"""Registration: a stage's ``register`` in, its ``registered`` (or ``refused``) out. Pure.

Part of the core (:class:`~zpipe.coordinator.core.CoordinatorCore`), which routes
registrations, probe answers, failed sends and ticks here. A registration under a
name a live stage holds is a claim (:mod:`~zpipe.coordinator.name_claims`): the
holder is probed first, and keeps its name if it answers; a holder gone or frozen
is declared dead and the newcomer admitted. A new process under the name of one of
the run's stages means that stage restarted: the run has lost it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from zpipe._errors import ConfigError, TransportTimeout
from zpipe.coordinator.commands import Command, Log, Persist, Send
from zpipe.coordinator.events import RegisterAsked, RequestFailed
from zpipe.coordinator.membership import Member, MemberState
from zpipe.coordinator.name_claims import Claim, NameClaims
from zpipe.coordinator.state import ControlState
from zpipe.protocol.stage_control import Probe, Refused, Register, Registered

# How the core handles a death it declares here: (name, reason, silent_s, now) -> commands.
OnDeath = Callable[[str, str, float, float], list[Command]]


def printable(routing_id: bytes) -> str:
    """A peer's routing id as text, for logs."""
    try:
        return routing_id.decode("ascii")
    except UnicodeDecodeError:
        return routing_id.hex()


def recorded_info(message: Register) -> dict[str, Any]:
    """What a member's info holds of its registration: what the stage said of itself,
    with its typed base cost (the planner reads it there:
    :func:`zpipe.coordinator.planning.base_bytes_of`)."""
    return {**message.info, "base_bytes": message.base_bytes}


class Registrations:
    """Registrations, and the claims on names that live stages hold."""

    def __init__(self, state: ControlState, on_death: OnDeath) -> None:
        self.state = state
        self._death = on_death
        # registrations under a name a live stage holds, until the holder answers or not
        self.claims = NameClaims()

    def register(self, event: RegisterAsked, now: float) -> list[Command]:
        """A stage asks to register: refused (a key not its name's), a claim (a live
        stage holds the name), or admitted."""
        state = self.state
        name = event.message.name
        reply_s = state.timeouts.reply_s
        if state.public_keys:
            expected = state.public_keys.get(name)
            if expected is None or event.user_key is None or expected.decode() != event.user_key:
                refused = Refused(reason=f"the key this stage uses is not {name}.key")
                return [
                    Log(
                        "warning",
                        "registration_refused",
                        {"stage": name, "reason": "key does not match name"},
                    ),
                    Send(event.routing_id, refused, name, reply_s),
                ]
        previous = state.membership.get(name)
        if (
            previous is not None
            and previous.state is not MemberState.DEAD
            and previous.routing_id != event.routing_id
        ):
            if previous.unreachable:
                # a send to the holder found its connection gone: nobody to ask
                return self._replace(name, event, "its connection is gone", now)
            # Within the holder's own suspect deadline (the one Membership.register
            # refuses a newcomer by), not the configured floor: past the floor and
            # within an adaptive deadline, the newcomer was refused and exited.
            if now - previous.last_seen < state.membership.deadlines(name)[0]:
                return self._claim(previous, event, now)
        if previous is not None and self._repeats(previous, event):
            return self._answer_again(event, now)
        return self._admit(event, now)

    def _repeats(self, member: Member, event: RegisterAsked) -> bool:
        """Whether ``event`` is the registration ``member`` already holds, sent again
        on the same connection: a stage repeats its registration every second until
        answered, and a coordinator that takes seconds to start finds them all queued
        (812 registrations for 300 fake peers at a start-up of 18 s under load)."""
        message = event.message
        return (
            member.state is not MemberState.DEAD
            # a member restored from disk registers in full: its first word to this process
            and message.name not in self.state.unconfirmed
            and member.routing_id == event.routing_id
            and member.data_endpoint == message.data_endpoint
            and member.info == recorded_info(message)
            and member.public_key == self.state.key_of(message.name)
        )

    def _answer_again(self, event: RegisterAsked, now: float) -> list[Command]:
        """A repeated registration: the member is refreshed as by any message from it
        and answered as the first time, without being made anew, logged at info or saved
        again (nothing of it changed)."""
        state, name = self.state, event.message.name
        self.claims.holder_gone(name)  # as a registration does: see _admit
        state.membership.heard_from(name, now)
        state.confirm(name)
        return [
            Log("debug", "stage_registered_again", {"stage": name}),
            Send(event.routing_id, self._registered(event, now), name, state.timeouts.reply_s),
        ]

    def _registered(self, event: RegisterAsked, now: float) -> Registered:
        state, name, token = self.state, event.message.name, event.bulk_token
        return Registered(
            name=name,
            heartbeat_interval=state.timeouts.heartbeat_interval_s,
            bulk_token=(
                state.bulk.issue(
                    name, token, event.routing_id, memory_mb=event.message.info.get("memory_mb")
                )
                if token
                else None
            ),
            clock=now,  # this coordinator stamps heartbeat acks
        )

    def _claim(self, holder: Member, event: RegisterAsked, now: float) -> list[Command]:
        """Another process registers under ``holder``'s name: ask the holder first."""
        # as long as the liveness rules would take to find the holder dead: a loaded
        # holder that answers late is not taken over sooner than it would be declared dead
        membership = self.state.membership
        window = membership.suspect_after_s + membership.probe_timeout_s
        claim = self.claims.open(holder.name, event, now, window)
        if claim is None:
            return []  # the newcomer repeated its registration; the probe is out
        probe = Probe(nonce=claim.nonce)
        return [
            Log(
                "info",
                "stage_name_claimed",
                {"stage": holder.name, "newcomer": printable(event.routing_id)},
            ),
            # stage=: a holder whose connection is gone fails this send at once
            Send(holder.routing_id, probe, holder.name, window, stage=holder.name),
        ]

    def refuse_claim(self, claim: Claim, holder: Member) -> list[Command]:
        reason = (
            f"the name {claim.name!r} is taken: a stage registered under it (data endpoint "
            f"{holder.data_endpoint}) is alive and answering; start this one with another "
            "--name, or stop that one first"
        )
        refused = Refused(reason=reason)
        return [
            Log(
                "warning",
                "registration_refused",
                {
                    "stage": claim.name,
                    "newcomer": printable(claim.registration.routing_id),
                    "reason": "name taken by a live stage",
                    "holder_endpoint": holder.data_endpoint,
                },
            ),
            Send(claim.registration.routing_id, refused, claim.name, self.state.timeouts.reply_s),
        ]

    def take_over(self, claim: Claim, why: str, now: float) -> list[Command]:
        """The holder is gone or frozen: it is dead, and the newcomer registers."""
        return self._replace(claim.name, claim.registration, why, now)

    def _replace(
        self, name: str, registration: RegisterAsked, why: str, now: float
    ) -> list[Command]:
        """``name``'s holder is dead (``why``), and ``registration`` takes its name."""
        holder = self.state.membership.get(name)
        if holder is None or holder.state is MemberState.DEAD:
            return self._admit(registration, now)  # declared dead meanwhile
        out: list[Command] = [Log("warning", "stage_name_taken_over", {"stage": name, "why": why})]
        death = self.state.membership.declare_dead(
            name, f"a new process registered under its name ({why})", now
        )
        if death is not None:
            out += self._death(death.name, death.reason, death.silent_s, now)
        return out + self._admit(registration, now)

    def holder_unreachable(self, event: RequestFailed, now: float) -> list[Command]:
        if event.stage not in self.claims or not isinstance(event.error, TransportTimeout):
            return []
        claim = self.claims.holder_gone(event.stage)
        assert claim is not None
        return self.take_over(claim, "its connection is gone", now)

    def _admit(self, event: RegisterAsked, now: float) -> list[Command]:
        message, state = event.message, self.state
        name = message.name
        # a claim on the name, should one be pending, is settled by this registration
        self.claims.holder_gone(name)
        reply_s = state.timeouts.reply_s
        out: list[Command] = []
        previous = state.membership.get(name)
        run = None if state.current is None else state.current.run
        data_endpoint = message.data_endpoint
        if (
            previous is not None
            and previous.state is not MemberState.DEAD
            and run is not None
            and name in run.devices
            and name not in run.failed
            and previous.data_endpoint != data_endpoint
        ):
            # A new process under the name of one of the run's stages: the one that
            # ran the run is gone (restarted), so the run has lost it.
            death = state.membership.declare_dead(name, "the stage restarted", now)
            if death is not None:
                out += self._death(death.name, death.reason, death.silent_s, now)
        try:
            member = state.membership.register(
                name=name,
                routing_id=event.routing_id,
                data_endpoint=data_endpoint,
                info=recorded_info(message),
                public_key=state.key_of(name),
                now=now,
            )
        except ConfigError as exc:
            return [
                *out,
                Log("warning", "registration_refused", {"stage": name, "reason": str(exc)}),
                Send(event.routing_id, Refused(reason=str(exc)), name, reply_s),
            ]
        state.confirm(name)
        registered = self._registered(event, now)
        return [
            *out,
            Log(
                "info",
                "stage_registered",
                {"stage": name, "data_endpoint": member.data_endpoint, "info": member.info},
            ),
            # every stage registers at a coordinator's start, and sends its queued
            # repeats then: one save for the burst, not one of every member each
            Persist(soon=True),
            Send(event.routing_id, registered, name, reply_s),
        ]

    def answered(self, holder: Member, nonce: int) -> list[Command] | None:
        """``holder`` answered a probe: the claim on its name that asked it, refused
        (None: the probe was the membership's own)."""
        claim = self.claims.answered(holder.name, nonce)
        return None if claim is None else self.refuse_claim(claim, holder)

    def expired(self, now: float) -> list[Command]:
        """Every claim whose holder did not answer in time: taken over."""
        out: list[Command] = []
        for claim in self.claims.expired(now):
            out += self.take_over(claim, "it did not answer a probe", now)
        return out
