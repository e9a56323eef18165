"""A stage's data port admits only the senders its assignment names (issue 33).

With keys, the context's CURVE authenticator admits the assignment's keys; without
keys, the stage's address authenticator admits the hosts of the assignment's
senders. Either way an unassigned peer is refused at the handshake: a well-formed
data message it sends never reaches the data port's receive loop (its bytes are
never counted, nothing is decoded or dropped there). Peers on 127.0.0.2 stand for
another host (loopback answers for all of 127/8; libzmq's ``tcp://SRC:0;DST``
chooses the source address).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from zpipe.protocol.stage_control import Assign, Connect, Register, Registered
from zpipe.stage.config import StageConfig
from zpipe.stage.dataport import DataMessage, DataPort
from zpipe.stage.lifecycle import DataRoute, StageLifecycle
from zpipe.stage.metrics import StageCounters
from zpipe.stage.ports import StageKeys, StagePorts
from zpipe.transport.address_auth import peer_addresses
from zpipe.transport.codec import Message, encode
from zpipe.transport.security import generate_keys, load_keypair, secure_client
from zpipe.transport.sockets import ReceiveLimits, SocketOptions, new_context, open_socket

OPTIONS = SocketOptions()
WAIT_S = 10.0  # generous: a loaded machine; every wait ends on an event
OTHER_HOST = "127.0.0.2"


@pytest.fixture
def context() -> Iterator[zmq.asyncio.Context]:
    ctx = new_context()
    yield ctx
    ctx.term()


class Sockets:
    """The test's own sockets (peers and monitors), closed with linger 0."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.ctx = ctx
        self.opened: list[zmq.asyncio.Socket] = []

    def push(self) -> zmq.asyncio.Socket:
        sock = open_socket(self.ctx, zmq.PUSH, OPTIONS)
        self.opened.append(sock)
        return sock

    def connect(self, sock: zmq.asyncio.Socket, endpoint: str, source: str | None) -> None:
        host_port = endpoint.removeprefix("tcp://")
        sock.connect(f"tcp://{source}:0;{host_port}" if source else endpoint)

    def monitor(self, sock: zmq.asyncio.Socket) -> zmq.asyncio.Socket:
        mon = sock.get_monitor_socket()
        mon.setsockopt(zmq.LINGER, 0)
        self.opened.append(mon)
        return mon

    def close(self) -> None:
        for sock in self.opened:
            sock.close(linger=0)


async def handshake_refused(monitor: zmq.asyncio.Socket) -> None:
    """Wait until the peer watched by ``monitor`` is refused by the server's ZAP."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if not await monitor.poll(100):
            continue
        event = await recv_monitor_message(monitor)
        if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return
        assert event["event"] != zmq.EVENT_HANDSHAKE_SUCCEEDED, "the intruder was admitted"
    raise AssertionError("no refusal seen")


async def handshake_done(monitor: zmq.asyncio.Socket) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if await monitor.poll(100):
            event = await recv_monitor_message(monitor)
            assert event["event"] != zmq.EVENT_HANDSHAKE_FAILED_AUTH, "a legitimate peer refused"
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return
    raise AssertionError("no handshake seen")


def running_lifecycle() -> StageLifecycle:
    """Stage s0 running inference run 1, epoch 1, upstream 'client'."""
    registration = Register(name="s0", data_endpoint="", info={})
    lifecycle = StageLifecycle(
        name="s0", coordinator="c", registration=registration, connect_s=1.0,
        silence_limit_s=1.0, now=0.0,
    )  # fmt: skip
    lifecycle.registration_reply(Registered(name="s0", heartbeat_interval=1), 0)
    assign = Assign(
        run=1, model={}, start=0, end=1, index=0, num_stages=1, upstream="client",
        downstream="client", downstream_endpoint="", dtype="float32", epoch=1,
    )  # fmt: skip
    lifecycle.control_message(assign, 0.0)
    lifecycle.assignment_ready(1, 1, build_s=0.0)
    lifecycle.control_message(Connect(run=1, epoch=1), 0.0)
    lifecycle.connected(1, DataRoute.inference(1, "client"))
    return lifecycle


def data(mb: int) -> list[bytes]:
    """A well-formed micro-batch of run 1 from 'client': what the port would deliver."""
    message = Message("data", {"run": 1, "mb": mb, "src": "client"}, 1, (torch.ones(4),))
    return [bytes(f) for f in encode(message)]


def stage_config(keys_dir: Path | None = None) -> StageConfig:
    # nothing listens at the coordinator's address: the control socket only retries
    return StageConfig(
        name="s0",
        coordinator="tcp://127.0.0.1:9",
        data_bind="tcp://127.0.0.1:0",
        keys_dir=keys_dir,
    )


class Port:
    """A stage's keys and ports, and its data port serving into ``delivered``."""

    def __init__(self, ctx: zmq.asyncio.Context, config: StageConfig) -> None:
        self.keys = StageKeys.load(ctx, config)
        self.ports = StagePorts.open(ctx, config, self.keys)
        self.counters = StageCounters()
        self.delivered: list[int] = []
        self.arrived = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def serve(self) -> None:
        port = DataPort(
            socket=self.ports.data_in,
            lifecycle=running_lifecycle(),
            counters=self.counters,
            name="s0",
            max_message_bytes=OPTIONS.max_message_bytes,
            allowed=self.keys.data_allow,
        )

        async def deliver(message: DataMessage) -> None:
            self.delivered.append(message.mb)
            self.arrived.set()

        self._task = asyncio.create_task(port.serve(deliver, upstream="client"))

    async def wait_for(self, mb: int) -> None:
        deadline = time.monotonic() + WAIT_S
        while mb not in self.delivered:
            self.arrived.clear()
            await asyncio.wait_for(self.arrived.wait(), max(0.01, deadline - time.monotonic()))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.ports.close()
        self.keys.stop()


async def test_without_keys_an_unassigned_host_is_refused_before_decoding(
    context: zmq.asyncio.Context,
) -> None:
    stage, peers = Port(context, stage_config()), Sockets(context)
    try:
        endpoint = stage.ports.data_endpoint
        assert stage.keys.data_addresses is not None and stage.keys.address_auth is not None
        # the assignment names an upstream on 127.0.0.1 (say, the client's sink there)
        stage.keys.data_addresses.replace(peer_addresses(["tcp://127.0.0.1:5555"], endpoint))
        stage.serve()
        intruder = peers.push()
        watch = peers.monitor(intruder)
        peers.connect(intruder, endpoint, OTHER_HOST)
        for mb in range(90, 95):
            await intruder.send_multipart(data(mb))  # queued at the intruder, never accepted
        await handshake_refused(watch)
        upstream = peers.push()
        peers.connect(upstream, endpoint, "127.0.0.1")
        await upstream.send_multipart(data(1))
        await stage.wait_for(1)
        await upstream.send_multipart(data(2))
        await stage.wait_for(2)
        assert stage.delivered == [1, 2]
        # nothing of the intruder's was read: only the upstream's bytes were counted,
        # and nothing was dropped (a message read and refused later counts as dropped)
        assert stage.counters.bytes_in == 2 * sum(len(f) for f in data(1))
        assert stage.counters.dropped == 0
        assert stage.keys.address_auth.refused[OTHER_HOST] >= 1
        assert stage.keys.data_refusals >= 1
    finally:
        peers.close()
        await stage.close()


async def test_without_keys_nobody_is_admitted_before_an_assignment(
    context: zmq.asyncio.Context,
) -> None:
    stage, peers = Port(context, stage_config()), Sockets(context)
    try:
        endpoint = stage.ports.data_endpoint
        local = peers.push()
        watch = peers.monitor(local)
        peers.connect(local, endpoint, None)  # even this host's processes
        await handshake_refused(watch)
    finally:
        peers.close()
        await stage.close()


async def test_a_new_assignment_admits_its_hosts_and_keeps_admitted_connections(
    context: zmq.asyncio.Context,
) -> None:
    stage, peers = Port(context, stage_config()), Sockets(context)
    try:
        endpoint = stage.ports.data_endpoint
        addresses = stage.keys.data_addresses
        assert addresses is not None
        addresses.replace(["127.0.0.1"])
        stage.serve()
        old = peers.push()
        peers.connect(old, endpoint, "127.0.0.1")
        await old.send_multipart(data(1))
        await stage.wait_for(1)
        # a re-plan moves the upstream to the other host
        addresses.replace(peer_addresses([f"tcp://{OTHER_HOST}:7000"]))
        await old.send_multipart(data(2))  # in flight on an admitted connection: kept
        await stage.wait_for(2)
        new = peers.push()
        peers.connect(new, endpoint, OTHER_HOST)
        await new.send_multipart(data(3))
        await stage.wait_for(3)
        again = peers.push()  # a new connection from the old host: refused
        watch = peers.monitor(again)
        peers.connect(again, endpoint, "127.0.0.1")
        await handshake_refused(watch)
        assert stage.delivered == [1, 2, 3]
    finally:
        peers.close()
        await stage.close()


async def test_a_reopened_data_port_keeps_refusing_by_address(
    context: zmq.asyncio.Context,
) -> None:
    stage, peers = Port(context, stage_config()), Sockets(context)
    try:
        endpoint = stage.ports.data_endpoint
        assert stage.keys.data_addresses is not None
        stage.keys.data_addresses.replace(["127.0.0.1"])
        # a plan with other limits reopens the data socket (zpipe.transport.reopen)
        fresh = await stage.ports.reopen_data_in(ReceiveLimits.for_largest_message(1 << 20))
        intruder = peers.push()
        watch = peers.monitor(intruder)
        peers.connect(intruder, endpoint, OTHER_HOST)
        await handshake_refused(watch)
        upstream = peers.push()
        peers.connect(upstream, endpoint, "127.0.0.1")
        await upstream.send_multipart(data(1))
        frames = await asyncio.wait_for(fresh.recv_multipart(), WAIT_S)
        assert frames == data(1)
    finally:
        peers.close()
        await stage.close()


async def test_with_keys_an_unassigned_key_is_refused_before_decoding(
    context: zmq.asyncio.Context, tmp_path: Path
) -> None:
    keys_dir = tmp_path / "keys"
    generate_keys(keys_dir, ["coordinator", "s0", "client", "s9"])
    stage, peers = Port(context, stage_config(keys_dir)), Sockets(context)
    try:
        endpoint = stage.ports.data_endpoint
        assert stage.keys.data_allow is not None and stage.keys.authenticator is not None
        assert stage.keys.data_addresses is None  # keys decide, not addresses
        stage.keys.data_allow.replace({"client": load_keypair(keys_dir, "client").public})
        stage.serve()
        server_key = load_keypair(keys_dir, "s0").public
        # s9 is a cluster member with a valid key, but not this run's upstream
        intruder = peers.push()
        secure_client(intruder, load_keypair(keys_dir, "s9"), server_key)
        watch = peers.monitor(intruder)
        peers.connect(intruder, endpoint, None)
        await intruder.send_multipart(data(90))
        await handshake_refused(watch)
        upstream = peers.push()
        secure_client(upstream, load_keypair(keys_dir, "client"), server_key)
        up_watch = peers.monitor(upstream)
        peers.connect(upstream, endpoint, None)
        await handshake_done(up_watch)
        await upstream.send_multipart(data(1))
        await stage.wait_for(1)
        assert stage.delivered == [1]
        assert stage.counters.bytes_in == sum(len(f) for f in data(1))
        assert stage.counters.dropped == 0
        assert stage.keys.authenticator.refused["127.0.0.1"] >= 1
    finally:
        peers.close()
        await stage.close()
