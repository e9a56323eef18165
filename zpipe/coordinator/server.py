"""The coordinator's shell: timers, the state store, jobs and sends; no decisions.

It carries control only. Activations go from the client to the first stage,
stage to stage, and from the last stage back to the client, never through
here, so the coordinator is never the bottleneck.

One ROUTER socket serves stages and clients alike (its control port,
:mod:`zpipe.coordinator.control_port`). A run goes::

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

Every message the control port admits is parsed into its protocol class once,
there, and comes here as an event (:mod:`zpipe.coordinator.events`) by its class;
the pure core (:mod:`zpipe.coordinator.core`) and the run's controller decide, and
this shell carries out the commands they return: sends, timers, persistence, and
jobs (:mod:`zpipe.coordinator.jobs`) whose results come back as events; its
sends go out through :mod:`zpipe.coordinator.shell_sends`. An event that a bug
makes fail is logged with its peer and lost, not the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zpipe._errors import StateFileError, ZpipeError
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
from zpipe.coordinator.control_port import COORDINATOR_MAX_FRAME_BYTES, ControlPort
from zpipe.coordinator.core import CoordinatorCore
from zpipe.coordinator.events import ClientRequest, Event, JobDone, JobFailed, Tick, TimerFired
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
from zpipe.transport.bulk import stall_after_s
from zpipe.transport.message_bounds import trim_heap
from zpipe.transport.sockets import SocketOptions, this_host_addresses

log = get_logger("zpipe.coordinator")

# how often the event loop's lag is sampled (zpipe.coordinator.loop_lag)
LAG_SAMPLE_S = 0.05

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
    # The largest frame a peer may send (see control_port.COORDINATOR_MAX_FRAME_BYTES).
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
        # the listening socket and what it admits; each admitted message comes to _feed
        self.port = ControlPort(
            options=config.socket_options,
            max_frame_bytes=config.max_frame_bytes,
            keys_dir=config.keys_dir,
            public_keys=self._public_keys,
            on_event=self._feed,
        )
        # torch and the run kinds: imported at the first run request (run_kinds.py)
        self._runs_imported = run_kinds_imported()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._timers: dict[int, asyncio.TimerHandle] = {}
        self._persist_soon: asyncio.TimerHandle | None = None
        self._trim_soon: asyncio.TimerHandle | None = None
        self._stopping = asyncio.Event()
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
        self.endpoint = self.port.open(self.config.bind)
        self._sends.router = self.port.router
        self.state.local_hosts = this_host_addresses(self.endpoint)

    async def serve(self, *, ready: asyncio.Event | None = None) -> None:
        self._setup()
        self._restore()
        self.port.start_guard()
        log.info(
            "coordinator_listening",
            endpoint=self.endpoint,
            secure=self.config.keys_dir is not None,
            heartbeat_interval=self.config.timeouts.heartbeat_interval_s,
        )
        if ready is not None:
            ready.set()
        receive = asyncio.create_task(self.port.receive_loop(), name="coordinator-receive")
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
        self.port.close()

    # ------------------------------------------------------------------ loops

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
