"""Asteroid Table 7's HPP case of ``bench/planner.py`` (section 3): EfficientNet-B1's
synthetic training profile over Asteroid's 6-device testbed (split out of that
script to keep it small; behaviour unchanged).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from bench._planner_models import F32, GIB
from zpipe.planner import ClusterDevice, ClusterSpec
from zpipe.planner.cluster import ClusterLink
from zpipe.planner.hpp import plan_training
from zpipe.planner.profile import ModelProfile, synthetic_profile

# EfficientNet-B1 (Tan and Le, 2019) as Asteroid plans it (Table 7: 213 layers): the B0
# stages scaled to depth 1.1 (repeats rounded up), width 1.0, a 240x240 input. Per stage:
# (expansion, output channels, repeats, stride, kernel).
EFFICIENTNET_B1_STAGES = (
    (1, 16, 2, 1, 3),
    (6, 24, 3, 2, 3),
    (6, 40, 3, 2, 5),
    (6, 80, 4, 2, 3),
    (6, 112, 4, 1, 5),
    (6, 192, 5, 2, 5),
    (6, 320, 2, 1, 3),
)
# Jetson Xavier NX training throughput, roughly: FLOPs per second of forward compute.
NX_FLOPS_PER_S = 100e9
# Asteroid's 6-device testbed, most memory first: (name, speed vs NX, memory GiB).
ASTEROID_DEVICES = (
    ("nx-a", 1.0, 8),
    ("nx-b", 1.0, 8),
    ("tx2-a", 0.5, 8),
    ("tx2-b", 0.5, 8),
    ("nano-a", 0.25, 4),
    ("nano-b", 0.25, 4),
)


def efficientnet_b1_training_profile(microbatch: int) -> ModelProfile:
    """213 units of EfficientNet-B1 (stem 3, 23 MBConv blocks of 9, head 3) for training.

    Each MBConv block is its layers as Asteroid counts them: expansion conv, its BN and
    activation, depthwise conv, its BN and activation, squeeze-excitation, projection
    conv, its BN (with the residual). Forward time is FLOPs at the NX's rate; backward
    twice the forward; saved activations are each layer's output.
    """
    rows: list[tuple[str, float, int, int]] = []  # (name, FLOPs, params, output elements)
    size, channels = 120, 32  # after the stride-2 stem
    stem = 240 * 240 // 4 * 3 * 32 * 9 * 2.0
    rows += [("stem.conv", stem, 3 * 32 * 9, size * size * channels)]
    rows += [(f"stem.{n}", size * size * channels * 4.0, 64, size * size * channels)
             for n in ("bn", "act")]  # fmt: skip
    for s, (expand, out, repeats, stride, kernel) in enumerate(EFFICIENTNET_B1_STAGES):
        for r in range(repeats):
            cin, hidden = channels, channels * expand
            size_in, size = size, size // (stride if r == 0 else 1)
            wide_in, wide = size_in * size_in * hidden, size * size * hidden
            name = f"b{s}.{r}"
            rows += [
                (f"{name}.expand", 2.0 * size_in * size_in * cin * hidden, cin * hidden, wide_in),
                (f"{name}.bn1", 4.0 * wide_in, 2 * hidden, wide_in),
                (f"{name}.act1", 4.0 * wide_in, 0, wide_in),
                (f"{name}.dw", 2.0 * wide * kernel * kernel, hidden * kernel * kernel, wide),
                (f"{name}.bn2", 4.0 * wide, 2 * hidden, wide),
                (f"{name}.act2", 4.0 * wide, 0, wide),
                (f"{name}.se", 3.0 * wide + hidden * cin, 2 * hidden * max(1, cin // 4), wide),
                (f"{name}.project", 2.0 * wide * out, hidden * out, size * size * out),
                (f"{name}.bn3", 4.0 * size * size * out, 2 * out, size * size * out),
            ]
            channels = out
    rows += [
        ("head.conv", 2.0 * size * size * channels * 1280, channels * 1280, size * size * 1280),
        ("head.pool", 1.0 * size * size * 1280, 0, 1280),
        ("head.fc", 2.0 * 1280 * 1000, 1280 * 1000, 1000),
    ]
    times = [flops * microbatch / NX_FLOPS_PER_S for _, flops, _, _ in rows]
    outputs = [elements * microbatch * F32 for _, _, _, elements in rows]
    return synthetic_profile(
        times,
        outputs,
        param_bytes=[params * F32 for _, _, params, _ in rows],
        backward_times_s=[2 * t for t in times],
        activation_bytes=outputs,
        input_bytes=240 * 240 * 3 * microbatch * F32,
        batch_size=microbatch,
        names=[name for name, _, _, _ in rows],
    )


def asteroid_cluster() -> ClusterSpec:
    devices = [
        ClusterDevice(name, memory_gib * GIB, speed, 100.0, 1.0)
        for name, speed, memory_gib in ASTEROID_DEVICES
    ]
    return ClusterSpec(tuple(devices), client=ClusterLink(bandwidth_mbps=100.0, latency_ms=1.0))


def hpp_solve_time(runs: int) -> dict[str, Any]:
    """Asteroid Table 7's case: HPP over EfficientNet-B1's 213 layers and 6 devices."""
    microbatch, num_microbatches = 8, 4
    profile = efficientnet_b1_training_profile(microbatch)
    cluster = asteroid_cluster()
    times, plan = [], None
    for _ in range(runs):
        t0 = time.perf_counter()
        plan = plan_training(
            profile,
            cluster,
            microbatch_size=microbatch,
            num_microbatches=num_microbatches,
            algo="hpp",
        )
        times.append(time.perf_counter() - t0)
    assert plan is not None
    return {
        "bench": "planner",
        "kind": "hpp_solve_time",
        "model": "efficientnet-b1",
        "units": profile.num_units,
        "devices": len(cluster.devices),
        "microbatch_size": microbatch,
        "num_microbatches": num_microbatches,
        "solve_s_median": statistics.median(times),
        "solve_s_runs": times,
        "plan": [[list(st.devices), st.start, st.end] for st in plan.stages],
        "predicted_round_s": plan.predicted.get("round_s"),
        "paper_solve_s": 480.0,  # Asteroid Table 7, on a Jetson NX
    }
