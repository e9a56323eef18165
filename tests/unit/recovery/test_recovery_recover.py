"""plan_recovery: one call gives the coordinator the new plan and the weight moves."""

from __future__ import annotations

import pytest

from zpipe._errors import ConfigError
from zpipe.planner.cluster import ClusterDevice, ClusterSpec
from zpipe.planner.plan import Plan, plan_from_partition
from zpipe.planner.profile import synthetic_profile
from zpipe.planner.training_plan import TrainingPlan, TrainStage
from zpipe.recovery import (
    COORDINATOR,
    POLICIES,
    RecoveryPlan,
    ftpipehd_replication,
    plan_recovery,
    stage_work,
)

N = 8
PROFILE = synthetic_profile(
    [1.0] * N,
    [1000] * N,
    param_bytes=[1000] * N,
    backward_times_s=[2.0] * N,
    activation_bytes=[100] * N,
    batch_size=2,
)
CLUSTER = ClusterSpec(tuple(ClusterDevice(f"w{i}", bandwidth_mbps=1000) for i in range(4)))


def training_plan() -> TrainingPlan:
    stages = tuple(
        TrainStage((f"w{i}",), 2 * i, 2 * i + 2, (2,), min(2 * (4 - i) - 1, 4)) for i in range(4)
    )
    return TrainingPlan("hpp", "1f1b", N, 2, 4, stages)


@pytest.mark.parametrize("policy", POLICIES)
def test_training_recovery_by_every_policy_fetches_only_from_live_holders(policy):
    old = training_plan()
    schedule = ftpipehd_replication(old)
    result = plan_recovery(
        old,
        failed={"w1"},
        policy=policy,
        profile=PROFILE,
        cluster=CLUSTER,
        live_version=120,
        replicas=schedule.replicas_after(120),
    )
    assert isinstance(result.plan, TrainingPlan) and "w1" not in result.plan.devices
    assert result.plan.microbatch_size == 2 and result.plan.num_microbatches == 4
    r = result.redistribution
    assert r is not None and "w1" not in {t.source for t in r.transfers}
    # w1's units [2, 4) now live on whoever runs them, from w2's chain copy at 100
    # (or the coordinator's global one), never at 120: that version died with w1.
    for t in r.transfers:
        if t.start < 4 and t.end > 2:
            assert t.version == 100 and t.source in {"w2", COORDINATOR}
    assert RecoveryPlan.from_dict(result.to_dict()) == result


def test_respipe_moves_least_and_lightweight_balances_better_on_training():
    old = training_plan()
    replicas = ftpipehd_replication(old).replicas_after(120)
    kw = dict(failed={"w1"}, profile=PROFILE, live_version=120, replicas=replicas)
    res = plan_recovery(old, policy="respipe", **kw)
    light = plan_recovery(old, policy="lightweight", **kw)
    work = [3.0] * N
    assert max(stage_work(light.plan, work)) < max(stage_work(res.plan, work))
    assert res.redistribution is not None and light.redistribution is not None
    assert res.redistribution.units_moved < light.redistribution.units_moved


def test_exact_consistency_rolls_every_unit_back_to_the_replicated_version():
    old = training_plan()
    schedule = ftpipehd_replication(old)
    result = plan_recovery(
        old,
        failed={"w1"},
        policy="respipe",
        live_version=120,
        replicas=schedule.replicas_after(120, senders_keep_copy=True),
        version=schedule.last_replicated(120),
    )
    r = result.redistribution
    assert r is not None
    assert {k.version for k in r.kept} | {t.version for t in r.transfers} == {100}


def test_inference_recovery_needs_no_redistribution():
    old = plan_from_partition(N, ["w0", "w1", "w2", "w3"], [[0, 2], [2, 4], [4, 6], [6, 8]])
    for policy in POLICIES:
        result = plan_recovery(
            old, failed={"w3"}, policy=policy, profile=PROFILE, cluster=CLUSTER, batch_size=2
        )
        assert isinstance(result.plan, Plan) and "w3" not in result.plan.devices
        assert result.redistribution is None
        assert RecoveryPlan.from_dict(result.to_dict()) == result


def test_missing_inputs_are_config_errors():
    old = plan_from_partition(N, ["w0", "w1"], [[0, 4], [4, 8]])
    with pytest.raises(ConfigError, match="unknown recovery policy"):
        plan_recovery(old, failed={"w1"}, policy="pray")
    with pytest.raises(ConfigError, match="profile and the cluster"):
        plan_recovery(old, failed={"w1"}, policy="heavy")
    with pytest.raises(ConfigError, match="unit_work or a profile"):
        plan_recovery(old, failed={"w1"}, policy="lightweight")
    with pytest.raises(ConfigError, match="batch size"):
        plan_recovery(old, failed={"w1"}, policy="lightweight", profile=PROFILE)
