"""The stage's data plane: the assignment being built, the one running, and its tasks.

An assignment goes through two phases the coordinator drives: ``assign``
(build the shard, allow the senders' keys, answer ``ready``) and ``connect``
(connect to the neighbours once every stage allows its upstream, start the
data tasks, answer ``connected``). The data tasks are the data port's receive
loop feeding either the inference loop or the training plane, run under the
stage's task supervisor. Each method returns the lifecycle controller's
commands for the runtime to carry out.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import zmq.asyncio

from zpipe._errors import PipelineError
from zpipe.log import get_logger
from zpipe.models import ModelSpec
from zpipe.protocol.stage_control import Assign
from zpipe.stage.assignment import (
    Assignment,
    AssignmentBuilder,
    FetchState,
    push_connector,
    sender_endpoints,
)
from zpipe.stage.commands import Command, ConnectAssignment, DropMessage
from zpipe.stage.config import StageConfig
from zpipe.stage.dataport import DataPort
from zpipe.stage.executors.inference import InferenceLoop
from zpipe.stage.executors.sync_training import TrainingExecutor, TrainingSetup
from zpipe.stage.executors.training_plane import (
    RingSockets,
    TrainingPlane,
    prepare_training,
    training_setup,
)
from zpipe.stage.lifecycle import DataRoute, StageLifecycle
from zpipe.stage.live_copies import CopyRoutes
from zpipe.stage.metrics import StageCounters
from zpipe.stage.ports import StageKeys, StagePorts, data_port_limits
from zpipe.stage.shard import Shard
from zpipe.stage.supervision import TaskSupervisor, describe_error
from zpipe.transport.address_auth import peer_addresses
from zpipe.transport.sockets import ReceiveLimits

log = get_logger("zpipe.stage")

# the tasks of a running assignment, stopped with it
DATA_TASKS = ["data-receive", "compute", "send"]


class DataPlane:
    def __init__(
        self,
        *,
        config: StageConfig,
        context: zmq.asyncio.Context,
        compute: ThreadPoolExecutor,
        counters: StageCounters,
        keys: StageKeys,
        ports: StagePorts,
        data_endpoint: str,
        lifecycle: StageLifecycle,
        supervisor: TaskSupervisor,
        fetch_state: FetchState,
        copy_routes: CopyRoutes | None = None,
    ) -> None:
        self.config = config
        self._context = context
        self._compute = compute
        self._counters = counters
        self._keys = keys
        self._ports = ports  # its data socket is reopened when a plan changes the limits
        self._data_endpoint = data_endpoint
        # the data port keeps its small pre-plan limits until the first assignment, then
        # the limits of each assignment's model (by spec: the last one computed)
        self._plan_limits: tuple[ModelSpec, ReceiveLimits] | None = None
        # the limits the data port is bound with now (ports.py binds it before_plan)
        self._bound_limits = ReceiveLimits.before_plan()
        self._lifecycle = lifecycle
        self._supervisor = supervisor
        self._fetch_state = fetch_state
        self._copy_routes = copy_routes  # where copies made without draining go
        self._builder = AssignmentBuilder(
            compute=compute,
            slowdown=config.emulated_slowdown(),
            emulate_compute=config.emulate_compute,
            device=config.resolved_device,
        )
        self._pending: Assignment | None = None  # built, waiting for "connect"
        self._downstream: zmq.asyncio.Socket | None = None  # inference assignments
        self._inference: InferenceLoop | None = None
        self._training: TrainingPlane | None = None
        self._retired_training: TrainingPlane | None = None  # its sockets still drain
        self._timeline_run: int | None = None  # the run the counters' timeline belongs to
        self._ring_sockets = RingSockets(
            context, config.socket_options, keys.keypair, keys.authenticator
        )

    @property
    def trainer(self) -> TrainingExecutor | None:
        return self._training.trainer if self._training is not None else None

    async def pace(self, nbytes: int) -> None:
        """Traffic beside the data (backups) crosses the device's one emulated radio too."""
        if self._training is not None:
            await self._training.pace(nbytes)

    # ------------------------------------------------------------ assignment

    async def assign(self, message: Assign) -> list[Command]:
        """Stop what runs, build the new assignment's shard, allow its senders."""
        name = self.config.name
        run, epoch = message.run, message.epoch
        log.info("assignment_received", stage=name, run=run, epoch=epoch, start=message.start,
                 end=message.end, downstream=message.downstream)  # fmt: skip
        await self.stop()
        self._discard_pending()
        started = time.monotonic()
        built = None
        try:
            built = await self._builder.build(
                message,
                parse_training=lambda m: training_setup(
                    m, name=name, wait_s=self.config.timeouts.result_s
                ),
                prepare_training=lambda a, train: prepare_training(
                    a,
                    train,
                    data_endpoint=self._data_endpoint,
                    data_bind=self.config.data_bind,
                    ring_sockets=self._ring_sockets,
                ),
                fetch_state=self._fetch_state,
            )
            if self._keys.data_allow is not None:
                # Allowed before anyone connects: a refused CURVE handshake is not retried.
                self._keys.data_allow.replace([k.encode() for k in built.senders if k])
            if self._keys.data_addresses is not None:
                # Without keys, their hosts (what the handshake can tell), set as early.
                self._keys.data_addresses.replace(
                    peer_addresses(sender_endpoints(message), self._data_endpoint)
                )
            await self._apply_data_limits(ModelSpec.from_dict(message.model))
        except Exception as exc:  # any failure to build is reported, and the stage keeps serving
            if built is not None:
                built.assignment.release_ring_port()
            log.error("assignment_failed", stage=name, run=run, error=str(exc))
            return self._lifecycle.assignment_failed(run, epoch, describe_error(exc))
        self._pending = built.assignment
        build_s = time.monotonic() - started
        log.info("assignment_ready", stage=name, run=run, epoch=epoch,
                 build_s=round(build_s, 3), reused=built.reused)  # fmt: skip
        limits = self._plan_limits[1] if self._plan_limits is not None else None
        return self._lifecycle.assignment_ready(
            run,
            epoch,
            build_s=build_s,
            ring_endpoint=built.assignment.ring_endpoint,
            max_message_bytes=limits.max_message_bytes if limits is not None else None,
        )

    def _discard_pending(self) -> None:
        """Forget the assignment built and never connected, and close its ring port."""
        if self._pending is not None:
            self._pending.release_ring_port()
            self._pending = None

    async def _apply_data_limits(self, spec: ModelSpec) -> None:
        """Give the data port the receive limits of this assignment's model before any
        of its peers connect (libzmq fixes a connection's limits when it is accepted:
        a peer that connected before keeps the ones it had)."""
        if not self._ports.data_bound:
            return
        if self._plan_limits is not None and self._plan_limits[0] == spec:
            limits = self._plan_limits[1]
        else:
            opts = self.config.socket_options
            fallback = ReceiveLimits(opts.max_message_bytes, opts.recv_hwm)
            # from the config alone: cheap, and nothing of a peer's is built or run
            limits, source = data_port_limits(
                spec, max_rows=self.config.max_batch_rows, fallback=fallback
            )
            log.info("data_limits", stage=self.config.name, source=source,
                     max_message_bytes=limits.max_message_bytes,
                     recv_hwm=limits.recv_hwm)  # fmt: skip
        await self._rebind(limits)
        self._plan_limits = (spec, limits)

    async def apply_limits(self, limits: ReceiveLimits) -> None:
        """Give the data port ``limits`` for a run that is not an assignment (a lossy
        run's partials), before its peers connect; the next assignment sets its own."""
        if not self._ports.data_bound:
            return
        await self._rebind(limits)
        self._plan_limits = None

    async def _rebind(self, limits: ReceiveLimits) -> None:
        """Reopen the data port under ``limits`` unless it is bound with them already
        (a recovery or a new run of the same model): the connections it accepted
        keep them, and its upstream does not reconnect. Re-binding one socket while
        peers were connected and sending (a recovery's upstream) crashed stages
        inside libzmq 4.3.5, a segfault in its I/O thread (seen in CI as a live
        stage that stopped answering); a fresh socket does not
        (:mod:`zpipe.transport.reopen`)."""
        if limits == self._bound_limits:
            return
        await self._ports.reopen_data_in(limits)
        self._bound_limits = limits
        log.info("data_port_rebound", stage=self.config.name,
                 max_message_bytes=limits.max_message_bytes,
                 recv_hwm=limits.recv_hwm)  # fmt: skip

    async def connect(self, command: ConnectAssignment) -> list[Command]:
        """Second phase of an assignment: every stage now allows its upstream's key."""
        assignment, run = self._pending, command.run
        if assignment is None or assignment.run != run:
            return [DropMessage("coordinator", f"connect for run {run}, which this stage "
                                               "has not built")]  # fmt: skip
        self._pending = None
        if self._retired_training is not None:
            self._retired_training.release_peers()
            self._retired_training = None
        try:
            if assignment.training is not None:
                self._training = self._training_plane(assignment)
                await self._training.connect(command.ring)
            else:
                self._connect_downstream(assignment)
        except Exception as exc:
            await self.stop()
            error = describe_error(exc)
            return self._lifecycle.connect_failed(run, assignment.epoch, error)
        # a re-plan of the same run (a new epoch) keeps the run's timeline whole
        self._counters.reset(keep_timeline=run == self._timeline_run)
        self._timeline_run = run
        commands = self._lifecycle.connected(run, _route(assignment))
        self._start_tasks(assignment)
        log.info("connected", stage=self.config.name, run=run, epoch=assignment.epoch,
                 downstream=assignment.downstream)  # fmt: skip
        return commands

    def rewire(self, setup: TrainingSetup, peers: dict[str, tuple[str, str | None]]) -> None:
        """A re-partition left a device out (:mod:`zpipe.stage.executors.
        async_repartition`): the training's new place in the chain, its new
        neighbours' sockets, and who may send it data from here on."""
        training = self._training
        if training is None:
            raise PipelineError("no training assignment runs here to re-wire")
        training.rewire(setup, peers)
        self._lifecycle.rerouted(_route(training.assignment))

    def allow_senders(self, peers: dict[str, tuple[str, str | None]]) -> None:
        """Admit ``peers`` (new neighbours after a leave-out: endpoint and key) on the
        data port from now on, besides those admitted already: done at the move's
        fetch, before any stage commits and connects (a refused CURVE handshake is
        not retried)."""
        if self._keys.data_allow is not None:
            for name, (_, key) in peers.items():
                if key:
                    self._keys.data_allow.allow(key.encode(), name)
        addresses = self._keys.data_addresses
        if addresses is not None and not addresses.admits_any:
            addresses.admit(peer_addresses([e for e, _ in peers.values()], self._data_endpoint))

    def _connect_downstream(self, assignment: Assignment) -> None:
        if self._downstream is not None:
            self._downstream.close(linger=0)
            self._downstream = None
        connect = push_connector(self._context, self.config.socket_options, self._keys.keypair)
        self._downstream = connect(
            assignment.downstream_endpoint, assignment.downstream_key, assignment.downstream
        )

    def _training_plane(self, assignment: Assignment) -> TrainingPlane:
        return TrainingPlane(
            assignment=assignment,
            context=self._context,
            connector=push_connector(self._context, self.config.socket_options, self._keys.keypair),
            compute=self._compute,
            counters=self._counters,
            link=self.config.link,
            socket_options=self.config.socket_options,
            keypair=self._keys.keypair,
            authenticator=self._keys.authenticator,
            timeout_s=self.config.timeouts.result_s,
            send_timeout_s=self.config.timeouts.send_s,
            copy_routes=self._copy_routes,
        )

    # ------------------------------------------------------------ data tasks

    def _start_tasks(self, assignment: Assignment) -> None:
        port = DataPort(
            socket=self._ports.data_in,
            lifecycle=self._lifecycle,
            counters=self._counters,
            name=self.config.name,
            max_message_bytes=self.config.socket_options.max_message_bytes,
            allowed=self._keys.data_allow,
        )
        upstream, supervisor = assignment.upstream, self._supervisor
        if self._training is not None:
            plane = self._training
            supervisor.start("data-receive", lambda: port.serve(plane.deliver, upstream=upstream))
            supervisor.start("compute", plane.run)
            supervisor.start("send", plane.send_loop)
            return
        assert isinstance(assignment.shard, Shard) and self._downstream is not None
        loop = InferenceLoop(
            name=self.config.name,
            run=assignment.run,
            epoch=assignment.epoch,
            shard=assignment.shard,
            compute=self._compute,
            counters=self._counters,
            downstream=self._downstream,
            downstream_name=assignment.downstream,
            link=self.config.link,
            send_timeout_s=self.config.timeouts.send_s,
        )
        self._inference = loop
        supervisor.start("data-receive", lambda: port.serve(loop.deliver, upstream=upstream))
        supervisor.start("compute", loop.compute_loop)
        supervisor.start("send", loop.send_loop)

    async def stop(self) -> None:
        """Stop the running assignment's tasks (a new assignment, a run broken elsewhere)."""
        await self._supervisor.stop(DATA_TASKS)
        if self._inference is not None:
            await self._inference.close()
            self._inference = None
        if self._training is not None:
            await self._training.close()
            if self._retired_training is not None:
                self._retired_training.release_peers()
            self._retired_training, self._training = self._training, None
        self._lifecycle.data_stopped()

    async def close(self) -> None:
        await self.stop()
        self._discard_pending()
        if self._retired_training is not None:
            self._retired_training.release_peers()
            self._retired_training = None
        if self._downstream is not None:
            self._downstream.close(linger=0)
            self._downstream = None


def _route(assignment: Assignment) -> DataRoute:
    setup = assignment.training
    if setup is None:
        return DataRoute.inference(assignment.epoch, assignment.upstream)
    return DataRoute.training(
        assignment.epoch, setup.upstream.names, setup.downstream.names, last=setup.last
    )
