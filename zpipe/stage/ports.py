"""A stage's sockets and keys: control (to the coordinator), data in, probes in.

- control: a DEALER to the coordinator, named by the stage's name and a suffix of
  this process's own;
- bulk: a second DEALER to the coordinator, for state (weights, replicas, an
  assignment's tensors) in chunks (:mod:`zpipe.stage.bulk`), so that liveness on
  the control one never queues behind it;
- data: a PULL where the assigned upstream (and, training, the neighbours and
  the client) send; with keys, only the keys the current assignment names may
  connect (until then, nobody); without keys, only the hosts of the peers it
  names (:mod:`zpipe.transport.address_auth`; until then, nobody either); small
  receive limits until an assignment, then the limits of its model
  (:func:`data_port_limits`);
- probe: a ROUTER where cluster members measure links, keep backups and fetch
  units; with keys, every member the coordinator names (``link_peers``), whose
  names say who sent a backup or a fetch (:func:`peer_identity`).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field, replace
from typing import cast

import zmq
import zmq.asyncio

from zpipe.log import get_logger
from zpipe.models import ModelSpec, load_layer_sequence
from zpipe.models.registry import USER_CODE_FAMILIES
from zpipe.models.size import largest_tensor_bytes_per_sample, peer_build_limit
from zpipe.stage.config import StageConfig
from zpipe.stage.link_watch import LINK_EVENTS
from zpipe.stage.linkprobe import PROBE_DOMAIN
from zpipe.stage.peer_policy import UNAUTHENTICATED, PeerIdentity
from zpipe.stage.supervision import describe_error
from zpipe.transport import security
from zpipe.transport.address_auth import (
    AddressAllowList,
    AddressAuthenticator,
    address_checked_server,
)
from zpipe.transport.conn_budget import data_port_budget, probe_port_budget
from zpipe.transport.conn_guard import FEW_CONNECTIONS_LOOK_S, ConnectionGuard
from zpipe.transport.reopen import bind_when_free, open_listener
from zpipe.transport.sockets import (
    CURVE_FRAME_OVERHEAD,
    ReceiveLimits,
    SocketOptions,
    advertised_endpoint,
    bind_endpoint,
    open_socket,
)

log = get_logger("zpipe.stage")

# The data port's RCVHWM: none (0), whatever its plan's limits say (those still size
# its guard's budget). libzmq 4.3.5 aborts the whole process (SIGABRT, "Assertion
# failed: !_io_error (src/stream_engine_base.cpp:310)") when a connection whose input
# it stopped at the mark breaks while a ZMTP PING the peer sent is still undecoded,
# and the stage then reads the queue: restarting the input answers the PING on the
# broken connection. zpipe's own PUSHes send no PINGs, but any peer at an admitted
# address may set HEARTBEAT_IVL, fill the port while the stage computes (its inbox
# full, nothing read) and go (tests/cluster/test_stage_abort.py). Without a mark the
# input is never stopped, and the guard may cut a connection safely (a cut of a
# stopped one is the same abort). What a connection queues is bounded by the guard
# (bytes per connection; resident memory for floods of small messages:
# zpipe.transport.conn_budget.data_port_budget); a legitimate sender is held back
# by its run's own windows (the client's max_in_flight, 1F1B's warm-up), its SNDHWM
# and the stage's inbox, not by this mark. None: the plan's mark (the old behaviour,
# for tests that show the abort).
DATA_PORT_RECV_HWM: int | None = 0

# The probe port's RCVHWM: none (0), for the same abort. It is a ROUTER every cluster
# member reaches (without keys, anyone who reaches the port); zpipe's own probers and
# peer transfers send no PINGs, but a member that sets HEARTBEAT_IVL, sends while the
# stage is paused or starved past the old mark (16) and goes aborted the stage when it
# next read its probes (tests/cluster/test_probe_port_abort.py). What a connection
# queues is bounded by the port's guard instead (:func:`guard_probe_port`); a prober
# is held back by its own protocol (one ping or one burst of at most
# zpipe.stage.linkprobe.ProbeSettings.max_bytes at a time) and the responder's rate
# limit. None: the options' mark (the old behaviour, for tests that show the abort).
PROBE_PORT_RECV_HWM: int | None = 0

# chunks of bulk state queued in the stage at most (zpipe.transport.bulk.CHUNK_BYTES each)
BULK_SEND_HWM = 2
# the bulk connection's routing id: the stage's name and this, so it keeps it on reconnect
BULK_ROUTING_SUFFIX = b"\x00bulk"


@dataclass
class StageKeys:
    keypair: security.KeyPair | None = None
    authenticator: security.CurveAuthenticator | None = None
    # who may send data (the assignment's senders) and probes (cluster members)
    data_allow: security.PeerAllowList | None = None
    probe_allow: security.PeerAllowList | None = None
    coordinator_key: bytes | None = None
    # without keys: the hosts that may connect to the data port (the assignment's
    # senders'), judged by the context's ZAP handler before any message is read
    data_addresses: AddressAllowList | None = None
    address_auth: AddressAuthenticator | None = None

    @classmethod
    def load(cls, context: zmq.asyncio.Context, config: StageConfig) -> StageKeys:
        keys_dir = config.keys_dir
        if keys_dir is None:
            security.warn_open_cluster(log, f"stage {config.name}")
            # Until the coordinator assigns senders, no host may send data.
            addresses = AddressAllowList()
            auth = AddressAuthenticator(context, addresses)
            auth.start()
            return cls(data_addresses=addresses, address_auth=auth)
        keys = cls(
            keypair=security.load_keypair(keys_dir, config.name),
            coordinator_key=security.load_keypair_public(keys_dir, "coordinator"),
            # Until the coordinator assigns an upstream peer, nobody may send data.
            data_allow=security.PeerAllowList(),
            # Link probes come from any cluster member the coordinator names (link_peers).
            probe_allow=security.PeerAllowList(),
        )
        assert keys.data_allow is not None and keys.probe_allow is not None
        keys.authenticator = security.CurveAuthenticator(context, keys.data_allow)
        keys.authenticator.add_domain(PROBE_DOMAIN, keys.probe_allow)
        keys.authenticator.start()
        return keys

    def stop(self) -> None:
        if self.authenticator is not None:
            self.authenticator.stop()
        if self.address_auth is not None:
            self.address_auth.stop()

    @property
    def data_refusals(self) -> int:
        """Connections the data port refused by address (without keys), since start."""
        return sum(self.address_auth.refused.values()) if self.address_auth is not None else 0


def peer_identity(allowed: security.PeerAllowList | None, key: bytes | None) -> PeerIdentity:
    """Who sent a request on the probe port: without keys nobody can tell; with keys,
    the name the coordinator gave the sender's key (``link_peers``), if any."""
    if allowed is None:
        return UNAUTHENTICATED
    return PeerIdentity(True, allowed.name_of(key) if key is not None else None)


@dataclass
class StagePorts:
    control: zmq.asyncio.Socket
    data_in: zmq.asyncio.Socket
    probe_in: zmq.asyncio.Socket
    data_endpoint: str
    probe_endpoint: str
    bulk: zmq.asyncio.Socket | None = None
    # what the data socket is bound to (port resolved): reopened when a plan changes its limits
    data_bound: str = ""
    # the control socket's handshakes and drops (zpipe.stage.link_watch)
    control_monitor: zmq.asyncio.Socket | None = None
    # cuts a connection to the data port that makes libzmq hold past its limits
    data_guard: ConnectionGuard | None = None
    # the same for the probe port (it has no receive mark either: PROBE_PORT_RECV_HWM)
    probe_guard: ConnectionGuard | None = None
    # what the probe socket is bound to (port resolved), and its limits: reopen_probe_in
    probe_bound: str = ""
    _probe_limits: ReceiveLimits | None = field(default=None, repr=False)
    # what a fresh data socket is made with (reopen_data_in)
    _context: zmq.asyncio.Context | None = field(default=None, repr=False)
    _options: SocketOptions | None = field(default=None, repr=False)
    _keypair: security.KeyPair | None = field(default=None, repr=False)
    _address_domain: str | None = field(default=None, repr=False)

    @classmethod
    def open(cls, context: zmq.asyncio.Context, config: StageConfig, keys: StageKeys) -> StagePorts:
        """Open and bind every socket; if one cannot be bound (a port in use), close
        the ones already open and raise: an open socket left behind would make the
        context's ``term()`` wait for it for ever, and the stage hang at exit."""
        opened: list[zmq.asyncio.Socket] = []
        try:
            return cls._open(context, config, keys, opened)
        except BaseException:
            for sock in opened:
                sock.close(linger=0)
            raise

    @classmethod
    def _open(
        cls,
        context: zmq.asyncio.Context,
        config: StageConfig,
        keys: StageKeys,
        opened: list[zmq.asyncio.Socket],
    ) -> StagePorts:
        opts = config.socket_options
        # Small limits until an assignment: nothing may queue megabytes at an idle stage.
        data_in = open_socket(context, zmq.PULL, opts, limits=ReceiveLimits.before_plan())
        opened.append(data_in)
        unmark_data_port(data_in)
        address_domain = None
        if keys.keypair is not None:
            security.secure_server(data_in, keys.keypair)
        elif keys.address_auth is not None:
            address_domain = keys.address_auth.domain
            address_checked_server(data_in, address_domain)
        bound = bind_endpoint(data_in, config.data_bind)
        data_endpoint = advertised_endpoint(
            bound, advertise_host=config.advertise_host, toward=config.coordinator
        )
        probe_limits = probe_port_limits(opts)
        probe_in = open_probe_listener(context, opts, probe_limits, keys.keypair)
        opened.append(probe_in)
        probe_bound = bind_endpoint(probe_in, config.probe_endpoint_to_bind)
        probe_endpoint = advertised_endpoint(
            probe_bound, advertise_host=config.advertise_host, toward=config.coordinator
        )
        control = open_socket(context, zmq.DEALER, opts)
        opened.append(control)
        # no receive mark: it has ZMTP heartbeats (zpipe.transport.sockets.HEARTBEAT_RECV_HWM)
        # This process's own routing id: a second process under the same name is then a
        # registration the coordinator can judge (refuse, or let take over a dead one),
        # where one routing id would have the coordinator's ROUTER silently drop it.
        routing_id = f"{config.name}#{uuid.uuid4().hex[:12]}".encode()
        control.setsockopt(zmq.ROUTING_ID, routing_id)
        if keys.keypair is not None and keys.coordinator_key is not None:
            security.secure_client(control, keys.keypair, keys.coordinator_key)
        # before connecting: the first handshake is then seen too
        monitor = cast(zmq.asyncio.Socket, control.get_monitor_socket(LINK_EVENTS))
        opened.append(monitor)
        control.connect(config.coordinator)
        # A few chunks queued at most: the sender feels a slow link at once, and the
        # coordinator hears progress as the chunks land. No ZMTP heartbeats: behind
        # megabytes in the kernel's buffer on a slow link a ping would time out and
        # drop a connection that is moving bytes (liveness is the control one's job).
        bulk = open_socket(
            context, zmq.DEALER, replace(opts, send_hwm=BULK_SEND_HWM), zmtp_heartbeat=False
        )
        opened.append(bulk)
        bulk.setsockopt(zmq.ROUTING_ID, routing_id + BULK_ROUTING_SUFFIX)
        if keys.keypair is not None and keys.coordinator_key is not None:
            security.secure_client(bulk, keys.keypair, keys.coordinator_key)
        bulk.connect(config.coordinator)
        # last: nothing after it can fail and leave its monitor open (context.term waits)
        data_guard = guard_data_port(data_in, ReceiveLimits.before_plan())
        probe_guard = guard_probe_port(probe_in, probe_limits)
        return cls(
            control, data_in, probe_in, data_endpoint, probe_endpoint, bulk, bound,
            control_monitor=monitor, data_guard=data_guard, probe_guard=probe_guard,
            probe_bound=probe_bound, _probe_limits=probe_limits,
            _context=context, _options=opts, _keypair=keys.keypair,
            _address_domain=address_domain,
        )  # fmt: skip

    async def reopen_data_in(self, limits: ReceiveLimits) -> zmq.asyncio.Socket:
        """Close the data socket and bind a fresh one to the same endpoint under
        ``limits`` (libzmq fixes a listener's limits at bind; re-binding one socket
        while a peer sends crashed it: :mod:`zpipe.transport.reopen`). Its peers
        reconnect by themselves; what the old one had queued is dropped (a new plan
        drops an older plan's messages anyway). Call it with no task waiting on it."""
        assert self._context is not None and self._options is not None and self.data_bound
        if self.data_guard is not None:
            self.data_guard.stop()
        self.data_in.close(linger=0)
        fresh = open_listener(
            self._context, self._options, limits, self._keypair, address_domain=self._address_domain
        )
        unmark_data_port(fresh)  # before the bind: a listener copies its options then
        self.data_guard = guard_data_port(fresh, limits)
        # the stage keeps an open socket even if the bind fails (the assignment fails;
        # the next one tries again), never a closed one
        self.data_in = fresh
        await bind_when_free(fresh, self.data_bound)
        return fresh

    async def reopen_probe_in(self) -> zmq.asyncio.Socket:
        """Close the probe socket and bind a fresh one to the same endpoint: what the
        old one had queued is dropped unread. libzmq keeps a cut connection's complete
        messages queued until the application reads them, and a flood's backlog of
        small probes is read far slower than it arrives (a stage under bench/hostile.py's
        probe_flood read some 5-10k a second of the 300-450k sent), so closing is the
        one way to free it. Every peer reconnects by itself; a request in flight is
        lost (its sender's deadline finds it). Call it from the one task that reads the
        probe socket. If the port cannot be bound again (another process took it in
        the moment it was free), ConfigError: the probe task dies and its supervisor
        says so, as for any probe task's death."""
        assert self._context is not None and self._options is not None and self.probe_bound
        assert self._probe_limits is not None
        if self.probe_guard is not None:
            self.probe_guard.stop()
        self.probe_in.close(linger=0)
        fresh = open_probe_listener(self._context, self._options, self._probe_limits, self._keypair)
        # never a closed socket, even if the bind fails (the next reopen tries again)
        self.probe_in = fresh
        await bind_when_free(fresh, self.probe_bound)
        self.probe_guard = guard_probe_port(fresh, self._probe_limits)
        return fresh

    def close(self) -> None:
        for guard in (self.data_guard, self.probe_guard):
            if guard is not None:
                guard.stop()
        if self.control_monitor is not None:
            self.control.disable_monitor()
            self.control_monitor.close(linger=0)
        for sock in (self.data_in, self.probe_in, self.control, self.bulk):
            if sock is not None:
                sock.close(linger=0)


def open_probe_listener(
    context: zmq.asyncio.Context,
    options: SocketOptions,
    limits: ReceiveLimits,
    keypair: security.KeyPair | None,
) -> zmq.asyncio.Socket:
    """A probe socket, not yet bound: a ROUTER under ``limits`` without a receive mark
    (:data:`PROBE_PORT_RECV_HWM`), a CURVE server of the probe domain with keys."""
    probe_in = open_socket(context, zmq.ROUTER, options, limits=limits)
    try:
        if PROBE_PORT_RECV_HWM is not None:
            probe_in.setsockopt(zmq.RCVHWM, PROBE_PORT_RECV_HWM)  # before the bind
        if keypair is not None:
            security.secure_server(probe_in, keypair, domain=PROBE_DOMAIN)
    except BaseException:
        probe_in.close(linger=0)
        raise
    return probe_in


def unmark_data_port(data_in: zmq.asyncio.Socket) -> None:
    """Give a data socket no receive mark (:data:`DATA_PORT_RECV_HWM`); before it binds."""
    if DATA_PORT_RECV_HWM is not None:
        data_in.setsockopt(zmq.RCVHWM, DATA_PORT_RECV_HWM)


def guard_data_port(data_in: zmq.asyncio.Socket, limits: ReceiveLimits) -> ConnectionGuard:
    """Start cutting the data port's connections that make libzmq hold more than
    ``limits`` let one peer queue (a message of many frames is held whole before any
    check sees it: issue 33, finding 3). Call inside the running event loop."""
    bounds = limits.message_bounds(zmq.PULL)
    budget = data_port_budget(
        limits.queued_bytes_per_peer, bounds.max_bytes, bounds.max_frames, limits.recv_hwm
    )
    guard = ConnectionGuard(
        data_in, budget, label="data port", connection_look_s=FEW_CONNECTIONS_LOOK_S
    )
    guard.start()
    return guard


def guard_probe_port(probe_in: zmq.asyncio.Socket, limits: ReceiveLimits) -> ConnectionGuard:
    """Start cutting the probe port's connections that make libzmq hold more than its
    ``limits`` let one peer queue: what the old mark allowed (``RCVHWM`` messages of
    the largest frame) and one more message arriving, as for a data port (a link
    burst, at most 32 MiB, and a backup's frame fit); and a sender of small messages
    (a probe flood) past a megabyte held (:func:`probe_port_budget`). It looks as
    often as a data port's guard: what a cut comes late by is what a flood queues
    between two looks. Call inside the running event loop."""
    bounds = limits.message_bounds(zmq.ROUTER)
    budget = probe_port_budget(
        limits.queued_bytes_per_peer, bounds.max_bytes, bounds.max_frames, limits.recv_hwm
    )
    guard = ConnectionGuard(
        probe_in, budget, label="probe port", connection_look_s=FEW_CONNECTIONS_LOOK_S
    )
    guard.start()
    return guard


# Link-measurement bursts send frames of up to 1 MiB (zpipe.stage.linkprobe).
PROBE_MIN_FRAME_BYTES = 2 << 20


def probe_port_limits(options: SocketOptions) -> ReceiveLimits:
    """The probe port's limits: a backup's tensor (one frame) is never larger than the
    parameters this device builds (--max-model-mb, else --memory-mb), which it could
    not hold anyway; link bursts always fit."""
    frame = min(options.max_message_bytes, max(PROBE_MIN_FRAME_BYTES, peer_build_limit()))
    return ReceiveLimits(frame, options.recv_hwm)


def data_port_limits(
    spec: ModelSpec, *, max_rows: int, fallback: ReceiveLimits
) -> tuple[ReceiveLimits, str]:
    """The data port's receive limits for a plan of ``spec``, and how they were found.

    ``MAXMSGSIZE``: the largest tensor any cut of the model sends (an activation, or
    the gradient of one), per sample (from the config: nothing is built or run),
    times ``max_rows``, plus header room; taken
    over every cut, not only this stage's, because a connection keeps the limit it
    was accepted under while a re-plan moves the cut. ``RCVHWM``: as many such
    messages as fit a connection's byte budget
    (:meth:`ReceiveLimits.for_largest_message`). A model whose units cannot be
    sized without building them (user code) gets ``fallback``.
    """
    if spec.family in USER_CODE_FAMILIES:
        return fallback, "fallback"  # sized only by building it: not again
    try:
        per_sample = largest_tensor_bytes_per_sample(load_layer_sequence(spec))
    except Exception as exc:  # a model that cannot be traced on meta keeps the fallback
        log.warning("data_limits_unsized", family=spec.family, error=describe_error(exc))
        return fallback, "fallback"
    if per_sample is None:
        return fallback, "fallback"
    # never above the socket's own limit, CURVE's framing included
    largest = min(per_sample * max_rows, fallback.max_message_bytes - CURVE_FRAME_OVERHEAD)
    return ReceiveLimits.for_largest_message(largest), "model"
