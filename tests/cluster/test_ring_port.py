"""A data-parallel group's ring port: bound when the stage is assigned, reported as bound.

The race these pin: a stage picked its ring port with ``free_tcp_port`` (bind port 0,
close, keep the number) when assigned, reported it, and bound it only when told to
connect, after every stage of the run had built its shard. Any socket bound to port 0
meanwhile could take the port (as a client's sink took the coordinator's, see
test_local_cluster_port.py); the ring then could not bind and the run failed.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq
import zmq.asyncio

from tests._support.training import (
    SGD,
    SPEC,
    assert_same_weights,
    make_batches,
    train_single_process,
)
from zpipe._errors import ConfigError, ProtocolError, TransportTimeout
from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.planner.training_plan import TrainingPlan
from zpipe.protocol.data_plane import AllReduce
from zpipe.protocol.stage_control import Assign
from zpipe.stage.assignment import Assignment
from zpipe.stage.data_parallel import RingPort
from zpipe.stage.data_parallel.ring_links import ring_allow_list
from zpipe.stage.executors.training_plane import RingSockets, prepare_training, training_setup
from zpipe.transport import security
from zpipe.transport.codec import Message
from zpipe.transport.sockets import SocketOptions, new_context, open_socket, recv_frames, send


@pytest.fixture
def squatted_port() -> Iterator[int]:
    """A port held by a PULL socket of this process, as a client's sink holds one."""
    context = zmq.Context()
    squatter = context.socket(zmq.PULL)
    squatter.setsockopt(zmq.LINGER, 0)
    port = squatter.bind_to_random_port("tcp://127.0.0.1")
    try:
        yield port
    finally:
        squatter.close()
        context.term()


def test_a_group_trains_when_the_ring_port_it_would_have_picked_is_taken(
    squatted_port: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The stages are separate interpreters: a sitecustomize on their path hands every
    # free_tcp_port of theirs the taken port, as the race did (both ranks of the group
    # get it; the old stage bound it at connect and failed). The stage no longer picks
    # a port at all, so nothing it calls is patched.
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        f"import zpipe.transport.ports as ports\nports.free_tcp_port = lambda *_: {squatted_port}\n"
    )
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(hook), *sys.path]))
    plan = TrainingPlan.from_dict(
        {
            "algo": "hpp",
            "schedule": "1f1b",
            "num_units": 4,
            "microbatch_size": 3,
            "num_microbatches": 2,
            "stages": [
                {"devices": ["g0", "g1"], "start": 0, "end": 2, "shares": [2, 1], "warmup": 2},
                {"devices": ["g2"], "start": 2, "end": 4, "shares": [3], "warmup": 1},
            ],
            "predicted": {},
        }
    )
    batches = make_batches(2, 6, seed=3)
    devices = [DeviceSpec("g0"), DeviceSpec("g1"), DeviceSpec("g2")]
    # spawned, not forked from the warm zygote: the hook runs as an interpreter starts
    with LocalCluster(devices, heartbeat_interval_s=0.5, zygote=False) as cluster:
        report = cluster.fit(
            SPEC, batches, optimizer=SGD, num_microbatches=2, plan=plan, progress=False
        )
        logs = cluster.logs("g0") + cluster.logs("g1")
    want, want_losses = train_single_process(SPEC, batches, SGD)
    assert_same_weights(report.state_dict, want)
    assert report.losses == pytest.approx(want_losses, rel=1e-5)
    assert report.stages["g0"]["allreduce_s"] > 0
    assert f":{squatted_port}" not in logs  # no ring was told the taken port


# ------------------------------------------------------------- the port, in-process


def _segment() -> Message:
    """A well-formed all-reduce segment, as the previous rank sends."""
    body = {"round": 1, "step": 0, "chunk": 1, "seg": 0, "src": 0}
    return Message(AllReduce.KIND, body, tensors=(torch.ones(2),))


@pytest.fixture(scope="module")
def keys_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ring-port-keys") / "keys"
    security.generate_keys(path, ["r0", "r1", "stranger"])
    return path


async def test_a_ring_port_admits_its_previous_rank_from_the_moment_it_is_bound(
    keys_dir: Path,
) -> None:
    """The previous rank may connect before this rank hears "connect" (libzmq never
    retries a refused handshake), and the data port's allow-list, replaced by every
    assignment after the ring port is bound, does not take its key away."""
    own, prev, stranger = (security.load_keypair(keys_dir, n) for n in ("r1", "r0", "stranger"))
    context = new_context()
    data_allow = security.PeerAllowList()
    auth = security.CurveAuthenticator(context, data_allow)
    auth.start()
    port = RingPort(
        context=context,
        bind="tcp://127.0.0.1:0",
        options=SocketOptions(),
        keypair=own,
        prev_key=prev.public,
        prev_label="rank 0",
        authenticator=auth,
    )
    senders = []
    try:
        assert port.port > 0 and port.bound_endpoint.endswith(f":{port.port}")
        data_allow.replace([stranger.public])  # the next assignment's senders
        for pair in (stranger, prev):  # the stranger first: refused, it delivers nothing
            sender = open_socket(context, zmq.PUSH, SocketOptions())
            senders.append(sender)
            security.secure_client(sender, pair, own.public)
            sender.connect(port.bound_endpoint)
            # (the stranger's send may wait for a connection that never comes)
            with contextlib.suppress(TransportTimeout):
                await send(sender, _segment(), timeout_s=2.0, peer="the ring port")
        assert port.socket is not None
        frames = await recv_frames(port.socket, timeout_s=30.0, peer="rank 0", awaited="a segment")
        assert security.sender_public_key(frames[0]) == prev.public
        assert prev.public in ring_allow_list(auth)
        assert prev.public not in data_allow
    finally:
        for sender in senders:
            sender.close(linger=0)
        port.close()
        auth.stop()
        context.term()
    assert prev.public not in ring_allow_list(auth)  # closing took back what it added
    assert port.socket is None


def test_a_secured_ring_port_needs_the_previous_rank_key(keys_dir: Path) -> None:
    context = new_context()
    try:
        with pytest.raises(ConfigError, match="public key of rank 0"):
            RingPort(
                context=context,
                bind="tcp://127.0.0.1:0",
                options=SocketOptions(),
                keypair=security.load_keypair(keys_dir, "r1"),
                prev_key=None,
                prev_label="rank 0",
            )
    finally:
        context.term()


def _assigned(rank: int, group_keys: list[str | None] | None) -> tuple[Assignment, dict[str, Any]]:
    names = ["r0", "r1"]
    group: dict[str, object] = {"names": names, "shares": [1, 1], "rank": rank}
    if group_keys is not None:
        group["keys"] = group_keys
    client = {"names": ["client"], "shares": [2], "endpoints": ["tcp://127.0.0.1:9"]}
    train = {
        "schedule": "1f1b",
        "num_microbatches": 2,
        "warmup": 1,
        "group": group,
        "upstream": {**client, "keys": [None]},
        "downstream": {**client, "keys": [None]},
    }
    message = Assign(
        run=1, model=SPEC.to_dict(), start=0, end=4, index=0, num_stages=1, upstream="client",
        downstream="client", downstream_endpoint="tcp://127.0.0.1:9", dtype="float32",
        mode="train", train=train, epoch=0,
    )  # fmt: skip
    setup = training_setup(message, name=names[rank], wait_s=5.0)
    assignment = Assignment(
        run=1, epoch=0, start=0, end=4, index=0, num_stages=1, upstream="client",
        downstream="client", downstream_endpoint="tcp://127.0.0.1:9",
        shard=None,  # type: ignore[arg-type]  # prepare_training never looks at it
        training=setup,
    )  # fmt: skip
    return assignment, train


async def test_an_assignment_reports_the_ring_port_it_holds() -> None:
    context = new_context()
    assignment, train = _assigned(1, None)
    try:
        prepare_training(
            assignment,
            train,
            data_endpoint="tcp://127.0.0.1:4000",
            data_bind="tcp://0.0.0.0:0",
            ring_sockets=RingSockets(context, SocketOptions()),
        )
        port = assignment.ring_port
        assert port is not None and port.bound_endpoint == f"tcp://0.0.0.0:{port.port}"
        # advertised on the data endpoint's host, on the port bound
        assert assignment.ring_endpoint == f"tcp://127.0.0.1:{port.port}"
        peer = open_socket(context, zmq.PUSH, SocketOptions())
        peer.connect(assignment.ring_endpoint)
        await send(peer, _segment(), timeout_s=10.0, peer="the ring port")
        assert port.socket is not None
        await recv_frames(port.socket, timeout_s=30.0, peer="rank 0", awaited="a segment")
        peer.close(linger=0)
    finally:
        assignment.release_ring_port()
        context.term()
    assert assignment.ring_port is None


async def test_a_secured_group_without_keys_in_its_assignment_is_refused(
    keys_dir: Path,
) -> None:
    """A coordinator older than the stage names the group's keys only in "connect":
    too late for a port bound when assigned; the assignment fails, naming why."""
    context = new_context()
    assignment, train = _assigned(1, None)
    try:
        with pytest.raises(ProtocolError, match="coordinator older than this stage"):
            prepare_training(
                assignment,
                train,
                data_endpoint="tcp://127.0.0.1:4000",
                data_bind="tcp://127.0.0.1:0",
                ring_sockets=RingSockets(
                    context, SocketOptions(), keypair=security.load_keypair(keys_dir, "r1")
                ),
            )
        assert assignment.ring_port is None
    finally:
        context.term()
