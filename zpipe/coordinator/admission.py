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

Pure: commands out, as the core's other parts.
"""

from __future__ import annotations

from zpipe.coordinator.commands import Command, Log, Send
from zpipe.coordinator.flows import Flow
from zpipe.coordinator.registration import printable
from zpipe.coordinator.starting import run_request
from zpipe.coordinator.state import CLIENT_NAME, ControlState
from zpipe.protocol.client_control import RunFailed, RunRequest

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
    if request_id is not None and state.answers.pending(key):
        log = Log("info", "run_request_repeated", {"request": request_id, "stands": "admitting"})
        return [log, *_answer(state, key, routing_id, user_key, request, now)]
    current = state.current
    if request_id is not None and current is not None and current.run.request_id == request_id:
        ready = current.run.ready
        if ready is not None:
            fields = {"request": request_id, "run": current.run.run, "stands": "ready"}
            return [
                Log("info", "run_request_repeated", fields),
                Send(routing_id, ready, CLIENT_NAME, reply_s),
            ]
    refused = _refusal(state, routing_id)
    if refused is not None:
        return refused
    if request_id is None:  # an older client's: never sent again, never a copy
        return state.flows.start(_send(state, routing_id, user_key, request), now)
    return _answer(state, key, routing_id, user_key, request, now)


def in_flight(state: ControlState) -> int | None:
    """The current run's id while it goes on (see the module notes), else None."""
    current = state.current
    if current is None:
        return None
    run = current.run
    if run.broken or state.answers.pending(("run_end", run.run, 0)):
        return None
    return run.run


def _refusal(state: ControlState, routing_id: bytes) -> list[Command] | None:
    """``run_failed`` for a request of another client while a run is in flight."""
    busy = in_flight(state)
    if busy is None or state.current is None or state.current.run.client == routing_id:
        return None
    error = (
        f"run {busy} of another client is in flight on this coordinator, which runs one "
        "run at a time: ask again once it ended, or end it (run_end) if its client is gone"
    )
    fields = {"in_flight": busy, "client": printable(routing_id)}
    return [
        Log("warning", "run_refused", fields),
        Send(
            routing_id, RunFailed(error=error, in_flight=busy), CLIENT_NAME, state.timeouts.reply_s
        ),
    ]


def _send(
    state: ControlState, routing_id: bytes, user_key: str | None, request: RunRequest
) -> Flow:
    answer = yield from run_request(state, routing_id, user_key, request)
    yield Send(routing_id, answer, CLIENT_NAME, state.timeouts.reply_s)


def _answer(
    state: ControlState,
    key: tuple[str, str, int],
    routing_id: bytes,
    user_key: str | None,
    request: RunRequest,
    now: float,
) -> list[Command]:
    return state.answers.answer(
        state.flows,
        key,
        routing_id,
        lambda: run_request(state, routing_id, user_key, request),
        peer=CLIENT_NAME,
        timeout_s=state.timeouts.reply_s,
        now=now,
    )
