"""Which stages carry a generation run on after some of them died. Pure.

A generation run's stages hold no state that a survivor cannot rebuild: weights
come from the model's spec (its checkpoint directory, or its seeded random
initialisation) and every KV cache is rebuilt by prefilling each sequence's prompt
and the tokens it generated so far (:class:`zpipe.generation.sequences.SequenceScheduler`).
So the re-plan is free to cut the units afresh: the survivors keep their pipeline
order (the first survivor takes the client's sequences and streams to it) and the
units are split over them as evenly as they go, as a run started without a
partition splits them (:func:`zpipe.planner.plan.even_ranges`: the first stages
take one more when they do not divide). The run's start uses the same even split,
so a run re-planned over N survivors is cut as a run started on those N.
"""

from __future__ import annotations

from collections.abc import Collection

from zpipe.planner.plan import Plan, plan_even_partition
from zpipe.recovery.errors import RecoveryError

# The algo a generation run's plan says (its start and each re-plan).
GENERATION_ALGO = "generation-even"


def replan_generation(plan: Plan, failed: Collection[str]) -> Plan:
    """``plan`` without the ``failed`` devices: the survivors in their order, the
    units cut evenly over them. RecoveryError when no stage is left."""
    survivors = [d for d in plan.devices if d not in failed]
    if not survivors:
        raise RecoveryError(f"no stage is left to generate: {sorted(failed)} died")
    even = plan_even_partition(plan.num_units, survivors)
    return Plan(algo=GENERATION_ALGO, num_units=plan.num_units, stages=even.stages)


__all__ = ["GENERATION_ALGO", "replan_generation"]
