"""An EdgePipe (lossy) run on ordinary stages: from ``lossy_run_request`` to ``lossy_run_report``.

    lossy_run_request ─> the stages (waiting for them to register) ─> [the stages
    measure their links, 50 probes each: zpipe.coordinator.runs.lossy_probe] ─> partition
    (Algorithm 1) and map super neurons to stages (Algorithm 2) on the reception
    ratios measured or given ─> lossy_setup to each stage (its partial layers, its data, its
    peers) ─> every lossy_ready ─> lossy_go ─> every lossy_result ─> lossy_run_report

A flow (:mod:`zpipe.coordinator.flows`): pure, driven by events. Device ``k`` of
the run is the ``k``-th stage (``stage_names`` order, or by name); the stages
exchange partials between themselves over their data sockets, the coordinator
carries control only. A stage that dies or does not answer before the run
starts fails it (the client hears ``run_failed``). One the heartbeats declare
dead once the passes run is null-filled: the others hear ``lossy_dead`` and stop
waiting for its partials, the run goes on, and the report names it with the
first mini-batch that ran without it (``dead``). With ``on_death="remap"`` the
survivors take its super neurons over instead (:mod:`zpipe.coordinator.runs.lossy_remap`)
and the report lists each switch (``remaps``).

At the end, as every run kind does (:func:`zpipe.coordinator.runs.base.stage_metrics`),
the report carries every live stage's counters (``metrics``) and the coordinator
records ``run_done`` (or ``run_failed``) in its event list.

Another client's run in flight is not replaced: the request is refused with
``run_failed`` naming it (:mod:`zpipe.coordinator.one_run`); the client whose run
is current may replace its own.

A coordinator restart: the run's progress lives in this flow and in the stages, not
on disk, but the client's request fixes the whole run (its seed decides every
drop). The client sends it again when its connection is made again; a coordinator
still running it shares the answer being made (``request_id``), a restarted one runs
it from the start, and the stages drop the old run at the new one's set-up and its
late partials by run id and epoch, which are saved before any stage hears them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from zpipe._errors import (
    ConfigError,
    PipelineError,
    ProtocolError,
    RunRefusedError,
    TransportTimeout,
    ZpipeError,
)
from zpipe.coordinator.commands import (
    AwaitReplies,
    AwaitStages,
    Command,
    Log,
    Persist,
    PlanLossy,
    Record,
    Send,
)
from zpipe.coordinator.flows import Flow
from zpipe.coordinator.membership import Member, MemberState
from zpipe.coordinator.one_run import blocking, refusal, refused_text
from zpipe.coordinator.registration import printable
from zpipe.coordinator.runs.base import stage_metrics
from zpipe.coordinator.runs.lossy_probe import measure_links
from zpipe.coordinator.runs.lossy_remap import ON_DEATH, RemapRun, results_remapping
from zpipe.coordinator.state import CLIENT_NAME, ControlState, LossyInFlight
from zpipe.lossy.cnn import CnnSpec, part_shapes
from zpipe.lossy.engine import shard_params
from zpipe.lossy.partial import FloatArray
from zpipe.lossy.partition import Allocation
from zpipe.lossy.shard import Topology
from zpipe.lossy.wire import RunSpec, cnn_from_map, to_array, to_tensor
from zpipe.protocol.client_control import RunFailed
from zpipe.protocol.lossy import (
    LossyDead,
    LossyGo,
    LossyReady,
    LossyResult,
    LossyRunReport,
    LossyRunRequest,
    LossyRunSpecMap,
    LossySetup,
)


def start_lossy_run(
    state: ControlState,
    routing_id: bytes,
    request: LossyRunRequest,
    now: float,
) -> list[Command]:
    """Answer a ``lossy_run_request``: ``lossy_run_report`` once every stage's result
    is in, or ``run_failed``. A request sent again with the same ``request_id`` (its
    client reconnected) shares the answer being made; one that reaches a restarted
    coordinator runs the whole run again (see the module docstring)."""
    if request.request_id is None:
        return state.flows.start(lossy_run_request(state, routing_id, request), now)
    return state.answers.answer(
        state.flows,
        ("lossy_run_request", request.request_id, 0),
        routing_id,
        lambda: lossy_answer(state, routing_id, request),
        peer=CLIENT_NAME,
        timeout_s=state.timeouts.reply_s,
        now=now,
    )


def lossy_run_request(state: ControlState, routing_id: bytes, request: LossyRunRequest) -> Flow:
    """The run, its answer sent to ``routing_id``."""
    answer = yield from lossy_answer(state, routing_id, request)
    yield Send(routing_id, answer, CLIENT_NAME, state.timeouts.reply_s)


def lossy_answer(state: ControlState, routing_id: bytes, request: LossyRunRequest) -> Flow:
    """The run; returns its ``lossy_run_report``, or ``run_failed`` (``in_flight``: it
    did not start, another client's run being in flight)."""
    refused = yield from refusal(state, routing_id)
    if refused is not None:
        return refused
    try:
        report: LossyRunReport = yield from _ran(state, routing_id, request)
    except RunRefusedError as exc:  # another client's run started while this waited
        yield Log("warning", "run_refused", {"in_flight": exc.run, "client": printable(routing_id)})
        return RunFailed(error=str(exc), in_flight=exc.run)
    except Exception as exc:  # whatever it was, the client hears that its run failed
        if not isinstance(exc, (ZpipeError, ValueError)):
            yield Log("error", "lossy_run_crashed", {"error": repr(exc)})
        yield Log("error", "run_failed", {"error": str(exc)})
        yield Record({"event": "run_failed", "kind": "lossy", "error": str(exc)})
        return RunFailed(error=str(exc))
    return report


def _ran(state: ControlState, routing_id: bytes, request: LossyRunRequest) -> Flow:
    """:func:`_run`, this client's lossy run no longer in flight however it ends."""
    try:
        return (yield from _run(state, routing_id, request))
    finally:
        flight = state.lossy_in_flight
        if flight is not None and flight.client == routing_id:
            state.lossy_in_flight = None


def _run(state: ControlState, routing_id: bytes, request: LossyRunRequest) -> Flow:
    sizes = [_positive_int(n, "layer size") for n in request.layer_sizes]
    if len(sizes) < 2:
        raise ConfigError(f"a lossy run needs at least 2 layers, got {sizes}")
    asked = LossyRunSpecMap.from_map(request.spec)  # the run spec less its allocation
    cnn = None if asked.cnn is None else cnn_from_map(asked.cnn)
    conv_devices = 0 if asked.conv_devices is None else asked.conv_devices
    params, inputs, labels, x_test = _tensors(request, sizes, cnn, testing=asked.test is not None)
    members: list[Member] = yield AwaitStages(
        None if request.stage_names is None else tuple(str(n) for n in request.stage_names),
        request.stages,
        float(request.wait_for_stages_s),
    )
    n = len(members)
    on_death = "null-fill" if request.on_death is None else str(request.on_death)
    if on_death not in ON_DEATH:
        raise ConfigError(f"on_death must be one of {ON_DEATH}, got {request.on_death!r}")
    if on_death == "remap" and asked.mode != "emulated":
        # deadline mode cuts by the clock: a hold would make the survivors miss theirs
        raise ConfigError("on_death='remap' needs the emulated wait mode")
    if on_death == "remap" and cnn is not None:
        # a convolution layer lives whole on one device: no survivor can take a slice of it
        raise ConfigError("on_death='remap' re-maps dense super neurons: not with a CNN")
    replica_every = request.replica_every
    if replica_every is not None and (isinstance(replica_every, bool) or replica_every < 1):
        raise ConfigError(f"replica_every must be a positive integer, got {replica_every!r}")
    seed = asked.seed
    measured: FloatArray | None = None
    if request.probes is None:
        try:
            prr_measured = np.asarray(request.prr_measured, dtype=np.float64)
        except (TypeError, ValueError):
            raise ConfigError("prr_measured must be a square matrix of numbers") from None
        if prr_measured.shape != (n, n):
            raise ConfigError(f"prr_measured is {prr_measured.shape}, the run has {n} stages")
    else:
        # the measurement takes the stages' data sockets
        yield from _replace_current(state, routing_id)
        probe_run, probe_epoch = state.next_run(), state.next_epoch()
        yield Persist()  # as the run's own ids below
        prr_measured = measured = yield from measure_links(
            state,
            members,
            prr=asked.prr,
            seed=seed,
            probes=request.probes,
            run=probe_run,
            epoch=probe_epoch,
        )
        yield Log("info", "lossy_links_measured", {"prr": measured.round(3).tolist()})
    # the genetic search takes a while: off the event loop
    alloc: Allocation = yield PlanLossy(
        tuple(sizes),
        request.allocation,
        n,
        prr_measured,
        request.mapping,
        seed,
        cnn=cnn,
        conv_devices=conv_devices,
    )
    # the request's spec with its mapping, less what only the coordinator's partition reads
    spec = RunSpec.from_body(replace(asked, alloc=alloc.to_dict(), conv_devices=None).body())
    if inputs.shape != (spec.n_data, spec.batch, sizes[0]) or labels.shape != inputs.shape[:2]:
        raise ConfigError(
            f"inputs {inputs.shape} and labels {labels.shape} do not fit n_data "
            f"{spec.n_data}, batch {spec.batch} and {sizes[0]} input neurons"
        )
    n_test = None if spec.test is None else spec.test.n_test
    if x_test is not None and x_test.shape != (n_test, sizes[0]):
        raise ConfigError(f"test inputs {x_test.shape} do not fit {n_test} rows of {sizes[0]}")
    yield from _replace_current(state, routing_id)
    run, epoch = state.next_run(), state.next_epoch()
    state.lossy_in_flight = LossyInFlight(run, routing_id)  # until it is answered
    # saved before any stage hears them: a restarted coordinator numbers its runs past
    # this one, so the stages tell this run's late partials from the next one's
    yield Persist()
    yield Log("info", "lossy_run_planned", {"run": run, "epoch": epoch, "alloc": alloc.to_dict()})
    topo = Topology(alloc)
    devices = sorted(set(alloc.device_of))
    taking_part = {d: members[d] for d in devices}
    peers = {str(d): m.data_endpoint for d, m in taking_part.items()}
    names = {str(d): m.name for d, m in taking_part.items()}
    keys = {str(d): k for d, m in taking_part.items() if (k := state.key_of(m.name)) is not None}
    for d, member in taking_part.items():
        weights = shard_params(topo, params, d)
        layers = sorted(weights)
        tensors = [to_tensor(a) for layer in layers for a in weights[layer]]
        owns_input = topo.slice_of(0, d) is not None
        owns_output = topo.slice_of(topo.last, d) is not None
        if owns_input:
            tensors.append(to_tensor(inputs))
            if x_test is not None:  # after the training inputs: the test passes' rows
                tensors.append(to_tensor(x_test))
        if owns_output:
            tensors.append(to_tensor(labels))
        setup = LossySetup(
            run=run,
            device=d,
            spec=spec.to_body(),
            peers=peers,
            layers=layers,
            inputs=owns_input,
            labels=owns_output,
            names=names,
            keys=keys or None,
            # replicas serve only a remap
            replica_every=replica_every if on_death == "remap" else None,
            tensors=tuple(tensors),
            epoch=epoch,
        )
        yield Send(member.routing_id, setup, member.name, stage=member.name)
    stage_names = tuple(m.name for m in taking_part.values())
    reply_s = state.timeouts.reply_s
    ready: dict[str, LossyReady] = yield AwaitReplies(
        stage_names, LossyReady, reply_s, "lossy_ready", run=run
    )
    refused = {name: r.error for name, r in ready.items() if r.error}
    if refused:
        raise PipelineError(f"stages refused the lossy run: {refused}")
    start_in_s = 0.0 if request.start_in_s is None else float(request.start_in_s)
    for member in taking_part.values():
        go = LossyGo(run=run, start_at=0.0, start_in_s=start_in_s, epoch=epoch)
        yield Send(member.routing_id, go, member.name, stage=member.name)
    if on_death == "remap":
        remap = RemapRun(run, epoch, spec.n_data, prr_measured, params, inputs, labels, x_test,
                         alloc)  # fmt: skip
        results = yield from results_remapping(
            state, remap, dict(taking_part), float(request.result_s)
        )
        remaps = remap.remaps
    else:
        results = yield from _results_null_filling(state, run, epoch, taking_part, request)
        remaps = []
    dead = {d: m for d, m in taking_part.items() if m.name not in results}
    silent = [m.name for m in dead.values() if not _declared_dead(state, m.name)]
    if silent:
        raise TransportTimeout(", ".join(silent), "lossy_result", float(request.result_s))
    if not results:
        raise PipelineError("every stage of the lossy run died")
    failed = {name: r.error for name, r in results.items() if r.error}
    if failed:
        raise PipelineError(f"stages failed the lossy run: {failed}")
    # the run-end counters every run kind reports (zpipe.coordinator.runs.base.stage_metrics)
    metrics, _ = yield from stage_metrics(state, sorted(results), run, epoch)
    done = {
        "run": run,
        "kind": "lossy",
        "stages": sorted(results),
        "dead": sorted(m.name for m in dead.values()),
        "remapped": [[d, name, switch_at] for d, name, switch_at, *_ in remaps],
        "wall_s": max((float(r.wall_s) for r in results.values()), default=0.0),
    }
    yield Log("info", "lossy_run_done", done)
    yield Record({"event": "run_done", **done})
    bodies: list[dict[str, Any]] = []
    out: list[torch.Tensor] = []
    for member in taking_part.values():
        if member.name in results:
            result = results[member.name]
            bodies.append(result.body())
            out.extend(result.tensors)
    return LossyRunReport(
        run=run,
        alloc=alloc.to_dict(),
        stages=[m.name for m in members],
        results=bodies,
        dead=[[d, m.name, _first_null_filled(results.values(), d)] for d, m in dead.items()]
        or None,
        measured=None if measured is None else measured.tolist(),
        remaps=remaps or None,
        metrics=metrics,
        tensors=tuple(out),
    )


def _results_null_filling(
    state: ControlState,
    run: int,
    epoch: int,
    taking_part: dict[int, Member],
    request: LossyRunRequest,
) -> Flow:
    # A stage declared dead during the run: the others hear it at once and null-fill its
    # partials from then on (EdgePipe's device malfunction case); the run goes on.
    notices = tuple(
        (
            member.name,
            tuple(
                Send(
                    other.routing_id,
                    LossyDead(run=run, device=d, epoch=epoch),
                    other.name,
                    stage=other.name,
                )
                for od, other in taking_part.items()
                if od != d
            ),
        )
        for d, member in taking_part.items()
    )
    results: dict[str, LossyResult] = yield AwaitReplies(
        tuple(m.name for m in taking_part.values()),
        LossyResult,
        float(request.result_s),
        "lossy_result",
        run=run,
        partial=True,
        on_lost=notices,
    )
    return results


def _replace_current(state: ControlState, routing_id: bytes) -> Flow:
    busy = blocking(state, routing_id)
    if busy is not None:  # admitted while this one waited for its stages
        raise RunRefusedError(busy, refused_text(busy))
    if state.current is not None:
        # this client's own run: its stages take the lossy run instead
        yield Log("warning", "run_replaced", {"previous": state.current.run.run})
        state.current = None
        yield Persist()


def _declared_dead(state: ControlState, name: str) -> bool:
    member = state.membership.get(name)
    return member is None or member.state is MemberState.DEAD


def _first_null_filled(results: Iterable[LossyResult], device: int) -> int | None:
    """The first mini-batch whose passes ran without ``device``'s partials, by the
    survivors' results (None: no survivor needed them after its death)."""
    firsts = []
    for result in results:
        first = (result.dead or {}).get(str(device))
        if isinstance(first, int) and not isinstance(first, bool):
            firsts.append(first)
    return min(firsts, default=None)


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{what} must be a positive integer, got {value!r}")
    return value


def _tensors(
    request: LossyRunRequest,
    sizes: Sequence[int],
    cnn: CnnSpec | None = None,
    *,
    testing: bool,
) -> tuple[list[tuple[FloatArray, FloatArray]], np.ndarray, np.ndarray, np.ndarray | None]:
    """The initial ``(W, b)`` per dense layer, the inputs, the labels and (``testing``:
    when the spec asks for test passes) the test inputs the request carries."""
    n_dense = len(sizes) - 1
    tensors = request.tensors
    want = 2 * n_dense + 2 + int(testing)
    if len(tensors) != want:
        raise ProtocolError(
            f"lossy_run_request: {len(tensors)} tensors, expected {want} (W and b of each "
            "dense layer, inputs, labels" + (", test inputs)" if testing else ")")
        )
    x_test = None
    if testing:
        x_test_t, tensors = tensors[-1], tensors[:-1]
        if x_test_t.dtype != torch.float64 or x_test_t.dim() != 2:
            raise ProtocolError("lossy_run_request: test inputs must be float64 (rows, features)")
        x_test = x_test_t.numpy()
    if cnn is not None and list(sizes) != cnn.layer_sizes:
        raise ConfigError(f"layer sizes {list(sizes)} are not the CNN's {cnn.layer_sizes}")
    params = []
    for k in range(n_dense):
        # a CNN's convolution layers travel as their kernels
        shape, b_shape = part_shapes(cnn, sizes, k + 1, sizes[k + 1])
        w = to_array(tensors[2 * k], shape=shape, dtype=torch.float64, what=f"W of layer {k + 2}")
        b = to_array(
            tensors[2 * k + 1],
            shape=b_shape,
            dtype=torch.float64,
            what=f"b of layer {k + 2}",
        )
        params.append((w, b))
    inputs, labels = tensors[-2], tensors[-1]
    if inputs.dtype != torch.float64 or inputs.dim() != 3:
        raise ProtocolError("lossy_run_request: inputs must be float64 (n_data, batch, features)")
    if labels.dtype != torch.int64 or labels.dim() != 2:
        raise ProtocolError("lossy_run_request: labels must be int64 (n_data, batch)")
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= sizes[-1]):
        raise ConfigError(f"labels must lie in [0, {sizes[-1]})")
    return params, inputs.numpy(), labels.numpy(), x_test
