"""``python -m zpipe fl-server``: the federated server over zpipe's transport.

A thin I/O shell around the same sans-IO server object fl-sim drives
(:mod:`zpipe.federated.server`): the shell owns the socket, the clock, the
trace file and the test set; :class:`~zpipe.federated.net_controller.FlServerController`
turns messages and timeouts into the object's calls and its :class:`TrainTask`
answers into commands, which the shell carries out. The shell decides nothing
itself (``--trace`` records every input, and
:func:`zpipe.federated.net_trace.replay` reproduces every decision)::

    fl_register from N clients (label counts and a profiled latency, never samples)
        -> ClientProfiles -> make_server(...).start() -> fl_task to each chosen client
    fl_update     -> on_update(), then observe_latency(client, measured round trip)
    no fl_update within --task-timeout -> observe_silence(client, --task-timeout), then
                     on_task_failed(): a silent client is dropped out of its group (the
                     timeout is only a lower bound of its latency, so no range decides)
                     before the failure can start a round that would pick it again

    a dropped client (Eco-FL) -> fl_probe every --probe-interval s; its round trip
                     -> observe_latency(): Algorithm 1 re-admits it once it fits a range
    fl_register after the start -> add_client() (eq. 4 association), then its tasks
    a set-aside client (fedavg, fedasync) -> fl_probe too; an answer brings it back
    a client's connection closes (the socket monitor) -> its id is released (its
                     address may register another), its task taken back at once
    fl_register from a known client (it reconnected under its routing id, or came
                     back on a new connection) -> welcomed back ("rejoined"); after two
                     releases for silence (of the id or of its address) it, or a new
                     id, gets no task until it answers a probe (net_presence)

The run ends after ``--updates`` global model updates, after ``--duration``
seconds, or when nothing is in flight and nothing can be dispatched or probed. Every
wait has a deadline; a message that does not decode, does not fit its kind,
comes from an unregistered peer or names a task that is not the sender's is
dropped (counted, logged) and the server goes on. With ``--keys DIR`` the
socket is a CurveZMQ server whose allow-list is every ``NAME.key`` in DIR but
its own (``fl-server``), and whose ``roles.txt`` decides which keys may act as
fl clients (:mod:`zpipe.federated.net_admission`).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from zpipe._errors import (
    ConfigError,
    PeerGoneError,
    ProtocolError,
    RoleError,
    TransportTimeout,
)
from zpipe.federated.model import MLPShape, accuracy
from zpipe.federated.net_admission import KeyIdentities, SenderRoles
from zpipe.federated.net_commands import (
    Abort,
    Command,
    Emit,
    Evaluate,
    FloatArray,
    LogLine,
    NetServerConfig,
    SendMessage,
    TraceLine,
)
from zpipe.federated.net_controller import FlServerController
from zpipe.federated.net_limits import Connections
from zpipe.log import get_logger
from zpipe.lossy.data import Dataset
from zpipe.protocol import WireMessage
from zpipe.protocol.federated import FlRegister
from zpipe.transport import security
from zpipe.transport.codec import decode_typed
from zpipe.transport.sockets import (
    SocketOptions,
    bind_endpoint,
    new_context,
    open_socket,
    recv_frames,
    send,
)

__all__ = ["MAX_MESSAGE_BYTES", "FederatedShell"]

log = get_logger("zpipe.federated.server")

MAX_MESSAGE_BYTES = 64 << 20  # the ceiling of any run's frame limit (the widest MLPs)
MIN_FRAME_BYTES = 1 << 20  # room for a header frame and CURVE's overhead on a tiny model


def frame_limit(shape: MLPShape) -> int:
    """The largest frame this run's server receives: twice its weights (one float64
    tensor), at least 1 MiB. A client sends nothing larger; a frame past it is cut off
    by libzmq before it is held (issue 33 finding 4: a message of 16 frames of 60 MB,
    each under the old 64 MiB limit, took the server from 312 to 784-1,209 MiB)."""
    return min(max(2 * 8 * shape.size, MIN_FRAME_BYTES), MAX_MESSAGE_BYTES)


class FederatedShell:
    """One federated run over the network: the socket, the clock and the files
    around a :class:`FlServerController`, which decides."""

    def __init__(
        self, config: NetServerConfig, dataset: Dataset, *, out: IO[str] | None = None
    ) -> None:
        self.config = config
        self.dataset = dataset
        self.shape = MLPShape(dataset.n_features, config.hidden, dataset.n_classes)
        self.controller = FlServerController(config, self.shape)
        self.max_frame_bytes = frame_limit(self.shape)
        self.out = out or sys.stdout
        self._context = new_context()
        self._router: zmq.asyncio.Socket | None = None
        # libzmq's events for the router: a closed connection releases its client ids
        self._monitor: zmq.asyncio.Socket | None = None
        self._connections = Connections()
        self._authenticator: security.CurveAuthenticator | None = None
        self._roles: SenderRoles | None = None
        self._identities = KeyIdentities()
        self._trace: IO[str] | None = None
        self._started = 0.0
        self._curve: list[dict[str, float | int]] = []
        self.endpoint = ""

    @property
    def dropped_messages(self) -> int:
        return self.controller.dropped_messages

    # ------------------------------------------------------------------ socket

    def open(self) -> str:
        options = SocketOptions(max_message_bytes=self.max_frame_bytes, send_hwm=64, recv_hwm=64)
        router = open_socket(self._context, zmq.ROUTER, options)
        router.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting client keeps its route
        keys_dir = self.config.keys_dir
        if keys_dir is not None:
            keypair = security.load_keypair(keys_dir, self.config.key_name)
            allowed = security.load_public_keys(keys_dir)
            allow = security.PeerAllowList(
                {name: key for name, key in allowed.items() if name != self.config.key_name}
            )
            self._authenticator = security.CurveAuthenticator(self._context, allow)
            self._authenticator.start()
            self._roles = SenderRoles(keys_dir)
            security.secure_server(router, keypair)
        else:
            security.warn_open_cluster(log, "fl-server")
        self._router = router
        self._monitor = router.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self.endpoint = bind_endpoint(router, self.config.bind)
        return self.endpoint

    def close(self) -> None:
        if self._monitor is not None and self._router is not None:
            self._router.disable_monitor()
            self._monitor.close(linger=0)
        if self._router is not None:
            # a bounded linger: the run's last messages (every client's fl_done) are only
            # queued when close comes, and linger 0 dropped one a loaded client then
            # waited for until its own idle limit
            self._router.close(linger=int(1000 * min(self.config.send_timeout_s, 2.0)))
        if self._authenticator is not None:
            self._authenticator.stop()
        self._context.term()
        if self._trace is not None:
            self._trace.close()

    async def _send(self, routing_id: bytes, message: WireMessage, peer: str) -> None:
        assert self._router is not None
        try:
            await send(
                self._router,
                message.to_message(),
                routing_id=routing_id,
                peer=peer,
                timeout_s=self.config.send_timeout_s,
            )
        except zmq.ZMQError:  # ROUTER_MANDATORY: the peer is not connected
            log.warning("fl_send_failed", peer=peer, error=str(PeerGoneError(peer, message.KIND)))
        except TransportTimeout as exc:
            log.warning("fl_send_failed", peer=peer, error=str(exc))

    async def _receive(self, timeout_s: float) -> tuple[bytes, WireMessage, str | None] | None:
        """The next valid message, its sender and, without --keys, the sender's address
        (what bounds its client ids); None on a timeout or a dropped message."""
        assert self._router is not None
        try:
            frames = await recv_frames(
                self._router, timeout_s=max(timeout_s, 0.0), peer="fl clients", awaited="a message"
            )
        except TransportTimeout:
            await self._closed_connections()
            return None
        # the connections closed before this message first: a descriptor closed may be
        # the one this message came on, reused (net_limits.Connections)
        await self._closed_connections()
        routing_id = bytes(frames[0].bytes) if frames else b""
        if frames:
            self._connections.seen(_source_fd(frames[-1]), routing_id)
        try:
            # the body checked once, by the codec, on its way to the typed class
            typed = decode_typed(frames[1:], max_message_bytes=self.max_frame_bytes)
            if self._roles is not None and len(frames) > 1:
                self._roles.check(typed.KIND, frames[1])
                key = security.sender_public_key(frames[1])
                if isinstance(typed, FlRegister) and key is not None:
                    try:
                        self._identities.check(key, typed.client)
                    except ProtocolError as exc:  # told why, as a refused key is
                        await self._carry_out(self.controller.refused(routing_id, typed, str(exc)))
                        return None
        except ProtocolError as exc:
            await self._carry_out(self.controller.drop(routing_id, str(exc)))
            return None
        except RoleError as exc:
            await self._carry_out(self.controller.refused(routing_id, typed, str(exc)))
            return None
        origin = None if self._roles is not None else _peer_address(frames[-1])
        return routing_id, typed, origin

    async def _closed_connections(self) -> None:
        """Read the monitor's queued events, never waiting: the routing ids a closed
        connection carried are gone (libzmq gives a new connection a new one), and the
        controller releases their client ids."""
        if self._monitor is None:
            return
        while True:
            try:
                frames = await self._monitor.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            event = parse_monitor_message(frames)
            # an accepted descriptor still naming routing ids: their connection closed
            # (its own event is never after this one; see Connections)
            for routing_id in self._connections.closed(int(event["value"])):
                await self._carry_out(self.controller.on_gone(routing_id, time.monotonic()))

    async def _carry_out(self, commands: Sequence[Command]) -> None:
        """Do what the controller decided, in its order."""
        for command in commands:
            match command:
                case SendMessage(to, message, peer, task):
                    if task is not None:
                        self.controller.task_sent(task, time.monotonic())
                    await self._send(to, message, peer)
                case Emit(event):
                    self._emit(event)
                case TraceLine(event):
                    if self._trace is not None:
                        self._trace.write(json.dumps(event) + "\n")
                case LogLine(level, event, fields):
                    getattr(log, level)(event, **fields)
                case Evaluate(version, weights):
                    self._evaluate(version, weights)
                case Abort(error):
                    raise error

    def _emit(self, event: Mapping[str, Any]) -> None:
        self.out.write(json.dumps(event) + "\n")
        self.out.flush()

    def _evaluate(self, version: int, weights: FloatArray) -> None:
        acc = accuracy(weights, self.shape, self.dataset.x_test, self.dataset.y_test)
        point = {
            "global_updates": version,
            "elapsed_s": round(time.monotonic() - self._started, 3),
            "test_acc": round(acc, 4),
        }
        self._curve.append(point)
        self._emit({"event": "eval", **point})

    # ----------------------------------------------------------------- the run

    async def register_clients(self) -> None:
        deadline = time.monotonic() + self.config.register_timeout_s
        while self.controller.registering:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            received = await self._receive(left)
            if received is not None:
                await self._carry_out(self.controller.on_registration(*received))
        if not self.controller.clients:
            raise ConfigError(f"no client registered within {self.config.register_timeout_s:g} s")

    async def run(self) -> dict[str, Any]:
        controller = self.controller
        self._started = time.monotonic()
        await self._carry_out(controller.start(self._started))
        while True:
            commands, ended = controller.tick(time.monotonic())
            await self._carry_out(commands)
            if ended:
                break
            received = await self._receive(controller.next_deadline() - time.monotonic())
            if received is not None:
                routing_id, message, origin = received
                now = time.monotonic()
                await self._carry_out(controller.on_message(routing_id, message, now, origin))
        await self._carry_out(controller.finish())
        server = controller.server
        assert server is not None
        return {
            "event": "fl_server_done",
            "method": self.config.server.method,
            "reason": controller.reason,
            "clients": sorted(controller.routes),
            "global_updates": server.version,
            "final_acc": self._curve[-1]["test_acc"],
            "curve": self._curve,
            "dropped_messages": controller.dropped_messages,
            "probes": controller.presence.probes.sent,
            "stats": server.stats(),
            "wall_s": round(time.monotonic() - self._started, 3),
        }

    async def serve(self) -> dict[str, Any]:
        if self.config.trace is not None:
            self._trace = self.config.trace.open("w")
        self._emit({"event": "listening", "endpoint": self.endpoint or self.open()})
        await self.register_clients()
        return await self.run()


def _source_fd(frame: zmq.Frame) -> int:
    """The file descriptor of the connection a message came on (-1 where libzmq has
    none): what the monitor names when that connection closes."""
    try:
        return int(frame.get(zmq.SRCFD))
    except zmq.ZMQError:
        return -1


def _peer_address(frame: zmq.Frame) -> str:
    """The IP address a message came from (without its port: one host's connections
    are one peer), or "unknown" where libzmq has none (ipc, inproc)."""
    try:
        address = frame.get("Peer-Address")
    except zmq.ZMQError:
        return "unknown"
    return str(address) if address else "unknown"
