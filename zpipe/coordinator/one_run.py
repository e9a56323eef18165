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
request, its work lost.
"""

from __future__ import annotations

from zpipe.coordinator.commands import Log, ReachClient, Record
from zpipe.coordinator.flows import Flow
from zpipe.coordinator.registration import printable
from zpipe.coordinator.state import ControlState
from zpipe.protocol.client_control import PRESENCE, Progress, RunFailed


def in_flight(state: ControlState) -> int | None:
    """The current run's id while it goes on, else None: a run is no longer in flight
    once it ended (or its ``run_end`` is being answered), or once a stage of it died
    with no re-plan under way, or once its client was found gone."""
    current = state.current
    if current is None:
        return None
    run = current.run
    if run.broken or run.abandoned or state.answers.pending(("run_end", run.run, 0)):
        return None
    return run.run


def blocking(state: ControlState, routing_id: bytes) -> int | None:
    """The run in flight of another client than ``routing_id``'s, if one is."""
    busy = in_flight(state)
    if busy is None or state.current is None or state.current.run.client == routing_id:
        return None
    return busy


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
    busy = blocking(state, routing_id)
    if busy is None:
        return None
    current = state.current
    assert current is not None  # blocking() found its run
    run = current.run
    probe = Progress(run=busy, awaited=PRESENCE)
    reached = yield ReachClient(run.client, probe, state.timeouts.reply_s)
    if not reached and state.current is current and in_flight(state) == busy:
        run.abandoned = True  # not in flight: a copy of the request is not refused
        fields = {"run": busy, "client": printable(run.client), "next": printable(routing_id)}
        yield Log("warning", "run_abandoned", fields)
        yield Record({"event": "run_abandoned", **fields})
        yield from current.end(busy)
    busy_now = blocking(state, routing_id)
    if busy_now is None:
        return None
    yield Log("warning", "run_refused", {"in_flight": busy_now, "client": printable(routing_id)})
    return RunFailed(error=refused_text(busy_now), in_flight=busy_now)
