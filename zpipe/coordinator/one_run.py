"""One run at a time: whether a client's request to start a run of any kind is refused
because another client's run is in flight. Pure.

Every way a run starts (``run_request``: :mod:`zpipe.coordinator.admission`;
``gen_run_request``: :mod:`zpipe.coordinator.runs.generation`; ``lossy_run_request``:
:mod:`zpipe.coordinator.runs.lossy`) asks :func:`refusal` first. The client whose
run is current may replace it (a resume, a re-balance, a retry); another client is
refused with ``run_failed`` naming the run in flight (its client raises
:class:`~zpipe.RunRefusedError`), unless that run's client is gone: then its run
ends (``run_abandoned``) and the request goes on. Generation and lossy starts used
to replace a run in flight silently (issue 33): its client learnt only at its next
request, its work lost. A lossy run, which has no controller as the current run,
is in flight from its stages' set-up to its answer (``state.lossy_in_flight``).
"""

from __future__ import annotations

from zpipe.coordinator.commands import Log, ReachClient, Record
from zpipe.coordinator.flows import Flow
from zpipe.coordinator.registration import printable
from zpipe.coordinator.state import ControlState
from zpipe.protocol.client_control import PRESENCE, Progress, RunFailed


def in_flight(state: ControlState) -> int | None:
    """The id of the run in flight, else None: the current run while it goes on (it
    is no longer in flight once it ended or its ``run_end`` is being answered, once a
    stage of it died with no re-plan under way, or once its client was found gone),
    else a lossy run set up and not yet answered."""
    flight = _in_flight(state)
    return None if flight is None else flight[0]


def _in_flight(state: ControlState) -> tuple[int, bytes] | None:
    """The run in flight and its client's route."""
    current = state.current
    if current is not None:
        run = current.run
        if not (run.broken or run.abandoned or state.answers.pending(("run_end", run.run, 0))):
            return run.run, run.client
    lossy = state.lossy_in_flight
    if lossy is not None and not lossy.abandoned:
        return lossy.run, lossy.client
    return None


def blocking(state: ControlState, routing_id: bytes) -> int | None:
    """The run in flight of another client than ``routing_id``'s, if one is."""
    flight = _in_flight(state)
    if flight is None or flight[1] == routing_id:
        return None
    return flight[0]


def refused_text(busy: int) -> str:
    """Why a request is refused while run ``busy`` of another client is in flight."""
    return (
        f"run {busy} of another client is in flight on this coordinator, which runs one "
        "run at a time: ask again once it ended, or end it if its client is gone "
        f"(python -m zpipe end-run --coordinator ENDPOINT {busy})"
    )


def refusal(state: ControlState, routing_id: bytes) -> Flow:
    """The ``run_failed`` for a request of ``routing_id``'s client to start a run while
    another client's run is in flight, or None when it may start. Before refusing,
    the coordinator looks whether that run's client is still connected (a harmless
    ``progress`` notice it drops): a client no longer connected has its run ended as
    ``run_end`` ends it, and the request may start."""
    flight = _in_flight(state)
    if flight is None or flight[1] == routing_id:
        return None
    busy, client = flight
    current, lossy = state.current, state.lossy_in_flight
    probe = Progress(run=busy, awaited=PRESENCE)
    reached = yield ReachClient(client, probe, state.timeouts.reply_s)
    if not reached and in_flight(state) == busy:
        fields = {"run": busy, "client": printable(client), "next": printable(routing_id)}
        if current is not None and state.current is current and current.run.run == busy:
            current.run.abandoned = True  # not in flight: a copy of the request is not refused
            yield Log("warning", "run_abandoned", fields)
            yield Record({"event": "run_abandoned", **fields})
            yield from current.end(busy)
        elif lossy is not None and state.lossy_in_flight is lossy:
            # its flow ends by itself (its answer goes nowhere); the next run's set-up
            # takes its stages
            lossy.abandoned = True
            yield Log("warning", "run_abandoned", fields)
            yield Record({"event": "run_abandoned", **fields})
    busy_now = blocking(state, routing_id)
    if busy_now is None:
        return None
    yield Log("warning", "run_refused", {"in_flight": busy_now, "client": printable(routing_id)})
    return RunFailed(error=refused_text(busy_now), in_flight=busy_now)
