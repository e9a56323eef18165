"""Admission: which ``run_request`` starts a run, and the answer to one sent again.

A client sends its ``run_request`` (and ``run_go``) again when it reconnects to
the coordinator while it waits for the answer: a coordinator restarted from its
state directory lost the request with its process, and a connection that broke
may have lost the answer. Each request carries the client's id for it, so the
coordinator answers it once:

- a request it is still answering (the same id): the answer goes to both;
- a request it answered (the current run's id): the same ``run_ready`` again;
- a request it does not know of (lost with a killed process: a run being
  admitted is saved as no run) is admitted fresh, under a new run id.

A coordinator holds one run at a time. A new request of the client whose run is
current replaces that run (a training run's resume or re-balance, a retry after
a failure); another client's request is refused (``run_failed`` naming the run in
flight) while that run goes on: it used to replace it silently, and the first
client learnt only at its next request ("run 4 is not the current run"), its
work lost. A run is no longer in flight once it ended (or its ``run_end`` is
being answered), or once a stage of it died with no re-plan under way.

A client SIGKILLed never sends its ``run_end``: its run would stay in flight for
ever, and every other client be refused. So before refusing, the coordinator
looks whether the run's client is still connected: it sends it a harmless
``progress`` notice (a client drops one it does not wait for), and the ROUTER
refuses a send to a connection that dropped (a killed process's drops at once).
A client not connected any more has its run ended as ``run_end`` ends it (logged
``run_abandoned``) and the request is admitted. A live client cut off from the
coordinator at that moment loses its run the same way: it hears so at its next
request ("run N is not the current run"), as it did before refusals.

Pure: commands out, as the core's other parts.
"""

from __future__ import annotations

from collections.abc import Callable

from zpipe.coordinator.commands import Command, Log, ReachClient, Record, Send
from zpipe.coordinator.flows import Flow
from zpipe.coordinator.registration import printable
from zpipe.coordinator.starting import run_request
from zpipe.coordinator.state import CLIENT_NAME, ControlState
from zpipe.protocol.client_control import PRESENCE, Progress, RunFailed, RunRequest

REQUEST_KIND = RunRequest.KIND


def admit(
    state: ControlState,
    routing_id: bytes,
    user_key: str | None,
    request: RunRequest,
    now: float,
) -> list[Command]:
    """Answer a client's ``run_request`` (see the module notes)."""
    reply_s = state.timeouts.reply_s
    request_id = request.request_id
    key = (REQUEST_KIND, request_id or "", 0)

    def make() -> Flow:
        busy = _blocking(state, routing_id)
        if busy is None:
            return run_request(state, routing_id, user_key, request)
        return _unless_gone(state, routing_id, user_key, request, busy)  # refused, unless

    if request_id is not None and state.answers.pending(key):
        log = Log("info", "run_request_repeated", {"request": request_id, "stands": "admitting"})
        return [log, *_answer(state, key, routing_id, make, now)]
    current = state.current
    if request_id is not None and current is not None and current.run.request_id == request_id:
        ready = current.run.ready
        if ready is not None:
            fields = {"request": request_id, "run": current.run.run, "stands": "ready"}
            return [
                Log("info", "run_request_repeated", fields),
                Send(routing_id, ready, CLIENT_NAME, reply_s),
            ]
    if request_id is None:  # an older client's: never sent again, never a copy
        return state.flows.start(_send(state, routing_id, make()), now)
    return _answer(state, key, routing_id, make, now)


def in_flight(state: ControlState) -> int | None:
    """The current run's id while it goes on (see the module notes), else None."""
    current = state.current
    if current is None:
        return None
    run = current.run
    if run.broken or run.abandoned or state.answers.pending(("run_end", run.run, 0)):
        return None
    return run.run


def _blocking(state: ControlState, routing_id: bytes) -> int | None:
    """The run in flight of another client than ``routing_id``'s, if one is."""
    busy = in_flight(state)
    if busy is None or state.current is None or state.current.run.client == routing_id:
        return None
    return busy


def _unless_gone(
    state: ControlState, routing_id: bytes, user_key: str | None, request: RunRequest, busy: int
) -> Flow:
    """Refuse ``request`` while run ``busy`` goes on, unless its client is gone: then
    that run ends (as ``run_end`` ends it) and ``request`` is admitted."""
    current = state.current
    run = current.run
    probe = Progress(run=busy, awaited=PRESENCE)
    reached = yield ReachClient(run.client, probe, state.timeouts.reply_s)
    if not reached and state.current is current and in_flight(state) == busy:
        run.abandoned = True  # not in flight: a copy of the request is not refused
        fields = {"run": busy, "client": printable(run.client), "next": printable(routing_id)}
        yield Log("warning", "run_abandoned", fields)
        yield Record({"event": "run_abandoned", **fields})
        yield from current.end(busy)
    busy_now = _blocking(state, routing_id)
    if busy_now is not None:
        return (yield from _refused(state, routing_id, busy_now))
    return (yield from run_request(state, routing_id, user_key, request))


def _refused(state: ControlState, routing_id: bytes, busy: int) -> Flow:
    """``run_failed`` for a request of another client while run ``busy`` is in flight."""
    error = (
        f"run {busy} of another client is in flight on this coordinator, which runs one "
        "run at a time: ask again once it ended, or end it if its client is gone "
        f"(python -m zpipe end-run --coordinator ENDPOINT {busy})"
    )
    yield Log("warning", "run_refused", {"in_flight": busy, "client": printable(routing_id)})
    return RunFailed(error=error, in_flight=busy)


def _send(state: ControlState, routing_id: bytes, answering: Flow) -> Flow:
    answer = yield from answering
    yield Send(routing_id, answer, CLIENT_NAME, state.timeouts.reply_s)


def _answer(
    state: ControlState,
    key: tuple[str, str, int],
    routing_id: bytes,
    make: Callable[[], Flow],
    now: float,
) -> list[Command]:
    return state.answers.answer(
        state.flows,
        key,
        routing_id,
        make,
        peer=CLIENT_NAME,
        timeout_s=state.timeouts.reply_s,
        now=now,
    )
