"""A pipelined generation run's set-up: from ``gen_run_request`` to ``gen_run_ready``.

    gen_run_request ─> the stages (waiting for them to register) ─> bounds (the
    client's partition, or the planner's split within each stage's memory) ─>
    gen_setup to each stage (its units, its neighbours, the run's limits) ─> every
    gen_ready ─> gen_run_ready

A flow (:mod:`zpipe.coordinator.flows`): pure, driven by events. After set-up the
coordinator carries no data of the run: the client sends sequences to the first
stage, steps go stage to stage, the last stage's tokens go back to the first (the
ring), and the first stage streams each sequence's events to the client's sink.
The client ends the run on the data path (``gen_close``, passed down the stages)
and tells the coordinator (``run_end``); a later run's set-up replaces it on each
stage too. Another client's run in flight is not replaced: the request is refused
with ``run_failed`` naming it (:mod:`zpipe.coordinator.one_run`); the client whose
run is current may replace its own.

Decisions made here, pure and tested alone: :func:`generation_bounds` (which units
each stage holds), :func:`kv_budget_tokens` (the tokens every stage's cache holds
at once, which the first stage's scheduler admits against) and
:func:`generation_setups` (each stage's ``gen_setup``). Without a partition the
split is planned within each stage's memory budget, and with one it is checked
against them (:mod:`zpipe.coordinator.generation_plan`), before any stage loads a
weight. Recovery after a stage's death is in
:mod:`zpipe.coordinator.runs.generation_recovery`, the run's controller once it is
set up.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from zpipe._errors import ConfigError, PipelineError, RunRefusedError, ZpipeError
from zpipe.coordinator.commands import AwaitReplies, AwaitStages, Command, Log, Persist, Send
from zpipe.coordinator.flows import Flow
from zpipe.coordinator.generation_plan import (
    check_generation_capacity,
    generation_units,
    generation_workload,
    planned_bounds,
)
from zpipe.coordinator.membership import Member
from zpipe.coordinator.one_run import blocking, refusal, refused_text
from zpipe.coordinator.registration import printable
from zpipe.coordinator.state import CLIENT_NAME, ControlState
from zpipe.generation.wire import DTYPE_BYTES, check_dtype
from zpipe.models import ModelSpec
from zpipe.models.causal_lm import FAMILY, kv_bytes_per_token_per_block, read_causal_lm_config
from zpipe.models.causal_lm.config import CausalLmConfig
from zpipe.protocol.client_control import RunFailed
from zpipe.protocol.generation import GenReady, GenRunReady, GenRunRequest, GenSetup


def start_generation_run(
    state: ControlState,
    routing_id: bytes,
    client_key: str | None,
    request: GenRunRequest,
    now: float,
    *,
    on_ready: Callable[[GenRunReady], None] | None = None,
) -> list[Command]:
    """Answer a ``gen_run_request``: ``gen_run_ready`` once every stage is built, or
    ``run_failed``. ``on_ready``: called with the answer before it leaves (the run's
    controller takes over from there: zpipe.coordinator.runs.generation_recovery)."""
    flow = generation_run(state, routing_id, client_key, request, on_ready)
    return state.flows.start(flow, now)


def generation_run(
    state: ControlState,
    routing_id: bytes,
    client_key: str | None,
    request: GenRunRequest,
    on_ready: Callable[[GenRunReady], None] | None = None,
) -> Flow:
    reply_s = state.timeouts.reply_s
    # another client's run in flight is not replaced: this request is refused
    refused = yield from refusal(state, routing_id)
    if refused is not None:
        yield Send(routing_id, refused, CLIENT_NAME, reply_s)
        return
    try:
        ready = yield from _set_up(state, routing_id, client_key, request)
    except RunRefusedError as exc:  # another client's run started while this waited
        yield Log("warning", "run_refused", {"in_flight": exc.run, "client": printable(routing_id)})
        yield Send(routing_id, RunFailed(error=str(exc), in_flight=exc.run), CLIENT_NAME, reply_s)
        return
    except Exception as exc:  # whatever it was, the client hears that its run failed
        if not isinstance(exc, (ZpipeError, ValueError)):
            yield Log("error", "generation_start_crashed", {"error": repr(exc)})
        yield Log("error", "run_failed", {"error": str(exc)})
        yield Send(routing_id, RunFailed(error=str(exc)), CLIENT_NAME, reply_s)
        return
    if on_ready is not None:
        on_ready(ready)
    yield Send(routing_id, ready, CLIENT_NAME, reply_s)


@dataclass(frozen=True)
class GenerationLimits:
    """A run's limits, checked once: what every stage and the scheduler are built for."""

    max_context: int
    max_sequences: int
    steps_in_flight: int
    chunk_tokens: int
    kv_budget_bytes: int | None
    dtype: str | None

    @classmethod
    def of(cls, request: GenRunRequest, config: CausalLmConfig) -> GenerationLimits:
        for name in ("max_context", "max_sequences", "steps_in_flight", "chunk_tokens"):
            value = getattr(request, name)
            if value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}")
        if request.max_context > config.max_positions:
            raise ConfigError(
                f"max_context {request.max_context} exceeds the model's "
                f"{config.max_positions} positions"
            )
        if request.kv_budget_bytes is not None and request.kv_budget_bytes < 1:
            raise ConfigError(f"kv_budget_bytes must be >= 1, got {request.kv_budget_bytes}")
        check_dtype(request.dtype)
        return cls(
            request.max_context,
            request.max_sequences,
            request.steps_in_flight,
            request.chunk_tokens,
            request.kv_budget_bytes,
            request.dtype,
        )


def generation_bounds(
    num_units: int, stages: int, partition: Sequence[object] | None = None
) -> list[tuple[int, int]]:
    """``[start, end)`` of each stage: the client's ``partition`` (units per stage, in
    order, summing to ``num_units``), or the units split as evenly as they go (the
    first stages take one more when they do not divide)."""
    if partition is not None:
        counts = list(partition)
        if any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts):
            raise ConfigError(f"a partition lists positive unit counts, got {counts}")
        if sum(counts) != num_units:  # type: ignore[arg-type]
            raise ConfigError(
                f"the partition {counts} covers {sum(counts)} units, the model has {num_units}"  # type: ignore[arg-type]
            )
        if len(counts) != stages:
            raise ConfigError(f"the partition has {len(counts)} stages, the run {stages}")
    else:
        if not 1 <= stages <= num_units:
            raise ConfigError(f"{stages} stages cannot split {num_units} units")
        base, extra = divmod(num_units, stages)
        counts = [base + (1 if i < extra else 0) for i in range(stages)]
    bounds, start = [], 0
    for count in counts:
        bounds.append((start, start + int(count)))  # type: ignore[call-overload]
        start += int(count)  # type: ignore[call-overload]
    return bounds


def blocks_in(config: CausalLmConfig, start: int, end: int) -> int:
    """Decoder blocks among units ``[start, end)`` (unit 0 is the embedding, the last
    the head): the blocks whose cache a stage keeps."""
    return max(0, min(end, config.num_units - 1) - max(start, 1))


def kv_budget_tokens(
    config: CausalLmConfig,
    bounds: Sequence[tuple[int, int]],
    kv_budget_bytes: int | None,
    dtype: str | None,
) -> int | None:
    """The tokens (all sequences together) every stage's cache holds within
    ``kv_budget_bytes``: the smallest stage's, since each keeps every sequence
    (None: no budget). A stage without blocks keeps no cache and binds nothing."""
    if kv_budget_bytes is None:
        return None
    per_block = kv_bytes_per_token_per_block(config, element_bytes=DTYPE_BYTES[dtype or "float32"])
    fits = [
        kv_budget_bytes // (per_block * blocks)
        for start, end in bounds
        if (blocks := blocks_in(config, start, end)) > 0
    ]
    if not fits:
        return None
    tokens = min(fits)
    if tokens < 1:
        raise ConfigError(
            f"a KV cache budget of {kv_budget_bytes} bytes holds no token on the stage "
            "with the most blocks"
        )
    return tokens


def generation_setups(
    run: int,
    epoch: int,
    spec: ModelSpec,
    members: Sequence[Member],
    bounds: Sequence[tuple[int, int]],
    limits: GenerationLimits,
    *,
    sink_endpoint: str,
    keys: dict[str, str | None],
    budget_tokens: int | None,
    text: bool | None = None,
) -> list[GenSetup]:
    """Each stage's ``gen_setup``, in pipeline order. ``keys``: public keys by name
    (the client's under ``client``)."""
    n = len(members)
    names = [m.name for m in members]
    out = []
    for i in range(n):
        first = i == 0
        # a ring of one stage is the stage itself: no message goes round
        upstream = "" if n == 1 else names[i - 1]  # the first stage's is the last (ring)
        downstream = "" if n == 1 else names[(i + 1) % n]
        out.append(
            GenSetup(
                run=run,
                model=spec.to_dict(),
                start=bounds[i][0],
                end=bounds[i][1],
                index=i,
                num_stages=n,
                upstream=upstream,
                downstream=downstream,
                max_context=limits.max_context,
                max_sequences=limits.max_sequences,
                steps_in_flight=limits.steps_in_flight,
                chunk_tokens=limits.chunk_tokens,
                upstream_key=keys.get(upstream) if upstream else None,
                downstream_endpoint=members[(i + 1) % n].data_endpoint if downstream else None,
                upstream_endpoint=members[i - 1].data_endpoint if upstream else None,
                downstream_key=keys.get(downstream) if downstream else None,
                sink_endpoint=sink_endpoint if first else None,
                client_key=keys.get(CLIENT_NAME) if first else None,
                kv_budget_bytes=limits.kv_budget_bytes,
                kv_budget_tokens=budget_tokens if first else None,
                dtype=limits.dtype,
                text=text if first else None,
                epoch=epoch,
            )
        )
    return out


def capacity_bounds(
    config: CausalLmConfig,
    members: Sequence[Member],
    limits: GenerationLimits,
    partition: Sequence[object] | None,
    margin: float,
) -> list[tuple[int, int]]:
    """Each stage's units: the client's partition, checked against every stage's memory
    room (its budget less ``margin`` and its process's base), or the planner's split
    over the stages that fits them; refused (naming the stage, the MiB it needs and
    has) before any stage hears of the run. A recovery re-plans its survivors with
    it too (zpipe.coordinator.runs.generation_recovery)."""
    units = generation_units(
        config, element_bytes=DTYPE_BYTES[limits.dtype or "float32"], max_context=limits.max_context
    )
    workload = generation_workload(
        max_sequences=limits.max_sequences,
        max_context=limits.max_context,
        steps_in_flight=limits.steps_in_flight,
        chunk_tokens=limits.chunk_tokens,
        kv_budget_bytes=limits.kv_budget_bytes,
    )
    if partition is not None:
        bounds = generation_bounds(config.num_units, len(members), partition)
        check_generation_capacity(units, members, bounds, workload, margin)
        return bounds
    generation_bounds(config.num_units, len(members))  # too many stages: said as before
    return planned_bounds(units, members, workload, margin)


def _set_up(
    state: ControlState, routing_id: bytes, client_key: str | None, request: GenRunRequest
) -> Flow:
    spec = ModelSpec.from_dict(request.model)
    if spec.family != FAMILY:
        raise ConfigError(f"a generation run needs a {FAMILY!r} model, got {spec.family!r}")
    config = read_causal_lm_config(spec.config)
    limits = GenerationLimits.of(request, config)
    names = None if request.stage_names is None else tuple(str(n) for n in request.stage_names)
    count = request.stages
    if count is None and request.partition is not None:
        count = len(request.partition)
    if names is None and count is None:
        raise ConfigError("a generation run names its stages, counts them, or gives a partition")
    if count is not None and count < 1:
        raise ConfigError(f"a generation run needs at least one stage, got {count}")
    if names is not None and (not names or len(set(names)) != len(names)):
        raise ConfigError(f"stage_names must name each stage once, got {list(names)}")
    members: list[Member] = yield AwaitStages(names, count, float(request.wait_for_stages_s))
    bounds = capacity_bounds(config, members, limits, request.partition, state.memory_margin)
    budget = kv_budget_tokens(config, bounds, limits.kv_budget_bytes, limits.dtype)
    busy = blocking(state, routing_id)
    if busy is not None:  # admitted while this one waited for its stages
        raise RunRefusedError(busy, refused_text(busy))
    if state.current is not None:
        # this client's own run: its stages take the generation run instead
        yield Log("warning", "run_replaced", {"previous": state.current.run.run})
        state.current = None
    run, epoch = state.next_run(), state.next_epoch()
    yield Persist()  # numbered before any stage hears them, as every run is
    keys = {m.name: state.key_of(m.name) for m in members}
    keys[CLIENT_NAME] = client_key
    setups = generation_setups(
        run,
        epoch,
        spec,
        members,
        bounds,
        limits,
        sink_endpoint=request.sink_endpoint,
        keys=keys,
        budget_tokens=budget,
        text=request.text or None,
    )
    yield Log("info", "generation_setup", {"run": run, "epoch": epoch, "bounds": bounds})
    for member, setup in zip(members, setups, strict=True):
        yield Send(member.routing_id, setup, member.name, stage=member.name)
    replies: dict[str, GenReady] = yield AwaitReplies(
        tuple(m.name for m in members), GenReady, state.timeouts.result_s, "gen_ready", run=run
    )
    refused = {name: r.error for name, r in replies.items() if r.error}
    if refused:
        raise PipelineError(f"stages refused the generation run: {refused}")
    first = members[0]
    yield Log("info", "generation_ready", {"run": run, "stages": [m.name for m in members]})
    return GenRunReady(
        run=run,
        stages=[m.name for m in members],
        bounds=[list(b) for b in bounds],
        first_endpoint=first.data_endpoint,
        first_stage=first.name,
        first_key=keys.get(first.name),
        epoch=epoch,
    )
