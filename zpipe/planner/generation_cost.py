"""The cost model of generation: a stage's memory (KV cache included) and a plan's speed.

Plain numbers in, plain numbers out. The model helper supplies each unit's
bytes from a configuration (:class:`GenerationUnit`); its times come from a
measurement or an estimate on a reference device, and a device of
``speed`` 0.5 takes twice as long (as in :mod:`zpipe.planner.cost`).

Memory of a stage running units ``[i, j)`` (what :func:`stage_memory` adds up):

- weights: ``sum(weight_bytes)`` of its units;
- KV cache: ``sum(kv_bytes_per_token) * max_context * sequences``: every
  sequence in flight may grow to the run's maximum context, and its cache
  lives on the stage that runs its blocks until the sequence ends (at most the
  workload's ``kv_budget_bytes`` when it has one);
- activations: ``max(prefill_chunk, decode_batch) * max(activation_bytes_per_token)``.
  A stage runs one forward at a time (a prefill chunk or a decode
  micro-batch), its units one after another, and a unit's working set is freed
  before the next unit runs (no backward keeps it), so the peak is the largest
  unit's working set at the larger of the two token counts;
- the runtime (``runtime``, beside the three): what any model's first build and
  forward cost the process, by the one memory model (:mod:`zpipe.planner.memory`);
  a device's room leaves it out, as it leaves out the process's base.

Times of a stage on a device (reference time / the device's speed):

- ``d``: one decode step of a micro-batch of ``decode_batch`` sequences;
- ``p``: one prefill chunk of ``prefill_chunk`` tokens of one sequence;
- ``x`` and ``y``: the serialisation of what the stage sends on per step and
  per chunk: ``tokens * output_bytes_per_token`` of its last unit over the link
  to the next stage (:meth:`ClusterSpec.comm_time_s`); the last stage's
  "next" is the first stage (the sampled token closes the ring), so the
  head's ``output_bytes_per_token`` is the size of a token id;
- ``l``: the link's latency (:meth:`ClusterSpec.latency_s`).

The formulas that combine them (ring time, bottleneck, tokens/s, time to
first token) are derived in :mod:`zpipe.planner.generation`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from zpipe._errors import ConfigError, InfeasiblePlanError
from zpipe.planner.cluster import CLIENT, ClusterDevice, ClusterSpec
from zpipe.planner.cost import fmt_bytes
from zpipe.planner.memory import predict_stage
from zpipe.planner.plan import Plan
from zpipe.planner.profile import MAX_BYTES, MAX_UNIT_TIME_S


def _is_count(value: object) -> bool:
    """An integer (numpy's too), not a bool and not a float such as 3.0."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclass(frozen=True)
class GenerationUnit:
    """One unit of a causal LM (the embedding, a decoder block, the norm with the head).

    ``decode_time_s`` is one decode step of the workload's ``decode_batch``
    sequences and ``prefill_time_s`` one chunk of its ``prefill_chunk``
    tokens, both on the reference device (speed 1.0).
    ``activation_bytes_per_token`` is a forward's peak working set per token in
    it; where attention materialises its scores, include their share at the
    maximum context (heads x max_context x dtype bytes per query token).
    """

    name: str
    weight_bytes: int
    kv_bytes_per_token: int = 0  # per sequence and token of context; 0 for embed and head
    activation_bytes_per_token: int = 0  # working set of one forward, per token in it
    output_bytes_per_token: int = 0  # what crosses to the next unit; a token id for the head
    decode_time_s: float = 0.0
    prefill_time_s: float = 0.0

    def __post_init__(self) -> None:
        where = f"unit {self.name!r}"
        for key in (
            "weight_bytes",
            "kv_bytes_per_token",
            "activation_bytes_per_token",
            "output_bytes_per_token",
        ):
            value = getattr(self, key)
            if not _is_count(value) or not 0 <= value <= MAX_BYTES:
                raise ConfigError(f"{where}: {key} must be a whole number of bytes, got {value!r}")
            object.__setattr__(self, key, int(value))  # numpy's integers too, as plain ints
        for key in ("decode_time_s", "prefill_time_s"):
            value = getattr(self, key)
            if (
                isinstance(value, bool)
                or not isinstance(value, numbers.Real)
                or not 0 <= float(value) <= MAX_UNIT_TIME_S
            ):
                raise ConfigError(
                    f"{where}: {key} must be a number of seconds in [0, {MAX_UNIT_TIME_S:g}], "
                    f"got {value!r}"
                )
            object.__setattr__(self, key, float(value))


@dataclass(frozen=True)
class GenerationWorkload:
    """What the run serves: ``sequences`` in flight, each up to ``max_context`` tokens.

    Decode runs ``ceil(sequences / decode_batch)`` micro-batches ("groups") in
    flight around the ring; a prompt of ``prompt_tokens`` is prefilled in
    chunks of ``prefill_chunk`` (time to first token is planned for that length).
    """

    sequences: int
    max_context: int
    decode_batch: int = 1
    prefill_chunk: int = 512
    prompt_tokens: int | None = None  # None: a prompt as long as the context allows
    # each stage's cache at most this many bytes (a run's KV budget; the scheduler admits
    # sequences against it); None: room for every sequence at max_context
    kv_budget_bytes: int | None = None

    def __post_init__(self) -> None:
        budget = self.kv_budget_bytes
        if budget is not None and (not _is_count(budget) or budget < 1):
            raise ConfigError(
                f"generation workload: kv_budget_bytes must be an integer >= 1, got {budget!r}"
            )
        if self.prompt_tokens is None:
            object.__setattr__(self, "prompt_tokens", self.max_context)
        for key in ("sequences", "max_context", "decode_batch", "prefill_chunk", "prompt_tokens"):
            value = getattr(self, key)
            if not _is_count(value) or value < 1:
                raise ConfigError(
                    f"generation workload: {key} must be an integer >= 1, got {value!r}"
                )
            object.__setattr__(self, key, int(value))
        if self.prompt > self.max_context:
            raise ConfigError(
                f"generation workload: a prompt of {self.prompt_tokens} tokens exceeds the "
                f"maximum context of {self.max_context}"
            )

    @property
    def prompt(self) -> int:
        """``P``: the prompt length time to first token is planned for."""
        assert self.prompt_tokens is not None  # set in __post_init__
        return self.prompt_tokens

    @property
    def groups(self) -> int:
        """Decode micro-batches in flight: ``G = ceil(S / b)``."""
        return -(-self.sequences // self.decode_batch)

    @property
    def chunks(self) -> int:
        """Prefill chunks of a prompt: ``ceil(P / C)``."""
        return -(-self.prompt // self.prefill_chunk)


@dataclass(frozen=True)
class StageMemory:
    """What one stage holds, in bytes.

    ``total`` is the model's part (weights, KV cache, working set): what a device's
    room for a model must hold. ``runtime`` is what running any model costs the
    stage's process the first time (:data:`~zpipe.planner.memory.COMPUTE_RUNTIME_BYTES`:
    torch's code and the CPU kernels' workspaces), which a room has already left out
    (:func:`~zpipe.planner.memory.model_room_bytes`), as it has the process's base;
    ``above_base`` adds it: what the process holds at its peak beyond its base."""

    weights: int
    kv_cache: int
    activations: int
    runtime: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.activations

    @property
    def above_base(self) -> int:
        return self.total + self.runtime


def stage_memory(
    units: Sequence[GenerationUnit], start: int, end: int, workload: GenerationWorkload
) -> StageMemory:
    """The memory of a stage running ``units[start:end]`` (see the module docstring)."""
    span = units[start:end]
    tokens = max(workload.prefill_chunk, workload.decode_batch)
    kv = sum(u.kv_bytes_per_token for u in span) * workload.max_context * workload.sequences
    if workload.kv_budget_bytes is not None:
        kv = min(kv, workload.kv_budget_bytes)
    # weights and working set by the one memory model (zpipe.planner.memory); a unit's
    # working set per token counts its input, so the stage's input adds nothing here
    model = predict_stage(
        weights=sum(u.weight_bytes for u in span),
        unit_peaks=[tokens * u.activation_bytes_per_token for u in span] or [0],
        stage_input=0,
    )
    return StageMemory(
        weights=model.weights, kv_cache=kv, activations=model.forward, runtime=model.runtime
    )


def device_speeds(
    cluster: ClusterSpec, speeds: Mapping[str, float] | None = None
) -> dict[str, float]:
    """Each device's speed: ``speeds`` where given (for example
    :func:`zpipe.planner.capacity.speeds_from_cluster`, which reads devices' own
    profiles), else the cluster's declared ``speed``."""
    out = {d.name: d.speed for d in cluster.devices}
    for name, value in (speeds or {}).items():
        cluster.device(name)  # an unknown name is a ConfigError
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"device {name!r}: speed must be a positive number, got {value!r}")
        out[name] = float(value)
    return out


def check_units(units: Sequence[GenerationUnit]) -> None:
    if not units:
        raise ConfigError("a generation plan needs at least one unit")


def memory_shortfall(device: ClusterDevice, need: StageMemory) -> str | None:
    """Why ``need`` does not fit ``device`` (naming it, what it needs and what it has), or None."""
    cap = device.memory_bytes
    if cap is None or need.total <= cap:
        return None
    return (
        f"device {device.name} needs {fmt_bytes(need.total)} (weights {fmt_bytes(need.weights)}, "
        f"KV cache {fmt_bytes(need.kv_cache)}, activations {fmt_bytes(need.activations)}) but "
        f"holds {fmt_bytes(cap)}; {fmt_bytes(need.total - cap)} short"
    )


def check_generation_memory(
    plan: Plan,
    units: Sequence[GenerationUnit],
    cluster: ClusterSpec,
    workload: GenerationWorkload,
) -> None:
    """Raise :class:`InfeasiblePlanError` naming the first stage whose device cannot hold it."""
    _check_plan_units(plan, units)
    for i, stage in enumerate(plan.stages):
        need = stage_memory(units, stage.start, stage.end, workload)
        why = memory_shortfall(cluster.device(stage.device), need)
        if why is not None:
            raise InfeasiblePlanError(
                f"the {plan.algo} plan puts units [{stage.start}, {stage.end}) on stage {i}: {why} "
                f"for {workload.sequences} sequences of up to {workload.max_context} tokens: "
                "serve fewer sequences or a shorter context, or add memory or devices"
            )


def kv_budget_tokens(
    plan: Plan,
    units: Sequence[GenerationUnit],
    cluster: ClusterSpec,
    workload: GenerationWorkload,
) -> int | None:
    """How many tokens of KV cache, over all sequences together, the plan's devices hold
    beside their weights and working sets: the least over the stages of
    ``(memory - weights - activations) // sum(kv_bytes_per_token)`` (None when no stage
    bounds it). What a scheduler admits against, counting each sequence's prompt plus
    its token limit, so that a sequence past it is refused, never killed."""
    return _least(_stage_kv_tokens(plan, units, cluster, workload))


def kv_capacity_sequences(
    plan: Plan,
    units: Sequence[GenerationUnit],
    cluster: ClusterSpec,
    workload: GenerationWorkload,
) -> int | None:
    """How many sequences of ``max_context`` tokens the plan's devices can cache at once
    (None when no stage bounds it)."""
    budget = kv_budget_tokens(plan, units, cluster, workload)
    return None if budget is None else budget // workload.max_context


def _stage_kv_tokens(
    plan: Plan,
    units: Sequence[GenerationUnit],
    cluster: ClusterSpec,
    workload: GenerationWorkload,
) -> list[int]:
    """Each bounded stage's tokens of cache (stages without a bound left out)."""
    _check_plan_units(plan, units)
    out = []
    for stage in plan.stages:
        cap = cluster.device(stage.device).memory_bytes
        per_token = sum(u.kv_bytes_per_token for u in units[stage.start : stage.end])
        if cap is None or per_token == 0:
            continue
        fixed = stage_memory(units, stage.start, stage.end, workload)
        out.append(max(0, (cap - fixed.weights - fixed.activations) // per_token))
    return out


def _least(values: list[int]) -> int | None:
    return min(values) if values else None


def _check_plan_units(plan: Plan, units: Sequence[GenerationUnit]) -> None:
    if plan.num_units != len(units):
        raise ConfigError(f"the plan covers {plan.num_units} units but the model has {len(units)}")


@dataclass(frozen=True)
class RingStageTimes:
    """One stage's times (seconds) in the ring, on its device."""

    decode_s: float  # d: compute of one decode step
    decode_send_s: float  # x: serialising the step's output to the next stage
    prefill_s: float  # p: compute of one prefill chunk
    prefill_send_s: float  # y: serialising the chunk's output to the next stage
    latency_s: float  # l: the link to the next stage


def stage_costs(
    units: Sequence[GenerationUnit],
    start: int,
    end: int,
    device: str,
    next_device: str,
    cluster: ClusterSpec,
    workload: GenerationWorkload,
    speed: float,
) -> RingStageTimes:
    """The times of a stage running ``units[start:end]`` on ``device`` and sending to
    ``next_device`` (itself for a one-stage ring: nothing crosses a link)."""
    span = units[start:end]
    out = units[end - 1].output_bytes_per_token
    if next_device == device:
        send_d = send_p = lat = 0.0
    else:
        send_d = cluster.comm_time_s(device, next_device, workload.decode_batch * out)
        send_p = cluster.comm_time_s(device, next_device, workload.prefill_chunk * out)
        lat = cluster.latency_s(device, next_device)
    return RingStageTimes(
        decode_s=math.fsum(u.decode_time_s for u in span) / speed,
        decode_send_s=send_d,
        prefill_s=math.fsum(u.prefill_time_s for u in span) / speed,
        prefill_send_s=send_p,
        latency_s=lat,
    )


def client_hops_s(
    units: Sequence[GenerationUnit],
    first: str,
    last: str,
    cluster: ClusterSpec,
    workload: GenerationWorkload,
) -> float:
    """The client's part of the time to first token: the prompt's token ids to the first
    stage, and the first token from the last stage back (transfer and latency)."""
    token = units[-1].output_bytes_per_token
    return (
        cluster.comm_time_s(CLIENT, first, workload.prompt * token)
        + cluster.latency_s(CLIENT, first)
        + cluster.comm_time_s(last, CLIENT, token)
        + cluster.latency_s(last, CLIENT)
    )


def combine(
    ring_s: float,
    period_s: float,
    prefill_sum_s: float,
    prefill_period_s: float,
    workload: GenerationWorkload,
) -> tuple[float, float, float]:
    """``(cycle_s, decode_tokens_per_s, ttft_s)`` from a ring's four figures (derived in
    :mod:`zpipe.planner.generation`): ``cycle = max(R, G * tau) / G``,
    ``tokens/s = S / max(R, G * tau)``, ``ttft = Q + (k - 1) * pi``."""
    span = max(ring_s, workload.groups * period_s)
    tokens = workload.sequences / span if span > 0 else math.inf
    ttft = prefill_sum_s + (workload.chunks - 1) * prefill_period_s
    return span / workload.groups, tokens, ttft


def predict_generation(
    plan: Plan,
    units: Sequence[GenerationUnit],
    cluster: ClusterSpec,
    workload: GenerationWorkload,
    *,
    speeds: Mapping[str, float] | None = None,
) -> dict[str, float]:
    """Per-stage times and memory, and the plan's ring time, bottleneck, decode tokens/s
    and time to first token; any plan (a planner's or a user's).

    Keys: ``stage{i}_decode_s``, ``stage{i}_decode_send_s``, ``stage{i}_prefill_s``,
    ``stage{i}_latency_s``, ``stage{i}_memory_bytes``, ``stage{i}_kv_bytes``,
    ``ring_s`` (one token's trip, ``R``), ``bottleneck_s`` (slowest stage or link
    per step, ``tau``), ``cycle_s``, ``decode_tokens_per_s``, ``ttft_s``,
    ``sequences``, ``groups``, ``num_stages`` and ``memory_violations``.
    """
    _check_plan_units(plan, units)
    check_units(units)
    speed = device_speeds(cluster, speeds)
    names = plan.devices
    pred: dict[str, float] = {
        "sequences": float(workload.sequences),
        "groups": float(workload.groups),
        "num_stages": float(len(names)),
    }
    ring = period = pre_sum = pre_period = 0.0
    violations = 0
    for i, stage in enumerate(plan.stages):
        nxt = names[(i + 1) % len(names)]
        c = stage_costs(
            units, stage.start, stage.end, stage.device, nxt, cluster, workload, speed[stage.device]
        )
        mem = stage_memory(units, stage.start, stage.end, workload)
        if memory_shortfall(cluster.device(stage.device), mem) is not None:
            violations += 1
        ring += c.decode_s + c.decode_send_s + c.latency_s
        period = max(period, c.decode_s, c.decode_send_s)
        pre_sum += c.prefill_s
        pre_period = max(pre_period, c.prefill_s)
        if i + 1 < len(names):  # the last stage's first token goes to the client
            pre_sum += c.prefill_send_s + c.latency_s
            pre_period = max(pre_period, c.prefill_send_s)
        pred[f"stage{i}_decode_s"] = c.decode_s
        pred[f"stage{i}_decode_send_s"] = c.decode_send_s
        pred[f"stage{i}_prefill_s"] = c.prefill_s
        pred[f"stage{i}_latency_s"] = c.latency_s
        pred[f"stage{i}_memory_bytes"] = float(mem.total)
        pred[f"stage{i}_kv_bytes"] = float(mem.kv_cache)
    pre_sum += client_hops_s(units, names[0], names[-1], cluster, workload)
    cycle, tokens, ttft = combine(ring, period, pre_sum, pre_period, workload)
    pred["ring_s"] = ring
    pred["bottleneck_s"] = period
    pred["cycle_s"] = cycle
    pred["decode_tokens_per_s"] = tokens
    pred["ttft_s"] = ttft
    pred["memory_violations"] = float(violations)
    return pred
