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

Pure: commands out, as the core's other parts.
"""

from __future__ import annotations

from zpipe.coordinator.commands import Command, Log, Send
from zpipe.coordinator.flows import Flow
from zpipe.coordinator.starting import run_request
from zpipe.coordinator.state import CLIENT_NAME, ControlState
from zpipe.protocol.client_control import RunRequest

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
    if request_id is None:  # an older client's: never sent again
        return state.flows.start(_send(state, routing_id, user_key, request), now)
    key = (REQUEST_KIND, request_id, 0)
    if state.answers.pending(key):
        log = Log("info", "run_request_repeated", {"request": request_id, "stands": "admitting"})
        return [log, *_answer(state, key, routing_id, user_key, request, now)]
    current = state.current
    if current is not None and current.run.request_id == request_id:
        ready = current.run.ready
        if ready is not None:
            fields = {"request": request_id, "run": current.run.run, "stands": "ready"}
            return [
                Log("info", "run_request_repeated", fields),
                Send(routing_id, ready, CLIENT_NAME, reply_s),
            ]
    return _answer(state, key, routing_id, user_key, request, now)


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
