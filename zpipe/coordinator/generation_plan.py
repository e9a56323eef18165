"""Which units each stage of a generation run holds, within each stage's memory: pure.

A stage reports its memory budget when it registers (``memory_mb``: the smaller of
its ``--memory-mb`` and the free memory it measured) and its process's base cost.
What it gives a model is the room every planner uses
(:func:`~zpipe.planner.memory.model_room_bytes`: the budget less the coordinator's
``--memory-margin``, the base and the runtime's allowance). Before any stage hears of a
run, the coordinator sizes what each stage would hold from the model's config
alone (:func:`generation_units`) and

- with the client's partition, checks every stage against its budget
  (:func:`check_generation_capacity`), refusing the run with the stage's name and
  the MiB it needs and has;
- without one, plans the split over the run's stages, in their order
  (:func:`~zpipe.planner.generation.plan_generation_in_order`): the split with the
  most decode tokens/s among those that fit every stage.

A stage's memory (:func:`~zpipe.planner.generation_cost.stage_memory`): its units'
weights, the KV cache of its blocks for ``max_sequences`` sequences of
``max_context`` tokens (at most the run's per-stage ``kv_budget_bytes``), and the
largest unit's working set for a prefill chunk; beside them the runtime (torch's
code pages and kernel workspaces that the first build and forward bring in,
measured 21-23 MiB on a generation stage, ``bench/generate.py``), which the room
leaves out as it does the base. Unit times are estimates from the
config (a decode step reads every weight once; a prefill chunk costs two flops per
weight and token) scaled by each stage's declared slowdown: they only rank splits
against one another.
"""

from __future__ import annotations

from collections.abc import Sequence

from zpipe._errors import InfeasiblePlanError
from zpipe.coordinator.membership import Member
from zpipe.coordinator.planning import base_bytes_of, cluster_from_members
from zpipe.models.causal_lm.config import (
    GPT2,
    CausalLmConfig,
    kv_bytes_per_token_per_block,
    parameter_elements,
)
from zpipe.planner.generation import plan_generation_in_order
from zpipe.planner.generation_cost import (
    GenerationUnit,
    GenerationWorkload,
    StageMemory,
    stage_memory,
)
from zpipe.planner.memory import DEFAULT_MEMORY_MARGIN, model_room_bytes, runtime_bytes

MIB = 2**20
# Reference speeds for the estimated unit times: only their ratios matter.
_READ_BYTES_PER_S = 10e9
_FLOPS_PER_S = 100e9
_TOKEN_ID_BYTES = 8


def generation_units(
    config: CausalLmConfig, *, element_bytes: int, max_context: int
) -> list[GenerationUnit]:
    """The embedding, each decoder block and the norm with the head, sized from the
    config: weights, KV cache per token (blocks only), working set per token in a
    forward, and what each sends on (hidden states; the head: a token id)."""
    n = config.num_units
    hidden_bytes = config.hidden * element_bytes
    kv = kv_bytes_per_token_per_block(config, element_bytes=element_bytes)
    # a block's forward: q, k, v, attention out and residuals of width hidden, the
    # MLP's intermediate (twice for SwiGLU's gate), and the attention scores at the
    # full context (materialised when the fused kernel is not taken)
    mlp = config.intermediate * (1 if config.arch == GPT2 else 2)
    block_act = (6 * config.hidden + mlp + config.num_heads * max_context) * element_bytes
    units = []
    for k in range(n):
        elements = parameter_elements(config, k, k + 1)
        weights = elements * element_bytes
        if k == 0:
            name, kv_k, act, out = "embed", 0, hidden_bytes, hidden_bytes
        elif k == n - 1:
            # the logits in float32 for sampling
            name, kv_k, act, out = "head", 0, 2 * config.vocab_size * 4, _TOKEN_ID_BYTES
        else:
            name, kv_k, act, out = f"block{k - 1}", kv, block_act, hidden_bytes
        units.append(
            GenerationUnit(
                name=name,
                weight_bytes=weights,
                kv_bytes_per_token=kv_k,
                activation_bytes_per_token=act,
                output_bytes_per_token=out,
                decode_time_s=weights / _READ_BYTES_PER_S,
                prefill_time_s=2.0 * elements / _FLOPS_PER_S,
            )
        )
    return units


def generation_workload(
    *,
    max_sequences: int,
    max_context: int,
    steps_in_flight: int,
    chunk_tokens: int,
    kv_budget_bytes: int | None,
) -> GenerationWorkload:
    """The run's limits as the planner's workload: its sequences spread over its steps
    in flight, prompts planned at one chunk."""
    return GenerationWorkload(
        sequences=max_sequences,
        max_context=max_context,
        decode_batch=-(-max_sequences // steps_in_flight),
        prefill_chunk=chunk_tokens,
        prompt_tokens=min(chunk_tokens, max_context),
        kv_budget_bytes=kv_budget_bytes,
    )


def _mib(n: float) -> str:
    return f"{n / MIB:.2f} MiB"


def stage_budget_mb(member: Member) -> float | None:
    """What the stage reported it may fill (None: no limit known)."""
    value = member.info.get("memory_mb")
    return float(value) if value else None


def stage_room_bytes(member: Member, margin: float = DEFAULT_MEMORY_MARGIN) -> int | None:
    """What the stage gives a model (None: no limit known): its budget less the margin,
    its process's base and the runtime's allowance, as for every other run kind."""
    budget = stage_budget_mb(member)
    if budget is None:
        return None
    return model_room_bytes(int(budget * MIB), base_bytes=base_bytes_of(member), margin=margin)


def capacity_shortfall(
    member: Member, need: StageMemory, margin: float = DEFAULT_MEMORY_MARGIN
) -> str | None:
    """Why ``need`` does not fit the stage's room (its name, the MiB needed and
    available), or None."""
    room = stage_room_bytes(member, margin)
    if room is None or need.total <= room:
        return None
    budget = stage_budget_mb(member) or 0.0
    return (
        f"stage {member.name!r} needs {_mib(need.total)} (weights {_mib(need.weights)}, "
        f"KV cache {_mib(need.kv_cache)}, working set {_mib(need.activations)}) but has "
        f"{_mib(room)} for its model (its --memory-mb or free memory, {_mib(budget * MIB)}, "
        f"less the {margin:.0%} margin, its process's base of "
        f"{_mib(base_bytes_of(member))} and the runtime's {_mib(runtime_bytes(False))})"
    )


def check_generation_capacity(
    units: Sequence[GenerationUnit],
    members: Sequence[Member],
    bounds: Sequence[tuple[int, int]],
    workload: GenerationWorkload,
    margin: float = DEFAULT_MEMORY_MARGIN,
) -> None:
    """Raise :class:`InfeasiblePlanError` naming the first stage whose units, cache and
    working set exceed its room."""
    for member, (start, end) in zip(members, bounds, strict=True):
        why = capacity_shortfall(member, stage_memory(units, start, end, workload), margin)
        if why is not None:
            raise InfeasiblePlanError(
                f"the generation run does not fit: {why}, holding units [{start}, {end}) "
                f"for {workload.sequences} sequences of up to {workload.max_context} tokens; "
                "split the model over more stages, or serve fewer sequences or a shorter "
                "context"
            )


def planned_bounds(
    units: Sequence[GenerationUnit],
    members: Sequence[Member],
    workload: GenerationWorkload,
    margin: float = DEFAULT_MEMORY_MARGIN,
) -> list[tuple[int, int]]:
    """The split over ``members`` (one stage each, in order) with the most decode
    tokens/s that fits every stage's budget; :class:`InfeasiblePlanError` naming a
    stage that cannot hold its share when none fits."""
    if len(members) == 1:  # nothing to choose: say by how much the one stage is short
        bounds = [(0, len(units))]
        check_generation_capacity(units, members, bounds, workload, margin)
        return bounds
    cluster = cluster_from_members(members, margin=margin)
    try:
        plan = plan_generation_in_order(units, cluster, workload)
    except InfeasiblePlanError as exc:
        # the even split's first shortfall says which stage and by how much
        base, extra = divmod(len(units), len(members))
        even, start = [], 0
        for i in range(len(members)):
            end = start + base + (1 if i < extra else 0)
            even.append((start, end))
            start = end
        try:
            check_generation_capacity(units, members, even, workload, margin)
        except InfeasiblePlanError as short:
            raise InfeasiblePlanError(
                f"no split over the {len(members)} stages fits: {exc}; the even split: {short}"
            ) from exc
        raise
    return [(s.start, s.end) for s in plan.stages]
