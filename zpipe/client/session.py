"""One run's session with the coordinator and its sink, shared by inference and training.

The life of every run the client starts::

    request_run()   run_request  ->  run_ready | run_failed   (the plan, the endpoints)
      ... the run opens its data sockets; allow_sink_senders(last stages' keys) ...
    go()            run_go       ->  run_started | run_failed (the stages connected)
    watch(...)      three tasks: the sink's receive loop, the coordinator's failure
                    notices, the stall reports of the data source's deadline
      ... the run feeds its inputs (spawn) and awaits its results (race) ...
    close()         the tasks stop
    finish()        run_end      ->  run_report               (each stage's counters)

A failure of the run (a stage declared dead, a stage's error, a task that died)
goes to :meth:`fail` once; :meth:`race` raises it into whatever the run awaits,
so a dead task is a clear error, never a silent stall.

The sink's receive loop survives any exception one message causes: the message
is logged and dropped, the next one is read (a peer's poison frame cannot end
a stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import replace
from typing import Any, TypeVar

from zpipe._errors import (
    PipelineError,
    RemoteStageError,
    RunRefusedError,
    StageFailedError,
    TransportTimeout,
    ZpipeError,
)
from zpipe.client.connection import ClientConnection
from zpipe.client.failures import run_failed_error, stage_failed_error, stage_not_connected
from zpipe.log import get_logger
from zpipe.protocol import WireMessage
from zpipe.protocol.client_control import (
    RunEnd,
    RunFailed,
    RunGo,
    RunReady,
    RunReplanned,
    RunRequest,
    RunStarted,
    StageFailed,
)
from zpipe.protocol.client_control import RunReport as StagesReport
from zpipe.protocol.data_plane import MicroBatchError
from zpipe.recovery import DEFAULT_STALL_DEADLINE, DeadlinePolicy, StallWatch
from zpipe.transport.sockets import recv_frames

log = get_logger("zpipe.client")

T = TypeVar("T")
# How often a run_request refused because a chosen stage's connection was gone is
# asked again (each waits up to its wait_for_stages_s for the stage to be back).
NOT_CONNECTED_RETRIES = 2
# a check raises (ProtocolError) for a message that does not belong to the run; the
# sink's messages reach checks and handlers parsed into their protocol classes
SinkCheck = Callable[[WireMessage], None]
SinkHandler = Callable[[WireMessage], Awaitable[None]]
ReplanHandler = Callable[[RunReplanned], Awaitable[None]]


class RunSession:
    """One run: its handshake, its sink, its failure watch and stall reports."""

    def __init__(
        self,
        connection: ClientConnection,
        *,
        what: str,
        stall_deadline: DeadlinePolicy | None = None,
    ) -> None:
        self.connection = connection
        self.control = connection.control
        self.timeouts = connection.timeouts
        self.what = what  # "stream" or "training": names log events
        self.stall = StallWatch(stall_deadline or DEFAULT_STALL_DEADLINE)
        self.run = -1
        self.epoch = 0
        self.last_stage = ""
        self.stage_failure: StageFailedError | None = None
        self._stage_failed = asyncio.Event()
        self._failure: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()
        self._tasks: list[asyncio.Task[Any]] = []
        self._closing = False
        # stage name -> its timeline of the run (finish(timeline=True))
        self.timelines: dict[str, Any] = {}

    # ------------------------------------------------------------------ handshake

    async def request_run(
        self, request: RunRequest, *, wait_for_stages_s: float, doing: str
    ) -> RunReady:
        """``run_request`` -> ``run_ready``: the plan and where to send; ``doing`` names
        the run in the error of a refusal ("start the run")."""
        timeouts = self.timeouts
        retries = NOT_CONNECTED_RETRIES
        while True:
            # A fresh id for each request (a training run's resume is a new one): sent
            # again when the connection to the coordinator is made again (a coordinator
            # restarted during admission lost it), answered once (coordinator/admission.py).
            request = replace(request, request_id=uuid.uuid4().hex)
            reply = await self.control.ask(
                request,
                expect=(RunReady, RunFailed),
                timeout_s=wait_for_stages_s + timeouts.assign_s + timeouts.reply_s,
                awaited="run_ready",
                resend_on_reconnect=True,
            )
            if not isinstance(reply, RunFailed):
                break
            if reply.in_flight is not None:  # another client's run: nothing was started
                raise RunRefusedError(
                    reply.in_flight, f"the coordinator could not {doing}: {reply.error}"
                )
            gone = stage_not_connected(reply.error)
            if gone is None or retries == 0:
                raise run_failed_error(reply.error, doing)
            # The stage's process was gone when the run started (killed, not yet found
            # dead). The coordinator suspects it from that send on and plans no run onto
            # it: the request asked again waits for a live process under its name (a
            # restarted stage, or the old one reconnected) up to wait_for_stages_s.
            retries -= 1
            log.warning("run_request_retried", stage=gone, error=reply.error)
        assert isinstance(reply, RunReady)
        self.run = reply.run
        # ended at finish(); a run the client leaves (an error, an interrupt) is ended
        # when its connection closes, so that it does not hold the coordinator
        self.connection.open_run = reply.run
        self.epoch = reply.epoch
        self.last_stage = reply.last_stage
        return reply

    def allow_sink_senders(self, keys: list[object]) -> None:
        self.connection.allow_sink_senders(keys)

    async def go(self) -> None:
        """``run_go`` -> ``run_started``: the sink allows the last stages and the data
        sockets are connected; the stages now connect downstream."""
        started = await self.control.ask(
            RunGo(run=self.run),
            expect=(RunStarted, RunFailed),
            timeout_s=self.timeouts.reply_s * 2,
            awaited="run_started",
            resend_on_reconnect=True,  # answered once: a copy gets the same answer
        )
        if isinstance(started, RunFailed):
            raise run_failed_error(started.error, "start the run")

    def follow(self, epoch: int, last_stage: str, last_key: object) -> None:
        """A re-plan: results of older epochs are dropped from now on."""
        self.epoch = epoch
        self.last_stage = last_stage
        self.allow_sink_senders([last_key])

    async def finish(self, *, timeline: bool = False) -> dict[str, Any]:
        """``run_end`` -> ``run_report``: each stage's counters for the run; with
        ``timeline``, each stage's spans too (in :attr:`timelines`; a coordinator
        older than timelines sends none)."""
        report = await self.control.ask(
            RunEnd(run=self.run, timeline=True if timeline else None),
            expect=(StagesReport,),
            timeout_s=self.timeouts.reply_s * 2,
            awaited="run report",
            resend_on_reconnect=True,
        )
        self.timelines = dict(report.timelines or {})
        if self.connection.open_run == self.run:
            self.connection.open_run = None
        return dict(report.stages)

    # ------------------------------------------------------------------ tasks and failure

    def watch(
        self,
        check: SinkCheck,
        handle: SinkHandler,
        *,
        awaited: str,
        on_replanned: ReplanHandler | None = None,
        idle_timeout_s: float | None = None,
        idle_ok: Callable[[], bool] | None = None,
    ) -> None:
        """Start the sink's receive loop, the failure watch and the stall reports.

        Each sink message that passes ``check`` goes to ``handle``, except a stage's
        ``error``, which fails the run. ``idle_timeout_s``: no message for that long
        is a :class:`TransportTimeout` unless ``idle_ok()`` (nothing is due)."""
        receive = self._receive(check, handle, awaited, idle_timeout_s, idle_ok)
        self.spawn(receive, "sink", essential=True)
        self.spawn(self._watch_notices(on_replanned), "failure watch", essential=True)
        stalls = self.control.report_stalls(self.stall, lambda: self.run, self.what)
        self.spawn(stalls, "stall reports", essential=True)
        self.spawn(self._watch_coordinator(), "coordinator watch", essential=True)

    def spawn(
        self, coro: Coroutine[Any, Any, None], name: str, *, essential: bool = False
    ) -> asyncio.Task[None]:
        """Run ``coro`` for this run: an exception from it fails the run; an
        ``essential`` task that ends at all (it should run until :meth:`close`)
        fails it too, with an error that names it."""
        task = asyncio.create_task(coro)
        task.add_done_callback(lambda t: self._task_done(t, name, essential))
        self._tasks.append(task)
        return task

    def _task_done(self, task: asyncio.Task[None], name: str, essential: bool) -> None:
        if self._closing:
            return
        if task.cancelled():
            if not essential:
                return
            # not by close(): a socket closed under a pending receive, say
            exc: BaseException | None = PipelineError(
                f"the client's {name} task of run {self.run} was cancelled"
            )
        else:
            exc = task.exception()
        if exc is None and (not essential or self._failure.done()):
            return  # it finished its job, or it stopped after the run failed
        if exc is None:
            exc = PipelineError(f"the client's {name} task of run {self.run} ended")
        elif essential and not isinstance(exc, ZpipeError):
            wrapped = PipelineError(f"the client's {name} task of run {self.run} failed: {exc!r}")
            wrapped.__cause__ = exc
            exc = wrapped
        log.error("run_task_failed", run=self.run, task=name, error=str(exc))
        self.fail(exc)

    def fail(self, error: BaseException) -> None:
        """The run cannot go on; the first failure is the one the run raises."""
        if isinstance(error, StageFailedError) and self.stage_failure is None:
            self.stage_failure = error
            self._stage_failed.set()
        if not self._failure.done():
            self._failure.set_result(error)

    @property
    def failed(self) -> bool:
        return self._failure.done()

    async def race(self, awaitable: Awaitable[T], *, timeout_s: float | None) -> T:
        """``awaitable``'s result, unless the run fails first (its error is raised) or
        ``timeout_s`` passes (:class:`asyncio.TimeoutError`)."""
        task = asyncio.ensure_future(awaitable)
        waits: set[asyncio.Future[Any]] = {task, self._failure}
        try:
            done, _ = await asyncio.wait(
                waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            if not task.done():
                task.cancel()
        if task in done:
            return task.result()
        if self._failure in done:
            raise self._failure.result()
        raise asyncio.TimeoutError

    async def stage_failure_within(self, timeout_s: float) -> StageFailedError | None:
        """The death of one of the run's stages, if the coordinator reports one in time."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._stage_failed.wait(), timeout_s)
        return self.stage_failure

    async def close(self) -> None:
        self._closing = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    # ------------------------------------------------------------------ the loops

    async def _receive(
        self,
        check: SinkCheck,
        handle: SinkHandler,
        awaited: str,
        idle_timeout_s: float | None,
        idle_ok: Callable[[], bool] | None,
    ) -> None:
        # the sink as it is now (limit_sink reopened it before this run's loop
        # started), held so that no reopen closes it under the receive below
        with self.connection.reading_sink() as sink:
            while True:
                try:
                    frames = await recv_frames(
                        sink, timeout_s=idle_timeout_s, peer=self.last_stage, awaited=awaited
                    )
                except TransportTimeout:
                    if idle_ok is not None and idle_ok():
                        continue
                    raise
                try:
                    # parsed into its protocol class here, once: checks and handlers
                    # read typed fields
                    message = self.connection.decode_sink_typed(frames)
                    check(message)
                    if isinstance(message, MicroBatchError):
                        self.fail(RemoteStageError(message.stage, message.mb, message.message))
                        return
                    await handle(message)
                except Exception as exc:
                    # Whatever one message causes (a malformed frame, a result that does not
                    # belong to the run, a bug its contents hit), it is dropped, not the loop.
                    log.warning("dropped_message", peer=self.last_stage, run=self.run,
                                error=str(exc), error_type=type(exc).__name__)  # fmt: skip

    async def _watch_coordinator(self) -> None:
        """The run cannot end without its coordinator (commits, replicas, recovery):
        once the control channel counts it lost, the run fails with that reason."""
        await self.control.lost.wait()
        raise self.control.lost_error(f"the {self.what} of run {self.run}")

    async def _watch_notices(self, on_replanned: ReplanHandler | None) -> None:
        failures = self.control.failures
        while True:
            notice = await failures.get()
            if notice.run != self.run:
                continue
            match notice:
                case StageFailed():
                    self.fail(stage_failed_error(notice))
                    return
                case RunReplanned() if on_replanned is None:
                    log.warning("notice_ignored", run=self.run, kind=notice.KIND)
                case RunReplanned() if notice.epoch <= self.epoch:
                    # a re-plan missed and sent again after a newer one was followed
                    log.warning("stale_replan_ignored", run=self.run, epoch=notice.epoch)
                case RunReplanned():
                    assert on_replanned is not None
                    await on_replanned(notice)
