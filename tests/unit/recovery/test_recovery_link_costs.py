"""Re-planners cost links as the planners do: a big activation's cut avoids a slow sender,
and every re-planned plan carries the planners' prediction of itself."""

from __future__ import annotations

import dataclasses
import math

import pytest

from zpipe.coordinator.runs.sync_balance import rebalanced
from zpipe.planner.cluster import ClusterDevice, ClusterSpec
from zpipe.planner.cost import predict_plan
from zpipe.planner.plan import plan_from_partition
from zpipe.planner.profile import synthetic_profile
from zpipe.planner.training_cost import TrainingCosts, predict_training
from zpipe.planner.training_plan import TrainingPlan, TrainStage
from zpipe.recovery import lightweight_replan, plan_recovery, respipe_replan
from zpipe.recovery.stage_costs import CostModel, with_speeds

N = 12
BIG = 4_800_000  # the 4.8 MB activation
SLOW_MBPS = 50.0  # ... on a 50 Mbit/s sender: 0.77 s a micro-batch
# Unit 5's output is the big one: a cut at 6 sends it.
OUTPUTS = [1_000] * N
OUTPUTS[5] = BIG


def cut_of(plan) -> int:
    """The one cut of a two-stage plan."""
    assert len(plan.stages) == 2
    return plan.stages[0].end


def slow_sender_cluster(names: list[str], slow: str, **memory: int) -> ClusterSpec:
    return ClusterSpec(
        tuple(
            ClusterDevice(
                n,
                bandwidth_mbps=SLOW_MBPS if n == slow else 10_000.0,
                memory_bytes=memory.get(n),
            )
            for n in names
        )
    )


# -- inference ---------------------------------------------------------------------------------

INFERENCE = synthetic_profile([0.1] * N, OUTPUTS, param_bytes=[1_000] * N)


def test_lightweight_inference_keeps_a_big_activation_off_a_slow_sender():
    plan = plan_from_partition(N, ["a", "b", "c"], [[0, 4], [4, 8], [8, 12]])
    cluster = slow_sender_cluster(["a", "b", "c"], slow="a")
    # Blind to links, the balanced cut (6 and 6 units) sends the 4.8 MB over a's 50 Mbit/s.
    blind = lightweight_replan(plan, failed={"c"}, unit_work=[1.0] * N)
    assert cut_of(blind) == 6 and blind.predicted == {}
    blind_cost = predict_plan(blind, INFERENCE, cluster, 1)
    assert blind_cost["stage0_comm_s"] == pytest.approx(BIG * 8 / (SLOW_MBPS * 1e6))

    model = CostModel(INFERENCE, cluster, batch_size=1)
    new = lightweight_replan(plan, failed={"c"}, model=model)
    assert new.devices == ["a", "b"] and cut_of(new) != 6
    # The least bottleneck left (a 7-unit stage, 0.7 s), and of the two cuts that reach
    # it the one that moves fewer weights: a takes one unit from b, not three.
    assert cut_of(new) == 5
    assert dict(new.predicted) == predict_plan(new, INFERENCE, cluster, 1)
    assert new.predicted["bottleneck_s"] == pytest.approx(0.7)
    assert new.predicted["bottleneck_s"] < blind_cost["bottleneck_s"]


def test_cuts_still_move_only_between_neighbours_when_links_are_costed():
    # d is fast and well linked; balancing freely would hand it units from a or b.
    plan = plan_from_partition(N, ["a", "b", "c", "d"], [[0, 3], [3, 6], [6, 9], [9, 12]])
    cluster = ClusterSpec(
        (
            ClusterDevice("a", bandwidth_mbps=SLOW_MBPS),
            ClusterDevice("b"),
            ClusterDevice("c"),
            ClusterDevice("d", speed=10.0),
        )
    )
    new = lightweight_replan(plan, failed={"c"}, model=CostModel(INFERENCE, cluster, batch_size=1))
    a, b, _ = ((s.start, s.end) for s in new.stages)
    assert a[1] in range(1, 6 + 1) and b[1] in range(3, 12)  # each cut within its window
    assert a[1] != 6  # a never sends unit 5's 4.8 MB


def test_memory_is_respected_when_a_placement_fits():
    # b holds 6 units' weights at most, so the cut cannot be left of 6; 6 itself sends the
    # 4.8 MB over a's slow link; so 7.
    plan = plan_from_partition(N, ["a", "b", "c"], [[0, 4], [4, 8], [8, 12]])
    cluster = slow_sender_cluster(["a", "b", "c"], slow="a", b=6_000)
    new = lightweight_replan(plan, failed={"c"}, model=CostModel(INFERENCE, cluster, batch_size=1))
    assert cut_of(new) == 7
    assert new.predicted["memory_violations"] == 0.0


def test_when_no_placement_fits_memory_the_least_bottleneck_is_taken_and_reported():
    # b must take at least units [8, 12) and holds only 3 units' weights.
    plan = plan_from_partition(N, ["a", "b", "c"], [[0, 4], [4, 8], [8, 12]])
    cluster = slow_sender_cluster(["a", "b", "c"], slow="a", b=3_000)
    new = lightweight_replan(plan, failed={"c"}, model=CostModel(INFERENCE, cluster, batch_size=1))
    assert cut_of(new) == 5
    assert new.predicted["memory_violations"] == 1.0


def test_respipe_keeps_its_policy_and_reports_what_it_costs():
    plan = plan_from_partition(N, ["a", "b", "c"], [[0, 4], [4, 8], [8, 12]])
    cluster = slow_sender_cluster(["a", "b", "c"], slow="a")
    new = respipe_replan(plan, failed={"b"}, model=CostModel(INFERENCE, cluster, batch_size=1))
    assert [(s.device, s.start, s.end) for s in new.stages] == [("a", 0, 4), ("c", 4, 12)]
    assert dict(new.predicted) == predict_plan(new, INFERENCE, cluster, 1)


def test_plan_recovery_gives_every_policy_the_planners_prediction():
    plan = plan_from_partition(N, ["a", "b", "c"], [[0, 4], [4, 8], [8, 12]])
    cluster = slow_sender_cluster(["a", "b", "c"], slow="a")
    for policy in ("lightweight", "respipe", "heavy"):
        new = plan_recovery(
            plan, failed={"c"}, policy=policy, profile=INFERENCE, cluster=cluster, batch_size=1
        ).plan
        assert new.predicted, policy
        survivors = ClusterSpec(cluster.devices[:2])
        # heavy's planner adds its own keys (its objective) beside the shared ones
        model = predict_plan(new, INFERENCE, survivors, 1)
        assert {k: new.predicted[k] for k in model} == model, policy
    light = plan_recovery(
        plan, failed={"c"}, policy="lightweight", profile=INFERENCE, cluster=cluster, batch_size=1
    ).plan
    assert cut_of(light) == 5


# -- training ----------------------------------------------------------------------------------

TRAINING = synthetic_profile(
    [0.05] * N,
    OUTPUTS,
    param_bytes=[1_000] * N,
    backward_times_s=[0.1] * N,
    activation_bytes=[100] * N,
)


def training_plan(names: list[str], bounds: list[int]) -> TrainingPlan:
    p = len(names)
    stages = tuple(
        TrainStage((n,), a, b, (1,), min(2 * (p - k) - 1, 4))
        for k, (n, a, b) in enumerate(zip(names, bounds, bounds[1:], strict=False))
    )
    return TrainingPlan("hpp", "1f1b", N, 1, 4, stages)


def test_lightweight_training_keeps_a_big_activation_off_a_slow_sender():
    plan = training_plan(["a", "b", "c"], [0, 4, 8, 12])
    cluster = slow_sender_cluster(["a", "b", "c"], slow="a")
    blind = lightweight_replan(plan, failed={"c"}, unit_work=[1.0] * N)
    assert cut_of(blind) == 6
    new = lightweight_replan(plan, failed={"c"}, model=CostModel(TRAINING, cluster))
    assert isinstance(new, TrainingPlan) and cut_of(new) == 5
    costs = TrainingCosts(TRAINING, cluster, microbatch_size=1)
    assert dict(new.predicted) == predict_training(new, costs)
    assert new.predicted["round_s"] < predict_training(blind, costs)["round_s"]
    assert new.predicted["stage0_send_forward_s"] < 0.01


def test_rebalance_moves_work_off_an_overloaded_device_but_not_a_big_cut_onto_a_slow_link():
    # b runs 9 units to a's 3 at the same speed: blind to links, rebalancing evens them
    # out with the cut after unit 5, and a must then send its 4.8 MB over 50 Mbit/s.
    plan = training_plan(["a", "b"], [0, 3, 12])
    cluster = slow_sender_cluster(["a", "b"], slow="a")
    counters = {
        "a": {"microbatches": 4, "forward_s": 4 * 3 * 0.05, "backward_s": 4 * 3 * 0.1},
        "b": {"microbatches": 4, "forward_s": 4 * 9 * 0.05, "backward_s": 4 * 9 * 0.1},
    }
    unit_work = [0.15] * N
    blind = rebalanced(plan, counters, unit_work, threshold=0.1)
    assert blind.plan is not None and cut_of(blind.plan) == 6
    assert blind.plan.predicted == {}

    model = CostModel(TRAINING, cluster)
    found = rebalanced(plan, counters, unit_work, threshold=0.1, model=model)
    assert found.plan is not None
    # 5 or 7 avoid the big cut with the same bottleneck (7 units on one side); 5 moves
    # fewer weights
    assert cut_of(found.plan) == 5
    speeds = found.fields["speeds"]
    measured = TrainingCosts(TRAINING, with_speeds(cluster, speeds), microbatch_size=1)
    assert dict(found.plan.predicted) == pytest.approx(predict_training(found.plan, measured))
    assert found.fields["balanced_round_s"] < found.fields["round_s"]
    # the blind answer is slower under the same model
    assert predict_training(blind.plan, measured)["round_s"] > found.plan.predicted["round_s"]


def test_rebalance_with_a_model_stays_when_the_round_would_not_shorten():
    plan = training_plan(["a", "b"], [0, 5, 12])
    cluster = slow_sender_cluster(["a", "b"], slow="a")
    counters = {
        "a": {"microbatches": 4, "forward_s": 5 * 0.2, "backward_s": 5 * 0.4},
        "b": {"microbatches": 4, "forward_s": 7 * 0.2, "backward_s": 7 * 0.4},
    }
    found = rebalanced(
        plan, counters, [0.15] * N, threshold=0.1, model=CostModel(TRAINING, cluster)
    )
    assert found.plan is None and math.isfinite(found.fields["round_s"])


def test_with_speeds_replaces_compute_and_keeps_links_and_memory():
    own = dataclasses.replace(
        ClusterDevice("a", bandwidth_mbps=5.0, memory_bytes=10), profile=TRAINING
    )
    cluster = ClusterSpec((own, ClusterDevice("b")))
    changed = with_speeds(cluster, {"a": 0.5})
    a = changed.device("a")
    assert a.speed == 0.5 and a.profile is None
    assert a.bandwidth_mbps == 5.0 and a.memory_bytes == 10
    assert changed.device("b") == cluster.device("b")
    assert with_speeds(cluster, None) is cluster


# -- the coordinator's call --------------------------------------------------------------------


def test_the_coordinators_in_place_recovery_costs_declared_links_from_cached_profiles():
    from zpipe.coordinator.decisions import replan_in_place
    from zpipe.coordinator.membership import Member

    def member(name: str, mbps: float) -> Member:
        info = {"link": {"bandwidth_mbps": mbps}}
        return Member(name, name.encode(), f"tcp://{name}:1", info, None, 0.0, 0.0)

    plan = plan_from_partition(N, ["a", "b", "c"], [[0, 4], [4, 8], [8, 12]])
    survivors = [member("a", SLOW_MBPS), member("b", 10_000.0)]
    profiles = {"a": INFERENCE, "b": INFERENCE}
    new = replan_in_place(
        plan, {"c"}, "lightweight", survivors, profiles, batch_size=1, train=False
    )
    assert cut_of(new) == 5 and new.predicted["bottleneck_s"] == pytest.approx(0.7)
    # without every survivor's profile: units and devices count alike, as before
    blind = replan_in_place(
        plan, {"c"}, "lightweight", survivors, {"a": INFERENCE}, batch_size=1, train=False
    )
    assert cut_of(blind) == 6 and blind.predicted == {}


def test_the_coordinators_in_place_recovery_prefers_a_measured_link_to_a_declared_one():
    """Real devices declare nothing (the default declared link is fast); the link the
    coordinator measured before the run is what the re-planner must cost."""
    from zpipe.coordinator.decisions import replan_in_place
    from zpipe.coordinator.membership import Member
    from zpipe.planner.cluster import ClusterLink

    def member(name: str) -> Member:
        return Member(name, name.encode(), f"tcp://{name}:1", {}, None, 0.0, 0.0)

    plan = plan_from_partition(N, ["a", "b", "c"], [[0, 4], [4, 8], [8, 12]])
    survivors = [member("a"), member("b")]
    profiles = {"a": INFERENCE, "b": INFERENCE}
    declared = replan_in_place(
        plan, {"c"}, "lightweight", survivors, profiles, batch_size=1, train=False
    )
    assert cut_of(declared) == 6  # nothing declared slow: the balanced cut
    measured = {("a", "b"): ClusterLink(bandwidth_mbps=SLOW_MBPS, latency_ms=0.0)}
    new = replan_in_place(
        plan, {"c"}, "lightweight", survivors, profiles, batch_size=1, train=False, links=measured
    )
    assert cut_of(new) == 5 and new.predicted["bottleneck_s"] == pytest.approx(0.7)
