"""Which stages carry a generation run on after some of them died. Pure.

A generation run's stages hold no state that a survivor cannot rebuild: weights
come from the model's spec (its checkpoint directory, or its seeded random
initialisation) and every KV cache is rebuilt by prefilling each sequence's prompt
and the tokens it generated so far (:class:`zpipe.generation.sequences.SequenceScheduler`).
So the re-plan is free to cut the units afresh: the survivors keep their pipeline
order (the first survivor takes the client's sequences and streams to it) and the
units are split over them by ``split`` when it gives a split: the coordinator's
capacity planner, the split that fits every survivor's memory room, as at the
run's start. Without one (no survivor reported a budget) they are cut as evenly
as they go (:func:`zpipe.planner.plan.even_ranges`: the first stages take one more
when they do not divide).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from zpipe.planner.plan import Plan, StagePlan, plan_even_partition
from zpipe.recovery.errors import RecoveryError

# The algo a generation run's plan says (its start and each re-plan).
GENERATION_ALGO = "generation-even"

# The survivors' names, in order -> each one's [start, end), or None: cut evenly.
# It raises (InfeasiblePlanError) when no split fits them.
Split = Callable[[Sequence[str]], Sequence[tuple[int, int]] | None]


def replan_generation(plan: Plan, failed: Collection[str], split: Split | None = None) -> Plan:
    """``plan`` without the ``failed`` devices: the survivors in their order, the
    units cut by ``split`` or evenly. RecoveryError when no stage is left."""
    survivors = [d for d in plan.devices if d not in failed]
    if not survivors:
        raise RecoveryError(f"no stage is left to generate: {sorted(failed)} died")
    bounds = split(survivors) if split is not None else None
    if bounds is None:
        stages = plan_even_partition(plan.num_units, survivors).stages
    else:
        # Plan checks that they cover every unit once, in order (ConfigError)
        stages = tuple(
            StagePlan(name, int(start), int(end))
            for name, (start, end) in zip(survivors, bounds, strict=True)
        )
    return Plan(algo=GENERATION_ALGO, num_units=plan.num_units, stages=stages)


__all__ = ["GENERATION_ALGO", "Split", "replan_generation"]
