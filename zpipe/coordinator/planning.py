"""From registered stages and profiles to a plan: the coordinator's planning step, pure.

Each stage reports its memory budget (the smaller of the free memory it
measured on its device, with what its process already holds, and what its operator
declared: the whole process's budget), the base cost of its process (its resident
memory before any model; the planner's device is the budget less that base and the
safety margin, :func:`zpipe.planner.memory.model_room_bytes`), its device kind
(cpu, cuda, mps) and its outgoing link (declared or emulated) when it
registers, and profiles the model on request (its own threads, slowdown and
device included), so every device is planned from its own
measured unit times. Links between stages are measured by the stages
(``zpipe.coordinator.links``); a link that was not measured, and every hop to
the client, is the sender's declared outgoing link: that is what a stage's
``--bandwidth-mbps`` shapes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from zpipe._errors import ConfigError
from zpipe.coordinator.membership import Member
from zpipe.planner import (
    PLANNERS,
    ClusterDevice,
    ClusterLink,
    ClusterSpec,
    Plan,
    plan_even_partition,
    plan_from_partition,
    plan_with,
)
from zpipe.planner.bucketing import parse_bucketing
from zpipe.planner.cluster import CLIENT
from zpipe.planner.memory import DEFAULT_MEMORY_MARGIN, DEFAULT_STAGE_BASE_BYTES, model_room_bytes
from zpipe.planner.profile import ModelProfile


def bucketing_of(value: object) -> str:
    """A run request's ``bucketing`` (absent: ``"auto"``), checked: ``"auto"``, ``"exact"``
    or a tolerance as a string. A bad value is a ConfigError the client is told."""
    mode = parse_bucketing("auto" if value is None else value)
    return mode if isinstance(mode, str) else repr(mode)


def _link_of(member: Member) -> ClusterLink:
    link: Mapping[str, Any] = member.info.get("link") or {}
    bandwidth = link.get("bandwidth_mbps")
    return ClusterLink(
        bandwidth_mbps=float(bandwidth) if bandwidth else None,
        latency_ms=float(link.get("latency_ms") or 0.0),
    )


# Devices that declare the same hardware and emulation and whose measured forward
# times differ by less than this are planned as one category.
ALIKE_TOLERANCE = 0.2


def _declared(member: Member) -> tuple[Any, ...]:
    info = member.info
    link = info.get("link") or {}
    device = info.get("device")
    if not isinstance(device, Mapping):  # an older stage reports none
        device = {}
    # A stage that reports its device separates declared from measured memory: free
    # memory measured at two starts is never equal, declarations are.
    memory = info.get("declared_memory_mb") if "device" in info else info.get("memory_mb")
    return (
        info.get("slowdown"),
        memory,
        str(device.get("type", "cpu")),
        str(device.get("name", "cpu")),
        link.get("bandwidth_mbps"),
        link.get("latency_ms"),
        info.get("cores"),
        info.get("threads"),
        info.get("torch"),
    )


def merge_alike_profiles(
    members: Sequence[Member], profiles: Mapping[str, ModelProfile]
) -> dict[str, ModelProfile]:
    """Give devices that are the same hardware one profile (the median of theirs).

    Measurements are never exactly equal, and the PipeEdge DP only groups devices
    whose numbers are identical: without this every device would be a category
    of its own and the DP's state space would double with each device.
    """
    groups: dict[tuple[Any, ...], list[str]] = {}
    for member in members:
        groups.setdefault(_declared(member), []).append(member.name)
    merged = dict(profiles)
    for names in groups.values():
        if len(names) < 2:
            continue
        totals = {n: sum(sum(u.time_s) for u in profiles[n].units) for n in names}
        ordered = sorted(names, key=totals.__getitem__)
        median = ordered[len(ordered) // 2]
        for name in names:
            if abs(totals[name] - totals[median]) <= ALIKE_TOLERANCE * totals[median]:
                merged[name] = profiles[median]
    return merged


def _memory_mb(member: Member) -> float | None:
    value = member.info.get("memory_mb")
    return float(value) if value else None


def merge_alike_memory(members: Sequence[Member]) -> dict[str, float | None]:
    """Each device's memory for the planner: devices that declare the same hardware and
    measured nearly the same free memory (within :data:`ALIKE_TOLERANCE` of the
    smallest of them) get the smallest, so that the planner sees them as one category,
    on the safe side."""
    merged = {m.name: _memory_mb(m) for m in members}
    groups: dict[tuple[Any, ...], list[tuple[float, str]]] = {}
    for member in members:
        measured = merged[member.name]
        if measured is not None:
            groups.setdefault(_declared(member), []).append((measured, member.name))
    for found in groups.values():
        known = sorted(found)
        while known:
            low = known[0][0]
            alike = [name for mb, name in known if mb <= low * (1 + ALIKE_TOLERANCE)]
            for name in alike:
                merged[name] = low
            known = known[len(alike) :]
    return merged


def base_bytes_of(member: Member) -> int:
    """The stage process's base cost: what it reported when it registered (the
    coordinator records ``Register.base_bytes`` in its info), else the default."""
    value = member.info.get("base_bytes")
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return DEFAULT_STAGE_BASE_BYTES


def model_rooms(
    members: Sequence[Member], margin: float = DEFAULT_MEMORY_MARGIN, *, training: bool = False
) -> dict[str, int | None]:
    """Each device's room for its model: its budget (alike devices share the smallest,
    :func:`merge_alike_memory`) less the safety margin and its process's base; devices
    that declare the same hardware and had the same budget get the smallest room of them,
    so that a few MiB of base between two processes do not split a category."""
    memory = merge_alike_memory(members)
    rooms: dict[str, int | None] = {}
    groups: dict[tuple[Any, ...], list[str]] = {}
    for member in members:
        budget = memory[member.name]
        if not budget:
            rooms[member.name] = None
            continue
        rooms[member.name] = model_room_bytes(
            int(budget * 2**20), base_bytes=base_bytes_of(member), margin=margin, training=training
        )
        groups.setdefault((*_declared(member), budget), []).append(member.name)
    for names in groups.values():
        least = min(rooms[n] or 0 for n in names)
        for name in names:
            rooms[name] = least
    return rooms


def cluster_from_members(
    members: Sequence[Member],
    profiles: Mapping[str, ModelProfile] | None = None,
    *,
    links: Mapping[tuple[str, str], ClusterLink] | None = None,
    margin: float = DEFAULT_MEMORY_MARGIN,
    training: bool = False,
) -> ClusterSpec:
    """The planner's view of the registered stages.

    With ``profiles`` (one per stage, measured there) every device is planned
    from its own times; without, a device's speed is ``1 / slowdown`` relative
    to the profile given with the run. ``links`` are measured links by
    (sender, receiver); a pair without one, and every hop to the client, is
    planned from the sender's declared outgoing link. Each device's memory is its
    room for the model (:func:`model_rooms`, with the safety ``margin``; to train, less
    what training's machinery costs a process too).
    """
    if profiles is not None:
        profiles = merge_alike_profiles(members, profiles)
    devices = []
    planned: dict[tuple[str, str], ClusterLink] = {}
    rooms = model_rooms(members, margin, training=training)
    for member in members:
        slowdown = float(member.info.get("slowdown") or 1.0)
        own = profiles.get(member.name) if profiles is not None else None
        devices.append(
            ClusterDevice(
                name=member.name,
                memory_bytes=rooms[member.name],
                speed=1.0 if own is not None else 1.0 / slowdown,
                profile=own,
            )
        )
        outgoing = _link_of(member)
        for other in [*members, None]:
            if other is not member:
                pair = (member.name, other.name if other is not None else CLIENT)
                planned[pair] = (links or {}).get(pair, outgoing)
    return ClusterSpec(devices=tuple(devices), links=planned)


def choose_plan(
    *,
    algo: str,
    num_units: int,
    names: Sequence[str],
    partition: Sequence[Sequence[int]] | None,
    profile: ModelProfile | None,
    cluster: ClusterSpec | None,
    batch_size: int,
    bucketing: object = "auto",
) -> tuple[Plan, Plan | None]:
    """The plan for a run, and the even partition it is compared with (if it differs).
    ``bucketing``: how the PipeEdge planner treats measured values (``plan_with``)."""
    if partition is not None:
        return plan_from_partition(num_units, names, partition), None
    if algo not in PLANNERS:
        raise ConfigError(f"unknown planner {algo!r}; known: {', '.join(sorted(PLANNERS))}")
    if profile is None or cluster is None:
        if algo != "even":
            raise ConfigError(f"planner {algo!r} needs a profile of the model")
        return plan_even_partition(num_units, list(names)[: min(len(names), num_units)]), None
    if profile.num_units != num_units:
        raise ConfigError(
            f"the profile describes {profile.num_units} units but the model has {num_units}"
        )
    plan = plan_with(algo, profile, cluster, batch_size, bucketing=bucketing)
    if algo == "even":
        return plan, None
    try:
        baseline = plan_with("even", profile, cluster, batch_size)
    except ConfigError:
        baseline = None  # even does not fit (memory, or more devices than units)
    return plan, baseline
