"""The link measurement a lossy run can ask for before it is mapped (EdgePipe: 50
probes per link), as a sub-flow of :mod:`zpipe.coordinator.runs.lossy`.

    lossy_probe_request to every stage ─> every lossy_ready ─> lossy_go ─>
    every lossy_probe_report ─> the measured matrix (received / sent, [src][dst])

Each stage sends its probes to the others over its data socket
(:mod:`zpipe.stage.executors.lossy_probes`), so the matrix is measured between the stages
themselves; the coordinator carries control only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from zpipe._errors import ConfigError, PipelineError, ProtocolError
from zpipe.coordinator.commands import AwaitReplies, Send
from zpipe.coordinator.flows import Flow
from zpipe.coordinator.membership import Member
from zpipe.coordinator.state import ControlState
from zpipe.lossy.partial import FloatArray
from zpipe.protocol.lossy import LossyGo, LossyProbeReport, LossyProbeRequest, LossyReady

#: EdgePipe measures each link with 50 packets
PROBES_PER_LINK = 50
# How long a stage waits for its peers' probes once it has sent its own.
PROBE_WAIT_S = 30.0


def measure_links(
    state: ControlState,
    members: Sequence[Member],
    *,
    prr: Any,
    seed: int,
    probes: int,
    run: int,
    epoch: int,
) -> Flow:
    """Have ``members`` (device ``k`` is ``members[k]``) probe each other; returns the
    measured reception ratios, 1 on the diagonal. ``prr``: the links' true ratios
    (the run spec's): each stage's emulated links drop its probes by the keyed decision
    they drop its partials by."""
    n = len(members)
    try:
        true_prr = np.asarray(prr, dtype=np.float64)
    except (TypeError, ValueError):
        raise ConfigError("the run spec's prr must be a square matrix of numbers") from None
    if true_prr.shape != (n, n):
        raise ConfigError(f"the run spec's prr is {true_prr.shape}, the run has {n} stages")
    if isinstance(probes, bool) or not isinstance(probes, int) or not 1 <= probes <= 10_000:
        raise ConfigError(f"probes per link must be in 1..10000, got {probes!r}")
    names = {str(d): m.name for d, m in enumerate(members)}
    keys = {str(d): k for d, m in enumerate(members) if (k := state.key_of(m.name)) is not None}
    peers = {str(d): m.data_endpoint for d, m in enumerate(members)}
    for d, member in enumerate(members):
        request = LossyProbeRequest(
            run=run,
            seed=seed,
            count=probes,
            prr=true_prr.tolist(),
            peers=peers,
            timeout_s=PROBE_WAIT_S,
            device=d,
            names=names,
            keys=keys or None,
            epoch=epoch,
        )
        yield Send(member.routing_id, request, member.name, stage=member.name)
    stage_names = tuple(m.name for m in members)
    reply_s = state.timeouts.reply_s
    ready: dict[str, LossyReady] = yield AwaitReplies(
        stage_names, LossyReady, reply_s, "lossy_ready", run=run
    )
    refused = {name: r.error for name, r in ready.items() if r.error}
    if refused:
        raise PipelineError(f"stages refused to measure their links: {refused}")
    for member in members:
        go = LossyGo(run=run, start_at=0.0, start_in_s=0.0, epoch=epoch)
        yield Send(member.routing_id, go, member.name, stage=member.name)
    reports: dict[str, LossyProbeReport] = yield AwaitReplies(
        stage_names,
        LossyProbeReport,
        PROBE_WAIT_S + 2 * reply_s,
        "lossy_probe_report",
        run=run,
    )
    return measured_matrix([reports[m.name] for m in members])


def measured_matrix(reports: Sequence[LossyProbeReport]) -> FloatArray:
    """``received / sent`` per link from each device's ``lossy_probe_report`` (device
    ``k``'s report is ``reports[k]``): ``[src][dst]``, 1 on the diagonal."""
    n = len(reports)
    measured = np.eye(n)
    for dst, report in enumerate(reports):
        if report.error:
            raise PipelineError(f"device {dst} could not measure its links: {report.error}")
        received, sent = report.received, report.sent
        if set(received) != {str(d) for d in range(n) if d != dst} or set(sent) != set(received):
            raise ProtocolError(f"lossy_probe_report from device {dst}: not one count per peer")
        for key, got in received.items():
            tried = sent[key]
            counts_ok = all(isinstance(v, int) and not isinstance(v, bool) for v in (got, tried))
            if not counts_ok or not 0 <= got <= tried or tried < 1:
                raise ProtocolError(f"lossy_probe_report from device {dst}: bad counts")
            measured[int(key), dst] = got / tried
    return measured
