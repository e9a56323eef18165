"""The embedded API of an EdgePipe (lossy) run on ordinary stages.

::

    async with PipelineClient(coordinator) as client:
        result = await run_lossy(client, prepared, data, stages=4)
        result.trace.losses, result.trace.params, result.alloc
        result.test_acc, result.test_acc_lossless, result.test.predictions

``prepared`` (:func:`zpipe.lossy.simulate.prepare_run`) fixes what the run's seed
fixes: the emulated links, the initial weights and every mini-batch's rows. The
client sends them with the run parameters (``lossy_run_request``); the
coordinator partitions and maps on the stages (:mod:`zpipe.coordinator.runs.lossy`)
and answers with every stage's result, which :func:`result_from_report` turns into
the :class:`~zpipe.lossy.trace.TrainingTrace` the in-process simulation
(:func:`zpipe.lossy.trace.train_in_process`) builds, so the two compare directly.

After training the stages run test-time inference under loss on their final weights
(:mod:`zpipe.lossy.evaluation`: each test mini-batch over the same seeded lossy
links); the result holds every output owner's predictions (``test``, the
:class:`~zpipe.lossy.trace.EvalTrace` that :func:`zpipe.lossy.trace.evaluate_in_process`
simulates), their accuracy and that of the same weights with nothing lost.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from zpipe._errors import ConfigError, PipelineError, ProtocolError, RunRefusedError
from zpipe.client.pipeline_client import PipelineClient
from zpipe.lossy.cnn import CnnSpec
from zpipe.lossy.data import Dataset
from zpipe.lossy.death_sim import DeviceDeath, heard_from_arrivals
from zpipe.lossy.evaluation import EvalSpec, eval_steps
from zpipe.lossy.linkmodes import WAIT_MODES
from zpipe.lossy.partial import FloatArray
from zpipe.lossy.partition import Allocation
from zpipe.lossy.schedule import total_timeslots
from zpipe.lossy.shard import Topology
from zpipe.lossy.simulate import PreparedRun, cnn_spec
from zpipe.lossy.trace import EvalTrace, TrainingTrace, evaluation_from_results, trace_from_results
from zpipe.lossy.wire import eval_body, to_tensor
from zpipe.protocol.client_control import RunFailed
from zpipe.protocol.lossy import LossyResult, LossyRunReport, LossyRunRequest

# What the stages' link measurement may add to a run (the coordinator's probe wait
# and its replies' deadlines, zpipe.coordinator.runs.lossy_probe).
LINK_MEASUREMENT_S = 60.0


@dataclass
class StagesLossyResult:
    """A lossy run on stages: its trace, and what only real processes have."""

    trace: TrainingTrace
    alloc: Allocation
    #: the stage name of each device index
    stages: list[str]
    #: per device: passes that ran with partials missing,
    #: ``[data, kind, key_layer, missing, deadline, proceeded]`` (deadline mode:
    #: wall-clock seconds; emulated mode: the stage's monotonic clock)
    waits: dict[int, list[list[Any]]] = field(default_factory=dict)
    #: partials that came after their pass had run, all devices
    late: int = 0
    #: malformed or foreign messages each device dropped during the run
    protocol_errors: dict[int, int] = field(default_factory=dict)
    #: partials of another run or plan epoch each device dropped since the run's set-up
    stale: dict[int, int] = field(default_factory=dict)
    wall_s: float = 0.0
    device_wall_s: dict[int, float] = field(default_factory=dict)
    #: devices declared dead during the run: device -> (its stage, the first mini-batch
    #: whose passes ran without its partials; None if none needed them after)
    dead: dict[int, tuple[str, int | None]] = field(default_factory=dict)
    #: the reception ratios the stages measured (``[src][dst]``), when asked (``probes``)
    measured_prr: FloatArray | None = None
    #: the test passes under loss on the final weights (None: not asked for)
    test: EvalTrace | None = None
    #: their accuracy (each output owner's view counting equally), and the final
    #: weights' with nothing lost (None: no test set)
    test_acc: float | None = None
    test_acc_lossless: float | None = None
    #: re-mapped deaths (``on_death="remap"``), in order: (device, its stage, the first
    #: mini-batch of the new allocation, that allocation, the mini-batch of the replica
    #: its neurons resumed from: None for the run's start)
    remaps: list[tuple[int, str, int, Allocation, int | None]] = field(default_factory=list)
    #: each stage's counters at the run's end, by stage name (as a run_report's stages)
    stage_metrics: dict[str, Any] = field(default_factory=dict)
    #: per device: what really crossed the wire (copies sent and lost, duplicates
    #: discarded, acknowledgements sent, lost, received and dropped; see
    #: zpipe.stage.executors.lossy_recovery.WireCounts)
    on_wire: dict[int, dict[str, int]] = field(default_factory=dict)
    #: ACK in the emulated wait mode, by sender and receiver: the promised
    #: acknowledgements awaited, overdue, not awaited (the receiver silent since an
    #: overdue one) and the silences ended (zpipe.lossy.ack_patience.AckWaitCounts)
    ack_waits: dict[int, dict[int, dict[str, int]]] = field(default_factory=dict)

    def wire_totals(self) -> dict[str, int]:
        """:attr:`on_wire` summed over the devices."""
        totals: dict[str, int] = {}
        for counts in self.on_wire.values():
            for key, value in counts.items():
                totals[key] = totals.get(key, 0) + value
        return totals

    def death(self, n_data: int) -> DeviceDeath | None:
        """The run's death as :func:`zpipe.lossy.death_sim.train_with_death` simulates it
        (None: nobody died): which of the dead device's partials each survivor used (by
        the arrivals) and, if re-mapped, where the allocation switched. ``n_data``: the
        run's mini-batches. One death only."""
        if not self.dead:
            return None
        if len(self.dead) > 1 or len(self.remaps) > 1:
            raise ConfigError("the simulation plays one death per run")
        (device,) = self.dead
        heard = heard_from_arrivals(self.alloc, n_data, device, self.trace.arrivals)
        if not self.remaps:
            return DeviceDeath(device, heard)
        _, _, switch_at, after, replica_step = self.remaps[0]
        return DeviceDeath(device, heard, switch_at, after, replica_step)


def lossy_request(
    prepared: PreparedRun,
    data: Dataset,
    *,
    stages: int | None = None,
    stage_names: Sequence[str] | None = None,
    prr_measured: FloatArray | None = None,
    mode: str = "emulated",
    slot_s: float = 0.1,
    wait_s: float = 30.0,
    wait_for_stages_s: float = 30.0,
    result_s: float = 120.0,
    start_in_s: float = 0.05,
    probes: int | None = None,
    test_repeats: int | None = 1,
    test_eval_index: int = 0,
    on_death: str = "null-fill",
    request_id: int | None = None,
    replica_every: int | None = None,
) -> LossyRunRequest:
    """The ``lossy_run_request`` of ``prepared`` (pure).

    ``prr_measured``: the reception ratios the coordinator maps on (default: the
    prepared run's simulated 50-probe measurement, which its allocation was mapped
    on); the emulated loss uses the topology's true ratios, as the simulation does.
    ``probes``: have the stages measure their links with this many probes each
    (EdgePipe: 50) and map on that instead (the result's ``measured_prr``; the same
    run simulated: ``prepare_run(cfg, data, measured=result.measured_prr)``).
    ``test_repeats``: passes over the test set under loss after training (None or no
    test rows: none), keyed as evaluation point ``test_eval_index`` (the simulation's
    final one: :func:`zpipe.lossy.simulate.final_eval_index`).
    """
    if mode not in WAIT_MODES:
        raise ConfigError(f"wait mode must be one of {WAIT_MODES}, got {mode!r}")
    if not slot_s > 0 or not wait_s > 0 or not result_s > 0 or not start_in_s >= 0:
        raise ConfigError("slot_s, wait_s and result_s must be positive, start_in_s not negative")
    cfg = prepared.config
    n = prepared.topology.prr.shape[0]
    if stage_names is None and stages is None:
        stages = n
    measured = prepared.topology.prr_measured if prr_measured is None else prr_measured
    test = test_spec(prepared, data, test_repeats, test_eval_index)
    if mode == "deadline":
        # every timeslot of the run must fit in the wait for its results (a test pass
        # takes a timeslot per layer and one to share the logits)
        n_slots = total_timeslots(prepared.alloc, prepared.n_data)
        if test is not None:
            n_slots += len(eval_steps(test)) * (prepared.alloc.n_layers + 1)
        result_s += n_slots * slot_s
    batches = [prepared.batch(data, i) for i in range(1, prepared.n_data + 1)]
    inputs = np.stack([x for x, _ in batches]).astype(np.float64)
    labels = np.stack([y for _, y in batches]).astype(np.int64)
    tensors = [to_tensor(np.asarray(a, dtype=np.float64)) for wb in prepared.params for a in wb]
    tensors += [to_tensor(inputs), to_tensor(labels)]
    if test is not None:
        tensors.append(to_tensor(np.asarray(data.x_test, dtype=np.float64)))
    request = LossyRunRequest(
        layer_sizes=list(prepared.layer_sizes),
        allocation=cfg.allocation,
        mapping=cfg.mapping,
        prr_measured=[[float(v) for v in row] for row in measured],
        spec={
            "prr": [[float(v) for v in row] for row in prepared.topology.prr],
            "seed": cfg.seed,
            "recovery": {
                "scheme": cfg.recovery.scheme,
                "copies": cfg.recovery.copies,
                "max_attempts": cfg.recovery.max_attempts,
            },
            "lossless": prepared.lossless,
            "lr": cfg.lr,
            "n_data": prepared.n_data,
            "batch": cfg.batch_size,
            "mode": mode,
            "slot_s": slot_s,
            "wait_s": wait_s,
            **({} if test is None else {"test": eval_body(test)}),
            **_cnn_body(prepared),
        },
        stages=stages,
        stage_names=None if stage_names is None else list(stage_names),
        wait_for_stages_s=wait_for_stages_s,
        result_s=result_s,
        start_in_s=start_in_s,
        probes=probes,
        on_death=None if on_death == "null-fill" else on_death,
        request_id=request_id,
        replica_every=replica_every,
        tensors=tuple(tensors),
    )
    return request


def test_spec(
    prepared: PreparedRun, data: Dataset, repeats: int | None, eval_index: int = 0
) -> EvalSpec | None:
    """The test passes a run on stages makes (None: none asked for, or no test rows)."""
    if repeats is None or len(data.x_test) == 0:
        return None
    return EvalSpec(len(data.x_test), prepared.config.batch_size, repeats, eval_index)


def _cnn_body(prepared: PreparedRun) -> dict[str, Any]:
    """A CNN run's spec fields: the network the stages build (``cnn``) and the devices
    its convolution layers get (``conv_devices``, for the coordinator's partition)."""
    cnn = run_cnn(prepared)
    if cnn is None:
        return {}
    return {"cnn": cnn.to_dict(), "conv_devices": prepared.config.conv_devices}


def run_cnn(prepared: PreparedRun) -> CnnSpec | None:
    """The CNN a prepared run trains (None: an MLP)."""
    if prepared.config.model != "cnn":
        return None
    return cnn_spec(prepared.config, prepared.layer_sizes)


def result_from_report(
    parsed: LossyRunReport,
    *,
    wall_s: float = 0.0,
    test: EvalSpec | None = None,
    cnn: CnnSpec | None = None,
) -> StagesLossyResult:
    """A ``lossy_run_report`` as traces (pure); :class:`ProtocolError` if it does not fit.
    ``test``: the test passes the request asked for; ``cnn``: the run's CNN."""
    alloc = Allocation.from_dict(parsed.alloc)
    remaps = _remaps(parsed.remaps, alloc)
    # the results hold the slices of the last allocation the run switched to
    topo = Topology(remaps[-1][3] if remaps else alloc)
    results: dict[int, LossyResult] = {r.device: r for r in parsed.device_results()}
    dead = _dead_devices(parsed.dead, Topology(alloc))
    tests = {d: m.test for d, m in results.items() if m.test is not None}
    if test is not None and len(tests) != len(results):
        raise ProtocolError("lossy_run_report: a stage's result lacks its test passes")
    return StagesLossyResult(
        trace=trace_from_results(topo, results, dead=dead.keys(), cnn=cnn),
        alloc=alloc,
        stages=[str(s) for s in parsed.stages],
        waits={d: list(m.waits) for d, m in results.items()},
        late=sum(m.late for m in results.values()),
        protocol_errors={d: m.protocol_errors for d, m in results.items()},
        stale={d: m.stale or 0 for d, m in results.items()},
        wall_s=wall_s,
        device_wall_s={d: float(m.wall_s) for d, m in results.items()},
        dead=dead,
        measured_prr=_measured(parsed.measured, len(parsed.stages)),
        test=None if test is None else evaluation_from_results(topo, test, tests),
        remaps=remaps,
        stage_metrics=dict(parsed.metrics or {}),
        on_wire={d: _counts(m.on_wire) for d, m in results.items()},
        ack_waits={d: _ack_waits(m.ack_waits) for d, m in results.items()},
    )


def _counts(body: Any) -> dict[str, int]:
    """A result's ``on_wire``: counter -> count (empty from a stage that sent none)."""
    if body is None:
        return {}
    if not isinstance(body, dict) or not all(
        isinstance(k, str) and isinstance(v, int) for k, v in body.items()
    ):
        raise ProtocolError("lossy_result: on_wire must map counters to counts")
    return dict(body)


def _ack_waits(body: Any) -> dict[int, dict[str, int]]:
    """A result's ``ack_waits``: receiver -> counter -> count (empty if none)."""
    if body is None:
        return {}
    if not isinstance(body, dict):
        raise ProtocolError("lossy_result: ack_waits must map receivers to counts")
    out: dict[int, dict[str, int]] = {}
    for receiver, counts in body.items():
        try:
            out[int(receiver)] = _counts(counts)
        except (TypeError, ValueError, ProtocolError):
            raise ProtocolError(
                f"lossy_result: ack_waits of {receiver!r} must map counters to counts"
            ) from None
    return out


def _remaps(body: Any, alloc: Allocation) -> list[tuple[int, str, int, Allocation, int | None]]:
    """``lossy_run_report``'s ``remaps``: ``[[device, stage, switch_at, alloc, replica
    step], ...]``."""
    out: list[tuple[int, str, int, Allocation, int | None]] = []
    for entry in body or []:
        if not isinstance(entry, list) or len(entry) != 5:
            raise ProtocolError(
                "lossy_run_report: remaps must list [device, stage, step, alloc, replica]"
            )
        device, stage, switch_at, after, replica = entry
        ints = all(isinstance(v, int) for v in (device, switch_at))
        if not (ints and isinstance(stage, str) and (replica is None or isinstance(replica, int))):
            raise ProtocolError(f"lossy_run_report: bad remap {entry[:3]!r}")
        try:
            new = Allocation.from_dict(after)
        except ConfigError as exc:
            raise ProtocolError(f"lossy_run_report: remap allocation: {exc}") from None
        if new.layer_sizes != alloc.layer_sizes:
            raise ProtocolError("lossy_run_report: a remap changed the network")
        out.append((device, stage, switch_at, new, replica))
    return out


def _measured(body: Any, n: int) -> FloatArray | None:
    if body is None:
        return None
    try:
        measured = np.asarray(body, dtype=np.float64)
    except (TypeError, ValueError):
        raise ProtocolError("lossy_run_report: measured must be a matrix of numbers") from None
    if measured.ndim != 2 or measured.shape[0] != measured.shape[1] or measured.shape[0] > n:
        raise ProtocolError(f"lossy_run_report: measured is {measured.shape}")
    return measured


def _dead_devices(body: Any, topo: Topology) -> dict[int, tuple[str, int | None]]:
    """``lossy_run_report``'s ``dead``: ``[[device, stage, first mini-batch], ...]``."""
    out: dict[int, tuple[str, int | None]] = {}
    for entry in body or []:
        if not isinstance(entry, list) or len(entry) != 3:
            raise ProtocolError("lossy_run_report: dead must list [device, stage, step]")
        device, stage, first = entry
        ints = isinstance(device, int) and (first is None or isinstance(first, int))
        if not ints or not isinstance(stage, str) or device not in topo.alloc.device_of:
            raise ProtocolError(f"lossy_run_report: bad dead device {entry!r}")
        out[device] = (stage, first)
    return out


async def run_lossy(
    client: PipelineClient, prepared: PreparedRun, data: Dataset, **options: Any
) -> StagesLossyResult:
    """Train ``prepared`` on the coordinator's stages (``options``: :func:`lossy_request`'s)."""
    # The coordinator may be restarted while the run goes on: the request then goes again
    # (the same id: a coordinator that still runs it shares its answer; a restarted
    # one, which lost the run with its memory, runs it again from the start).
    request = lossy_request(prepared, data, request_id=secrets.randbits(62), **options)
    started = time.perf_counter()
    # the coordinator answers once every stage's result is in: its waits, and a margin
    timeout_s = (
        float(request.wait_for_stages_s) + float(request.result_s) + 2 * client.timeouts.reply_s
    )
    if request.probes is not None:
        timeout_s += LINK_MEASUREMENT_S
    answer = await client.connection.control.ask(
        request,
        expect=(LossyRunReport, RunFailed),
        timeout_s=timeout_s,
        awaited="lossy run report",
        resend_on_reconnect=True,
    )
    if isinstance(answer, RunFailed):
        if answer.in_flight is not None:  # another client's run: nothing was started
            raise RunRefusedError(
                answer.in_flight, f"the lossy run was not started: {answer.error}"
            )
        raise PipelineError(f"the lossy run failed: {answer.error}")
    assert isinstance(answer, LossyRunReport)
    test = test_spec(
        prepared, data, options.get("test_repeats", 1), options.get("test_eval_index", 0)
    )
    cnn = run_cnn(prepared)
    result = result_from_report(answer, wall_s=time.perf_counter() - started, test=test, cnn=cnn)
    if test is not None and result.test is not None:
        result.test_acc = result.test.accuracy(data.y_test)
    if len(data.x_test):
        result.test_acc_lossless = result.trace.test_accuracy(data, cnn)
    return result
