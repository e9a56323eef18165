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

A coordinator holds one run at a time (:mod:`zpipe.coordinator.one_run`, which
every kind of run start asks). A new request of the client whose run is
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

from zpipe.coordinator.commands import Command, Log, Send
from zpipe.coordinator.flows import Flow
from zpipe.coordinator.one_run import refusal
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
    key = (REQUEST_KIND, request_id or "", 0)

    def make() -> Flow:
        return _admitted(state, routing_id, user_key, request)

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


def _admitted(
    state: ControlState, routing_id: bytes, user_key: str | None, request: RunRequest
) -> Flow:
    """``request``'s run, unless another client's run is in flight (then ``run_failed``)."""
    refused = yield from refusal(state, routing_id)
    if refused is not None:
        return refused
    return (yield from run_request(state, routing_id, user_key, request))


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
