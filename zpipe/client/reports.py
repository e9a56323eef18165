"""What a finished run looked like: :class:`InferenceReport`, :class:`TrainReport`.

``RunReport`` is the old name of :class:`InferenceReport`, kept as a deprecated
alias (``zpipe.protocol.client_control.RunReport`` is the coordinator's
``run_report`` message, a different thing).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from zpipe.models import ModelSpec, build_full_model
from zpipe.models.weights import STEPS_KEY, is_weight_key, write_state
from zpipe.planner import Plan
from zpipe.planner.training_plan import TrainingPlan


@dataclass
class InferenceReport:
    """What a finished inference stream looked like: the plan, timing and each stage's
    counters."""

    run: int
    plan: Plan
    baseline: Plan | None = None  # the even partition the planner's choice was compared with
    microbatches: int = 0
    samples: int = 0
    elapsed_s: float = 0.0
    stages: dict[str, dict[str, Any]] = field(default_factory=dict)
    # one entry per stage lost mid-stream: who, how long recovery took, what was replayed
    recoveries: list[dict[str, Any]] = field(default_factory=list)

    @property
    def throughput(self) -> float:
        """Samples per second over the streaming part of the run."""
        return self.samples / self.elapsed_s if self.elapsed_s > 0 else 0.0


# the name before issue 28, deprecated: use InferenceReport
RunReport = InferenceReport


@dataclass
class TrainReport:
    """A finished training run: its plan, losses, timing and the trained weights."""

    run: int
    plan: Plan
    model_spec: ModelSpec
    schedule: str
    num_microbatches: int
    training_plan: TrainingPlan | None = None
    # the plan the run started on (training_plan is its last attempt's: a recovery's)
    first_training_plan: TrainingPlan | None = None
    losses: list[float] = field(default_factory=list)  # the mean loss of each mini-batch
    samples: int = 0  # samples trained (after a recovery, replays count again)
    elapsed_s: float = 0.0
    state_dict: dict[str, torch.Tensor] = field(default_factory=dict)
    stages: dict[str, Any] = field(default_factory=dict)
    # one entry per stage lost mid-run (recover=True): who, when, what was replayed
    recoveries: list[dict[str, Any]] = field(default_factory=list)
    # mini-batches after which the coordinator kept a global replica
    replicas: list[int] = field(default_factory=list)
    # plans the run moved to at a replica because the stages' speeds changed
    rebalances: list[dict[str, Any]] = field(default_factory=list)
    # live re-partitions of an asynchronous run: each look's decision, where it moved
    repartitions: list[dict[str, Any]] = field(default_factory=list)
    # mini-batches trained before this run (a resumed run's start_step)
    start_step: int = 0
    # whether state_dict holds the optimizer's state (fit's optimizer_state=True)
    with_optimizer_state: bool = False
    # an asynchronous run's fast recoveries (live_copies, consistency="fast"; FTPipeHD):
    # mini-batches of progress lost, summed over them (each recovery's most any unit
    # lost: the units restored from a copy miss the updates between the copy and the
    # first un-acknowledged mini-batch, where the run resumed); each recovery's entry
    # in ``recoveries`` has its own ``progress_lost``, ``lost_per_unit``, ``resumed_at``
    progress_lost: int = 0
    # where each unit came from at the last fast recovery: "kept" (its survivor kept
    # it), "peer" (another survivor's, moved by the re-cut), "chain@<holder>" (the
    # dead stage's chain copy, held by the next stage or "coordinator"), "global"
    unit_sources: dict[int, str] = field(default_factory=dict)

    @property
    def steps(self) -> int:
        return len(self.losses)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def optimizer_state(self) -> dict[str, torch.Tensor]:
        """The optimizer's state (``"<weight key>#opt.<name>"``; empty unless the run
        gathered it with ``optimizer_state=True``)."""
        return {k: v for k, v in self.state_dict.items() if not is_weight_key(k)}

    def model(self) -> torch.nn.Module:
        """The trained model, in one process (``build_full_model(spec)`` + the weights)."""
        full = build_full_model(self.model_spec)
        full.load_state_dict({k: v for k, v in self.state_dict.items() if is_weight_key(k)})
        return full

    def save(self, path: str | Path) -> None:
        """Write the trained weights (.safetensors or .pt), loadable with ``ModelSpec.weights``;
        with the optimizer's state, when gathered, and the mini-batches trained so far,
        a checkpoint that a run resumes from (``resume_optimizer``, ``start_step``)."""
        state = dict(self.model().state_dict())
        if self.with_optimizer_state:
            # (plain SGD keeps no state: the step count still marks a checkpoint)
            state.update(self.optimizer_state)
            state[STEPS_KEY] = torch.tensor(self.start_step + self.steps, dtype=torch.int64)
        write_state(state, path)
