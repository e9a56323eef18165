"""bench/hostile.py's plan: which attack goes to which port, in what order, each a
:class:`Step` with what its window must expect (its own fake stage's death, a target
whose memory is followed, a wait before memory is read again)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from bench._hostile_attacker import Attacker
from bench._hostile_targets import fl_identities, half_bulk, max_model_bypass
from bench._hostile_wire import (
    factory_request,
    fetches,
    garbage_messages,
    model_bomb_request,
    planted_backups,
    poison_messages,
)
from zpipe.protocol.client_control import RunFailed
from zpipe.protocol.peer import BackupOk, Units

Outcome = int | tuple[int, dict[str, Any]]

# the fake stage of half_bulk: the one death its window expects
FAKE_STAGE = "mallory_bulk"
# the classes that ``--only CLASS`` runs with CLASS: its sub-cases
SUB_CASES = {"data_port_frames": ("data_port_frames_unadmitted",)}
# an address of this host that no assignment names (loopback admits binding it as a
# connection's source): finding 3 from an unadmitted peer
UNADMITTED_SOURCE = "127.0.0.2"
# slowloris' frame: the largest a 2 GiB message limit lets through
SLOW_FRAME = 2**31 - 1
GIB = 1 << 30


@dataclass(frozen=True)
class Step:
    klass: str
    endpoint: str
    attack: Callable[[Attacker], Outcome]
    target: str | None = None  # the process whose memory the finding follows
    expected_deaths: tuple[str, ...] = ()
    leave_s: float = 0.0  # wait after the attack before memory is read again
    cpu: bool = False  # the target's CPU seconds and suspicions (probe floods)


def _by_endpoint(members: list[dict[str, Any]]) -> dict[str, str]:
    """Process name of every stage's data and probe endpoint."""
    out = {}
    for m in members:
        out[str(m["data_endpoint"])] = str(m["name"])
        probe = str(m["info"].get("probe_endpoint") or "")
        if probe:
            out[probe] = str(m["name"])
    return out


def peer_request_steps(
    members: list[dict[str, Any]], coordinator: str, count: int, marker: str
) -> list[Step]:
    """The classes that ask for something: remote code, a model bomb, planted backups
    and fetched units (each must be refused)."""

    def factory(a: Attacker, ep: str) -> Outcome:
        return a.send_all(zmq.DEALER, ep, iter([factory_request(marker)]), 1)

    def bomb(a: Attacker, ep: str) -> Outcome:
        replies = a.requests(ep, [model_bomb_request()], 60.0)
        failed = [RunFailed.from_message(m) for m in replies[:1] if m.kind == RunFailed.KIND]
        error = failed[0].error if failed else ""
        reply = replies[0].kind if replies else None
        return 1, {"reply": reply, "error": error[:160], "refused": bool(error)}

    names = [str(m["name"]) for m in members]

    def plant(a: Attacker, ep: str) -> Outcome:
        oks = [BackupOk.from_message(r) for r in a.requests(ep, planted_backups(count))]
        kept = sum(1 for ok in oks if not ok.error)
        return count, {"kept": kept, "refused_replies": len(oks) - kept, "refused": kept == 0}

    def fetch(a: Attacker, ep: str, owner: str) -> Outcome:
        replies = a.requests(ep, fetches(owner, count))
        units = [Units.from_message(r) for r in replies if r.kind == Units.KIND]
        leaked = sum(len(u.tensors) for u in units)
        return count, {"leaked_units": leaked, "refused": leaked == 0}

    steps = [
        Step("factory", coordinator, lambda a: factory(a, coordinator)),
        Step("model_bomb", coordinator, lambda a: bomb(a, coordinator)),
    ]
    for member in members:
        probe = str(member["info"].get("probe_endpoint") or "")
        if not probe:
            continue
        other = next((n for n in names if n != member["name"]), names[0])
        steps.append(Step("backup_plant", probe, lambda a, ep=probe: plant(a, ep)))
        steps.append(Step("fetch_units", probe, lambda a, ep=probe, o=other: fetch(a, ep, o)))
    return steps


def attack_plan(
    members: list[dict[str, Any]],
    coordinator: str,
    sink: str,
    args: argparse.Namespace,
    *,
    control: str,
    idle_data: str,
    first_data: str,
    on_sent: Callable[[], None],
) -> list[Step]:
    """Every attack on every port it fits, the findings' classes last (they hold the
    most memory, so an earlier class is not judged on what they left)."""
    owner = _by_endpoint(members)
    data = [str(m["data_endpoint"]) for m in members]
    probes = [str(m["info"].get("probe_endpoint") or "") for m in members]
    probes = [p for p in probes if p]
    pulls = [*data, sink]
    routers = [coordinator, *probes]
    n = args.messages
    plan: list[Step] = []
    for ep in pulls:
        plan.append(
            Step(
                "poison_shape", ep, lambda a, ep=ep: a.send_all(zmq.PUSH, ep, poison_messages(), n)
            )
        )
    for ep in routers:
        plan.append(
            Step(
                "poison_shape",
                ep,
                lambda a, ep=ep: a.send_all(zmq.DEALER, ep, poison_messages(), n),
            )
        )
    for ep in pulls:
        plan.append(
            Step(
                "garbage",
                ep,
                lambda a, ep=ep: a.send_all(zmq.PUSH, ep, garbage_messages(a.rng), n),
            )
        )
    for ep in routers:
        plan.append(
            Step(
                "garbage",
                ep,
                lambda a, ep=ep: a.send_all(zmq.DEALER, ep, garbage_messages(a.rng), n),
            )
        )
    for ep in data:
        plan.append(
            Step("fill_and_hang_up", ep, lambda a, ep=ep: a.fill_and_hang_up(ep, args.rounds))
        )
    for ep in routers:
        plan.append(Step("flood", ep, lambda a, ep=ep: a.flood(zmq.DEALER, ep, args.flood_s)))
    flood_s, connections = args.probe_flood_s, args.probe_flood_connections
    for ep in probes:
        plan.append(
            Step(
                "probe_flood",
                ep,
                lambda a, ep=ep: a.probe_flood(ep, flood_s, connections),
                target=owner.get(ep),
                leave_s=flood_s / 4,  # a suspicion may come just after
                cpu=True,
            )
        )
        if control:  # as many floods of a port whose owner only receives
            plan.append(
                Step(
                    "probe_flood_control",
                    control,
                    lambda a, ep=control: a.probe_flood(ep, flood_s, connections),
                    target="receiver",
                    leave_s=flood_s / 4,
                    cpu=True,
                )
            )
    for ep in [*pulls, *routers]:
        plan.append(Step("raw_tcp", ep, lambda a, ep=ep: a.raw_tcp(ep, args.rounds, junk=True)))
        plan.append(
            Step(
                "connection_flood", ep, lambda a, ep=ep: a.raw_tcp(ep, 10 * args.rounds, junk=False)
            )
        )
    for ep in data:
        plan.append(
            Step("big_frames", ep, lambda a, ep=ep: a.big_frames(ep, args.big_count, args.big_mb))
        )
    return plan + finding_steps(coordinator, args, idle_data, first_data, owner, on_sent)


def finding_steps(
    coordinator: str,
    args: argparse.Namespace,
    idle_data: str,
    first_data: str,
    owner: dict[str, str],
    on_sent: Callable[[], None],
) -> list[Step]:
    """Issue 33's findings 1-5 and 7, one class each (finding 6 is probe_flood); the
    frame storms last: on a coordinator or stage without a per-message bound they can
    stop the cluster (stages exit after 60 s without word from their coordinator)."""
    hold, leave = args.hold_s, args.leave_s
    steps = [
        Step(
            "max_model_bypass",
            "its own coordinator",
            lambda a: max_model_bypass(
                a, hidden=args.bypass_hidden, max_model_mb=64, log_level="info"
            ),
        ),
        Step(
            "fl_identities",
            "its own fl-server",
            lambda a: fl_identities(
                a,
                identities=args.fl_identities,
                window_s=args.fl_window_s,
                big_frames=16,
                big_mb=60,
            ),
        ),
    ]
    steps.append(
        Step(
            "half_bulk",
            coordinator,
            lambda a: half_bulk(
                a,
                coordinator,
                name=FAKE_STAGE,
                transfers=args.bulk_transfers,
                announced=GIB,
                sent_bytes=args.bulk_mb << 20,
                on_sent=on_sent,
            ),
            target="coordinator",
            expected_deaths=(FAKE_STAGE,),
            leave_s=leave,
        )
    )
    steps.append(
        Step(
            "slowloris",
            coordinator,
            lambda a: _slowloris(a, coordinator, args, on_sent),
            target="coordinator",
            leave_s=leave,
        )
    )
    for ep in (idle_data, first_data):
        steps.append(
            Step(
                "data_port_frames",
                ep,
                lambda a, ep=ep: a.frame_storm(
                    zmq.PUSH,
                    ep,
                    connections=args.dp_connections,
                    messages=1,
                    frames=args.dp_frames,
                    frame_bytes=args.dp_kb * 1000,
                    hold_s=hold,
                    on_sent=on_sent,
                ),
                target=owner.get(ep),
                leave_s=leave,
            )
        )
    for ep in (idle_data, first_data):
        steps.append(
            Step(
                "data_port_frames_unadmitted",
                ep,
                lambda a, ep=ep: _unadmitted(a, ep, args, on_sent),
                target=owner.get(ep),
                leave_s=leave,
            )
        )
    steps.append(
        Step(
            "frame_amplification",
            coordinator,
            lambda a: a.frame_storm(
                zmq.DEALER,
                coordinator,
                connections=args.amp_connections,
                messages=args.amp_messages,
                frames=args.amp_frames,
                frame_bytes=1,
                hold_s=hold,
                on_sent=on_sent,
            ),
            target="coordinator",
            leave_s=leave,
        )
    )
    return steps


def _unadmitted(
    a: Attacker, endpoint: str, args: argparse.Namespace, on_sent: Callable[[], None]
) -> Outcome:
    figures = a.unadmitted_storm(
        endpoint,
        source=UNADMITTED_SOURCE,
        connections=args.dp_connections,
        frames=args.dp_frames,
        frame_bytes=args.dp_kb * 1000,
        wait_s=args.hold_s,
    )
    on_sent()
    # refused: every handshake refused, none admitted (a connection that never
    # answered within the wait counts as neither, and fails the class too)
    refused = figures["handshakes_refused"] == args.dp_connections
    return figures["queued"], {**figures, "refused": refused}


def _slowloris(
    a: Attacker, coordinator: str, args: argparse.Namespace, on_sent: Callable[[], None]
) -> Outcome:
    figures = a.slowloris(
        coordinator,
        connections=args.slow_connections,
        frame_size=SLOW_FRAME,
        send_bytes=args.slow_mb << 20,
        hold_s=args.hold_s,
        on_sent=on_sent,
    )
    return args.slow_connections, dict(figures)
