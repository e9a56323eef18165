"""The coordinator's shell: sockets, security, timers, the state store; no decisions.

It carries control only. Activations go from the client to the first stage,
stage to stage, and from the last stage back to the client, never through
here, so the coordinator is never the bottleneck.

One ROUTER socket serves stages and clients alike. A run goes::

    client  run_request ─> coordinator ── assign (epoch) ──> each stage
                                        <─ ready ─────────── each stage
    client <─ run_ready (plan, first stage, keys) ─┘
    client  run_go ──────> coordinator ── connect ─────────> each stage
    client <─ run_started ─┘            <─ connected ─────── each stage
    client ── data ──> stage 0 ──> ... ──> stage n-1 ── data ──> client
    client  run_end ───> coordinator ── metrics_request ──> stages
    client <─ run_report ┘

The two phases exist because a CURVE handshake refused once is not retried:
every stage (and the client) must allow its upstream's key before anyone
connects to it.

Every message is parsed into its protocol class once, here, and becomes an
event (:mod:`zpipe.coordinator.events`) by its class; the pure core
(:mod:`zpipe.coordinator.core`) and the run's controller decide, and this
shell carries out the commands they return: sends, timers, persistence, and
jobs (:mod:`zpipe.coordinator.jobs`) whose results come back as events; its
sends go out through :mod:`zpipe.coordinator.shell_sends`. One
bad message, or a bug it triggers, is logged with its peer and dropped: the
receive loop never dies of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from zpipe._errors import ProtocolError, RoleError, StateFileError, ZpipeError
from zpipe.config import Timeouts
from zpipe.coordinator.bulk_links import BulkLinks
from zpipe.coordinator.commands import (
    Command,
    Deliver,
    FailRequests,
    GiveBackMemory,
    Log,
    Persist,
    ReachClient,
    Record,
    RunJob,
    Send,
    StartTimer,
)
from zpipe.coordinator.core import CoordinatorCore
from zpipe.coordinator.events import (
    ClientRequest,
    Event,
    JobDone,
    JobFailed,
    Tick,
    TimerFired,
    event_of,
)
from zpipe.coordinator.jobs import JobRunner
from zpipe.coordinator.links import LinkMeasurer
from zpipe.coordinator.loop_lag import LoopLag
from zpipe.coordinator.membership import Membership
from zpipe.coordinator.persistence import StateStore
from zpipe.coordinator.registration import printable
from zpipe.coordinator.restored_replica import fallback_named
from zpipe.coordinator.run_kinds import import_at_run_request, run_kinds_imported
from zpipe.coordinator.runs.async_copies import HeldCopy
from zpipe.coordinator.shell_sends import ShellSends
from zpipe.coordinator.state import ControlState
from zpipe.log import get_logger
from zpipe.planner.memory import DEFAULT_MEMORY_MARGIN
from zpipe.protocol.stage_control import Shutdown
from zpipe.transport import security
from zpipe.transport.bulk import stall_after_s
from zpipe.transport.codec import decode_typed
from zpipe.transport.conn_budget import control_port_budget
from zpipe.transport.conn_guard import ConnectionGuard
from zpipe.transport.message_bounds import trim_heap
from zpipe.transport.ratelimit import PeerRateLimiter
from zpipe.transport.roles import KeyRoles
from zpipe.transport.sockets import (
    CURVE_FRAME_OVERHEAD,
    ReceiveLimits,
    SocketOptions,
    bind_endpoint,
    new_context,
    open_socket,
    recv_frames,
    this_host_addresses,
)

log = get_logger("zpipe.coordinator")

# how often the event loop's lag is sampled (zpipe.coordinator.loop_lag)
LAG_SAMPLE_S = 0.05

# The receive loop gives the event loop a turn after this many messages in a row.
# zmq.asyncio hands back a message already queued without suspending, so a burst
# (300 stages registering at once, their repeats, a heartbeat round after a pause)
# otherwise held the loop for all of it: timers, ticks and pending sends waited
# 0.37 s behind 300 registrations (1.1 s under load).
RECEIVE_TURN_EVERY = 8

# The largest frame the ROUTER takes (its MAXMSGSIZE; libzmq drops the connection of
# a peer that announces a larger one before allocating it). Bulk state travels in
# chunks of at most 16 MiB (zpipe.transport.bulk.MAX_CHUNK_BYTES), but tensors still
# arrive whole on control connections: a stage's state resent there when a restarted
# coordinator refused its bulk transfer, and an EdgePipe client's layer matrices and
# input batches in lossy_run_request. One tensor of a model zpipe ships is at most
# gpt2-small's token embedding, 147 MiB (50257 x 768 float32); 256 MiB leaves room
# for that and an MNIST-sized float64 input block. It was the 2 GiB of every socket:
# 8 connections each part-way through a 2 GiB frame held 1.8 GB (issue 33, finding
# 7); a connection now holds at most this much of an unfinished frame. Raise it
# (CoordinatorConfig.max_frame_bytes) for a model with a larger single tensor.
COORDINATOR_MAX_FRAME_BYTES = 256 << 20

# The ROUTER's RCVHWM: none (0). libzmq 4.3.5 aborts the whole process (SIGABRT,
# "Assertion failed: !_io_error (src/stream_engine_base.cpp:310)") when a connection
# whose input it stopped at the high-water mark breaks (the peer went: a killed stage, a
# stage whose ZMTP heartbeats gave up on a paused coordinator), and the application then
# reads that connection's queue: restarting its input decodes what was left of the last
# read, and a ZMTP PING there (stages and clients send one a second) is answered on the
# broken connection. 16 heartbeats unread (5 s of a stopped or starved coordinator at
# 0.3 s intervals) were enough; any peer could also do it at will. Without a high-water
# mark a connection's input is never stopped. The mark bounded little (16 messages of
# up to max_frame_bytes each, and a million frames a message): what a connection may
# queue has to be bounded by its bytes, and cutting such a connection is safe only
# when its input was never stopped.
COORDINATOR_RECV_HWM = 0

# Memory freed (dropped bulk transfers) is handed back this long after the first ask,
# once for all the asks meanwhile.
TRIM_SOON_S = 0.5

# A save asked for ``soon`` waits this long for the others of its burst: each save
# writes every member and waits for the disk twice, on the loop (300 stages
# registering took 0.9-1.1 s with --state-dir, 0.22-0.24 s without).
PERSIST_SOON_S = 0.1


@dataclass
class CoordinatorConfig:
    bind: str = "tcp://0.0.0.0:5550"
    keys_dir: Path | None = None
    timeouts: Timeouts = field(default_factory=Timeouts)
    socket_options: SocketOptions = field(default_factory=SocketOptions)
    # Plan from links the stages measure, not only from what they declare.
    measure_links: bool = True
    # the fraction added to every memory prediction before it meets a budget
    memory_margin: float = DEFAULT_MEMORY_MARGIN
    # Keep the run and its latest replica here, so a restarted coordinator resumes it.
    state_dir: Path | None = None
    # The largest frame a peer may send (see COORDINATOR_MAX_FRAME_BYTES).
    max_frame_bytes: int = COORDINATOR_MAX_FRAME_BYTES
    # What one stage's open bulk transfers may announce together (None: the message
    # limit, one whole message at a time), and how long one is kept without a chunk
    # (None: two send deadlines, zpipe.transport.bulk.stall_after_s).
    bulk_budget_bytes: int | None = None
    bulk_stall_s: float | None = None
    # On exit, tell every stage to shut down. None: only without a state directory (with
    # one, the stages serve on for the coordinator that takes over).
    shutdown_stages_on_exit: bool | None = None

    @property
    def shuts_down_stages(self) -> bool:
        if self.shutdown_stages_on_exit is not None:
            return self.shutdown_stages_on_exit
        return self.state_dir is None


class Coordinator:
    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        t = config.timeouts
        self.membership = Membership(
            heartbeat_interval_s=t.heartbeat_interval_s,
            suspect_after_intervals=t.suspect_after_intervals,
            probe_intervals=t.probe_intervals,
        )
        self._public_keys: dict[str, bytes] = {}
        self._store = StateStore(config.state_dir) if config.state_dir is not None else None
        self.state = ControlState(
            timeouts=t,
            membership=self.membership,
            public_keys=self._public_keys,
            saves_replicas=self._store is not None,
            memory_margin=config.memory_margin,
            bulk=BulkLinks(
                cap_bytes=config.socket_options.max_message_bytes,
                budget_bytes=config.bulk_budget_bytes,
                stall_s=(
                    stall_after_s(t.send_s) if config.bulk_stall_s is None else config.bulk_stall_s
                ),
            ),
        )
        self.core = CoordinatorCore(self.state)
        self._context = new_context()
        self._router: zmq.asyncio.Socket | None = None
        self._guard: ConnectionGuard | None = None
        # torch and the run kinds: imported at the first run request (run_kinds.py)
        self._runs_imported = run_kinds_imported()
        self._authenticator: security.CurveAuthenticator | None = None
        self._keypair: security.KeyPair | None = None
        # With --keys: what each key's role lets it send (roles.txt; a key it does not
        # list may send nothing; without the file, each key's name implies its role).
        self._roles: KeyRoles | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._timers: dict[int, asyncio.TimerHandle] = {}
        self._persist_soon: asyncio.TimerHandle | None = None
        self._trim_soon: asyncio.TimerHandle | None = None
        self._stopping = asyncio.Event()
        # Per-peer token buckets (by CURVE key, else by connection), as at a stage's
        # probe port: a flooding peer's excess is dropped before it is decoded.
        self.limiter = PeerRateLimiter()
        self.endpoint = ""
        # how late the loop wakes (sampled by _lag_loop, logged as loop_lag every 10 s)
        self.loop_lag = LoopLag()
        # sends in order, bulk state in chunks, and the shell's own requests
        self._sends = ShellSends(
            bulk_links=self.state.bulk, send_s=t.send_s, feed=self._feed, spawn=self._spawn
        )
        request = self._sends.request
        links = LinkMeasurer(request, self._public_keys, timeout_s=4 * t.reply_s)
        if config.measure_links:
            self.state.measured_links = links.known_cluster_links
        self._jobs = JobRunner(
            self.state, request, links, measure_links=config.measure_links, store=self._store
        )

    @property
    def events(self) -> list[dict[str, Any]]:
        return self.state.events

    # ------------------------------------------------------------------ set-up

    def _setup(self) -> None:
        keys_dir = self.config.keys_dir
        opts = self.config.socket_options
        # CURVE wraps each frame in 33 bytes more, and libzmq checks the wrapped size
        frame_limit = min(self.config.max_frame_bytes, opts.max_message_bytes)
        limits = ReceiveLimits(frame_limit + CURVE_FRAME_OVERHEAD, opts.recv_hwm)
        self._router = open_socket(self._context, zmq.ROUTER, opts, limits=limits)
        self._router.setsockopt(zmq.RCVHWM, COORDINATOR_RECV_HWM)  # before the bind
        # A peer that reconnects (its ZMTP heartbeats dropped the connection to a paused or
        # cut-off coordinator) takes over its routing id at once; without this, the new
        # connection stays unread while the stale one is not yet torn down (seen: 30 s).
        self._router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if keys_dir is not None:
            self._keypair = security.load_keypair(keys_dir, "coordinator")
            self._public_keys.update(security.load_public_keys(keys_dir))
            self._roles = KeyRoles.from_dir(keys_dir)
            if self._roles.without_role():
                log.warning(
                    "keys_without_role",
                    keys=self._roles.without_role(),
                    detail="roles.txt does not list these keys: they may send nothing",
                    fix="add 'NAME ROLE' lines, or python -m zpipe keys --role ROLE NAME",
                )
            allow = security.PeerAllowList()
            allow.replace(key for name, key in self._public_keys.items() if name != "coordinator")
            self._authenticator = security.CurveAuthenticator(self._context, allow)
            self._authenticator.start()
            security.secure_server(self._router, self._keypair)
        else:
            security.warn_open_cluster(log, "coordinator")
        self.endpoint = bind_endpoint(self._router, self.config.bind)
        # what each connection makes libzmq hold, cut past its budget (issue 33)
        self._guard = ConnectionGuard(
            self._router, control_port_budget(frame_limit), label="coordinator"
        )
        self._sends.router = self._router
        self.state.local_hosts = this_host_addresses(self.endpoint)

    async def serve(self, *, ready: asyncio.Event | None = None) -> None:
        self._setup()
        self._restore()
        if self._guard is not None:
            self._guard.start()
        log.info(
            "coordinator_listening",
            endpoint=self.endpoint,
            secure=self.config.keys_dir is not None,
            heartbeat_interval=self.config.timeouts.heartbeat_interval_s,
        )
        if ready is not None:
            ready.set()
        receive = asyncio.create_task(self._receive_loop(), name="coordinator-receive")
        ticker = asyncio.create_task(self._tick_loop(), name="coordinator-tick")
        self._spawn(self._lag_loop())
        stopping = asyncio.create_task(self._stopping.wait())
        try:
            done, _ = await asyncio.wait(
                {receive, ticker, stopping}, return_when=asyncio.FIRST_COMPLETED
            )
            for task in done:
                if task is not stopping and not task.cancelled() and task.exception() is not None:
                    # The coordinator cannot go on without these: fail loudly.
                    error = task.exception()
                    log.critical("coordinator_loop_died", task=task.get_name(), error=repr(error))
                    raise error  # type: ignore[misc]
        finally:
            for task in (receive, ticker, stopping, *self._tasks):
                task.cancel()
            for timer in self._timers.values():
                timer.cancel()
            if self._persist_soon is not None:
                self._persist()  # what a burst changed, saved before the stages hear why
            if self._trim_soon is not None:
                self._trim_soon.cancel()
                self._trim_soon = None
            if self.config.shuts_down_stages:
                await self._shutdown_stages("coordinator stopping")
            else:
                log.info(
                    "stages_left_running",
                    stages=[m.name for m in self.membership.alive()],
                    detail="a coordinator started with the same --state-dir takes them over",
                )
            self._close()

    def stop(self) -> None:
        self._stopping.set()

    def _restore(self) -> None:
        if self._store is None:
            return
        try:
            saved = self._store.load_state()
            replica = self._store.load_replica()
            newest_global = self._store.load_global()
            copies = [HeldCopy(r, s) for r, s in self._store.load_copies()]
            self.core.restore(saved, replica, time.monotonic(), newest_global, copies)
        except StateFileError as exc:
            # never half a state: the operator decides whether the saved run is lost
            raise StateFileError(
                f"{exc}; the coordinator did not start. Restore the file from a backup, "
                f"or move it out of {self._store.directory} to start without it (what it held "
                "is then forgotten)"
            ) from exc
        run = self.core.run
        log.info(
            "coordinator_restored",
            state_dir=str(self._store.directory),
            members=sorted(self.state.unconfirmed),
            run=None if run is None else run.run,
            epoch=self.state.epoch,
            replica=None if replica is None else {"run": replica.run, "step": replica.step},
            fallback=fallback_named(self.state.replica),
            copies=self.state.async_copies.summary() or None,
        )

    def _persist(self) -> None:
        if self._persist_soon is not None:  # this save covers what it waited for
            self._persist_soon.cancel()
            self._persist_soon = None
        if self._store is None:
            return
        try:
            self._store.save_state(self.core.saved_state())
        except (OSError, ZpipeError) as exc:
            # The run goes on; only a restart would lose it. Say so loudly.
            log.error("state_not_saved", state_dir=str(self._store.directory), error=str(exc))

    def _trim(self) -> None:
        self._trim_soon = None
        trim_heap()

    def _persist_later(self) -> None:
        if self._store is None or self._persist_soon is not None:
            return
        self._persist_soon = asyncio.get_running_loop().call_later(PERSIST_SOON_S, self._persist)

    async def _shutdown_stages(self, reason: str) -> None:
        for member in self.membership.alive():
            with contextlib.suppress(Exception):
                await self._sends.send(
                    member.routing_id, Shutdown(reason=reason), peer=member.name, timeout_s=0.5
                )

    def _close(self) -> None:
        if self._guard is not None:
            self._guard.stop()
        if self._router is not None:
            self._router.close(linger=0)
        if self._authenticator is not None:
            self._authenticator.stop()
        self._context.term()

    # ------------------------------------------------------------------ loops

    async def _receive_loop(self) -> None:
        assert self._router is not None
        max_bytes = self.config.socket_options.max_message_bytes
        # only a CURVE socket's messages carry a key (asking an open one raises, at a
        # cost per message that showed in a profile of 300 stages' heartbeats)
        secure = self._authenticator is not None
        received = 0
        while True:
            received += 1
            if received % RECEIVE_TURN_EVERY == 0:
                await asyncio.sleep(0)  # the others' turn: see RECEIVE_TURN_EVERY
            frames = await recv_frames(
                self._router, timeout_s=None, peer="any", awaited="control message"
            )
            if len(frames) < 2:
                log.warning("dropped_message", error="no routing id or header")
                continue
            routing_id = frames[0].bytes
            if not self._within_rate(routing_id, frames[1], secure):
                continue
            try:
                user_key = _curve_user_id(frames[1]) if secure else None
                # parsed once, its body checked once: past this point everything sees
                # protocol classes
                typed = decode_typed(frames[1:], max_message_bytes=max_bytes)
                self._check_role(typed.KIND, user_key)
                self._feed(event_of(routing_id, user_key, typed), peer=routing_id)
            except ProtocolError as exc:
                log.warning("dropped_message", peer=printable(routing_id), error=str(exc))
            except RoleError as exc:
                log.warning("role_refused", peer=printable(routing_id), error=str(exc))
            except Exception as exc:  # one message must never end the loop
                log.error(
                    "message_failed", peer=printable(routing_id), error=repr(exc), exc_info=True
                )

    def _within_rate(self, routing_id: bytes, first: zmq.Frame, secure: bool) -> bool:
        """The peer's rate limit, by its CURVE key (new connections give a flooder no
        new buckets), else by connection; a report of the excess every few seconds."""
        peer = (security.sender_public_key(first) if secure else None) or routing_id
        now = time.monotonic()
        if self.limiter.allow(peer, now):
            return True
        report = self.limiter.report_due(now)
        if report is not None:
            log.warning(
                "coordinator_flood_dropped",
                dropped=report.dropped,
                over_s=round(report.over_s, 3),
                worst_peer=printable(report.worst_peer),
                worst_dropped=report.worst_dropped,
                dropped_total=self.limiter.dropped_total,
            )
        return False

    def _check_role(self, kind: str, user_key: str | None) -> None:
        """Raise RoleError when the sender's key may not send ``kind`` (a stage key
        starting a run, a client key registering as a stage)."""
        if self._roles is None or user_key is None:
            return  # an open cluster: no keys, no roles
        self._roles.check(kind, user_key)

    async def _tick_loop(self) -> None:
        interval = self.config.timeouts.heartbeat_interval_s
        while True:
            await asyncio.sleep(interval / 4)
            self._feed(Tick())

    async def _lag_loop(self) -> None:
        """Sample how late the loop wakes (``LAG_SAMPLE_S`` apart) and log it now and then."""
        interval = self.config.timeouts.heartbeat_interval_s
        while True:
            asked_at = time.monotonic() + LAG_SAMPLE_S
            cpu_at = time.thread_time()  # the loop's own work, against waiting for a core
            await asyncio.sleep(LAG_SAMPLE_S)
            woke_at = time.monotonic()
            self.loop_lag.woke(asked_at, woke_at, time.thread_time() - cpu_at)
            lag = self.loop_lag.due(woke_at)
            if lag is not None:
                # debug: a bench reads it; a person needs it only when it grows
                level = "warning" if lag.p99_s > interval / 4 else "debug"
                getattr(log, level)(
                    "loop_lag", members=len(self.membership.live()), **lag.to_fields()
                )

    # --------------------------------------------------------------- commands

    def _feed(self, event: Event, *, peer: bytes | None = None) -> None:
        """Hand ``event`` to the core and carry out what it returns."""
        if not self._runs_imported and isinstance(event, ClientRequest):
            self._runs_imported = import_at_run_request(event.message, len(self.membership.live()))
        try:
            commands = self.core.on_event(event, time.monotonic())
        except Exception as exc:  # a controller's bug: this event is lost, not the process
            log.error(
                "event_failed",
                # not ``event=``: the logger takes the event's name in that argument
                failed_event=type(event).__name__,
                peer=None if peer is None else printable(peer),
                error=repr(exc),
                exc_info=True,
            )
            return
        self._carry_out(commands)

    def _carry_out(self, commands: Iterable[Command]) -> None:
        sends: list[Send] = []
        saved = False
        for command in commands:
            if isinstance(command, Send):
                sends.append(command)
                continue
            if isinstance(command, Persist) and not command.soon:
                # the state saved is the state after the whole batch: once is enough
                # (a death and the re-plan it starts each ask; a save is an fsync)
                if saved:
                    continue
                saved = True
            try:
                self._do(command)
            except Exception as exc:  # one command that fails must not take the rest
                log.error("command_failed", command=type(command).__name__, error=repr(exc))
        if sends:
            self._sends.soon(sends)

    def _do(self, command: Command) -> None:
        if isinstance(command, Log):
            getattr(log, command.level)(command.event, **command.fields)
        elif isinstance(command, Persist):
            if command.soon:
                self._persist_later()
            else:
                self._persist()
        elif isinstance(command, Record):
            self.state.events.append({**command.event, "at": time.time()})
        elif isinstance(command, StartTimer):
            self._timers[command.tag] = asyncio.get_running_loop().call_later(
                command.delay_s, self._timer_fired, command.tag
            )
        elif isinstance(command, RunJob):
            self._spawn(self._run_job(command))
        elif isinstance(command, Deliver):
            self._sends.deliver(command.stage, command.message)
        elif isinstance(command, FailRequests):
            self._sends.fail_requests(command.stage, command.error)
        elif isinstance(command, GiveBackMemory):
            # once for a burst (the chunks of a refused transfer, say): a trim walks
            # every arena, and a peer must not make this process do it per message.
            # An ask while one is due is covered by it (it fell through to
            # unknown_command, an error line per refused chunk).
            if self._trim_soon is None:
                self._trim_soon = asyncio.get_running_loop().call_later(TRIM_SOON_S, self._trim)
        else:
            log.error("unknown_command", command=repr(command))

    def _timer_fired(self, tag: int) -> None:
        self._timers.pop(tag, None)
        self._feed(TimerFired(tag))

    async def _run_job(self, command: RunJob) -> None:
        try:
            job = command.job
            if isinstance(job, ReachClient):  # a send: the sending side's
                result: Any = await self._sends.reach(job)
            else:
                result = await self._jobs.run(job)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the flow that asked decides what it means
            self._feed(JobFailed(command.tag, exc))
            return
        self._feed(JobDone(command.tag, result))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("task_failed", task=task.get_name(), error=repr(task.exception()))


def _curve_user_id(frame: zmq.Frame) -> str | None:
    """The CURVE public key the authenticator saw for this message, if any."""
    key = security.sender_public_key(frame)
    return key.decode() if key is not None else None
