"""Eco-FL's grouping: JS divergence, K-means, eq. 4 association, thresholds, Algorithm 1."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.spatial.distance import jensenshannon

from zpipe._errors import ConfigError
from zpipe.federated.divergence import js_divergence, js_divergence_rows
from zpipe.federated.grouping import (
    ClientProfile,
    Grouping,
    GroupingPolicy,
    kmeans_latency_clusters,
)


def test_js_divergence_matches_scipy_and_its_bounds() -> None:
    rng = np.random.default_rng(0)
    for _ in range(20):
        p, q = rng.random(10), rng.random(10)
        p[rng.random(10) < 0.3] = 0.0
        p[0] += 0.1
        expected = jensenshannon(p, q, base=2) ** 2
        assert js_divergence(p, q) == pytest.approx(expected, abs=1e-12)
    assert js_divergence([5, 5, 0], [1, 1, 0]) == pytest.approx(0.0, abs=1e-12)
    assert js_divergence([1, 0], [0, 1]) == pytest.approx(1.0)
    rows = js_divergence_rows(np.array([[1, 0], [0, 1], [1, 1]]), [1, 1])
    assert rows == pytest.approx([js_divergence([1, 0], [1, 1]), js_divergence([0, 1], [1, 1]), 0])
    with pytest.raises(ConfigError):
        js_divergence([0, 0], [1, 1])


def _profiles(latencies: list[float], counts: list[tuple[int, ...]]) -> list[ClientProfile]:
    return [
        ClientProfile(i, lat, c) for i, (lat, c) in enumerate(zip(latencies, counts, strict=True))
    ]


def _clustered(rng: np.random.Generator, centers: list[float], per: int) -> list[float]:
    return [float(c + rng.uniform(-0.2, 0.2)) for c in centers for _ in range(per)]


def test_kmeans_finds_separated_latency_clusters_in_ascending_order() -> None:
    rng = np.random.default_rng(1)
    latencies = _clustered(rng, [9.0, 1.0, 5.0], 6)
    centers, labels = kmeans_latency_clusters(latencies, 3, seed=0)
    assert centers == sorted(centers)
    assert centers == pytest.approx([1.0, 5.0, 9.0], abs=0.2)
    # clients listed 9-first: the first six are the slowest cluster (index 2)
    assert labels.tolist() == [2] * 6 + [0] * 6 + [1] * 6


def _random_counts(rng: np.random.Generator, n: int) -> list[tuple[int, ...]]:
    out = []
    for _ in range(n):
        counts = np.zeros(10, dtype=int)
        a, b = rng.choice(10, size=2, replace=False)
        counts[a], counts[b] = rng.integers(5, 40, size=2)
        out.append(tuple(int(c) for c in counts))
    return out


def test_cost_is_eq4_against_a_direct_computation() -> None:
    rng = np.random.default_rng(2)
    profiles = _profiles(_clustered(rng, [1.0, 6.0], 5), _random_counts(rng, 10))
    grouping = Grouping(profiles, GroupingPolicy(n_groups=2, lam=7.0, seed=0))
    total = np.sum([p.label_counts for p in profiles], axis=0)
    pi_iid = total / total.sum()
    for group in grouping.groups:
        others = [p for p in profiles if p.client_id in group.members]
        for p in profiles:
            union = np.sum([q.label_counts for q in others if q.client_id != p.client_id], axis=0)
            union = union + np.asarray(p.label_counts)
            expected = abs(group.center_s - p.latency_s) + 7.0 * (
                jensenshannon(union, pi_iid, base=2) ** 2
            )
            assert grouping.cost(p.client_id, group) == pytest.approx(expected, abs=1e-9)


def test_association_prefers_the_client_that_balances_the_group_data() -> None:
    # one latency group (centre 2.1375): lambda = 0 picks by distance to the centre;
    # lambda = 10 picks the client whose classes complement the group's second
    latencies = [2.0, 2.05, 2.1, 2.4]
    counts = [(10, 10, 0, 0), (10, 10, 0, 0), (9, 11, 0, 0), (0, 0, 10, 10)]
    profiles = _profiles(latencies, counts)
    by_distance = Grouping(profiles, GroupingPolicy(n_groups=1, lam=0.0, seed=0))
    assert [c for c, _ in by_distance.association_order] == [2, 1, 0, 3]
    balancing = Grouping(profiles, GroupingPolicy(n_groups=1, lam=10.0, seed=0))
    assert [c for c, _ in balancing.association_order][:2] == [2, 3]
    for grouping in (by_distance, balancing):
        assert grouping.groups[0].members == {0, 1, 2, 3} and not grouping.dropped


def test_lambda_zero_is_latency_grouping_and_huge_lambda_is_data_grouping() -> None:
    rng = np.random.default_rng(3)
    profiles = _profiles(_clustered(rng, [1.0, 4.0, 8.0], 12), _random_counts(rng, 36))

    def members(policy: GroupingPolicy) -> list[set[int]]:
        return [set(g.members) for g in Grouping(profiles, policy).groups]

    latency_only = members(GroupingPolicy(mode="latency", n_groups=3, seed=0))
    assert members(GroupingPolicy(mode="eco", n_groups=3, lam=0.0, seed=0)) == latency_only
    data_only = members(GroupingPolicy(mode="data", n_groups=3, seed=0))
    huge = members(GroupingPolicy(mode="eco", n_groups=3, lam=1e9, rt_factor=1e9, seed=0))
    assert huge == data_only
    assert data_only != latency_only
    # data-only groups are far closer to the overall label distribution
    js = [
        Grouping(profiles, GroupingPolicy(mode=m, n_groups=3, seed=0)).mean_js()
        for m in ("data", "latency")
    ]
    assert js[0] < js[1]


def test_threshold_drops_clients_out_of_every_range() -> None:
    rng = np.random.default_rng(4)
    profiles = _profiles(_clustered(rng, [1.0, 5.0], 10), _random_counts(rng, 20))
    grouping = Grouping(profiles, GroupingPolicy(n_groups=2, lam=5.0, rt_factor=0.5, seed=0))
    assert grouping.dropped  # the outer half of each cluster's radius is out of range
    for group in grouping.groups:
        for c in group.members:
            assert abs(group.center_s - grouping.latency[c]) <= group.threshold_s
    for c in grouping.dropped:
        assert not any(g.admits(grouping.latency[c]) for g in grouping.groups)
    assert len(grouping.dropped) + sum(len(g.members) for g in grouping.groups) == 20


def test_algorithm1_moves_drops_and_readmits_on_latency_changes() -> None:
    rng = np.random.default_rng(5)
    profiles = _profiles(_clustered(rng, [1.0, 10.0], 8), _random_counts(rng, 16))
    grouping = Grouping(profiles, GroupingPolicy(n_groups=2, lam=5.0, seed=0))
    fast, slow = grouping.groups
    client = min(fast.members)
    assert grouping.observe_latency(client, 1.0 + 0.01) is None  # still in range
    change = grouping.observe_latency(client, slow.center_s)
    assert change is not None and (change.kind, change.from_group, change.to_group) == (
        "moved",
        0,
        1,
    )
    assert client in slow.members and client not in fast.members
    change = grouping.observe_latency(client, 100.0)
    assert change is not None and change.kind == "dropped" and client in grouping.dropped
    assert grouping.observe_latency(client, 60.0) is None  # still out of every range
    change = grouping.observe_latency(client, fast.center_s)
    assert change is not None and (change.kind, change.to_group) == ("readmitted", 0)
    assert client in fast.members and client not in grouping.dropped
    # the groups' label counts follow their members
    for group in grouping.groups:
        expected = np.sum([profiles[c].label_counts for c in group.members], axis=0)
        assert group.label_counts == pytest.approx(expected)


def test_algorithm1_picks_the_eligible_group_of_smallest_cost() -> None:
    rng = np.random.default_rng(6)
    profiles = _profiles(_clustered(rng, [1.0, 3.0, 5.0], 10), _random_counts(rng, 30))
    grouping = Grouping(profiles, GroupingPolicy(n_groups=3, lam=50.0, rt_factor=6.0, seed=0))
    moved = 0
    for client in range(30):
        target_latency = 2.0 + 0.1 * (client % 5)
        before = grouping.group_of.get(client)
        change = grouping.observe_latency(client, target_latency)
        if change is None:
            continue
        eligible = [g for g in grouping.groups if g.admits(target_latency)]
        assert len(eligible) >= 2  # the choice is between groups, not forced
        best = min(eligible, key=lambda g: grouping.cost(client, g))
        assert change.to_group == best.group_id and change.from_group == before
        moved += 1
    assert moved > 0


def test_without_dynamic_grouping_latency_changes_move_nobody() -> None:
    rng = np.random.default_rng(7)
    profiles = _profiles(_clustered(rng, [1.0, 10.0], 5), _random_counts(rng, 10))
    grouping = Grouping(profiles, GroupingPolicy(n_groups=2, dynamic=False, seed=0))
    before = [set(g.members) for g in grouping.groups]
    assert grouping.observe_latency(0, 50.0) is None
    assert [set(g.members) for g in grouping.groups] == before
    assert grouping.latency[0] == 50.0
    with pytest.raises(ConfigError):
        grouping.observe_latency(0, math.nan)
    with pytest.raises(ConfigError):
        grouping.observe_latency(99, 1.0)


def test_a_silent_client_is_dropped_from_a_range_that_would_admit_its_timeout() -> None:
    rng = np.random.default_rng(5)
    profiles = _profiles(_clustered(rng, [1.0, 10.0], 8), _random_counts(rng, 16))
    grouping = Grouping(profiles, GroupingPolicy(n_groups=2, lam=5.0, seed=0))
    _fast, slow = grouping.groups
    client = min(slow.members)
    # the timeout sits at the slow group's centre: as a latency it would keep the client in
    assert slow.admits(slow.center_s)
    change = grouping.drop_silent(client, slow.center_s)
    assert change is not None and (change.kind, change.from_group, change.to_group) == (
        "dropped",
        1,
        None,
    )
    assert client in grouping.dropped and client not in slow.members
    assert grouping.drop_silent(client, 30.0) is None  # already out
    assert grouping.latency[client] == 30.0  # the longest wait is its latency's lower bound
    change = grouping.observe_latency(client, slow.center_s)  # a probe's answer
    assert change is not None and (change.kind, change.to_group) == ("readmitted", 1)
    with pytest.raises(ConfigError):
        grouping.drop_silent(client, math.inf)


def test_silence_decides_nothing_without_eco_dynamic_grouping() -> None:
    rng = np.random.default_rng(6)
    profiles = _profiles(_clustered(rng, [1.0, 10.0], 4), _random_counts(rng, 8))
    grouping = Grouping(profiles, GroupingPolicy(n_groups=2, seed=0, dynamic=False))
    client = min(grouping.groups[0].members)
    assert grouping.drop_silent(client, 100.0) is None
    assert client not in grouping.dropped
