"""Fault tolerance and adaptive re-partitioning, as pure functions over plain data.

Nothing here does I/O or reads a clock; the coordinator feeds it what it
measured and applies what it returns.

- :mod:`~zpipe.recovery.detection`: adaptive deadlines (median + k MAD) that
  tell a slow device from a dead one.
- :mod:`~zpipe.planner.capacity`: FTPipeHD's capacity re-estimation and
  Eco-FL's deviation check that triggers workload migration.
- :mod:`~zpipe.recovery.replanning`: lightweight (Asteroid), heavy (the full
  planners over the survivors) and ResPipe re-planning.
- :mod:`~zpipe.recovery.replication`: Asteroid's and FTPipeHD's replication
  schedules, versioned by mini-batch.
- :mod:`~zpipe.recovery.redistribution`: FTPipeHD's Algorithm 1, the fewest
  weight transfers from live holders.
- :mod:`~zpipe.recovery.restore`: chain and global copies as replica points,
  restored from the newest that covers every unit; heavy recovery's moves.
- :mod:`~zpipe.recovery.recover`: one call for the coordinator, by policy.
- :mod:`~zpipe.recovery.fast_recovery`: FTPipeHD's recovery of an asynchronous
  run (``consistency="fast"``): survivors keep their weights, eq. 5 re-cuts them.
- :mod:`~zpipe.recovery.timeline`: the recovery timeline for structured logs.
"""

from __future__ import annotations

from zpipe.planner.capacity import (
    CapacityHistory,
    Deviation,
    estimate_capacities,
    find_deviations,
    scaled_unit_times,
    speeds_from_capacities,
    speeds_from_cluster,
)
from zpipe.recovery.detection import (
    DEFAULT_STALL_DEADLINE,
    DeadlinePolicy,
    LatencyWindow,
    StallWatch,
    Verdict,
    adaptive_deadline,
    judge_wait,
)
from zpipe.recovery.errors import RecoveryError, WeightsLostError
from zpipe.recovery.fast_recovery import FastRecoveryPlan, UnitSource, plan_fast_recovery
from zpipe.recovery.recover import POLICIES, RecoveryPlan, plan_recovery
from zpipe.recovery.redistribution import (
    Kept,
    Redistribution,
    Replica,
    Transfer,
    own_replicas,
    plan_redistribution,
)
from zpipe.recovery.replanning import (
    heavy_replan_inference,
    heavy_replan_training,
    lightweight_replan,
    rebalance_boundaries,
    respipe_replan,
    stage_work,
    surviving_cluster,
    unit_work_from_profile,
)
from zpipe.recovery.replication import (
    REPLICATIONS,
    TOPOLOGIES,
    ReplicaSend,
    ReplicationSchedule,
    asteroid_replication,
    ftpipehd_replication,
    plan_replication,
    replicas_due,
)
from zpipe.recovery.restore import HeavyMoves, ReplicaPoint, Restore, heavy_restore, plan_restore
from zpipe.recovery.spans import COORDINATOR, StageSpan, device_ranges, stage_spans
from zpipe.recovery.timeline import RecoveryTimeline, summarize_recoveries

__all__ = [
    "COORDINATOR",
    "DEFAULT_STALL_DEADLINE",
    "POLICIES",
    "REPLICATIONS",
    "TOPOLOGIES",
    "CapacityHistory",
    "DeadlinePolicy",
    "Deviation",
    "FastRecoveryPlan",
    "HeavyMoves",
    "Kept",
    "LatencyWindow",
    "RecoveryError",
    "RecoveryPlan",
    "RecoveryTimeline",
    "Redistribution",
    "Replica",
    "ReplicaPoint",
    "ReplicaSend",
    "ReplicationSchedule",
    "Restore",
    "StageSpan",
    "StallWatch",
    "Transfer",
    "UnitSource",
    "Verdict",
    "WeightsLostError",
    "adaptive_deadline",
    "asteroid_replication",
    "device_ranges",
    "estimate_capacities",
    "find_deviations",
    "ftpipehd_replication",
    "heavy_replan_inference",
    "heavy_replan_training",
    "heavy_restore",
    "judge_wait",
    "lightweight_replan",
    "own_replicas",
    "plan_fast_recovery",
    "plan_recovery",
    "plan_redistribution",
    "plan_replication",
    "plan_restore",
    "rebalance_boundaries",
    "replicas_due",
    "respipe_replan",
    "scaled_unit_times",
    "speeds_from_capacities",
    "speeds_from_cluster",
    "stage_spans",
    "stage_work",
    "summarize_recoveries",
    "surviving_cluster",
    "unit_work_from_profile",
]
