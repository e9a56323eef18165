"""bench/federated.py's pipeline-memory section (Eco-FL Table 2): its plan and its ratios
(pure; the stage processes it measures are the bench's)."""

from __future__ import annotations

import bench._federated_memory as mem
from bench._federated_pipeline import gpipe_of
from zpipe.planner.profile import ModelProfile, synthetic_profile
from zpipe.planner.schedules import peak_live_activations, stage_actions


def _profile() -> ModelProfile:
    # the CNN's shape: early units heavy in activations, later ones light
    return synthetic_profile(
        [0.04, 0.04, 0.02, 0.01, 0.001],
        [1 << 20, 1 << 18, 1 << 17, 1 << 15, 320],
        param_bytes=[4_000, 37_000, 75_000, 148_000, 41_000],
        backward_times_s=[0.08, 0.08, 0.04, 0.02, 0.002],
        activation_bytes=[2 << 20, 3 << 20, 3 << 19, 1 << 19, 1 << 15],
        input_bytes=8 * 3 * 32 * 32 * 4,
        batch_size=mem.MICROBATCH,
    )


def test_the_plan_is_eco_fl_s_over_the_table_2_home_and_gpipe_keeps_its_cut() -> None:
    plan = mem.plan_memory(_profile(), 16)
    assert sorted(plan.devices) == ["nano0", "tx20"] and plan.num_stages == 2
    assert (plan.microbatch_size, plan.num_microbatches) == (8, 16)
    gpipe = gpipe_of(plan)
    assert [(s.start, s.end) for s in gpipe.stages] == [(s.start, s.end) for s in plan.stages]
    # what each stage holds in flight: 1F1B-Sync's warm-ups, all 16 under GPipe
    for i, (one, all_first) in enumerate(zip(plan.stages, gpipe.stages, strict=True)):
        held = [
            peak_live_activations(
                stage_actions(
                    p.schedule, stage=i, num_stages=2, num_microbatches=16, warmup=s.warmup
                )
            )
            for p, s in ((plan, one), (gpipe, all_first))
        ]
        assert held == [one.warmup, 16] and one.warmup < 16


def test_the_plan_s_times_come_from_multiply_accumulates_so_it_does_not_follow_load() -> None:
    # conv 3->32 and 32->32 at 32x32, 32->64 at 16x16, 64->64 at 8x8, then 64*4*4 -> 10
    assert mem.cnn_macs() == [884_736, 9_437_184, 4_718_592, 2_359_296, 10_240]
    fast = _profile()
    # one measured profile ten times slower on stage 0's units: the same plan
    slow = synthetic_profile(
        [10 * t for t in (0.04, 0.04, 0.02, 0.01, 0.001)],
        [u.output_bytes[0] for u in fast.units],
        param_bytes=[u.param_bytes for u in fast.units],
        backward_times_s=[0.8, 0.8, 0.04, 0.02, 0.002],
        activation_bytes=[(u.activation_bytes or (0,))[0] for u in fast.units],
        input_bytes=fast.input_bytes[0],
        batch_size=mem.MICROBATCH,
    )
    plans = [mem.plan_memory(mem.analytic_times(p), 16) for p in (slow, fast)]
    assert plans[0] == plans[1]
    timed = mem.analytic_times(fast)
    assert timed.activation_bytes(8) == fast.activation_bytes(8)  # bytes kept as measured
    assert timed.units[1].time_s[0] == 9_437_184 * 8 * 1e-9
    # Table 2's order (the TX2 first) and a stage 0 that holds few of the 16
    assert plans[0].devices == ["tx20", "nano0"] and plans[0].warmups[0] < 8


def test_the_ratios_take_the_largest_stage_and_each_stage() -> None:
    one = {
        "a": {"peak_rss_mib": 370.0, "peak_over_idle_mib": 60.0, "torch_saved_mib": 14.0},
        "b": {"peak_rss_mib": 344.0, "peak_over_idle_mib": 32.0, "torch_saved_mib": 2.0},
    }
    gpipe = {
        "a": {"peak_rss_mib": 450.0, "peak_over_idle_mib": 140.0, "torch_saved_mib": 73.5},
        "b": {"peak_rss_mib": 376.0, "peak_over_idle_mib": 64.0, "torch_saved_mib": 0.0},
    }
    out = mem.memory_figures(["a", "b"], one, gpipe)
    assert out["gpipe_over_1f1b_peak_memory"] == round(450 / 370, 3)
    assert out["gpipe_over_1f1b_peak_memory_per_stage"] == [round(450 / 370, 3), 1.093]
    assert out["gpipe_over_1f1b_peak_over_idle_per_stage"] == [2.333, 2.0]
    assert out["gpipe_over_1f1b_torch_saved_per_stage"] == [5.25, 0.0]
    # a stage with nothing counted under 1F1B has no ratio rather than a division error
    one["b"]["torch_saved_mib"] = 0.0
    assert (
        mem.memory_figures(["a", "b"], one, gpipe)["gpipe_over_1f1b_torch_saved_per_stage"][1]
        is None
    )


def test_the_paper_s_figures_ride_along() -> None:
    paper = mem.PAPER_TABLE2
    assert paper["gpipe_over_1f1b_per_stage"] == [1.588, 1.304]
    assert paper["gpipe_m6_gb"] == [2.70, 1.20] and paper["ecofl_1f1b_m16_gb"] == [1.70, 0.92]
