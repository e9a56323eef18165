"""A stage's part of a pipelined generation run: its units, its KV cache, the ring.

The coordinator's set-up (:mod:`zpipe.coordinator.runs.generation`) sends each
stage a ``gen_setup``; the lifecycle hands it here. The executor:

- stops whatever ran on the stage's data socket and takes it for the run; builds
  its units and cache (:class:`~zpipe.stage.executors.generation_steps.GenerationStage`)
  in the compute thread; allows its upstream's key (the first stage: the client's
  and the last stage's) and answers ``gen_ready``. It connects to its downstream
  (and the first stage to the client's sink) at its first send: by then every stage
  of the run was ready, so every key it meets is allowed;
- receives on the data port, parses each message once and checks its run, epoch
  and sender (``src``, and with keys the CURVE key): anything else is counted and
  dropped, and the loop goes on;
- computes in order, one item at a time, in the compute thread (never on the event
  loop): a step (then its hidden states go downstream, or at the last stage its
  tokens go to the first stage), a free (then passed downstream), the run's close.

The first stage also runs the run's :class:`~zpipe.generation.sequences.SequenceScheduler`
on the event loop (it never waits): the client's ``gen_submit`` and ``gen_cancel``
and the last stage's ``gen_tokens`` go in, and its commands come out: a step to
compute, token events to stream to the client (a step's in one ``gen_token_batch``),
a cache to free at every stage. The scheduler makes every decision of the loop
(admission, chunked prefill, which rows sample, when a sequence stops); this module
only moves them.

A client that goes away unannounced is noticed when the first stage's events to
it stop leaving (its sink's queue full for the send deadline): the run closes as
if it had said ``gen_close``. When a stage dies the coordinator sets every survivor
up again (a ``gen_setup`` of the same run under a new epoch: this stage drops the
old run's state and builds the units it now holds) and the client sends each
unfinished sequence again with the tokens it already received, which the new first
stage's scheduler prefills (:mod:`zpipe.coordinator.runs.generation_recovery`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import torch
import zmq
import zmq.asyncio

from zpipe._errors import ProtocolError, TransportTimeout, ZpipeError
from zpipe.generation.refusals import refusal_kind
from zpipe.generation.sequences import (
    FreeCache,
    RunStep,
    SchedulerCommand,
    SequenceScheduler,
    StreamToken,
)
from zpipe.generation.wire import (
    check_setup,
    events_to_wire,
    params_from_map,
    tokens_from_wire,
)
from zpipe.log import get_logger
from zpipe.protocol import WireMessage
from zpipe.protocol.generation import (
    GenCancel,
    GenClose,
    GenFree,
    GenReady,
    GenRefused,
    GenSetup,
    GenStep,
    GenStepFailed,
    GenSubmit,
    GenTokenBatch,
    GenTokens,
)
from zpipe.stage.assignment import PushConnector
from zpipe.stage.executors.generation_messages import (
    CLIENT,
    after_step,
    failed_step,
    first_stage_scheduler,
    refusals_for,
    sender_keys,
)
from zpipe.stage.executors.generation_steps import (
    GenerationStage,
    after_failed_step,
    compute_step,
    expect_sender,
    first_step,
    freed_sequences,
    largest_message,
    load_detokenizer,
    same_units,
    submitted_tokens,
)
from zpipe.stage.supervision import TaskSupervisor, describe_error, serve_messages
from zpipe.transport import security
from zpipe.transport.codec import Message, decode_typed
from zpipe.transport.slowdown import Slowdown, slowdown_factor
from zpipe.transport.sockets import ReceiveLimits, recv_frames, send

log = get_logger("zpipe.stage")

# The supervisor's names of a running assignment's data tasks: a later assignment or
# lossy run (DataPlane.stop) stops a generation run's tasks as it stops any other's.
RECEIVE_TASK = "data-receive"
RUN_TASK = "compute"

SendControl = Callable[[Message], Awaitable[None]]


@dataclass(frozen=True)
class _Free:
    sequences: tuple[int, ...]


@dataclass(frozen=True)
class _Close:
    pass


_Work = GenStep | GenStepFailed | _Free | _Close


@dataclass
class _Run:
    """The run set up on this stage."""

    setup: GenSetup
    work: GenerationStage
    scheduler: SequenceScheduler | None  # the first stage's
    queue: asyncio.Queue[_Work]
    downstream: zmq.asyncio.Socket | None = None
    sink: zmq.asyncio.Socket | None = None
    steps: int = 0  # computed here
    client_gone: bool = False  # the first stage's sends to the client's sink time out
    tokens: int = 0  # rows fed here (prefill chunks and decode steps)

    @property
    def first(self) -> bool:
        return self.setup.index == 0

    @property
    def last(self) -> bool:
        return self.setup.index == self.setup.num_stages - 1


def _close_sockets(state: _Run, *, linger_s: float = 0.0) -> None:
    for sock in (state.downstream, state.sink):
        if sock is not None:
            sock.close(linger=int(linger_s * 1000))
    state.downstream = state.sink = None


class GenerationExecutor:
    """One stage's generation runs, one at a time (see the module docstring)."""

    def __init__(
        self,
        *,
        name: str,
        data_in: Callable[[], zmq.asyncio.Socket],
        data_allow: security.PeerAllowList | None,
        connector: PushConnector,
        compute: ThreadPoolExecutor,
        supervisor: TaskSupervisor,
        send_control: SendControl,
        stop_data: Callable[[], Awaitable[None]],
        apply_limits: Callable[[ReceiveLimits], Awaitable[None]],
        max_message_bytes: int,
        send_timeout_s: float,
        device: torch.device | str | None = None,
        slowdown: Slowdown = 1.0,
    ) -> None:
        self.name = name
        self._data_in = data_in
        self._allow = data_allow
        self._connect = connector
        self._compute = compute
        self._supervisor = supervisor
        self._send_control = send_control
        self._stop_data = stop_data
        self._apply_limits = apply_limits
        self._max_bytes = max_message_bytes
        self._send_timeout_s = send_timeout_s
        self._device = device
        self._slowdown = slowdown  # an emulated slower device stretches each step
        self.state: _Run | None = None
        self.protocol_errors = 0
        self.stale = 0  # messages of another run or epoch, since the latest set-up

    # ------------------------------------------------------------ control

    async def on_control(self, setup: GenSetup) -> None:
        previous = self.state
        await self._reset()  # frees every cache of the previous run
        error = ""
        try:
            check_setup(setup)
            loop = asyncio.get_running_loop()
            if previous is not None and same_units(previous.setup, setup):
                work = previous.work  # a re-plan left this stage its units: no re-read
            else:
                work = await loop.run_in_executor(
                    self._compute, GenerationStage.build, setup, self._device
                )
            await self._raise_limits(largest_message(setup, work))
            self._allow_senders(setup)
            scheduler = None
            if setup.index == 0:
                detokenizer = None
                if setup.text:
                    detokenizer = await loop.run_in_executor(self._compute, load_detokenizer, setup)
                scheduler = first_stage_scheduler(setup, detokenizer)
        except Exception as exc:  # any failure to set up is reported: the stage keeps serving
            error = describe_error(exc)
            log.warning("generation_setup_refused", stage=self.name, run=setup.run, error=error)
        else:
            self.state = _Run(setup, work, scheduler, asyncio.Queue())
            self._supervisor.start(RECEIVE_TASK, self._receive_loop)
            self._supervisor.start(RUN_TASK, self._work_loop)
            log.info(
                "generation_setup",
                stage=self.name,
                run=setup.run,
                units=[setup.start, setup.end],
                index=setup.index,
            )
        ready = GenReady(run=setup.run, name=self.name, error=error, epoch=setup.epoch)
        await self._send_control(ready.to_message())

    def _allow_senders(self, setup: GenSetup) -> None:
        """Allow the keys of who sends to this stage, before any of them connects (a
        refused CURVE handshake is not retried)."""
        if self._allow is not None:
            self._allow.replace(sender_keys(setup))

    async def _raise_limits(self, largest: int) -> None:
        """Reopen the data port with room for this run's largest message, only where its
        limit is smaller (as a lossy run does: reopening drops its connections)."""
        limit = self._data_in().getsockopt(zmq.MAXMSGSIZE)
        needed = ReceiveLimits.for_largest_message(min(largest, self._max_bytes))
        if 0 <= int(limit) < needed.max_message_bytes:
            await self._apply_limits(needed)

    async def _reset(self) -> None:
        """Whatever ran on the data socket stops: a new run takes it."""
        await self._stop_data()
        await self._supervisor.stop([RECEIVE_TASK, RUN_TASK])
        state, self.state = self.state, None
        if state is not None:
            _close_sockets(state)
            await asyncio.get_running_loop().run_in_executor(self._compute, state.work.free_all)
        self.stale = 0

    async def close(self) -> None:
        await self._supervisor.stop([RECEIVE_TASK, RUN_TASK])
        if self.state is not None:
            _close_sockets(self.state)
        self.state = None

    # ------------------------------------------------------------ receiving

    async def _receive_loop(self) -> None:
        async def receive() -> list[zmq.Frame]:
            # cancelled when the run is replaced or the stage stops: no deadline needed
            return await recv_frames(
                self._data_in(), timeout_s=None, peer="generation peers", awaited="a message"
            )

        async def handle(frames: list[zmq.Frame]) -> None:
            sender = self._sender(frames[0])
            await self._on_data(decode_typed(frames, max_message_bytes=self._max_bytes), sender)

        await serve_messages(receive, handle, self._dropped)

    def _sender(self, frame: zmq.Frame) -> str | None:
        """With keys, the run's name for the sender's CURVE key (what its ``src`` must
        say); None without keys, where nobody can tell."""
        if self._allow is None:
            return None
        key = security.sender_public_key(frame)
        name = None if key is None or key not in self._allow else self._allow.name_of(key)
        if name is None:
            raise ProtocolError("a message from a peer that is not in this generation run")
        return name

    def _dropped(self, item: Any, exc: Exception) -> None:
        self.protocol_errors += 1
        log.warning(
            "dropped_message", stage=self.name, peer="generation peer", error=describe_error(exc)
        )

    async def _on_data(self, message: WireMessage, sender: str | None = None) -> None:
        st = self.state
        run = getattr(message, "run", None)
        if st is None or run != st.setup.run or message.epoch != st.setup.epoch:
            self.stale += 1
            log.debug("generation_stale", stage=self.name, kind=message.KIND, run=run)
            return
        src = getattr(message, "src", None)
        if sender is not None and src != sender:
            raise ProtocolError(f"{message.KIND} says it is from {src!r}, its key is {sender!r}'s")
        match message:
            case GenSubmit() | GenCancel() if st.first:
                expect_sender(src, CLIENT, message)
                if isinstance(message, GenSubmit):
                    await self._submit(st, message)
                else:
                    await self._carry_out(st, self._scheduler(st).cancel(message.sequence))
            case GenClose() if st.first:
                expect_sender(src, CLIENT, message)
                st.queue.put_nowait(_Close())
            case GenTokens() if st.first and st.setup.num_stages > 1:
                expect_sender(src, st.setup.upstream, message)
                tokens = tokens_from_wire(message.tokens)
                await self._carry_out(st, self._scheduler(st).step_done(message.step, tokens))
            case GenStepFailed() if st.first and st.setup.num_stages > 1:
                expect_sender(src, st.setup.upstream, message)
                await self._step_failed(st, message)
            case GenStepFailed() if not st.first:
                expect_sender(src, st.setup.upstream, message)
                st.queue.put_nowait(message)  # in order with the steps it passes on
            case GenStep() if not st.first:
                expect_sender(src, st.setup.upstream, message)
                st.queue.put_nowait(message)
            case GenFree() if not st.first:
                expect_sender(src, st.setup.upstream, message)
                st.queue.put_nowait(_Free(freed_sequences(message)))
            case GenClose() if not st.first:
                expect_sender(src, st.setup.upstream, message)
                st.queue.put_nowait(_Close())
            case _:
                raise ProtocolError(
                    f"{message.KIND!r} does not belong on stage {st.setup.index}'s data port"
                )

    @staticmethod
    def _scheduler(st: _Run) -> SequenceScheduler:
        assert st.scheduler is not None  # the first stage's, made with the run
        return st.scheduler

    async def _submit(self, st: _Run, message: GenSubmit) -> None:
        try:
            params = params_from_map(message.params)
            ids, generated = submitted_tokens(message, st.work.stage.config.vocab_size)
            if generated:  # sent again after a re-plan: its caches are rebuilt here
                log.info(
                    "generation_sequence_taken_over",
                    stage=self.name,
                    sequence=message.sequence,
                    generated=len(generated),
                )
            commands = self._scheduler(st).submit(
                message.sequence, ids, params, generated=generated
            )
        except (ZpipeError, ValueError) as exc:
            kind = refusal_kind(exc)
            refused = GenRefused(
                run=st.setup.run,
                sequence=message.sequence,
                src=self.name,
                error=str(exc),
                kind=kind,
                epoch=st.setup.epoch,
            )
            log.info(
                "generation_refused",
                stage=self.name,
                sequence=message.sequence,
                kind=kind,
                error=str(exc),
            )
            await self._to_client(st, refused)
            return
        await self._carry_out(st, commands)

    async def _carry_out(self, st: _Run, commands: list[SchedulerCommand]) -> None:
        """The scheduler's commands: frees and steps queued for the compute thread in
        their order, then the token events among them (a step's, one per sequence)
        streamed to the client in one message, in their order. Only the client sees
        the events and only the compute thread the rest, so neither order changes;
        the next step is queued before the send waits."""
        setup = st.setup
        events = []
        for command in commands:
            match command:
                case StreamToken(event=event):
                    events.append(event)
                case FreeCache(sequence=sequence):
                    st.queue.put_nowait(_Free((sequence,)))
                case RunStep():
                    params, _ = self._scheduler(st).sampling(command.step)
                    st.queue.put_nowait(
                        first_step(setup.run, command, params, src=self.name, epoch=setup.epoch)
                    )
        if events:
            batch = GenTokenBatch(
                run=setup.run, src=self.name, events=events_to_wire(events), epoch=setup.epoch
            )
            await self._to_client(st, batch)

    # ------------------------------------------------------------ computing

    async def _work_loop(self) -> None:
        """One item at a time, in arrival order: a free sent after a step is carried
        out after it here and at every stage downstream (their sockets keep order)."""
        st = self.state
        assert st is not None
        loop = asyncio.get_running_loop()
        while True:
            item = await st.queue.get()
            try:
                if isinstance(item, _Close):
                    await loop.run_in_executor(self._compute, st.work.free_all)
                    if not st.last:
                        await self._downstream(
                            st, GenClose(run=st.setup.run, src=self.name, epoch=st.setup.epoch)
                        )
                    log.info(
                        "generation_closed",
                        stage=self.name,
                        run=st.setup.run,
                        steps=st.steps,
                        tokens=st.tokens,
                        stale=self.stale,
                        dropped=self.protocol_errors,
                    )
                    while not st.queue.empty():  # what was queued behind the close is moot
                        st.queue.get_nowait()
                        st.queue.task_done()
                    if self.state is st:  # what comes for the run now is stale
                        self.state = None
                        # the close (and the last events) still get to leave
                        _close_sockets(st, linger_s=self._send_timeout_s)
                    return
                if isinstance(item, GenStepFailed):
                    await self._downstream(st, replace(item, src=self.name))
                    continue
                if isinstance(item, _Free):
                    await loop.run_in_executor(self._compute, st.work.free, item.sequences)
                    if not st.last:
                        free = GenFree(
                            run=st.setup.run,
                            src=self.name,
                            sequences=list(item.sequences),
                            epoch=st.setup.epoch,
                        )
                        await self._downstream(st, free)
                    continue
                await self._step(st, item, loop)
            except asyncio.CancelledError:
                raise
            except TransportTimeout as exc:
                # the next stage took nothing for the whole send deadline: it died or
                # hangs, which the coordinator's failure detector judges (a re-plan
                # rebuilds every sequence); refusing the step's sequences here would
                # end streams that the re-plan carries on
                log.error("generation_downstream_lost", stage=self.name, error=str(exc))
            except Exception as exc:  # one bad step must not end the run's other sequences
                self.protocol_errors += 1
                log.error(
                    "generation_step_failed",
                    stage=self.name,
                    run=st.setup.run,
                    error=describe_error(exc),
                )
                if isinstance(item, GenStep):
                    await self._report_failed_step(st, item, exc)
            finally:
                st.queue.task_done()  # queue.join(): everything handed over is carried out

    async def _step(self, st: _Run, step: GenStep, loop: asyncio.AbstractEventLoop) -> None:
        out = await loop.run_in_executor(
            self._compute, compute_step, st.work, step, slowdown_factor(self._slowdown)
        )
        st.steps += 1
        st.tokens += sum(int(row[2]) for row in step.rows)
        if st.first and st.last:  # one stage: the ring is this process
            await self._carry_out(st, self._scheduler(st).step_done(step.step, list(out.tokens)))
        else:
            await self._downstream(st, after_step(st.setup, step, out, self.name))

    async def _report_failed_step(self, st: _Run, step: GenStep, exc: Exception) -> None:
        """A step this stage could not compute: the first stage hears it round the ring
        (here, at once) and ends the step's sequences; the others go on."""
        failed = failed_step(st.setup, step, self.name, describe_error(exc))
        if st.first:
            await self._step_failed(st, failed)
        else:
            await self._downstream(st, failed)

    async def _step_failed(self, st: _Run, failed: GenStepFailed) -> None:
        sequences = tokens_from_wire(failed.sequences, "sequences")
        for refused in refusals_for(st.setup, failed, sequences, self.name):
            await self._to_client(st, refused)
        await self._carry_out(st, after_failed_step(self._scheduler(st), sequences))

    # ------------------------------------------------------------ sending

    async def _downstream(self, st: _Run, message: WireMessage) -> None:
        setup = st.setup
        if st.downstream is None:
            endpoint = setup.downstream_endpoint or ""
            st.downstream = self._connect(endpoint, setup.downstream_key, setup.downstream)
        await send(
            st.downstream,
            message.to_message(),
            timeout_s=self._send_timeout_s,
            peer=setup.downstream,
        )

    async def _to_client(self, st: _Run, message: WireMessage) -> None:
        """Stream to the client's sink. A client whose sink stayed full for the whole
        send deadline (its queue holds many events) has gone away: the run closes as
        if it had said ``gen_close``, and every stage frees its caches."""
        setup = st.setup
        if st.sink is None:
            st.sink = self._connect(setup.sink_endpoint or "", setup.client_key, CLIENT)
        try:
            await send(st.sink, message.to_message(), timeout_s=self._send_timeout_s, peer=CLIENT)
        except TransportTimeout as exc:
            if not st.client_gone:
                st.client_gone = True
                log.warning(
                    "generation_client_gone",
                    stage=self.name,
                    run=setup.run,
                    kind=message.KIND,
                    error=str(exc),
                )
                st.queue.put_nowait(_Close())

    async def release(self) -> None:
        """Another run takes this stage (an assignment, a lossy run): stop this one's
        tasks and let go of its units and caches."""
        await self._supervisor.stop([RECEIVE_TASK, RUN_TASK])
        state, self.state = self.state, None
        if state is not None:
            _close_sockets(state)
            log.info("generation_released", stage=self.name, run=state.setup.run)
