"""Flows: a controller's multi-step conversations, written as generators, run without I/O.

A flow is a generator that yields commands (:mod:`zpipe.coordinator.commands`).
Plain commands are collected and the flow goes on at once; an ``Await`` suspends
it until the event that answers it, which :class:`FlowRunner` routes back::

    def start(self):
        members = yield AwaitStages(names, None, wait_s)     # the shell waits
        yield Send(...)                                       # collected
        replies = yield AwaitReplies(names, Ready, ...)       # stages' replies
        return

Nothing here awaits: ``FlowRunner`` methods take one event and return the
commands it caused, so a test drives a flow by feeding events, as h11's tests
feed bytes. An exception a flow does not catch ends that flow only; it is
logged, and the coordinator goes on serving.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

from zpipe._errors import ConfigError, TransportTimeout
from zpipe.config import Timeouts
from zpipe.coordinator.commands import (
    Await,
    AwaitReplies,
    Command,
    Log,
    Now,
    RunJob,
    Send,
    ShellJob,
    StartTimer,
)
from zpipe.protocol import WireMessage
from zpipe.transport.bulk import progress_deadline

# A flow may return a value to the flow that runs it with `yield from`.
Flow = Generator[Any, Any, Any]

# A request a stage neither answered nor made progress on goes again after this many
# heartbeat intervals (and never sooner than the floor): rare enough to cost nothing,
# soon enough that a request lost while a partition healed does not stall a run.
RESEND_INTERVALS = 5
RESEND_FLOOR_S = 2.0


# A waiting client hears that the state it awaits is moving at most this often.
PROGRESS_NOTICE_S = 2.0


def request_resend_s(timeouts: Timeouts) -> float:
    return max(RESEND_FLOOR_S, RESEND_INTERVALS * timeouts.heartbeat_interval_s)


@dataclass
class _Wait:
    flow: Flow
    request: AwaitReplies
    pending: set[str]
    started: float = 0.0
    replies: dict[str, WireMessage] = field(default_factory=dict)
    sent: float = 0.0  # when the requests last went out
    noticed: float = float("-inf")  # when on_progress last went out

    def next_timer(self, deadline: float) -> float:
        """When this wait next needs a look: its deadline, or the next resend."""
        resend_s = self.request.resend_s
        if resend_s is None or not self.request.requests:
            return deadline
        return min(deadline, self.sent + resend_s)


class FlowRunner:
    """Runs flows: starts them, and resumes each with the event its await named."""

    def __init__(self) -> None:
        self._next_tag = 1
        self._jobs: dict[int, Flow] = {}
        self._waits: dict[int, _Wait] = {}
        # when each stage last moved a chunk of bulk state (zpipe.coordinator.bulk)
        self._progress: dict[str, float] = {}
        self.now = 0.0

    @property
    def suspended(self) -> int:
        """Flows waiting now (for tests and logs)."""
        return len(self._jobs) + len(self._waits)

    def start(self, flow: Flow, now: float) -> list[Command]:
        self.now = now
        return self._advance(flow, None, None)

    # ----------------------------------------------------------------- events

    def job_done(self, tag: int, result: Any, now: float) -> list[Command]:
        self.now = now
        flow = self._jobs.pop(tag, None)
        return [] if flow is None else self._advance(flow, result, None)

    def job_failed(self, tag: int, error: Exception, now: float) -> list[Command]:
        self.now = now
        flow = self._jobs.pop(tag, None)
        return [] if flow is None else self._advance(flow, None, error)

    def reply(self, stage: str, message: WireMessage, now: float) -> list[Command] | None:
        """Route a stage's reply to the wait that asked for it; None if none did."""
        self.now = now
        for tag, wait in list(self._waits.items()):
            request = wait.request
            fail = request.fail
            failed = fail is not None and isinstance(message, fail)
            answers = failed or isinstance(message, request.reply)
            if stage not in wait.pending or not answers:
                continue
            # every reply a wait names a run for is of a kind that carries one
            if request.run is not None and getattr(message, "run", None) != request.run:
                continue
            if failed:
                del self._waits[tag]
                error = ConfigError(f"stage {stage!r}: {getattr(message, 'error', '')}")
                return self._advance(wait.flow, None, error)
            wait.pending.discard(stage)
            wait.replies[stage] = message
            if not wait.pending:
                del self._waits[tag]
                return self._advance(wait.flow, wait.replies, None)
            return []
        return None

    def stage_lost(self, stage: str, error: Exception, now: float) -> list[Command]:
        """``stage`` died (or cannot be reached): every wait on it ends now."""
        self.now = now
        out: list[Command] = []
        for tag, wait in list(self._waits.items()):
            if tag not in self._waits or stage not in wait.pending:
                continue
            for lost, commands in wait.request.on_lost:
                if lost == stage:
                    out += commands
            if wait.request.partial:
                wait.pending.discard(stage)
                if wait.pending and not wait.request.stop_on_lost:
                    continue
                del self._waits[tag]
                out += self._advance(wait.flow, wait.replies, None)
            else:
                del self._waits[tag]
                out += self._advance(wait.flow, None, error)
        return out

    def request_unsent(self, stage: str, error: Exception, now: float) -> list[Command]:
        """A request to ``stage`` could not leave (it is not connected right now: a
        link cut, a reconnect under way). A wait that asks again every ``resend_s``
        keeps waiting, so a stage that comes back answers the next request and one
        that does not is judged by the failure detector or the wait's deadline, not by
        one send; every other wait on ``stage`` ends as :meth:`stage_lost` ends it."""
        self.now = now
        resending = {
            tag
            for tag, wait in self._waits.items()
            if stage in wait.pending and wait.request.resend_s is not None and wait.request.requests
        }
        held = {tag: self._waits.pop(tag) for tag in resending}
        out = self.stage_lost(stage, error, now)
        self._waits.update(held)
        return out

    def progress(self, stage: str, now: float) -> list[Command]:
        """``stage`` moved part of a reply (a chunk of its weights, or of a backup to a
        peer): a wait on it gives up only ``timeout_s`` after its latest progress (see
        :meth:`timer`), and the waits that tell a client so send their notice."""
        self.now = now
        self._progress[stage] = now
        out: list[Command] = []
        for wait in self._waits.values():
            notice = wait.request.on_progress
            if notice is None or stage not in wait.pending:
                continue
            if now >= wait.noticed + PROGRESS_NOTICE_S:
                wait.noticed = now
                out.append(notice)
        return out

    def timer(self, tag: int, now: float) -> list[Command]:
        self.now = now
        wait = self._waits.get(tag)
        if wait is None:
            return []  # answered in time
        moved = [self._progress[n] for n in wait.pending if n in self._progress]
        deadline = progress_deadline(wait.started, wait.request.timeout_s, max(moved, default=None))
        if now < deadline:
            out = self._resend(wait, now)
            return [*out, StartTimer(tag, max(0.0, wait.next_timer(deadline) - now))]
        del self._waits[tag]
        if wait.request.partial:
            return self._advance(wait.flow, wait.replies, None)
        silent = ", ".join(n for n in wait.request.stages if n in wait.pending)
        error = TransportTimeout(silent, wait.request.awaited, wait.request.timeout_s)
        return self._advance(wait.flow, None, error)

    def _resend(self, wait: _Wait, now: float) -> list[Command]:
        """Ask again the stages that neither answered nor moved a chunk since the last
        asking (their request may have gone down a connection that was replaced)."""
        resend_s = wait.request.resend_s
        if resend_s is None or now < wait.sent + resend_s:
            return []
        last_sent, wait.sent = wait.sent, now
        return [
            send
            for send in wait.request.requests
            if send.stage in wait.pending and self._progress.get(send.stage, -1.0) < last_sent
        ]

    # ------------------------------------------------------------------ driver

    def _advance(self, flow: Flow, value: Any, error: Exception | None) -> list[Command]:
        out: list[Command] = []
        while True:
            try:
                item = flow.throw(error) if error is not None else flow.send(value)
            except StopIteration:
                return out
            except Exception as exc:  # a flow's bug ends that flow, not the coordinator
                out.append(Log("error", "flow_failed", {"error": repr(exc)}))
                return out
            value, error = None, None
            if isinstance(item, Now):
                value = self.now
            elif isinstance(item, AwaitReplies):
                if not item.stages:
                    value = {}
                    continue
                tag = self._tag()
                wait = _Wait(flow, item, set(item.stages), started=self.now, sent=self.now)
                self._waits[tag] = wait
                out.extend(item.requests)
                deadline = self.now + item.timeout_s
                out.append(StartTimer(tag, wait.next_timer(deadline) - self.now))
                return out
            elif isinstance(item, ShellJob):
                tag = self._tag()
                self._jobs[tag] = flow
                out.append(RunJob(tag, item))
                return out
            elif isinstance(item, Await):
                error = TypeError(f"unknown await {item!r}")
            else:
                out.append(item)

    def _tag(self) -> int:
        tag = self._next_tag
        self._next_tag += 1
        return tag


class Answers:
    """Client requests being answered, by (kind, run, step): a request the client sends
    again (it reconnected to a restarted coordinator) shares the answer being made.
    (A ``run_request`` has no run yet: its key holds the client's request id.)"""

    def __init__(self) -> None:
        self._waiting: dict[tuple[str, int | str, int], list[bytes]] = {}

    def pending(self, key: tuple[str, int | str, int]) -> bool:
        """Whether an answer to ``key`` is being made."""
        return key in self._waiting

    def answer(
        self,
        runner: FlowRunner,
        key: tuple[str, int | str, int],
        routing_id: bytes,
        make: Callable[[], Generator[Any, Any, WireMessage]],
        *,
        peer: str,
        timeout_s: float,
        now: float,
    ) -> list[Command]:
        """Start ``make()`` and send its answer to every requester of ``key``."""
        if key in self._waiting:
            if routing_id not in self._waiting[key]:  # one answer to each requester:
                # a second would be read as the answer to its next request
                self._waiting[key].append(routing_id)
            return []
        self._waiting[key] = [routing_id]

        def flow() -> Flow:
            try:
                answer = yield from make()
            finally:
                routes = self._waiting.pop(key, [])
            for route in routes:
                yield Send(route, answer, peer, timeout_s)

        return runner.start(flow(), now)
