"""Planning for generation: which devices, in which order, run which units of a causal LM.

The pipeline of a generation run is a ring. The last stage samples each
sequence's next token and sends it straight back to the first stage, so a
sequence's token ``t + 1`` cannot start before token ``t`` has gone all the
way round. The planner picks a device subset, its order and a contiguous split
of the units (PipeEdge's search space) that maximise aggregate decode tokens/s
with ``S`` sequences in flight, within every device's memory including the KV
cache (:mod:`zpipe.planner.generation_cost`), with time to first token as a
tie-break and, optionally, a bound (``max_ttft_s``).

Decode throughput of a ring
---------------------------
``S`` sequences decode in ``G = ceil(S / b)`` micro-batches ("groups") of up
to ``b`` sequences. For stage ``s`` of ``N`` (stage ``N - 1``'s next is stage
0): ``d_s`` its compute of one step, ``x_s`` the serialisation of the step's
output on its link to the next stage, ``l_s`` that link's latency. Each group
goes round and round; a stage computes one group at a time, a link serialises
one message at a time, and latency delays a message without occupying
anything. That is a timed event graph (a closed, deterministic, FIFO network)
with ``G`` tokens circulating, and its cycle time is the largest, over its
elementary circuits, of the circuit's delay over the tokens on it (Ramamoorthy
and Ho, 1980; Baccelli et al., "Synchronization and Linearity", ch. 2):

- the ring itself: delay ``R = sum_s (d_s + x_s + l_s)``, ``G`` tokens;
- each stage's compute and each link's serialisation: a self-loop with one
  token, delay ``d_s`` or ``x_s``.

So in the steady state each group completes one step every
``max(R / G, tau)``, with ``tau = max_s max(d_s, x_s)`` (PipeEdge's eq. 2
period), and as a group step yields ``S / G`` tokens on average::

    decode tokens/s = (S / G) / max(R / G, tau) = S / max(R, G * tau)
                    = min(S / R, (S / G) / tau)

This is exact for the model (deterministic times, queues that never block a
sender), not an approximation: with few groups the ring's round trip limits
the rate, with many the slowest stage or link does, and in between the
larger of the two. The planner minimises ``J = max(R, G * tau)``.

How this differs from PipeEdge. PipeEdge (section III-B, eq. 3) plans a
feed-forward stream with unboundedly many micro-batches in flight, so its
throughput is ``b / tau`` and only the bottleneck matters; latency (``l_s``)
and the sum of stage times never enter it. Here a sequence cannot have more
than one step in flight, so with ``G`` small the sum ``R`` decides: at
``S = 1`` (``G = 1``) ``J = R`` (``R >= tau`` always), the plan that minimises
one token's trip around the ring, which prefers few, fast, well-linked
devices, and pays every latency, including the closing hop from the last
stage to the first. As ``G`` grows ``G * tau`` takes over and the plan tends
to PipeEdge's. The ring's closing hop makes the first device matter to the
last stage's cost, which PipeEdge's DP (a path from the client to the client)
does not track.

Time to first token
-------------------
A prompt of ``P`` tokens is prefilled in ``k = ceil(P / C)`` chunks of ``C``
tokens, in order (chunk ``j`` attends to the cache of chunks ``< j``). With
``p_s`` a stage's compute of a chunk and ``y_s`` the serialisation of its
output (no closing hop: the last stage samples the first token and streams it
to the client), ``k`` identical jobs through a flow line whose servers are
the stages and links and whose latencies are pure delays finish after::

    ttft = c + Q + (k - 1) * pi,   Q = sum_s p_s + sum_{s < N-1} (y_s + l_s),
                                   pi = max(max_s p_s, max_{s < N-1} y_s)

with ``c`` the client's hops (the prompt's token ids in, the first token
out). Every chunk is costed at the full ``C`` tokens, so when ``C`` does not
divide ``P`` this is an upper bound; a prefill is costed on an idle pipeline
(decode steps of other sequences interleaved with it add to it).

The dynamic program
-------------------
PipeEdge's, over categories of interchangeable devices
(:func:`~zpipe.planner.pipeedge.device_categories`): a state is the count of
devices used per category, the category of the first stage (for the closing
hop), the category of the last stage so far and the unit boundary ``k``
reached. PipeEdge keeps one number per state (the bottleneck so far); here
the objective mixes sums and maxima, ``max(R, G * tau)`` and
``Q + (k - 1) * pi``, and the best partial plan by one is not always the best
to extend by the other, so a state keeps the Pareto front of its
``(R, tau, Q, pi)``: all four only grow as stages are appended, and both
objectives grow with each of them, so a partial plan dominated in all four is
never part of a better plan, and the front holds every plan that can be. The
DP is exact. A partial plan whose ``max(R, G * tau)`` already exceeds the best
complete plan's, or whose ``Q + (k - 1) * pi`` exceeds ``max_ttft_s``, is
dropped (both bounds only grow).

Ties: among plans whose ``J`` is equal (within a relative 1e-9) the least
time to first token wins, then the fewest stages, then the least bottleneck
``tau`` (a balanced split: with one sequence every split of a homogeneous ring
ties), then the first found
(categories in cluster order, each category's devices in cluster order).

Size. The states are ``prod(n_c + 1) * C^2 * (L + 1)`` for ``C`` categories
of ``n_c`` devices and ``L`` units; a cluster whose lattice exceeds
:data:`MAX_STATES` is planned over the devices in four fixed orders instead
(:func:`fixed_orders`: fastest first, its reverse, and two that fold it); a
plan's stages then
follow one order, skipping devices, and the DP's state is (first device, last
device, boundary), exact within that order. The search over every order starts
from that plan's ``J`` as its bound.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace

from zpipe._errors import ConfigError, InfeasiblePlanError
from zpipe.planner.cluster import ClusterSpec
from zpipe.planner.cost import fmt_bytes
from zpipe.planner.generation_cost import (
    GenerationUnit,
    GenerationWorkload,
    check_units,
    device_speeds,
    memory_shortfall,
    predict_generation,
    stage_memory,
)
from zpipe.planner.generation_search import GenerationSolver, PlanKey, better_key
from zpipe.planner.pipeedge import device_categories
from zpipe.planner.plan import Plan, StagePlan

# Exact while the state space is at most this (see the module docstring). The bounds
# prune most of it; on this project's 2-core machine at load 6 (bench/plan_generation.py)
# 16 devices in 4 kinds (625 count vectors, 34 units, 350,000 states) took up to 1.7 s,
# 8 distinct devices (573,000) up to 5.4 s, so those go to the fixed orders (at most
# 2.1 s at 16 distinct devices) instead.
MAX_STATES = 400_000
# With more categories than this the full search starts from the fixed orders' plan.
SEED_CATEGORIES = 3


def plan_generation(
    units: Sequence[GenerationUnit],
    cluster: ClusterSpec,
    workload: GenerationWorkload,
    *,
    max_ttft_s: float | None = None,
    speeds: Mapping[str, float] | None = None,
    exact: bool | None = None,
) -> Plan:
    """The plan with the most decode tokens/s for ``workload`` that fits every device's memory.

    ``max_ttft_s``: plans whose time to first token exceeds it are not
    considered. ``speeds``: device speeds to use instead of the cluster's
    (:func:`~zpipe.planner.generation_cost.device_speeds`). ``exact``: None
    (default) searches every device subset and order while the state space is at
    most :data:`MAX_STATES`, else the devices in four fixed orders
    (:func:`fixed_orders`); True insists on the full search; False takes the
    fixed orders. The plan's ``predicted`` holds :func:`predict_generation`'s figures
    and ``planner_exact`` (1.0 or 0.0).

    Raises :class:`InfeasiblePlanError` when no plan fits memory (naming the
    device when one device is all there is or one unit fits nowhere), or none
    meets ``max_ttft_s``.
    """
    check_units(units)
    if max_ttft_s is not None and not (max_ttft_s > 0):
        raise ConfigError(f"max_ttft_s must be a positive number of seconds, got {max_ttft_s!r}")
    speed = device_speeds(cluster, speeds)
    _check_fits_somewhere(units, cluster, workload)
    if exact is None:
        exact = _state_space(cluster, len(units)) <= MAX_STATES
    # The fixed orders' plan first: quick, and its J bounds the full search (not worth it
    # when the categories are few: that search is small anyway).
    bound: float | None = None
    states = 0
    categories = _speed_categories(cluster, speed)
    if not exact or len(categories) > SEED_CATEGORIES:
        try:
            stages, key, states = _fixed_orders(units, cluster, workload, speed, max_ttft_s)
            bound = key[0]
        except InfeasiblePlanError:
            if not exact:
                raise
            # no plan in either order: the full search may still find one
    if exact:
        solver = GenerationSolver(
            units, cluster, workload, speed, categories, max_ttft_s, fixed_order=False
        )
        stages = solver.solve(bound)
        states += solver.states
    plan = Plan(algo="generation", num_units=len(units), stages=stages)
    predicted = predict_generation(plan, units, cluster, workload, speeds=speed)
    predicted["planner_exact"] = 1.0 if exact else 0.0
    predicted["planner_states"] = float(states)
    return replace(plan, predicted=predicted)


def plan_generation_in_order(
    units: Sequence[GenerationUnit],
    cluster: ClusterSpec,
    workload: GenerationWorkload,
    *,
    speeds: Mapping[str, float] | None = None,
) -> Plan:
    """The best split of the units over every device of ``cluster``, one stage each, in
    the cluster's order: what a run that names its stages plans (it chose the devices
    and their order; the split is the planner's). Exact (the DP of the module
    docstring over that one order, no device skipped). Raises
    :class:`InfeasiblePlanError` when no split fits every device's memory."""
    check_units(units)
    if len(cluster.devices) > len(units):
        raise InfeasiblePlanError(f"{len(cluster.devices)} stages cannot split {len(units)} units")
    speed = device_speeds(cluster, speeds)
    _check_fits_somewhere(units, cluster, workload)
    solver = GenerationSolver(
        units,
        cluster,
        workload,
        speed,
        [[n] for n in cluster.names],
        None,
        fixed_order=True,
        every_device=True,
    )
    plan = Plan(algo="generation", num_units=len(units), stages=solver.solve())
    predicted = predict_generation(plan, units, cluster, workload, speeds=speed)
    predicted["planner_exact"] = 1.0
    predicted["planner_states"] = float(solver.states)
    return replace(plan, predicted=predicted)


def fixed_orders(cluster: ClusterSpec, speed: Mapping[str, float]) -> list[list[str]]:
    """The device orders the fixed-order search tries, each exactly.

    From the devices sorted fastest first (then most memory, then cluster order):
    that order and its reverse, and the two that fold it, fastest (or slowest) at
    both ends of the pipeline and the others towards the middle. The units at the
    ends (the embedding, the head) often differ most from the blocks between them,
    and which kind of device suits them decides where the order should put it.
    """
    order = sorted(
        cluster.names, key=lambda n: (-speed[n], -(cluster.device(n).memory_bytes or math.inf))
    )
    rev = order[::-1]
    out: list[list[str]] = []
    odd = len(order) % 2
    peak = order[0::2] + rev[odd::2]  # fastest first, second fastest last
    valley = rev[0::2] + order[odd::2]  # slowest first, second slowest last
    for candidate in (order, rev, peak, valley):
        if candidate not in out:
            out.append(candidate)
    return out


def _fixed_orders(
    units: Sequence[GenerationUnit],
    cluster: ClusterSpec,
    workload: GenerationWorkload,
    speed: Mapping[str, float],
    max_ttft_s: float | None,
) -> tuple[tuple[StagePlan, ...], PlanKey, int]:
    """The best plan over :func:`fixed_orders`: its stages, its (J, ttft, stages) and the
    states searched; :class:`InfeasiblePlanError` when neither order has one."""
    found: tuple[tuple[StagePlan, ...], PlanKey] | None = None
    states = 0
    error: InfeasiblePlanError | None = None
    for order in fixed_orders(cluster, speed):
        solver = GenerationSolver(
            units, cluster, workload, speed, [[n] for n in order], max_ttft_s, fixed_order=True
        )
        try:
            # a later order need only find a plan as good as the best so far
            stages = solver.solve(None if found is None else found[1][0])
        except InfeasiblePlanError as exc:
            error = exc
            continue
        finally:
            states += solver.states
        if found is None or better_key(solver.best_key, found[1]):
            found = (stages, solver.best_key)
    if found is None:
        assert error is not None
        raise error
    return found[0], found[1], states


def _state_space(cluster: ClusterSpec, num_units: int) -> int:
    categories = device_categories(cluster)
    return math.prod(len(c) + 1 for c in categories) * len(categories) ** 2 * (num_units + 1)


def _speed_categories(cluster: ClusterSpec, speed: Mapping[str, float]) -> list[list[str]]:
    """Interchangeable devices, split further where ``speeds`` tells them apart."""
    out: list[list[str]] = []
    for members in device_categories(cluster):
        by_speed: dict[float, list[str]] = {}
        for name in members:
            by_speed.setdefault(speed[name], []).append(name)
        out.extend(by_speed.values())
    return out


def _check_fits_somewhere(
    units: Sequence[GenerationUnit], cluster: ClusterSpec, workload: GenerationWorkload
) -> None:
    """The two refusals no search can lift: one unit fits no device, or all the devices
    together hold less than the model needs."""
    largest = max(
        cluster.devices, key=lambda d: math.inf if d.memory_bytes is None else d.memory_bytes
    )
    for k in range(len(units)):
        why = memory_shortfall(largest, stage_memory(units, k, k + 1, workload))
        if why is not None:
            raise InfeasiblePlanError(
                f"unit {k} ({units[k].name}) alone fits on no device: the largest, {why}, "
                f"for {workload.sequences} sequences of up to {workload.max_context} tokens: "
                "serve fewer sequences or a shorter context, or add a bigger device"
            )
    need = stage_memory(units, 0, len(units), workload)
    if len(cluster.devices) == 1:
        why = memory_shortfall(cluster.devices[0], need)
        if why is not None:
            raise InfeasiblePlanError(
                f"the model does not fit its one device: {why}, for {workload.sequences} "
                f"sequences of up to {workload.max_context} tokens: serve fewer sequences or a "
                "shorter context, or add devices"
            )
    if any(d.memory_bytes is None for d in cluster.devices):
        return
    held = sum(d.memory_bytes or 0 for d in cluster.devices)
    # Weights and caches add up over stages; activations only grow with more stages.
    if need.weights + need.kv_cache > held:
        raise InfeasiblePlanError(
            f"the model needs {fmt_bytes(need.weights)} of weights and {fmt_bytes(need.kv_cache)} "
            f"of KV cache for {workload.sequences} sequences of up to {workload.max_context} "
            f"tokens, but the {len(cluster.devices)} devices together hold {fmt_bytes(held)}: "
            "serve fewer sequences or a shorter context, or add devices or memory"
        )
