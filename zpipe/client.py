"""The embedded API's client: asks the coordinator for a run and streams data through it.

The client is the data source and the sink: it sends micro-batches straight to
the first stage and receives results straight from the last one, keeping at
most ``max_in_flight`` micro-batches in the pipeline (backpressure), and
returns results in input order whatever order they arrive in.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from zpipe._errors import (
    ConfigError,
    PipelineError,
    ProtocolError,
    RemoteStageError,
    StageFailedError,
    TransportTimeout,
)
from zpipe.config import Timeouts
from zpipe.log import get_logger
from zpipe.models import ModelSpec
from zpipe.planner import Plan
from zpipe.planner.profile import ModelProfile
from zpipe.recovery import DEFAULT_STALL_DEADLINE, DeadlinePolicy, StallWatch
from zpipe.recovery import POLICIES as RECOVERY_POLICIES
from zpipe.transport import security
from zpipe.transport.codec import Message
from zpipe.transport.sockets import (
    SocketOptions,
    advertised_endpoint,
    bind_endpoint,
    decode_frames,
    new_context,
    open_socket,
    recv_frames,
    send,
)

if TYPE_CHECKING:
    from zpipe.fit import TrainReport

log = get_logger("zpipe.client")

Batch = torch.Tensor | Sequence[torch.Tensor]
Outputs = tuple[torch.Tensor, ...]
CLIENT_NAME = "client"
_warned_open = [False]


@dataclass
class RunReport:
    """What a finished run looked like: the plan, timing and each stage's counters."""

    run: int
    plan: Plan
    baseline: Plan | None = None  # the even partition the planner's choice was compared with
    microbatches: int = 0
    samples: int = 0
    elapsed_s: float = 0.0
    stages: dict[str, dict[str, Any]] = field(default_factory=dict)
    # one entry per stage lost mid-stream: who, how long recovery took, what was replayed
    recoveries: list[dict[str, Any]] = field(default_factory=list)

    @property
    def throughput(self) -> float:
        """Samples per second over the streaming part of the run."""
        return self.samples / self.elapsed_s if self.elapsed_s > 0 else 0.0


def as_tensors(batch: Batch) -> tuple[torch.Tensor, ...]:
    if isinstance(batch, torch.Tensor):
        return (batch,)
    tensors = tuple(batch)
    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise ConfigError("a batch must be a tensor or a non-empty sequence of tensors")
    return tensors


def split_microbatches(
    tensors: tuple[torch.Tensor, ...], microbatch_size: int | None
) -> list[tuple[torch.Tensor, ...]]:
    """Split along dim 0; every tensor of a batch must have the same batch size."""
    if any(t.dim() == 0 for t in tensors):
        raise ConfigError("every tensor of a batch needs a batch dimension; got a scalar")
    sizes = {int(t.shape[0]) for t in tensors}
    if len(sizes) != 1:
        raise ConfigError(f"every tensor of a batch needs the same batch size, got {sizes}")
    (batch_size,) = sizes
    if microbatch_size is None or microbatch_size >= batch_size:
        return [tuple(t.contiguous() for t in tensors)]
    parts = [torch.split(t, microbatch_size) for t in tensors]
    return [tuple(p.contiguous() for p in group) for group in zip(*parts, strict=False)]


class _ControlChannel:
    """The client's DEALER to the coordinator: requests with deadlines, failure notices."""

    def __init__(self, sock: zmq.asyncio.Socket, options: SocketOptions, timeouts: Timeouts):
        self.sock = sock
        self.options = options
        self.timeouts = timeouts
        self.failures: asyncio.Queue[Message] = asyncio.Queue()
        self._replies: asyncio.Queue[Message] = asyncio.Queue()
        self._reader = asyncio.create_task(self._read())
        # Reconnections to the coordinator's endpoint (a restarted coordinator): a
        # request that may have been lost with the old process is sent again.
        self.reconnections = 0
        self._reconnected = asyncio.Event()
        self._monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._watcher = asyncio.create_task(self._watch_connection())

    async def _watch_connection(self) -> None:
        disconnected = False
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                disconnected = True
                log.warning("coordinator_disconnected", endpoint=event["endpoint"])
            elif event["event"] == zmq.EVENT_CONNECTED and disconnected:
                disconnected = False
                self.reconnections += 1
                self._reconnected.set()
                log.info("coordinator_reconnected", endpoint=event["endpoint"])

    async def _read(self) -> None:
        while True:
            frames = await recv_frames(
                self.sock, timeout_s=None, peer="coordinator", awaited="control message"
            )
            try:
                message = decode_frames(frames, self.options.max_message_bytes)
            except ProtocolError as exc:
                log.warning("dropped_message", peer="coordinator", error=str(exc))
                continue
            if message.kind in ("stage_failed", "run_replanned"):
                await self.failures.put(message)
            else:
                await self._replies.put(message)

    async def request(
        self,
        message: Message,
        *,
        expect: Sequence[str],
        timeout_s: float,
        awaited: str,
        resend_on_reconnect: bool = False,
    ) -> Message:
        """Send ``message`` and wait for a reply of a kind in ``expect``.

        ``resend_on_reconnect``: for a request the coordinator may answer twice
        (it shares the answer of a duplicate): when the connection to the
        coordinator is made again while waiting (it was restarted and took its
        run over from disk), the request goes again, with a fresh deadline.
        """
        seen = self.reconnections
        await send(self.sock, message, timeout_s=timeout_s, peer="coordinator")
        deadline = time.monotonic() + timeout_s
        while True:
            if resend_on_reconnect and self.reconnections != seen:
                seen = self.reconnections
                log.warning("request_sent_again", kind=message.kind)
                await send(self.sock, message, timeout_s=timeout_s, peer="coordinator")
                deadline = time.monotonic() + timeout_s
            left = max(deadline - time.monotonic(), 0.0)
            self._reconnected.clear()
            reply_task = asyncio.ensure_future(self._replies.get())
            waits: set[asyncio.Future[Any]] = {reply_task}
            if resend_on_reconnect:
                waits.add(asyncio.ensure_future(self._reconnected.wait()))
            try:
                done, _ = await asyncio.wait(
                    waits, timeout=left, return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                for task in waits:
                    if not task.done():
                        task.cancel()
            if reply_task in done:
                reply = reply_task.result()
                if reply.kind in expect:
                    return reply
                log.debug("unexpected_reply", kind=reply.kind)
            elif not done:
                raise TransportTimeout("coordinator", awaited, timeout_s)

    async def report_stalls(self, watch: StallWatch, run: Callable[[], int], what: str) -> None:
        """Until cancelled: when the next result of ``run()`` is later than ``watch``'s
        deadline (FTPipeHD's deadline at the data source), tell the coordinator, which
        probes the run's stages at once instead of waiting for heartbeats to lapse."""
        while True:
            await asyncio.sleep(min(max(watch.deadline() / 4, 0.02), 0.5))
            stalled = watch.stalled(time.monotonic())
            if stalled is None:
                continue
            waited, deadline = stalled
            log.warning(f"{what}_stalled", run=run(), waited_s=round(waited, 3),
                        deadline_s=round(deadline, 3))  # fmt: skip
            body = {"run": run(), "waited_s": waited, "deadline_s": deadline}
            try:
                await send(
                    self.sock,
                    Message("stalled", body),
                    timeout_s=self.timeouts.send_s,
                    peer="coordinator",
                )
            except TransportTimeout as exc:  # heartbeats still find a dead stage
                log.warning("stall_not_reported", run=run(), error=str(exc))

    async def close(self) -> None:
        for task in (self._reader, self._watcher):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        with contextlib.suppress(zmq.ZMQError):
            self.sock.disable_monitor()
        self._monitor.close(linger=0)


class PipelineClient:
    """Connects to a coordinator and runs inference streams on its stages.

    Use as ``async with PipelineClient(endpoint) as client: ...``.
    """

    def __init__(
        self,
        coordinator: str,
        *,
        keys_dir: Path | None = None,
        key_name: str = CLIENT_NAME,
        sink_bind: str = "tcp://0.0.0.0:0",
        advertise_host: str | None = None,
        timeouts: Timeouts | None = None,
        socket_options: SocketOptions | None = None,
    ) -> None:
        self.coordinator = coordinator
        self.keys_dir = keys_dir
        self.key_name = key_name
        self.sink_bind = sink_bind
        self.advertise_host = advertise_host
        self.timeouts = timeouts or Timeouts()
        self.options = socket_options or SocketOptions()
        self._context: zmq.asyncio.Context | None = None
        self._control: _ControlChannel | None = None
        self._sink: zmq.asyncio.Socket | None = None
        self._keypair: security.KeyPair | None = None
        self._sink_allow: security.PeerAllowList | None = None
        self._authenticator: security.CurveAuthenticator | None = None
        self.sink_endpoint = ""
        self.last_report: RunReport | None = None

    async def __aenter__(self) -> PipelineClient:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def open(self) -> None:
        self._context = new_context()
        dealer = open_socket(self._context, zmq.DEALER, self.options)
        dealer.setsockopt(zmq.ROUTING_ID, f"{CLIENT_NAME}-{uuid.uuid4().hex[:12]}".encode())
        self._sink = open_socket(self._context, zmq.PULL, self.options)
        if self.keys_dir is not None:
            self._keypair = security.load_keypair(self.keys_dir, self.key_name)
            coordinator_key = security.load_keypair_public(self.keys_dir, "coordinator")
            security.secure_client(dealer, self._keypair, coordinator_key)
            self._sink_allow = security.PeerAllowList()
            self._authenticator = security.CurveAuthenticator(self._context, self._sink_allow)
            self._authenticator.start()
            security.secure_server(self._sink, self._keypair)
        elif not _warned_open[0]:
            # Once per process: an embedding program opens many clients.
            _warned_open[0] = True
            security.warn_open_cluster(log, "client")
        dealer.connect(self.coordinator)
        bound = bind_endpoint(self._sink, self.sink_bind)
        self.sink_endpoint = advertised_endpoint(
            bound, advertise_host=self.advertise_host, toward=self.coordinator
        )
        self._control = _ControlChannel(dealer, self.options, self.timeouts)

    async def close(self) -> None:
        if self._control is not None:
            await self._control.close()
            self._control.sock.close(linger=0)
            self._control = None
        if self._sink is not None:
            self._sink.close(linger=0)
            self._sink = None
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None
        if self._context is not None:
            self._context.term()
            self._context = None

    def decode_sink_message(self, frames: Sequence[zmq.Frame]) -> Message:
        """A message that reached the sink, decoded; with keys, only from an allowed peer
        (CURVE checks keys at the handshake only, so each message is checked again)."""
        if self._sink_allow is not None:
            key = security.sender_public_key(frames[0])
            if key is None or key not in self._sink_allow:
                raise ProtocolError("a message from a peer that is not an assigned last stage")
        return decode_frames(frames, self.options.max_message_bytes)

    async def cluster_state(self) -> list[dict[str, Any]]:
        """The coordinator's view of every stage: name, state, endpoint, device info."""
        assert self._control is not None, "open() the client first"
        reply = await self._control.request(
            Message("cluster_request"),
            expect=("cluster_state",),
            timeout_s=self.timeouts.reply_s,
            awaited="cluster state",
        )
        return list(reply["members"])

    async def wait_for_stages(self, count: int, *, timeout_s: float) -> list[dict[str, Any]]:
        """Poll until ``count`` stages are alive; ``TransportTimeout`` past the deadline."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                state = await self.cluster_state()
            except TransportTimeout:
                # A coordinator still starting (import torch on a loaded machine) answers
                # late; keep asking until the caller's deadline, not just one reply_s.
                if time.monotonic() > deadline:
                    raise
                continue
            members = [m for m in state if m["state"] == "alive"]
            if len(members) >= count:
                return members
            if time.monotonic() > deadline:
                raise TransportTimeout("coordinator", f"{count} registered stages", timeout_s)
            await asyncio.sleep(0.1)

    async def infer_stream(
        self,
        model: ModelSpec,
        batches: Iterable[Batch] | AsyncIterable[Batch],
        *,
        microbatch_size: int | None = None,
        partition: Sequence[Sequence[int]] | None = None,
        stages: int | None = None,
        stage_names: Sequence[str] | None = None,
        dtype: str = "float32",
        planner: str | None = None,
        profile: ModelProfile | None = None,
        max_in_flight: int = 4,
        wait_for_stages_s: float = 30.0,
        progress: Callable[[int, int], None] | None = None,
        recover: bool = True,
        recovery: str = "lightweight",
        stall_deadline: DeadlinePolicy | None = None,
    ) -> AsyncIterator[Outputs]:
        """Yield the outputs of each input batch, in input order.

        The coordinator plans the run with ``planner`` ("pipeedge" by default,
        "pipedream" or "even") from each stage's own profile of the model at
        ``microbatch_size`` (or from ``profile``, scaled by each stage's
        slowdown), unless ``partition`` gives the unit ranges.

        With ``recover`` (the default), a stage that dies mid-stream is planned
        around: the coordinator re-plans over the surviving stages, and the
        micro-batches without a result are sent again (the client keeps each
        input until its result arrives); every output is still delivered once,
        in order. Without it, or when no stage is left, the stream raises
        :class:`StageFailedError`. ``recovery`` chooses how the survivors are
        planned: "lightweight" (Asteroid: the same stages in the same order, their
        boundaries shifted so that each one's work matches its speed, units moving
        only between neighbours), "heavy" (the full planner over the survivors)
        or "respipe" (the next stage takes all of the dead one's units).
        ``stall_deadline``: how late the next result may be before the coordinator
        probes the stages (see :func:`zpipe.fit.fit`; default
        :data:`DEFAULT_STALL_DEADLINE`).

        The run's report (plan, throughput, per-stage counters, recoveries) is in
        :attr:`last_report` once the stream is exhausted.
        """
        if recovery not in RECOVERY_POLICIES:
            raise ConfigError(
                f"unknown recovery {recovery!r}; choose one of {', '.join(RECOVERY_POLICIES)}"
            )
        if self._control is None or self._sink is None or self._context is None:
            raise PipelineError("open() the client first")
        if microbatch_size is not None and microbatch_size < 1:
            raise ConfigError(f"microbatch_size must be >= 1, got {microbatch_size}")
        if max_in_flight < 1:
            raise ConfigError(f"max_in_flight must be >= 1, got {max_in_flight}")
        request = {
            "model": model.to_dict(),
            "partition": [list(r) for r in partition] if partition is not None else None,
            "stages": stages,
            "stage_names": list(stage_names) if stage_names is not None else None,
            "dtype": dtype,
            "planner": planner or "pipeedge",
            "microbatch_size": microbatch_size,
            "profile": profile.to_dict() if profile is not None else None,
            "sink_endpoint": self.sink_endpoint,
            "wait_for_stages_s": float(wait_for_stages_s),
            "recover": recover,
            "recovery": recovery,
        }
        reply = await self._control.request(
            Message("run_request", request),
            expect=("run_ready", "run_failed"),
            timeout_s=wait_for_stages_s + self.timeouts.assign_s + self.timeouts.reply_s,
            awaited="run_ready",
        )
        if reply.kind == "run_failed":
            raise PipelineError(f"the coordinator could not start the run: {reply['error']}")
        stream = _Stream(self, reply, microbatch_size, max_in_flight, progress)
        stream.stall = StallWatch(stall_deadline or DEFAULT_STALL_DEADLINE)
        try:
            started = await self._control.request(
                Message("run_go", {"run": stream.run}),
                expect=("run_started", "run_failed"),
                timeout_s=self.timeouts.reply_s * 2,
                awaited="run_started",
            )
        except BaseException:
            await stream.close()
            raise
        if started.kind == "run_failed":
            await stream.close()
            raise PipelineError(f"the coordinator could not start the run: {started['error']}")
        try:
            async for outputs in stream.outputs_in_order(batches):
                yield outputs
        finally:
            await stream.close()
        report = await self._control.request(
            Message("run_end", {"run": stream.run}),
            expect=("run_report",),
            timeout_s=self.timeouts.reply_s * 2,
            awaited="run report",
            resend_on_reconnect=True,
        )
        stream.report.stages = dict(report["stages"])
        self.last_report = stream.report

    async def infer(
        self, model: ModelSpec, batches: Iterable[Batch] | AsyncIterable[Batch], **kwargs: Any
    ) -> list[Outputs]:
        """All outputs of :meth:`infer_stream` as a list."""
        return [outputs async for outputs in self.infer_stream(model, batches, **kwargs)]

    async def fit(
        self, model: ModelSpec, batches: Iterable[Any] | AsyncIterable[Any], **kwargs: Any
    ) -> TrainReport:
        """Train ``model`` across the cluster; see :func:`zpipe.fit.fit` for the arguments."""
        from zpipe.fit import fit

        return await fit(self, model, batches, **kwargs)


class _Stream:
    """One run's data plane on the client side: source, sink and reordering."""

    def __init__(
        self,
        client: PipelineClient,
        ready: Message,
        microbatch_size: int | None,
        max_in_flight: int,
        progress: Callable[[int, int], None] | None,
    ) -> None:
        assert client._context is not None and client._control is not None
        self.client = client
        self.run = int(ready["run"])
        self.epoch = ready.epoch
        self.plan = Plan.from_dict(ready["plan"])
        self.first_stage = str(ready["first_stage"])
        self.last_stage = str(ready["last_stage"])
        self.microbatch_size = microbatch_size
        self.window = asyncio.Semaphore(max_in_flight)
        self.progress = progress
        baseline = ready.get("baseline")
        self.report = RunReport(
            run=self.run,
            plan=self.plan,
            baseline=Plan.from_dict(baseline) if baseline is not None else None,
        )
        self.source = open_socket(client._context, zmq.PUSH, client.options)
        if client._keypair is not None:
            first_key = ready.get("first_key")
            if not first_key:
                raise PipelineError("the coordinator sent no key for the first stage")
            security.secure_client(self.source, client._keypair, str(first_key).encode())
            assert client._sink_allow is not None
            last_key = ready.get("last_key")
            client._sink_allow.replace([str(last_key).encode()] if last_key else [])
        self.source.connect(str(ready["first_endpoint"]))
        # inputs whose results have not arrived, to send again after a re-plan
        self.unanswered: dict[int, tuple[torch.Tensor, ...]] = {}
        self.send_lock = asyncio.Lock()
        # micro-batch id -> (batch index, part index); batch index -> number of parts
        self.owner: dict[int, tuple[int, int]] = {}
        self.parts: dict[int, int] = {}
        self.arrived: dict[int, dict[int, Outputs]] = {}
        self.results: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self.sent = 0
        self.received = 0
        self.total_batches: int | None = None
        self.tasks: list[asyncio.Task[None]] = []
        self.stall = StallWatch(DEFAULT_STALL_DEADLINE)

    async def outputs_in_order(
        self, batches: Iterable[Batch] | AsyncIterable[Batch]
    ) -> AsyncIterator[Outputs]:
        started = time.perf_counter()
        control = self.client._control
        assert control is not None
        self.tasks = [
            asyncio.create_task(self._feed(batches)),
            asyncio.create_task(self._drain()),
            asyncio.create_task(self._watch_failures()),
            asyncio.create_task(control.report_stalls(self.stall, lambda: self.run, "stream")),
        ]
        next_batch = 0
        waiting: dict[int, Outputs] = {}
        while self.total_batches is None or next_batch < self.total_batches:
            try:
                index, value = await asyncio.wait_for(
                    self.results.get(), self.client.timeouts.result_s
                )
            except asyncio.TimeoutError:
                raise TransportTimeout(
                    self.last_stage,
                    f"the result of batch {next_batch}",
                    self.client.timeouts.result_s,
                ) from None
            if isinstance(value, BaseException):
                raise value
            if index < 0:  # the feeder finished: now the number of batches is known
                continue
            waiting[index] = value
            while next_batch in waiting:
                yield waiting.pop(next_batch)
                next_batch += 1
        self.report.elapsed_s = time.perf_counter() - started
        self.report.microbatches = self.received

    async def _feed(self, batches: Iterable[Batch] | AsyncIterable[Batch]) -> None:
        try:
            index = 0
            if isinstance(batches, AsyncIterable):
                async for batch in batches:
                    await self._send_batch(index, batch)
                    index += 1
            else:
                for batch in batches:
                    await self._send_batch(index, batch)
                    index += 1
            self.total_batches = index
            await self.results.put((-1, None))
        except Exception as exc:
            await self.results.put((-1, exc))

    async def _send_batch(self, index: int, batch: Batch) -> None:
        tensors = as_tensors(batch)
        micro = split_microbatches(tensors, self.microbatch_size)
        self.parts[index] = len(micro)
        self.report.samples += int(tensors[0].shape[0])
        for part, mb_tensors in enumerate(micro):
            await self.window.acquire()
            async with self.send_lock:  # not interleaved with a replay to a new first stage
                mb = self.sent
                self.sent += 1
                self.stall.sent(time.monotonic())
                self.owner[mb] = (index, part)
                self.unanswered[mb] = mb_tensors
                await self._send_input(mb, mb_tensors)

    async def _send_input(self, mb: int, tensors: tuple[torch.Tensor, ...]) -> None:
        await send(
            self.source,
            Message(
                "data",
                {"run": self.run, "mb": mb, "src": CLIENT_NAME},
                epoch=self.epoch,
                tensors=tensors,
            ),
            timeout_s=self.client.timeouts.send_s,
            peer=self.first_stage,
        )

    async def _drain(self) -> None:
        sink = self.client._sink
        assert sink is not None
        while True:
            frames = await recv_frames(
                sink, timeout_s=None, peer=self.last_stage, awaited="results"
            )
            try:
                message = self.client.decode_sink_message(frames)
                self._check_result(message)
            except ProtocolError as exc:
                log.warning("dropped_message", peer=self.last_stage, error=str(exc))
                continue
            mb = int(message["mb"])
            self.unanswered.pop(mb, None)
            self.window.release()
            self.received += 1
            self.stall.completed(time.monotonic())
            if message.kind == "error":
                await self.results.put(
                    (-1, RemoteStageError(str(message["stage"]), mb, str(message["message"])))
                )
                return
            index, part = self.owner.pop(mb)
            self.arrived.setdefault(index, {})[part] = message.tensors
            if self.progress is not None:
                self.progress(self.received, self.sent)
            if len(self.arrived[index]) == self.parts[index]:
                pieces = self.arrived.pop(index)
                ordered = [pieces[p] for p in range(len(pieces))]
                outputs = tuple(
                    torch.cat(group) if len(ordered) > 1 else group[0]
                    for group in zip(*ordered, strict=False)
                )
                await self.results.put((index, outputs))

    def _check_result(self, message: Message) -> None:
        if message.kind not in ("data", "error"):
            raise ProtocolError(f"{message.kind!r} does not belong on the sink")
        if message.epoch != self.epoch or message["run"] != self.run:
            raise ProtocolError(f"a result of epoch {message.epoch}, expected {self.epoch}")
        if message.kind == "data" and message["src"] != self.last_stage:
            raise ProtocolError(f"a result from {message['src']!r}, not {self.last_stage!r}")
        if int(message["mb"]) not in self.owner:
            raise ProtocolError(f"a result for unknown or finished micro-batch {message['mb']}")

    async def _watch_failures(self) -> None:
        control = self.client._control
        assert control is not None
        while True:
            notice = await control.failures.get()
            if notice["run"] != self.run:
                continue
            if notice.kind == "run_replanned":
                await self._replay(notice)
                continue
            await self.results.put(
                (-1, StageFailedError(str(notice["stage"]), str(notice["reason"])))
            )
            return

    async def _replay(self, notice: Message) -> None:
        """Follow a re-plan: the new first and last stage, then every unanswered input."""
        client = self.client
        assert client._context is not None
        async with self.send_lock:
            self.epoch = notice.epoch  # results of the old epoch are dropped from now on
            self.plan = Plan.from_dict(notice["plan"])
            self.report.plan = self.plan
            self.first_stage = str(notice["first_stage"])
            self.last_stage = str(notice["last_stage"])
            self.source.close(linger=0)
            self.source = open_socket(client._context, zmq.PUSH, client.options)
            if client._keypair is not None:
                first_key = notice["first_key"]
                if not first_key:
                    raise PipelineError("the coordinator sent no key for the new first stage")
                security.secure_client(self.source, client._keypair, str(first_key).encode())
                assert client._sink_allow is not None
                last_key = notice["last_key"]
                client._sink_allow.replace([str(last_key).encode()] if last_key else [])
            self.source.connect(str(notice["first_endpoint"]))
            replayed = sorted(self.unanswered)
            for mb in replayed:
                await self._send_input(mb, self.unanswered[mb])
        self.report.recoveries.append(
            {
                "dead": str(notice["dead"]),
                "detected_s": float(notice.get("detected_s") or 0.0),
                "recovered_s": float(notice["recovered_s"]),
                "replayed": len(replayed),
                "epoch": notice.epoch,
                # this process's time.monotonic() when the new plan arrived
                "at": time.monotonic(),
            }
        )
        log.warning(
            "stream_replanned",
            run=self.run,
            dead=notice["dead"],
            replayed=len(replayed),
            plan=notice["plan"]["stages"],
        )

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self.source.close(linger=0)
