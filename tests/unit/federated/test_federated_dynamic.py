"""Late joins, latency probes and key roles of the federated server, pure parts."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from scipy.spatial.distance import jensenshannon

pytest.importorskip("sklearn")

from zpipe._errors import ConfigError, ProtocolError, RoleError
from zpipe.federated.grouping import ClientProfile, Grouping, GroupingPolicy
from zpipe.federated.net_admission import KeyIdentities, profile_from_register
from zpipe.federated.net_trace import config_to_json, replay
from zpipe.federated.probing import ProbeSchedule
from zpipe.federated.server import (
    METHODS,
    ClientUpdate,
    HierarchicalServer,
    ServerConfig,
    TrainTask,
    make_server,
)
from zpipe.protocol.federated import FlRegister
from zpipe.transport.roles import check_role, default_role, generate_keys_with_roles, load_roles


def _counts(*classes: int, n: int = 10, width: int = 4) -> tuple[int, ...]:
    counts = [0] * width
    for c in classes:
        counts[c] = n
    return tuple(counts)


def _update(task: TrainTask) -> ClientUpdate:
    return ClientUpdate(task.task_id, task.client_id, np.ones(3), 20)


def test_a_late_client_joins_the_group_of_smallest_eq4_cost() -> None:
    # two latency groups with ranges wide enough that either may take the newcomer
    profiles = [
        ClientProfile(0, 1.0, _counts(0, 1)),
        ClientProfile(1, 1.1, _counts(0, 1)),
        ClientProfile(2, 2.0, _counts(2, 3)),
        ClientProfile(3, 2.1, _counts(2, 3)),
    ]
    policy = GroupingPolicy(n_groups=2, lam=5.0, rt_floor_fraction=2.0, seed=0)
    grouping = Grouping(profiles, policy)
    # both ranges admit client 4: eq. 4 weighs its latency against the groups' data
    late = ClientProfile(4, 1.9, _counts(2, 3))
    change = grouping.add_client(late)
    total = np.sum([p.label_counts for p in [*profiles, late]], axis=0)
    costs = []
    for group in grouping.groups:
        members = [p for p in profiles if p.client_id in group.members]
        union = np.sum([p.label_counts for p in members], axis=0) + np.asarray(late.label_counts)
        js = jensenshannon(union, total, base=2) ** 2
        costs.append(abs(group.center_s - late.latency_s) + 5.0 * js)
    best = int(np.argmin(costs))
    assert abs(costs[0] - costs[1]) > 1e-3  # the choice is not a tie
    assert change.kind == "joined" and change.to_group == best
    assert 4 in grouping.groups[best].members
    assert np.allclose(grouping.pi_iid, total / total.sum())  # pi_iid counts the newcomer


def test_a_late_client_out_of_every_range_is_dropped_then_readmitted() -> None:
    profiles = [ClientProfile(i, lat, _counts(i % 4)) for i, lat in enumerate([1.0, 1.1, 5.0])]
    grouping = Grouping(profiles, GroupingPolicy(n_groups=2, lam=1.0, seed=0))
    change = grouping.add_client(ClientProfile(9, 60.0, _counts(1)))
    assert change.kind == "dropped" and 9 in grouping.dropped
    assert grouping.observe_latency(9, 1.05) is not None
    assert 9 in grouping.groups[0].members
    with pytest.raises(ConfigError, match="already"):
        grouping.add_client(ClientProfile(9, 1.0, _counts(1)))
    with pytest.raises(ConfigError, match="same classes"):
        grouping.add_client(ClientProfile(10, 1.0, (1, 2)))


def test_fedat_puts_a_late_client_in_its_nearest_tier() -> None:
    profiles = [ClientProfile(i, lat, _counts(0)) for i, lat in enumerate([1.0, 1.2, 9.0, 9.5])]
    grouping = Grouping(profiles, GroupingPolicy(mode="latency", n_groups=2, seed=0))
    assert grouping.add_client(ClientProfile(7, 30.0, _counts(1))).to_group == 1
    assert grouping.add_client(ClientProfile(8, 0.1, _counts(1))).to_group == 0


@pytest.mark.parametrize("method", METHODS)
def test_every_method_gives_a_late_client_work(method: str) -> None:
    profiles = [ClientProfile(i, 1.0 + 0.01 * i, _counts(i % 4)) for i in range(2)]
    config = ServerConfig(
        method=method, max_concurrent=2, grouping=GroupingPolicy(n_groups=1, seed=0)
    )
    server = make_server(profiles, np.zeros(3), config)
    outstanding = {t.task_id: t for t in server.start()}
    assert {t.client_id for t in outstanding.values()} == {0, 1}
    # K = 2 is taken: the newcomer waits for a free slot (FedAvg: for the next round)
    outstanding.update({t.task_id: t for t in server.add_client(ClientProfile(5, 1.0, _counts(3)))})
    seen = set()
    for _ in range(20):
        task = outstanding.pop(min(outstanding))
        seen.add(task.client_id)
        outstanding.update({t.task_id: t for t in server.on_update(_update(task))})
    assert 5 in seen
    with pytest.raises(ConfigError):
        server.add_client(ClientProfile(5, 1.0, _counts(3)))


def test_fedasync_fills_a_free_slot_at_once_when_a_client_joins() -> None:
    config = ServerConfig(method="fedasync", max_concurrent=3)
    server = make_server([ClientProfile(0, 1.0, _counts(0))], np.zeros(3), config)
    assert len(server.start()) == 1
    assert [t.client_id for t in server.add_client(ClientProfile(1, 1.0, _counts(1)))] == [1]


def test_only_dropped_idle_clients_of_dynamic_ecofl_are_probe_candidates() -> None:
    profiles = [ClientProfile(i, lat, _counts(i % 4)) for i, lat in enumerate([1.0, 1.1, 9.0])]
    policy = GroupingPolicy(n_groups=2, lam=1.0, seed=0)
    eco = make_server(profiles, np.zeros(3), ServerConfig(method="ecofl", grouping=policy))
    assert isinstance(eco, HierarchicalServer)
    tasks = {t.client_id: t for t in eco.start()}
    assert eco.probe_candidates() == []
    eco.observe_latency(2, 500.0)  # busy, then dropped: probed only once its task ends
    assert eco.is_dropped(2) and eco.probe_candidates() == []
    eco.on_task_failed(tasks[2].task_id)
    assert eco.probe_candidates() == [2]
    eco.observe_latency(2, 9.0)
    assert not eco.is_dropped(2) and eco.probe_candidates() == []
    for method in ("ecofl-nodg", "fedat", "astraea", "fedavg", "fedasync"):
        config = ServerConfig(method=method, grouping=policy)
        other = make_server(profiles, np.zeros(3), config)
        other.start()
        other.observe_latency(2, 500.0)
        assert other.probe_candidates() == []


def test_a_probe_schedule_probes_once_at_a_time_and_measures_round_trips() -> None:
    probes = ProbeSchedule(interval_s=2.0, timeout_s=5.0)
    assert probes.due(10.0, [3, 1]) == [(0, 1), (1, 3)]
    assert probes.due(10.5, [1, 3]) == []  # one probe out per client
    assert probes.next_event([1, 3]) == 15.0  # their deadline
    assert probes.answered(0, 3, 11.0) is None  # probe 0 is client 1's
    result = probes.answered(0, 1, 10.75)
    assert result is not None and result.answered and result.latency_s == pytest.approx(0.75)
    assert probes.answered(0, 1, 10.8) is None  # repeated
    assert probes.due(12.0, [1]) == []  # interval since its last probe ended
    assert probes.next_event([1]) == pytest.approx(12.75)
    assert probes.due(12.75, [1]) == [(2, 1)]
    expired = probes.expired(15.0)
    assert [(r.client_id, r.latency_s, r.answered) for r in expired] == [(3, 5.0, False)]
    assert probes.outstanding() == 1 and probes.sent == 3
    off = ProbeSchedule(interval_s=0.0, timeout_s=1.0)
    assert not off.enabled and off.due(0.0, [1]) == [] and off.next_event([1]) == math.inf
    with pytest.raises(ConfigError):
        ProbeSchedule(interval_s=-1.0, timeout_s=1.0)


def test_a_trace_with_a_join_replays_to_the_same_decisions() -> None:
    profiles = [[0, 1.0, [10, 0, 0, 0]], [1, 1.2, [0, 10, 0, 0]]]
    config = ServerConfig(method="ecofl", max_concurrent=3, grouping=GroupingPolicy(n_groups=1))
    events = [
        {"event": "config", "server": config_to_json(config), "initial_weights": [0.0, 0.0]},
        {"event": "profiles", "profiles": profiles},
        {"event": "join", "client": 4, "latency_s": 1.1, "label_counts": [0, 0, 10, 0]},
        {"event": "update", "task": 0, "client": 0, "n_samples": 10, "weights": [1.0, 1.0]},
        {"event": "update", "task": 1, "client": 1, "n_samples": 10, "weights": [3.0, 3.0]},
    ]
    replayed = replay(events)
    assert replayed.version == 1
    assert 4 in {client for _, client, _ in replayed.dispatches}


def test_a_registration_is_checked_field_by_field() -> None:
    good = FlRegister(client=3, label_counts=[1, 0, 2], latency_s=0.5)
    assert profile_from_register(good, 3) == ClientProfile(3, 0.5, (1, 0, 2))
    bad = [
        FlRegister(client=-1, label_counts=[1, 0, 2], latency_s=0.5),
        FlRegister(client=3, label_counts=[1, 0], latency_s=0.5),
        FlRegister(client=3, label_counts=[1, True, 2], latency_s=0.5),
        FlRegister(client=3, label_counts=[0, 0, 0], latency_s=0.5),
        FlRegister(client=3, label_counts=[1, 0, 2], latency_s=float("inf")),
        # issue 33 finding 4: all accepted before
        FlRegister(client=3, label_counts=[1, 0, 2], latency_s=1e308),
        FlRegister(client=3, label_counts=[1, 0, 2], latency_s=5e-324),
        FlRegister(client=3, label_counts=[1, 0, 2], latency_s=0.0),
        FlRegister(client=3, label_counts=[1 << 31, 0, 2], latency_s=0.5),
    ]
    for message in bad:
        with pytest.raises(ProtocolError):
            profile_from_register(message, 3)


def test_a_key_registers_one_client_id() -> None:
    """Issue 33 finding 4: one client key registered 300 silent ids in 1.1 s."""
    identities = KeyIdentities()
    alice, bob = b"A" * 40, b"B" * 40
    identities.check(alice, 3)
    identities.check(alice, 3)  # the same id again: a reconnection
    identities.check(bob, 4)
    for other in (4, 5, 300):
        with pytest.raises(ProtocolError, match="this key registered client 3"):
            identities.check(alice, other)


def test_only_client_keys_may_act_as_fl_clients(tmp_path: Path) -> None:
    for kind in ("fl_register", "fl_update", "fl_probe_reply"):
        check_role(kind, "client")  # allowed: no RoleError
        for role in ("stage", "coordinator"):
            with pytest.raises(RoleError, match="only client"):
                check_role(kind, role)  # type: ignore[arg-type]
    assert default_role("fl-client") == "client" and default_role("fl-server") == "stage"
    generate_keys_with_roles(tmp_path, ["fl-server", "fl-client", "jetson"])
    assert load_roles(tmp_path)["fl-client"] == "client"
