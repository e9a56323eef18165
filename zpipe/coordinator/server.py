"""The coordinator: membership, heartbeats, plans, assignment and run control.

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
connects to it. A stage declared dead during a run is reported to that run's client at once
(``stage_failed``); repairing the pipeline is the recovery layer's job.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
import zmq
import zmq.asyncio

from zpipe._errors import (
    ConfigError,
    PeerGoneError,
    ProtocolError,
    TransportTimeout,
    ZpipeError,
)
from zpipe.config import Timeouts
from zpipe.coordinator.links import LinkMeasurer
from zpipe.coordinator.membership import Member, Membership, MemberState
from zpipe.coordinator.persistence import SavedMember, SavedReplica, SavedState, StateStore
from zpipe.coordinator.planning import DEFAULT_PLANNER, choose_plan, cluster_from_members
from zpipe.coordinator.runs import Replica as _Replica
from zpipe.coordinator.runs import Run as _Run
from zpipe.log import get_logger
from zpipe.models import ModelSpec, load_layer_sequence
from zpipe.models.weights import split_unit_key
from zpipe.planner import ClusterLink, ClusterSpec, Plan
from zpipe.planner.hpp import plan_training
from zpipe.planner.plan import StagePlan
from zpipe.planner.profile import ModelProfile
from zpipe.planner.training_cost import TrainingCosts, predict_training
from zpipe.planner.training_plan import TRAINING_ALGOS, TrainingPlan, TrainStage
from zpipe.recovery import (
    COORDINATOR,
    REPLICATIONS,
    asteroid_replication,
    estimate_capacities,
    ftpipehd_replication,
    lightweight_replan,
    respipe_replan,
    speeds_from_capacities,
    speeds_from_cluster,
    stage_work,
    unit_work_from_profile,
)
from zpipe.recovery import (
    POLICIES as RECOVERY_POLICIES,
)
from zpipe.training.objectives import check_train_settings
from zpipe.transport import codec, security
from zpipe.transport.codec import Message
from zpipe.transport.sockets import (
    SocketOptions,
    bind_endpoint,
    decode_frames,
    new_context,
    open_socket,
    recv_frames,
    send,
)

log = get_logger("zpipe.coordinator")

CLIENT_NAME = "client"
PlanT = TypeVar("PlanT", Plan, TrainingPlan)
# Asteroid's choice: keep the stages, shift their boundaries (zpipe.recovery.replanning)
DEFAULT_RECOVERY = "lightweight"


@dataclass
class CoordinatorConfig:
    bind: str = "tcp://0.0.0.0:5550"
    keys_dir: Path | None = None
    timeouts: Timeouts = field(default_factory=Timeouts)
    socket_options: SocketOptions = field(default_factory=SocketOptions)
    # Plan from links the stages measure, not only from what they declare.
    measure_links: bool = True
    # Keep the run and its latest replica here, so a restarted coordinator resumes it.
    state_dir: Path | None = None


class Coordinator:
    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        t = config.timeouts
        self.membership = Membership(
            heartbeat_interval_s=t.heartbeat_interval_s,
            suspect_after_intervals=t.suspect_after_intervals,
            probe_intervals=t.probe_intervals,
        )
        self._context = new_context()
        self._router: zmq.asyncio.Socket | None = None
        self._authenticator: security.CurveAuthenticator | None = None
        self._public_keys: dict[str, bytes] = {}
        self._keypair: security.KeyPair | None = None
        self._epoch = 0
        self._run_counter = 0
        self._run: _Run | None = None
        # the latest global replica of a training run (FTPipeHD's global replication)
        self._replica: _Replica | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stopping = asyncio.Event()
        self.endpoint = ""
        self.events: list[dict[str, Any]] = []
        self._profile_cache: dict[tuple[ModelSpec, int, str, str, float, bool], ModelProfile] = {}
        # Replies a request awaits, by (stage, reply kind): one request of a kind at a time.
        self._reply_waiters: dict[tuple[str, str], asyncio.Future[Message]] = {}
        self._links = LinkMeasurer(
            self._request, self._public_keys, timeout_s=4 * config.timeouts.reply_s
        )
        self._store = StateStore(config.state_dir) if config.state_dir is not None else None
        # Members restored from disk that have not spoken to this process yet.
        self._unconfirmed: set[str] = set()
        self._confirmed = asyncio.Event()
        # Client requests being answered, by (kind, run, step): a request the client
        # sends again (it reconnected to a restarted coordinator) shares the answer.
        self._answering: dict[tuple[str, int, int], asyncio.Future[Message]] = {}

    # ------------------------------------------------------------------ set-up

    def _setup(self) -> None:
        keys_dir = self.config.keys_dir
        self._router = open_socket(self._context, zmq.ROUTER, self.config.socket_options)
        if keys_dir is not None:
            self._keypair = security.load_keypair(keys_dir, "coordinator")
            self._public_keys.update(security.load_public_keys(keys_dir))
            allow = security.PeerAllowList()
            allow.replace(key for name, key in self._public_keys.items() if name != "coordinator")
            self._authenticator = security.CurveAuthenticator(self._context, allow)
            self._authenticator.start()
            security.secure_server(self._router, self._keypair)
        else:
            security.warn_open_cluster(log, "coordinator")
        self.endpoint = bind_endpoint(self._router, self.config.bind)

    async def serve(self, *, ready: asyncio.Event | None = None) -> None:
        self._setup()
        self._restore()
        log.info(
            "coordinator_listening",
            endpoint=self.endpoint,
            secure=self.config.keys_dir is not None,
            heartbeat_interval=self.config.timeouts.heartbeat_interval_s,
        )
        if ready is not None:
            ready.set()
        receive = asyncio.create_task(self._receive_loop())
        ticker = asyncio.create_task(self._tick_loop())
        stopping = asyncio.create_task(self._stopping.wait())
        try:
            done, _ = await asyncio.wait(
                {receive, ticker, stopping}, return_when=asyncio.FIRST_COMPLETED
            )
            for task in done:
                if not task.cancelled() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
        finally:
            for task in (receive, ticker, stopping, *self._tasks):
                task.cancel()
            await self._shutdown_stages("coordinator stopping")
            self._close()

    def stop(self) -> None:
        self._stopping.set()

    # ------------------------------------------------------------ persistence

    def _restore(self) -> None:
        """Take over the members, the run and the replica a previous coordinator saved.

        Restored members count as alive from now: one that does not speak within the
        usual suspect and probe intervals is declared dead as any other would be.
        """
        if self._store is None:
            return
        saved = self._store.load_state()
        replica = self._store.load_replica()
        if saved is not None:
            self._epoch = max(self._epoch, saved.epoch)
            self._run_counter = max(self._run_counter, saved.run_counter)
            now = time.monotonic()
            for m in saved.members:
                self.membership.register(
                    name=m.name,
                    routing_id=m.routing_id,
                    data_endpoint=m.data_endpoint,
                    info=m.info,
                    public_key=m.public_key,
                    now=now,
                )
                self._unconfirmed.add(m.name)
            if saved.run is not None:
                self._run = _Run.from_saved(saved.run)
        if replica is not None:
            self._replica = _Replica(
                replica.run,
                replica.step,
                TrainingPlan.from_dict(replica.plan),
                replica.state,
                dict(replica.holders),
            )
        log.info(
            "coordinator_restored",
            state_dir=str(self._store.directory),
            members=sorted(self._unconfirmed),
            run=None if self._run is None else self._run.run,
            epoch=self._epoch,
            replica=None if replica is None else {"run": replica.run, "step": replica.step},
        )

    def _persist(self) -> None:
        """Save counters, live members and the current run (small; on every change)."""
        if self._store is None:
            return
        members = tuple(
            SavedMember(m.name, m.routing_id, m.data_endpoint, m.info, m.public_key)
            for m in self.membership.alive()
        )
        run = None if self._run is None else self._run.to_saved()
        try:
            self._store.save_state(SavedState(self._epoch, self._run_counter, members, run))
        except (OSError, ZpipeError) as exc:
            # The run goes on; only a restart would lose it. Say so loudly.
            log.error("state_not_saved", state_dir=str(self._store.directory), error=str(exc))

    async def _await_restored(self, names: list[str]) -> None:
        """Wait until restored members among ``names`` spoke or were declared dead."""
        t = self.config.timeouts
        deadline = time.monotonic() + (t.suspect_after_intervals + t.probe_intervals + 1) * (
            t.heartbeat_interval_s
        )
        while any(n in self._unconfirmed for n in names):
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._confirmed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._confirmed.wait(), left)

    def _confirm(self, name: str) -> None:
        """``name`` spoke to this process, or died: it is no longer only restored."""
        if name in self._unconfirmed:
            self._unconfirmed.discard(name)
            self._confirmed.set()

    async def _answer_once(
        self, key: tuple[str, int, int], answer: Callable[[], Awaitable[Message]]
    ) -> Message:
        """``answer()``, or the answer already being prepared for the same request."""
        pending = self._answering.get(key)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._answering[key] = future
        try:
            result = await answer()
        except asyncio.CancelledError:
            future.cancel()
            raise
        except Exception as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: a lone request must not log it as lost
            raise
        finally:
            self._answering.pop(key, None)
        future.set_result(result)
        return result

    async def _shutdown_stages(self, reason: str) -> None:
        for member in self.membership.alive():
            with contextlib.suppress(Exception):
                await self._send(
                    member.routing_id,
                    Message("shutdown", {"reason": reason}),
                    peer=member.name,
                    timeout_s=0.5,
                )

    def _close(self) -> None:
        if self._router is not None:
            self._router.close(linger=0)
        if self._authenticator is not None:
            self._authenticator.stop()
        self._context.term()

    # ------------------------------------------------------------- messaging

    async def _send(
        self, routing_id: bytes, message: Message, *, peer: str, timeout_s: float | None = None
    ) -> None:
        assert self._router is not None
        try:
            await send(
                self._router,
                message,
                routing_id=routing_id,
                peer=peer,
                timeout_s=timeout_s or self.config.timeouts.send_s,
            )
        except zmq.ZMQError as exc:  # ROUTER_MANDATORY: the peer is not connected
            raise PeerGoneError(peer, message.kind) from exc

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("task_failed", error=repr(task.exception()))

    async def _receive_loop(self) -> None:
        assert self._router is not None
        max_bytes = self.config.socket_options.max_message_bytes
        while True:
            frames = await recv_frames(
                self._router, timeout_s=None, peer="any", awaited="control message"
            )
            if len(frames) < 2:
                log.warning("dropped_message", error="no routing id or header")
                continue
            routing_id = frames[0].bytes
            user_key = _curve_user_id(frames[1])
            try:
                message = decode_frames(frames[1:], max_bytes)
                await self._handle(routing_id, user_key, message)
            except ProtocolError as exc:
                log.warning("dropped_message", peer=_printable(routing_id), error=str(exc))
            except TransportTimeout as exc:
                log.warning("reply_failed", peer=_printable(routing_id), error=str(exc))

    async def _tick_loop(self) -> None:
        interval = self.config.timeouts.heartbeat_interval_s
        while True:
            await asyncio.sleep(interval / 4)
            now = time.monotonic()
            probes, deaths = self.membership.tick(now)
            for probe in probes:
                member = self.membership.get(probe.name)
                assert member is not None
                log.warning(
                    "stage_suspect", stage=probe.name, silent_s=round(now - member.last_seen, 2)
                )
                with contextlib.suppress(TransportTimeout):
                    await self._send(
                        member.routing_id,
                        Message("probe", {"nonce": probe.nonce}),
                        peer=probe.name,
                        timeout_s=interval,
                    )
            for death in deaths:
                await self._on_death(death.name, death.reason, death.silent_s)

    async def _on_death(self, name: str, reason: str, silent_s: float) -> None:
        log.error("stage_dead", stage=name, reason=reason, silent_s=round(silent_s, 2))
        self._confirm(name)
        event = {
            "event": "stage_dead",
            "stage": name,
            "reason": reason,
            "silent_s": silent_s,
            "at": time.time(),
        }
        for (peer, _), waiter in self._reply_waiters.items():
            if peer == name and not waiter.done():
                # a request to the dead stage (weights for a replica, say) fails now
                waiter.set_exception(ConfigError(f"stage {name!r} died: {reason}"))
        run = self._run
        if run is not None and name in run.devices:
            event["run"] = run.run
            run.failed.add(name)
            for futures in (run.ready, run.metrics):
                fut = futures.get(name)
                if fut is not None and not fut.done():
                    fut.set_exception(ConfigError(f"stage {name!r} died: {reason}"))
            if run.recover and run.streaming and run.request is not None:
                self._spawn(self._recover_inference(run, name, time.monotonic(), silent_s))
            else:
                await self._notify_stage_failed(run, name, reason)
        self.events.append(event)
        self._persist()

    # --------------------------------------------------------------- handlers

    async def _handle(self, routing_id: bytes, user_key: str | None, message: Message) -> None:
        kind = message.kind
        now = time.monotonic()
        if kind == "register":
            await self._on_register(routing_id, user_key, message, now)
            return
        if kind == "run_request":
            self._spawn(self._on_run_request(routing_id, user_key, message))
            return
        if kind == "stalled":
            await self._on_stalled(message, now)
            return
        if kind in ("run_go", "run_end", "cluster_request", "weights_request", "replicate"):
            handler = {
                "run_go": self._on_run_go,
                "run_end": self._on_run_end,
                "cluster_request": self._on_cluster_request,
                "weights_request": self._on_weights_request,
                "replicate": self._on_replicate,
            }[kind]
            self._spawn(handler(routing_id, message))
            return
        member = self.membership.by_routing_id(routing_id)
        if member is None:
            if kind == "heartbeat":
                # A stage this process does not know (it restarted without its state,
                # or declared the stage dead): it registers again and can be planned.
                await self._send(
                    routing_id,
                    Message("register_again", {"reason": "this coordinator does not know you"}),
                    peer=_printable(routing_id),
                    timeout_s=self.config.timeouts.heartbeat_interval_s,
                )
                return
            raise ProtocolError(f"{kind!r} from a peer that is not registered")
        self._confirm(member.name)
        self.membership.heard_from(member.name, now, message.get("metrics"))
        if kind == "heartbeat":
            await self._send(
                routing_id,
                Message("heartbeat_ack"),
                peer=member.name,
                timeout_s=self.config.timeouts.heartbeat_interval_s,
            )
        elif kind == "probe_ack":
            log.info("stage_answered_probe", stage=member.name)
        elif kind in ("profile_reply", "link_peers_ok", "link_probe_reply", "weights", "backed_up"):
            waiter = self._reply_waiters.get((member.name, kind))
            if waiter is not None and not waiter.done():
                waiter.set_result(message)
        elif kind in ("ready", "assign_failed", "connected", "metrics"):
            self._resolve_run_reply(member, message)
        else:
            raise ProtocolError(f"unexpected {kind!r} from stage {member.name!r}")

    async def _on_stalled(self, message: Message, now: float) -> None:
        """The client's results are late: probe every stage of the run now rather than
        after their heartbeats lapse. One that answers is slow and stays; one that
        does not is declared dead after the probe intervals, as any other."""
        run = self._run
        if run is None or run.run != message["run"]:
            return  # a late report of a run already over
        log.warning(
            "stall_reported",
            run=run.run,
            waited_s=round(float(message["waited_s"]), 3),
            deadline_s=round(float(message["deadline_s"]), 3),
        )
        interval = self.config.timeouts.heartbeat_interval_s
        for name in run.devices:
            probe = self.membership.suspect(name, now)
            member = self.membership.get(name)
            if probe is None or member is None:
                continue
            log.warning("stage_suspect", stage=name, reason="stall")
            with contextlib.suppress(TransportTimeout):
                await self._send(
                    member.routing_id,
                    Message("probe", {"nonce": probe.nonce}),
                    peer=name,
                    timeout_s=interval,
                )

    async def _on_register(
        self, routing_id: bytes, user_key: str | None, message: Message, now: float
    ) -> None:
        name = str(message["name"])
        if self._public_keys:
            expected = self._public_keys.get(name)
            if expected is None or user_key is None or expected.decode() != user_key:
                log.warning("registration_refused", stage=name, reason="key does not match name")
                await self._send(
                    routing_id,
                    Message("refused", {"reason": f"the key this stage uses is not {name}.key"}),
                    peer=name,
                    timeout_s=self.config.timeouts.reply_s,
                )
                return
        previous = self.membership.get(name)
        run = self._run
        if (
            previous is not None
            and previous.state is not MemberState.DEAD
            and run is not None
            and name in run.devices
            and name not in run.failed
            and previous.data_endpoint != str(message["data_endpoint"])
        ):
            # A new process under the name of one of the run's stages: the one that
            # ran the run is gone (restarted), so the run has lost it.
            death = self.membership.declare_dead(name, "the stage restarted", now)
            if death is not None:
                await self._on_death(death.name, death.reason, death.silent_s)
        try:
            member = self.membership.register(
                name=name,
                routing_id=routing_id,
                data_endpoint=str(message["data_endpoint"]),
                info=dict(message["info"]),
                public_key=(
                    self._public_keys[name].decode() if name in self._public_keys else None
                ),
                now=now,
            )
        except ConfigError as exc:
            await self._send(
                routing_id,
                Message("refused", {"reason": str(exc)}),
                peer=name,
                timeout_s=self.config.timeouts.reply_s,
            )
            return
        log.info(
            "stage_registered", stage=name, data_endpoint=member.data_endpoint, info=member.info
        )
        self._confirm(name)
        self._persist()
        await self._send(
            routing_id,
            Message(
                "registered",
                {"name": name, "heartbeat_interval": self.config.timeouts.heartbeat_interval_s},
            ),
            peer=name,
            timeout_s=self.config.timeouts.reply_s,
        )

    def _resolve_run_reply(self, member: Member, message: Message) -> None:
        run = self._run
        if run is None or message["run"] != run.run:
            log.debug("late_reply", stage=member.name, kind=message.kind, run=message["run"])
            return
        if message.kind == "ready":
            fut = run.ready.get(member.name)
            if fut is not None and not fut.done():
                if message.get("ring_endpoint"):
                    run.ring_endpoints[member.name] = str(message["ring_endpoint"])
                fut.set_result(float(message["build_s"]))
        elif message.kind == "assign_failed":
            error = ConfigError(f"stage {member.name!r}: {message['error']}")
            for futures in (run.ready, run.connected):
                pending = futures.get(member.name)
                if pending is not None and not pending.done():
                    pending.set_exception(error)
        elif message.kind == "connected":
            connected = run.connected.get(member.name)
            if connected is not None and not connected.done():
                connected.set_result(None)
        else:
            metrics_fut = run.metrics.get(member.name)
            if metrics_fut is not None and not metrics_fut.done():
                metrics_fut.set_result(dict(message["metrics"]))

    async def _on_cluster_request(self, routing_id: bytes, message: Message) -> None:
        members = [m.to_dict() for m in self.membership.all()]
        await self._send(
            routing_id,
            Message("cluster_state", {"members": members}),
            peer=CLIENT_NAME,
            timeout_s=self.config.timeouts.reply_s,
        )

    async def _choose_devices(self, message: Message) -> list[Member]:
        """The stages for a run, waiting up to ``wait_for_stages_s`` for enough to register."""
        names = message.get("stage_names")
        count = message.get("stages")
        partition = message.get("partition")
        if count is None and partition is not None:
            count = len(partition)
        deadline = time.monotonic() + float(message["wait_for_stages_s"])
        while True:
            # By name, so that the same cluster gives the same plan whatever the join order.
            alive = sorted(
                (m for m in self.membership.alive() if m.state is MemberState.ALIVE),
                key=lambda m: m.name,
            )
            if names is not None:
                by_name = {m.name: m for m in alive}
                if all(n in by_name for n in names):
                    return [by_name[n] for n in names]
                missing = [n for n in names if n not in by_name]
                problem = f"stages {missing} are not registered"
            else:
                # Without a count, every stage registered now takes part.
                need = count or 1
                if len(alive) >= need:
                    return alive[:need] if count is not None else alive
                problem = f"{len(alive)} stages registered, {need} needed"
            if time.monotonic() >= deadline:
                raise ConfigError(f"{problem} after waiting {message['wait_for_stages_s']} s")
            await asyncio.sleep(0.05)

    async def _on_run_request(
        self, routing_id: bytes, user_key: str | None, message: Message
    ) -> None:
        try:
            ready = await self._start_run(routing_id, user_key, message)
        except (ZpipeError, ValueError) as exc:
            self._run = None
            self._persist()
            await self._reply_run_failed(routing_id, exc)
            return
        self._persist()
        await self._send(
            routing_id, ready, peer=CLIENT_NAME, timeout_s=self.config.timeouts.reply_s
        )

    async def _reply_run_failed(self, routing_id: bytes, error: Exception) -> None:
        log.error("run_failed", error=str(error))
        await self._send(
            routing_id,
            Message("run_failed", {"error": str(error)}),
            peer=CLIENT_NAME,
            timeout_s=self.config.timeouts.reply_s,
        )

    async def _start_run(
        self, routing_id: bytes, client_key: str | None, message: Message
    ) -> Message:
        if self._run is not None:
            log.warning("run_replaced", previous=self._run.run)
        spec = ModelSpec.from_dict(message["model"])
        num_units = load_layer_sequence(spec).num_units
        mode = message.get("mode") or "infer"
        if mode not in ("infer", "train"):
            raise ConfigError(f"unknown run mode {mode!r}; use infer or train")
        recovery = message.get("recovery") or DEFAULT_RECOVERY
        if recovery not in RECOVERY_POLICIES:
            raise ConfigError(
                f"unknown recovery {recovery!r}; choose one of {', '.join(RECOVERY_POLICIES)}"
            )
        replication = message.get("replication") or "global"
        if replication not in REPLICATIONS:
            raise ConfigError(
                f"unknown replication {replication!r}; choose one of {', '.join(REPLICATIONS)}"
            )
        rebalance = message.get("rebalance")
        if rebalance is not None and not 0 < rebalance < 1:
            raise ConfigError(f"rebalance must lie in (0, 1), got {rebalance}")
        settings = dict(message.get("train") or {})
        replica = None
        if mode == "train" and message.get("resume") is not None:
            replica = self._replica_to_resume(dict(message["resume"]), spec)
            names = message.get("stage_names")
            if names is not None:
                # Stages that died with the one the client heard of (not yet declared when
                # it asked) are left out too, rather than waited for.
                alive = {m.name for m in self.membership.alive() if m.state is MemberState.ALIVE}
                dead = set(message["resume"].get("dead") or [])
                kept = [n for n in names if n in alive and n not in dead]
                message = Message("run_request", {**message.body, "stage_names": kept})
            if message["resume"].get("consistency") == "fast":
                replica = await self._fast_replica(replica, message)
            if recovery != "heavy" and settings.get("plan") is None:
                given = self._replan_training(replica, recovery, message, spec)
                return await self._start_training_run(
                    routing_id, client_key, message, spec, given, replica=replica
                )
        if mode == "train" and settings.get("plan") is not None:
            given = TrainingPlan.from_dict(settings["plan"])
            return await self._start_training_run(
                routing_id, client_key, message, spec, given, replica=replica
            )
        members = await self._choose_devices(message)
        algo = str(message.get("planner") or DEFAULT_PLANNER)
        if mode == "train" and algo in TRAINING_ALGOS and message.get("partition") is None:
            planned = await self._plan_training(spec, members, message, settings)
            return await self._start_training_run(
                routing_id, client_key, message, spec, planned, replica=replica
            )
        plan, baseline = await self._plan(spec, num_units, members, message)
        if mode == "train":
            return await self._start_training_run(
                routing_id, client_key, message, spec, None, straight=plan, replica=replica
            )
        members = [m for m in members if m.name in plan.devices]
        self._epoch += 1
        self._run_counter += 1
        run = _Run(
            run=self._run_counter,
            epoch=self._epoch,
            client=routing_id,
            plan=plan,
            client_key=client_key,
            request=message,
            recover=bool(message.get("recover", False)),
        )
        self._run = run
        log.info(
            "run_planned",
            run=run.run,
            epoch=run.epoch,
            plan=plan.to_dict(),
            baseline=baseline.to_dict() if baseline is not None else None,
        )
        by_name = {m.name: m for m in members}
        await self._assign_inference(run, spec, by_name, message)
        return Message(
            "run_ready",
            {
                **self._endpoints_of(plan, by_name),
                "run": run.run,
                "plan": plan.to_dict(),
                "baseline": baseline.to_dict() if baseline is not None else None,
            },
            epoch=run.epoch,
        )

    def _endpoints_of(self, plan: Plan, by_name: dict[str, Member]) -> dict[str, Any]:
        """Where the client sends inputs and whose results it accepts."""
        first, last = plan.stages[0].device, plan.stages[-1].device
        return {
            "first_endpoint": by_name[first].data_endpoint,
            "first_stage": first,
            "first_key": self._key_of(first),
            "last_stage": last,
            "last_key": self._key_of(last),
            "last_endpoint": by_name[last].data_endpoint,
        }

    async def _assign_inference(
        self, run: _Run, spec: ModelSpec, by_name: dict[str, Member], message: Message
    ) -> None:
        """Send every stage of ``run.plan`` its assignment; wait until all are ready."""
        plan = run.plan
        loop = asyncio.get_running_loop()
        run.ready = {}
        for i, stage in enumerate(plan.stages):
            member = by_name[stage.device]
            last = i == len(plan.stages) - 1
            downstream = CLIENT_NAME if last else plan.stages[i + 1].device
            endpoint = (
                str(message["sink_endpoint"])
                if last
                else by_name[plan.stages[i + 1].device].data_endpoint
            )
            upstream = CLIENT_NAME if i == 0 else plan.stages[i - 1].device
            run.ready[stage.device] = loop.create_future()
            await self._send(
                member.routing_id,
                Message(
                    "assign",
                    {
                        "run": run.run,
                        "model": spec.to_dict(),
                        "start": stage.start,
                        "end": stage.end,
                        "index": i,
                        "num_stages": len(plan.stages),
                        "upstream": upstream,
                        "upstream_key": self._key_of(upstream),
                        "downstream": downstream,
                        "downstream_endpoint": endpoint,
                        "downstream_key": self._key_of(downstream),
                        "dtype": str(message["dtype"]),
                    },
                    epoch=run.epoch,
                ),
                peer=member.name,
            )
        build_times = await _await_all(
            run.ready, timeout_s=self.config.timeouts.assign_s, awaited="ready after assignment"
        )
        log.info(
            "run_ready",
            run=run.run,
            epoch=run.epoch,
            build_s={n: round(b, 3) for n, b in zip(run.ready, build_times, strict=False)},
        )

    async def _recover_inference(
        self, run: _Run, dead: str, detected_at: float, silent_s: float
    ) -> None:
        """Re-plan a stream without a dead stage and tell the client to replay.

        Inference weights come from the model spec, so the survivors only build
        their new units; the client resends every micro-batch whose result it
        has not received, and drops results of the old epoch, so each output
        arrives once.
        """
        request = run.request
        assert request is not None
        policy = str(request.get("recovery") or DEFAULT_RECOVERY)
        try:
            spec = ModelSpec.from_dict(request["model"])
            num_units = load_layer_sequence(spec).num_units
            survivors = [
                m
                for m in self.membership.alive()
                if m.state is MemberState.ALIVE
                and m.name not in run.failed
                and (request.get("stage_names") is None or m.name in request["stage_names"])
            ]
            survivors.sort(key=lambda m: m.name)
            if not survivors:
                raise ConfigError("no stage is left to run the model")
            names = [m.name for m in survivors]
            if policy == "heavy":
                # The old partition named the dead stage: plan the survivors afresh.
                replan = Message(
                    "run_request",
                    {**request.body, "partition": None, "stage_names": names, "stages": None},
                )
                plan, _ = await self._plan(spec, num_units, survivors, replan)
            else:
                plan = self._replan_in_place(
                    run.plan,
                    run.failed,
                    policy,
                    spec,
                    survivors,
                    batch_size=int(request.get("microbatch_size") or 1),
                    dtype=str(request["dtype"]),
                    train=False,
                )
            planned_at = time.monotonic()
            self._epoch += 1
            run.epoch = self._epoch
            run.plan = plan
            run.devices = list(plan.devices)
            by_name = {m.name: m for m in survivors}
            await self._assign_inference(run, spec, by_name, request)
            await self._connect_all(run)
            self._persist()
        except (ZpipeError, ValueError) as exc:
            log.error("recovery_failed", run=run.run, stage=dead, error=str(exc))
            await self._notify_stage_failed(run, dead, f"died, and recovery failed: {exc}")
            return
        now = time.monotonic()
        timeline = {
            "detected_s": round(silent_s, 3),
            "replanned_s": round(planned_at - detected_at, 3),
            "recovered_s": round(now - detected_at, 3),
        }
        log.info(
            "run_recovered",
            run=run.run,
            epoch=run.epoch,
            dead=dead,
            policy=policy,
            plan=plan.to_dict(),
            **timeline,
        )
        self.events.append(
            {"event": "run_recovered", "run": run.run, "dead": dead, "policy": policy, **timeline}
        )
        with contextlib.suppress(TransportTimeout):
            await self._send(
                run.client,
                Message(
                    "run_replanned",
                    {
                        **self._endpoints_of(plan, by_name),
                        "run": run.run,
                        "plan": plan.to_dict(),
                        "dead": dead,
                        "detected_s": timeline["detected_s"],
                        "recovered_s": timeline["recovered_s"],
                    },
                    epoch=run.epoch,
                ),
                peer=CLIENT_NAME,
                timeout_s=self.config.timeouts.reply_s,
            )

    def _replan_in_place(
        self,
        plan: PlanT,
        failed: set[str],
        policy: str,
        spec: ModelSpec,
        survivors: list[Member],
        *,
        batch_size: int,
        dtype: str,
        train: bool,
    ) -> PlanT:
        """The surviving stages keep their order; "lightweight" moves unit boundaries so
        each stage's work matches its speed (from the stages' cached profiles, when the
        run was planned from them; else every unit and device counts alike), "respipe"
        hands a dead stage's units to the next one."""
        num_units = plan.num_units
        profiles = {
            m.name: self._profile_cache.get((spec, batch_size, dtype, m.name, m.joined_at, train))
            for m in survivors
        }
        unit_work: list[float] = [1.0] * num_units
        speeds: dict[str, float] | None = None
        known = {name: p for name, p in profiles.items() if p is not None}
        if len(known) == len(survivors):
            profile = known[survivors[0].name]
            cluster = cluster_from_members(survivors, known)
            unit_work = unit_work_from_profile(profile, batch_size, training=train)
            speeds = speeds_from_cluster(profile, cluster, batch_size)
        if policy == "respipe":
            return respipe_replan(plan, failed=failed, speeds=speeds)
        return lightweight_replan(plan, failed=failed, unit_work=unit_work, speeds=speeds)

    async def _notify_stage_failed(self, run: _Run, name: str, reason: str) -> None:
        with contextlib.suppress(TransportTimeout):
            await self._send(
                run.client,
                Message(
                    "stage_failed",
                    {"run": run.run, "stage": name, "reason": reason},
                    epoch=run.epoch,
                ),
                peer=CLIENT_NAME,
                timeout_s=self.config.timeouts.reply_s,
            )

    async def _start_training_run(
        self,
        routing_id: bytes,
        client_key: str | None,
        message: Message,
        spec: ModelSpec,
        given: TrainingPlan | None,
        *,
        straight: Plan | None = None,
        replica: _Replica | None = None,
    ) -> Message:
        """Assign a training run: a plan of device groups, or a straight pipeline; with
        ``replica``, every stage starts from its units' state in it."""
        settings = dict(message.get("train") or {})
        settings.pop("plan", None)
        if given is not None:
            tplan = given
            num_units = load_layer_sequence(spec).num_units
            if tplan.num_units != num_units:
                raise ConfigError(
                    f"the training plan covers {tplan.num_units} units, the model has {num_units}"
                )
            settings["schedule"] = tplan.schedule
            settings["num_microbatches"] = tplan.num_microbatches
            settings["warmups"] = tplan.warmups
            members = await self._choose_devices(
                Message("run_request", {**message.body, "stage_names": tplan.devices})
            )
            groups = [(list(st.devices), st.start, st.end, list(st.shares)) for st in tplan.stages]
        else:
            assert straight is not None
            members = await self._choose_devices(message)
            groups = [([st.device], st.start, st.end, [1]) for st in straight.stages]
        training = check_train_settings(settings, len(groups))
        by_name = {m.name: m for m in members}
        self._epoch += 1
        self._run_counter += 1
        view = Plan(
            algo=tplan.algo if given is not None else (straight.algo if straight else "even"),
            num_units=groups[-1][2],
            stages=tuple(StagePlan(g[0][0], g[1], g[2]) for g in groups),
            predicted=dict(tplan.predicted)
            if given is not None
            else dict(straight.predicted)
            if straight is not None
            else {},
        )
        run = _Run(
            run=self._run_counter,
            epoch=self._epoch,
            client=routing_id,
            plan=view,
            client_key=client_key,
            devices=[d for g in groups for d in g[0]],
            groups=[list(g[0]) for g in groups],
        )
        self._run = run
        log.info("run_planned", run=run.run, epoch=run.epoch, mode="train", groups=groups)
        client = {
            "names": [CLIENT_NAME],
            "shares": [1],
            "endpoints": [str(message["sink_endpoint"])],
            "keys": [self._key_of(CLIENT_NAME)],
        }

        def side(i: int) -> dict[str, Any]:
            if i < 0 or i >= len(groups):
                return client
            names, _, _, shares = groups[i]
            return {
                "names": names,
                "shares": shares,
                "endpoints": [by_name[n].data_endpoint for n in names],
                "keys": [self._key_of(n) for n in names],
            }

        if replica is not None and replica.at_stages and self._public_keys:
            # stages fetch units from each other's probe sockets: allowed beforehand
            await self._links.allow_peers(
                [m for m in self.membership.alive() if m.state is MemberState.ALIVE]
            )
        loop = asyncio.get_running_loop()
        for i, (names, start, end, shares) in enumerate(groups):
            for rank, name in enumerate(names):
                run.ready[name] = loop.create_future()
                up, down = side(i - 1), side(i + 1)
                train = {
                    "schedule": training["schedule"],
                    "num_microbatches": training["num_microbatches"],
                    "warmup": training["warmups"][i],
                    "loss": training["loss"],
                    "optimizer": training["optimizer"],
                    "group": {"names": names, "shares": shares, "rank": rank},
                    "upstream": up,
                    "downstream": down,
                }
                body = {
                    "mode": "train",
                    "train": train,
                    "run": run.run,
                    "model": spec.to_dict(),
                    "start": start,
                    "end": end,
                    "index": i,
                    "num_stages": len(groups),
                    "upstream": up["names"][0],
                    "upstream_key": up["keys"][0],
                    "downstream": down["names"][0],
                    "downstream_endpoint": down["endpoints"][0],
                    "downstream_key": down["keys"][0],
                    "dtype": "float32",
                }
                state: dict[str, torch.Tensor] = {}
                if replica is not None:
                    state = _units_state(replica.state, start, end)
                    body["state_keys"] = list(state)
                    if replica.at_stages:
                        body["fetch"] = self._fetch_plan(replica, name, start, end, by_name)
                assign = Message("assign", body, epoch=run.epoch, tensors=tuple(state.values()))
                await self._send(by_name[name].routing_id, assign, peer=name)
        await _await_all(
            run.ready, timeout_s=self.config.timeouts.assign_s, awaited="ready after assignment"
        )
        tplan_out = (
            tplan
            if given is not None
            else TrainingPlan(
                algo=view.algo,
                schedule=training["schedule"],
                num_units=view.num_units,
                microbatch_size=1,
                num_microbatches=training["num_microbatches"],
                stages=tuple(
                    TrainStage((n[0],), a, b, (1,), w)
                    for (n, a, b, _), w in zip(groups, training["warmups"], strict=True)
                ),
                predicted=dict(view.predicted),
            )
        )
        run.training_plan = tplan_out
        run.request = message
        run.rebalance = message.get("rebalance")
        run.replication = str(message.get("replication") or "global")
        first, last = groups[0][0], groups[-1][0]
        return Message(
            "run_ready",
            {
                "run": run.run,
                "plan": view.to_dict(),
                "baseline": None,
                "first_endpoint": by_name[first[0]].data_endpoint,
                "first_stage": first[0],
                "first_key": self._key_of(first[0]),
                "last_stage": last[0],
                "last_key": self._key_of(last[0]),
                "last_endpoint": by_name[last[0]].data_endpoint,
                "training_plan": {
                    **tplan_out.to_dict(),
                    "endpoints": {n: by_name[n].data_endpoint for n in run.devices},
                    "keys": {n: self._key_of(n) for n in run.devices},
                },
            },
            epoch=run.epoch,
        )

    async def _plan_training(
        self,
        spec: ModelSpec,
        members: list[Member],
        message: Message,
        settings: dict[str, Any],
    ) -> TrainingPlan:
        """Plan a training run from every stage's own training profile and measured links."""
        algo = str(message["planner"])
        batch = message.get("microbatch_size")
        if batch is None:
            raise ConfigError(f"planner {algo!r} needs the micro-batch size (microbatch_size)")
        checked = check_train_settings(settings, 1)
        optimizer = checked["optimizer"]
        profile, cluster = await self._training_model(spec, members, int(batch))
        plan = plan_training(
            profile,
            cluster,
            microbatch_size=int(batch),
            num_microbatches=int(checked["num_microbatches"]),
            algo=algo,
            schedule=str(checked["schedule"]),
            optimizer=_memory_model(optimizer),
            devices=[m.name for m in members],
        )
        log.info("training_planned", plan=plan.to_dict())
        return plan

    async def _training_model(
        self, spec: ModelSpec, members: list[Member], batch: int
    ) -> tuple[ModelProfile, ClusterSpec]:
        """The training profile and the cluster (profiled devices, measured links)."""
        profiles = await self._profiles_of(members, spec, batch, "float32", train=True)
        cluster = cluster_from_members(members, profiles, links=await self._measured_links(members))
        return profiles[members[0].name], cluster

    async def _with_newcomers(self, run: _Run, plan: TrainingPlan) -> TrainingPlan | None:
        """A device that registered (or came back) since the run was planned joins it at
        a replica when the planner, over it and the run's devices, predicts a round
        shorter by at least ``run.rebalance`` than the current plan's (same cost model)."""
        assert run.request is not None and run.rebalance is not None
        admit = run.request.get("admit")
        newcomers = [
            m
            for m in self.membership.alive()
            if m.state is MemberState.ALIVE
            and m.name not in run.devices
            and (admit is None or m.name in admit)
        ]
        current = [self.membership.get(d) for d in plan.devices]
        if not newcomers or any(m is None for m in current):
            return None
        members = [m for m in current if m is not None] + newcomers
        settings = dict(run.request.get("train") or {})
        settings.pop("plan", None)
        settings.update(schedule=plan.schedule, num_microbatches=plan.num_microbatches)
        planner = str(run.request.get("planner") or "hpp")
        batch = int(run.request.get("microbatch_size") or plan.microbatch_size)
        request = Message(
            "run_request",
            {
                **run.request.body,
                "planner": planner if planner in TRAINING_ALGOS else "hpp",
                "microbatch_size": batch,
            },
        )
        spec = ModelSpec.from_dict(run.request["model"])
        try:
            bigger = await self._plan_training(spec, members, request, settings)
            profile, cluster = await self._training_model(spec, members, batch)
            optimizer = check_train_settings(settings, 1)["optimizer"]
            costs = TrainingCosts(profile, cluster, microbatch_size=batch,
                                  optimizer=_memory_model(optimizer))  # fmt: skip
            as_is = _at_microbatch_size(plan, batch)
            now = predict_training(as_is, costs)["round_s"]
            then = float(bigger.predicted["round_s"])
        except (ZpipeError, ValueError, KeyError) as exc:
            log.warning("admission_skipped", run=run.run, error=str(exc))
            return None
        joining = [n for n in bigger.devices if n not in plan.devices]
        log.info(
            "admission_considered",
            run=run.run,
            newcomers=[m.name for m in newcomers],
            round_s=round(now, 6),
            with_newcomers_s=round(then, 6),
        )
        if not joining or then > now * (1.0 - run.rebalance):
            return None
        log.info("admitted", run=run.run, devices=joining, plan=bigger.to_dict())
        return bigger

    def _ring_of(self, run: _Run, device: str) -> dict[str, Any] | None:
        for group in run.groups:
            if device in group and len(group) > 1:
                return {
                    "endpoints": [run.ring_endpoints.get(n, "") for n in group],
                    "keys": [self._key_of(n) for n in group],
                }
        return None

    async def _plan(
        self, spec: ModelSpec, num_units: int, members: list[Member], message: Message
    ) -> tuple[Plan, Plan | None]:
        names = [m.name for m in members]
        partition = message.get("partition")
        algo = str(message.get("planner") or DEFAULT_PLANNER)
        batch_size = int(message.get("microbatch_size") or 1)
        profile: ModelProfile | None = None
        cluster: ClusterSpec | None = None
        if partition is None and message.get("profile") is not None:
            profile = ModelProfile.from_dict(message["profile"], source="the run's profile")
            cluster = cluster_from_members(members, links=await self._measured_links(members))
        elif partition is None and algo != "even":
            profiles = await self._profiles_of(members, spec, batch_size, str(message["dtype"]))
            profile = profiles[names[0]]
            cluster = cluster_from_members(
                members, profiles, links=await self._measured_links(members)
            )
        return choose_plan(
            algo=algo,
            num_units=num_units,
            names=names,
            partition=partition,
            profile=profile,
            cluster=cluster,
            batch_size=batch_size,
        )

    async def _measured_links(self, members: list[Member]) -> dict[tuple[str, str], ClusterLink]:
        if not self.config.measure_links or len(members) < 2:
            return {}
        measured = await self._links.measure(members)
        return {pair: link.as_cluster_link() for pair, link in measured.items()}

    async def _profiles_of(
        self,
        members: list[Member],
        spec: ModelSpec,
        batch_size: int,
        dtype: str,
        *,
        train: bool = False,
    ) -> dict[str, ModelProfile]:
        """Each stage's own profile of the model, cached until the stage registers again.

        All stages profile at once: on separate devices that costs nothing, and
        stages that share one machine then measure under the same contention for
        its cores that they will see while the pipeline runs.
        """
        profiles = await asyncio.gather(
            *(self._profile_of(m, spec, batch_size, dtype, train) for m in members)
        )
        return {m.name: p for m, p in zip(members, profiles, strict=True)}

    async def _profile_of(
        self, member: Member, spec: ModelSpec, batch_size: int, dtype: str, train: bool = False
    ) -> ModelProfile:
        key = (spec, batch_size, dtype, member.name, member.joined_at, train)
        cached = self._profile_cache.get(key)
        if cached is not None:
            return cached
        body = {
            "model": spec.to_dict(),
            "batch_size": batch_size,
            "dtype": dtype,
            "repeats": 3,
            "train": train,
        }
        reply = await self._request(
            member, Message("profile_request", body), "profile_reply", self.config.timeouts.assign_s
        )
        if reply["profile"] is None:
            raise ConfigError(f"stage {member.name!r} could not profile: {reply['error']}")
        profile = ModelProfile.from_dict(reply["profile"], source=f"{member.name}'s profile")
        self._profile_cache[key] = profile
        log.info(
            "stage_profiled", stage=member.name, forward_s=round(sum(profile.times(batch_size)), 4)
        )
        return profile

    async def _request(
        self, member: Member, message: Message, reply_kind: str, timeout_s: float
    ) -> Message:
        """Send ``message`` to a stage and wait for its ``reply_kind`` answer."""
        waiter: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._reply_waiters[(member.name, reply_kind)] = waiter
        try:
            # a send that fails says so itself (TransportTimeout is a TimeoutError too)
            await self._send(member.routing_id, message, peer=member.name)
            try:
                return await asyncio.wait_for(waiter, timeout_s)
            except asyncio.TimeoutError:
                raise TransportTimeout(member.name, reply_kind, timeout_s) from None
        finally:
            self._reply_waiters.pop((member.name, reply_kind), None)

    async def _gather_state(
        self, run: _Run, step: int, *, optimizer: bool, metrics: dict[str, Any] | None = None
    ) -> tuple[list[str], list[torch.Tensor]]:
        """Every device's weights (and optimizer state) once it finished round ``step``."""
        members = {m.name: m for m in self.membership.alive()}
        missing = [d for d in run.devices if d not in members]
        if missing:
            raise ConfigError(f"stages {missing} are gone; their weights are lost")
        body: dict[str, Any] = {"run": run.run, "step": step}
        if optimizer:
            body["optimizer"] = True
        request = Message("weights_request", body, epoch=run.epoch)
        replies = await asyncio.gather(
            *(
                self._request(members[d], request, "weights", self.config.timeouts.result_s)
                for d in run.devices
            )
        )
        keys: list[str] = []
        tensors: list[torch.Tensor] = []
        for reply in replies:
            if reply["error"]:
                raise ConfigError(f"stage {reply['name']!r}: {reply['error']}")
            if len(reply["keys"]) != len(reply.tensors):
                raise ProtocolError(f"stage {reply['name']!r} sent mismatched weights")
            keys += [str(k) for k in reply["keys"]]
            tensors += list(reply.tensors)
            if metrics is not None and isinstance(reply.get("metrics"), dict):
                metrics[str(reply["name"])] = reply["metrics"]
        return keys, tensors

    async def _on_weights_request(self, routing_id: bytes, message: Message) -> None:
        """Gather every stage's weights once it finished round ``step``; reply with all."""
        run_id, step = int(message["run"]), int(message["step"])
        answer = await self._answer_once(
            ("weights", run_id, step), lambda: self._checkpoint(run_id, step)
        )
        await self._send(
            routing_id, answer, peer=CLIENT_NAME, timeout_s=self.config.timeouts.send_s
        )

    async def _checkpoint(self, run_id: int, step: int) -> Message:
        run = self._run
        try:
            if run is None or run.run != run_id:
                raise ConfigError(f"run {run_id} is not the current run")
            await self._await_restored(run.devices)
            keys, tensors = await self._gather_state(run, step, optimizer=False)
            if len(tensors) > codec.MAX_TENSORS:
                # Refuse here, with a reply: an encode error after the try would leave
                # the client waiting for a checkpoint that never comes.
                raise ConfigError(
                    f"the checkpoint holds {len(tensors)} tensors (replicas included), "
                    f"more than one message carries ({codec.MAX_TENSORS})"
                )
        except (ZpipeError, ValueError) as exc:
            log.error("run_failed", error=str(exc))
            return Message("run_failed", {"error": str(exc)})
        return Message(
            "checkpoint",
            {"run": run.run, "step": step, "keys": keys},
            epoch=run.epoch,
            tensors=tuple(tensors),
        )

    async def _on_replicate(self, routing_id: bytes, message: Message) -> None:
        """Keep a global replica of the run after round ``step`` (weights and optimizer
        state of every unit; a group's members hold identical copies, one is kept)."""
        run_id, step = int(message["run"]), int(message["step"])
        reply = await self._answer_once(
            ("replicate", run_id, step), lambda: self._take_replica(run_id, step)
        )
        await self._send(
            routing_id, reply, peer=CLIENT_NAME, timeout_s=self.config.timeouts.reply_s
        )

    async def _take_replica(self, run_id: int, step: int) -> Message:
        run = self._run
        body: dict[str, Any] = {"run": run_id, "step": step, "tensors": 0, "bytes": 0}
        try:
            if run is None or run.run != run_id or run.training_plan is None:
                raise ConfigError(f"run {run_id} is not the current training run")
            await self._await_restored(run.devices)
            counters: dict[str, Any] = {}
            holders: dict[str, str] = {}
            if run.replication == "global":
                keys, tensors = await self._gather_state(
                    run, step, optimizer=True, metrics=counters
                )
            else:
                keys, tensors, holders = await self._back_up(run, step, counters)
            state: dict[str, torch.Tensor] = {}
            for key, tensor in zip(keys, tensors, strict=True):
                if key not in state:
                    # A copy: the received frame's memory belongs to a zmq message.
                    state[key] = tensor.clone()
            replica = _Replica(run.run, step, run.training_plan, state, holders)
            if self._store is not None:
                # On disk before the client hears of it: it then drops what came before.
                saved = SavedReplica(run.run, step, run.training_plan.to_dict(), state, holders)
                try:
                    await asyncio.to_thread(self._store.save_replica, saved)
                except OSError as exc:
                    raise ConfigError(f"the replica could not be saved: {exc}") from exc
            self._replica = replica
            body["tensors"] = len(state)
            body["bytes"] = sum(t.numel() * t.element_size() for t in state.values())
            body["error"] = ""
            log.info(
                "replica_kept",
                run=run.run,
                step=step,
                tensors=len(state),
                bytes=body["bytes"],
                saved=self._store is not None,
                replication=run.replication,
                holders=holders or None,
            )
            if run.rebalance is not None:
                balanced = await self._with_newcomers(run, run.training_plan)
                if balanced is None:
                    balanced = self._rebalanced(run, run.training_plan, counters)
                if balanced is not None:
                    body["rebalance"] = balanced.to_dict()
        except (ZpipeError, ValueError) as exc:
            body["error"] = f"{type(exc).__name__}: {exc}"
            log.error("replica_failed", run=run_id, step=step, error=body["error"])
        return Message("replicated", body)

    def _rebalanced(
        self, run: _Run, plan: TrainingPlan, counters: dict[str, Any]
    ) -> TrainingPlan | None:
        """Eco-FL's workload migration: when the stages' measured speeds (FTPipeHD's
        capacities, from each device's forward and backward time per micro-batch) say
        that moving unit boundaries between neighbours shortens the bottleneck by at
        least ``run.rebalance``, the lightweight plan that does; else None."""
        assert run.rebalance is not None and run.request is not None
        spec = ModelSpec.from_dict(run.request["model"])
        members = {m.name: m for m in self.membership.alive()}
        unit_work: list[float] = [1.0] * plan.num_units
        first = members.get(plan.devices[0])
        if first is not None:
            key = (spec, plan.microbatch_size, "float32", first.name, first.joined_at, True)
            profile = self._profile_cache.get(key)
            if profile is not None:
                unit_work = unit_work_from_profile(profile, plan.microbatch_size, training=True)
        measured: dict[str, float] = {}
        ranges: dict[str, tuple[int, int]] = {}
        fractions: dict[str, float] = {}
        for stage in plan.stages:
            for device, share in zip(stage.devices, stage.shares, strict=True):
                c = counters.get(device) or {}
                done = int(c.get("microbatches") or 0)
                if share == 0:
                    continue
                if done == 0:
                    return None  # not measured yet
                measured[device] = (float(c["forward_s"]) + float(c["backward_s"])) / done
                ranges[device] = (stage.start, stage.end)
                fractions[device] = share / sum(stage.shares)
        try:
            speeds = speeds_from_capacities(
                estimate_capacities(measured, ranges, unit_work, work_fraction=fractions)
            )
            # a device with share 0 counts as the slowest measured one
            for device in plan.devices:
                speeds.setdefault(device, min(speeds.values()))
            balanced = lightweight_replan(plan, failed=(), unit_work=unit_work, speeds=speeds)
        except (ZpipeError, ValueError) as exc:
            log.warning("rebalance_skipped", run=run.run, error=str(exc))
            return None
        now = max(stage_work(plan, unit_work, speeds))
        then = max(stage_work(balanced, unit_work, speeds))
        old_ranges = [(st.start, st.end) for st in plan.stages]
        moved = [(st.start, st.end) for st in balanced.stages] != old_ranges
        log.info(
            "rebalance_considered",
            run=run.run,
            speeds={d: round(v, 4) for d, v in speeds.items()},
            bottleneck=round(now, 6),
            balanced=round(then, 6),
        )
        if not moved or then > now * (1.0 - run.rebalance):
            return None
        log.info("rebalanced", run=run.run, plan=balanced.to_dict())
        return balanced

    def _replica_to_resume(self, resume: dict[str, Any], spec: ModelSpec) -> _Replica:
        replica = self._replica
        run, step = resume.get("run"), resume.get("step")
        if replica is None or replica.run != run or replica.step != step:
            held = "none" if replica is None else f"run {replica.run} after step {replica.step}"
            raise ConfigError(f"no replica of run {run} after step {step} to resume (held: {held})")
        if replica.plan.num_units != load_layer_sequence(spec).num_units:
            raise ConfigError("the replica is of another model")
        return replica

    async def _back_up(
        self, run: _Run, step: int, counters: dict[str, Any]
    ) -> tuple[list[str], list[torch.Tensor], dict[str, str]]:
        """Chain (FTPipeHD) or topology-driven (Asteroid) replication after round
        ``step``: every device keeps a snapshot, each stage's first device backs it up
        to its holder. Returns what was backed up to the coordinator, and the holders."""
        assert run.training_plan is not None
        if run.replication == "topology":
            schedule = asteroid_replication(run.training_plan, every=1)
        else:
            schedule = ftpipehd_replication(run.training_plan, chain_every=1, global_every=1)
        holders = {s.source: s.dest for s in schedule.sends if s.kind in ("chain", "backup")}
        members = {m.name: m for m in self.membership.alive()}
        missing = [d for d in run.devices if d not in members]
        if missing:
            raise ConfigError(f"stages {missing} are gone; they cannot back up")
        if self._public_keys:
            # peers reach each other's probe sockets: allowed before anyone connects
            await self._links.allow_peers([members[d] for d in run.devices])
        requests = []
        for device in run.devices:
            holder = holders.get(device, "")
            body: dict[str, Any] = {"run": run.run, "step": step, "holder": holder}
            if holder and holder != COORDINATOR:
                body["holder_endpoint"] = str(members[holder].info["probe_endpoint"])
                body["holder_key"] = self._key_of(holder)
            message = Message("backup_request", body, epoch=run.epoch)
            requests.append(
                self._request(members[device], message, "backed_up", self.config.timeouts.result_s)
            )
        keys: list[str] = []
        tensors: list[torch.Tensor] = []
        for reply in await asyncio.gather(*requests):
            if reply["error"]:
                raise ConfigError(f"stage {reply['name']!r}: {reply['error']}")
            if len(reply["keys"]) != len(reply.tensors):
                raise ProtocolError(f"stage {reply['name']!r} sent a mismatched backup")
            keys += [str(k) for k in reply["keys"]]
            tensors += list(reply.tensors)
            if isinstance(reply.get("metrics"), dict):
                counters[str(reply["name"])] = reply["metrics"]
        return keys, tensors, {d: holders.get(d, "") for d in run.devices}

    def _fetch_plan(
        self, replica: _Replica, device: str, start: int, end: int, by_name: dict[str, Member]
    ) -> list[dict[str, Any]]:
        """Where ``device`` gets units ``[start, end)`` of a replica kept at the stages:
        what the coordinator holds comes with the assignment; every other range from
        the device's own snapshot, a surviving member of the stage that held it, or the
        backup its holder keeps (FTPipeHD Algorithm 1's sources, nearest first)."""
        alive = {m.name: m for m in self.membership.alive() if m.state is MemberState.ALIVE}
        alive.update(by_name)
        held_here = {u for key in replica.state if (u := split_unit_key(key)) is not None}
        held_units = {u[0] for u in held_here}
        fetch: list[dict[str, Any]] = []
        for old in replica.plan.stages:
            a, b = max(start, old.start), min(end, old.end)
            if a >= b or all(u in held_units for u in range(a, b)):
                continue
            owner = old.devices[0]
            holder = replica.holders.get(owner, "")
            if device in old.devices:
                source, owner = device, device
            elif survivors := [d for d in old.devices if d in alive]:
                source = owner = survivors[0]
            elif holder and holder != COORDINATOR and holder in alive:
                source = holder
            else:
                raise ConfigError(
                    f"units [{a}, {b}) are lost: {', '.join(old.devices)} and the holder of "
                    f"their backup ({holder or 'none'}) are gone"
                )
            entry: dict[str, Any] = {"from": source, "owner": owner, "run": replica.run,
                                     "step": replica.step, "start": a, "end": b}  # fmt: skip
            if source != device:
                entry["endpoint"] = str(alive[source].info["probe_endpoint"])
                entry["key"] = self._key_of(source)
            fetch.append(entry)
        return fetch

    async def _fast_replica(self, replica: _Replica, message: Message) -> _Replica:
        """The `fast` consistency (as FTPipeHD and Asteroid recover): the survivors of
        the broken run keep their newest weights and optimizer state; only the units
        no survivor holds (the dead's) come from the replica."""
        run = self._run
        dead = {str(d) for d in (message["resume"].get("dead") or [])}
        if run is None or run.training_plan is None:
            return replica  # no broken run here (a restarted coordinator): exact it is
        alive = {m.name: m for m in self.membership.alive() if m.state is MemberState.ALIVE}
        survivors = [d for d in run.devices if d in alive and d not in dead | run.failed]
        request = Message(
            "weights_request",
            {"run": run.run, "step": 0, "optimizer": True, "latest": True},
            epoch=run.epoch,
        )
        replies = await asyncio.gather(
            *(
                self._request(alive[d], request, "weights", self.config.timeouts.result_s)
                for d in survivors
            ),
            return_exceptions=True,
        )
        newer: dict[str, torch.Tensor] = {}
        completed: dict[str, int] = {}
        for name, reply in zip(survivors, replies, strict=True):
            if isinstance(reply, BaseException) or reply["error"]:
                # Its units fall back to the replica: still a consistent model.
                error = reply if isinstance(reply, BaseException) else reply["error"]
                log.warning("fast_state_missing", stage=name, error=str(error))
                continue
            for key, tensor in zip(reply["keys"], reply.tensors, strict=True):
                # a data-parallel group's members hold identical copies; one is kept
                newer.setdefault(str(key), tensor.clone())
            completed[name] = int(reply.get("completed") or 0)
        log.info(
            "fast_resume",
            run=run.run,
            replica_step=replica.step,
            completed=completed,
            units_from_replica=sorted(
                {u[0] for k in replica.state if k not in newer and (u := split_unit_key(k))}
            ),
        )
        return _Replica(replica.run, replica.step, replica.plan, {**replica.state, **newer})

    def _replan_training(
        self, replica: _Replica, policy: str, message: Message, spec: ModelSpec
    ) -> TrainingPlan:
        """Lightweight or ResPipe re-planning of the replica's plan without the dead."""
        alive = {m.name: m for m in self.membership.alive() if m.state is MemberState.ALIVE}
        dead = {str(d) for d in (message["resume"].get("dead") or [])}
        failed = dead | {d for d in replica.plan.devices if d not in alive}
        survivors = [alive[d] for d in replica.plan.devices if d not in failed]
        if not survivors:
            raise ConfigError("no stage of the run survives to resume it")
        plan = self._replan_in_place(
            replica.plan,
            failed,
            policy,
            spec,
            survivors,
            batch_size=replica.plan.microbatch_size,
            dtype="float32",
            train=True,
        )
        log.info("training_replanned", policy=policy, failed=sorted(failed), plan=plan.to_dict())
        return plan

    def _key_of(self, name: str) -> str | None:
        if name == CLIENT_NAME and self._run is not None:
            # the key the client authenticated with, whatever its file is called
            return self._run.client_key
        key = self._public_keys.get(name)
        return key.decode() if key is not None else None

    async def _on_run_go(self, routing_id: bytes, message: Message) -> None:
        """The client allows the last stage and is connected: stages connect downstream."""
        run = self._run
        try:
            if run is None or run.run != message["run"]:
                raise ConfigError(f"run {message['run']} is not the current run")
            await self._connect_all(run)
        except (ZpipeError, ValueError) as exc:
            await self._reply_run_failed(routing_id, exc)
            return
        run.streaming = True
        log.info("run_streaming", run=run.run, epoch=run.epoch)
        self._persist()
        await self._send(
            routing_id,
            Message("run_started", {"run": run.run}, epoch=run.epoch),
            peer=CLIENT_NAME,
            timeout_s=self.config.timeouts.reply_s,
        )

    async def _connect_all(self, run: _Run) -> None:
        """Second phase: every stage connects to its neighbours, now that all allow theirs."""
        loop = asyncio.get_running_loop()
        run.connected = {}
        for device in run.devices:
            member = self.membership.get(device)
            if member is None or member.state is MemberState.DEAD:
                raise ConfigError(f"stage {device!r} is gone")
            run.connected[device] = loop.create_future()
            body: dict[str, Any] = {"run": run.run}
            ring = self._ring_of(run, device)
            if ring is not None:
                body["ring"] = ring
            await self._send(
                member.routing_id, Message("connect", body, epoch=run.epoch), peer=device
            )
        await _await_all(run.connected, timeout_s=self.config.timeouts.reply_s, awaited="connected")

    async def _on_run_end(self, routing_id: bytes, message: Message) -> None:
        run_id = int(message["run"])
        report = await self._answer_once(("run_end", run_id, 0), lambda: self._end_run(run_id))
        await self._send(
            routing_id, report, peer=CLIENT_NAME, timeout_s=self.config.timeouts.reply_s
        )

    async def _end_run(self, run_id: int) -> Message:
        run = self._run
        stages: dict[str, Any] = {}
        if run is not None and run.run == run_id:
            loop = asyncio.get_running_loop()
            for device in run.devices:
                member = self.membership.get(device)
                if member is None or device in run.failed:
                    continue
                run.metrics[device] = loop.create_future()
                with contextlib.suppress(TransportTimeout):
                    await self._send(
                        member.routing_id,
                        Message("metrics_request", {"run": run.run}, epoch=run.epoch),
                        peer=device,
                    )
            for name, fut in run.metrics.items():
                try:
                    stages[name] = await asyncio.wait_for(fut, self.config.timeouts.reply_s)
                except (asyncio.TimeoutError, ConfigError):
                    stages[name] = {"error": "no metrics"}
            self._run = None
            self._persist()
        return Message("run_report", {"run": run_id, "stages": stages})


async def _await_all(
    futures: dict[str, asyncio.Future[Any]], *, timeout_s: float, awaited: str
) -> list[Any]:
    """Every stage's reply, or a timeout that names the stages still silent."""
    try:
        return await asyncio.wait_for(asyncio.gather(*futures.values()), timeout_s)
    except asyncio.TimeoutError:
        silent = [name for name, fut in futures.items() if not fut.done()]
        raise TransportTimeout(", ".join(silent), awaited, timeout_s) from None


def _curve_user_id(frame: zmq.Frame) -> str | None:
    """The CURVE public key the authenticator saw for this message, if any."""
    key = security.sender_public_key(frame)
    return key.decode() if key is not None else None


def _printable(routing_id: bytes) -> str:
    try:
        return routing_id.decode("ascii")
    except UnicodeDecodeError:
        return routing_id.hex()


def _at_microbatch_size(plan: TrainingPlan, batch: int) -> TrainingPlan:
    """``plan`` costed at micro-batches of ``batch`` samples (a straight plan the
    coordinator built without knowing the size records 1)."""
    if plan.microbatch_size == batch:
        return plan
    if any(len(stage.devices) > 1 for stage in plan.stages):
        raise ConfigError("the plan's groups share micro-batches of another size")
    data = plan.to_dict()
    data["microbatch_size"] = batch
    data["stages"] = [{**stage, "shares": [batch]} for stage in data["stages"]]
    return TrainingPlan.from_dict(data)


def _memory_model(optimizer: dict[str, Any]) -> str:
    """The planners' name for an optimizer's state (momentum is one more copy)."""
    name = str(optimizer["name"])
    return "sgd-momentum" if name == "sgd" and optimizer.get("momentum") else name


def _units_state(state: dict[str, torch.Tensor], start: int, end: int) -> dict[str, torch.Tensor]:
    """The entries of a replica that belong to units ``[start, end)``."""
    out = {}
    for key, tensor in state.items():
        parsed = split_unit_key(key)
        if parsed is not None and start <= parsed[0] < end:
            out[key] = tensor
    return out
