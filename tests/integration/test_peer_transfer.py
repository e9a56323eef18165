"""Big stage-to-stage state (backups, fetched units) crosses the probe sockets in chunks.

Issue 17: bulk state is chunked so that a transfer that keeps moving never outlasts a
deadline; a backup or fetch of tens of megabytes was one message on a slow link.
The pure part (cutting and putting together) is tested alone; the rest through a
snapshot service and a peer's held copies talking over a real ROUTER on loopback, as
two stages do.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest
import torch
import zmq
import zmq.asyncio

from zpipe._errors import ProtocolError
from zpipe.protocol import WireMessage
from zpipe.protocol.peer import Backup
from zpipe.protocol.stage_control import BackupRequest
from zpipe.stage.executors.sync_training import DataParallelGroup, TrainingSetup
from zpipe.stage.held_copies import CopyHolder
from zpipe.stage.linkprobe import ProbeResponder
from zpipe.stage.metrics import StageCounters
from zpipe.stage.peer_policy import FetchGrant
from zpipe.stage.peer_transfer import ChunkedState, encoded_size, state_chunks
from zpipe.stage.replicas import ReplicaStore
from zpipe.stage.snapshots import SnapshotService
from zpipe.transport.emulation import LinkSpec
from zpipe.transport.sockets import SocketOptions, bind_endpoint, new_context, open_socket

CHUNK = 64 * 1024


def big_state(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "units.0.weight": torch.randn(300, 200, generator=generator),  # 240 kB
        "units.0.bias": torch.randn(300, generator=generator),
        "units.1.weight": torch.randn(50, 100, generator=generator).to(torch.bfloat16),
        "units.1.weight#opt.momentum_buffer": torch.randn(50, 100, generator=generator),
    }


def backup_of(owner: str, state: dict[str, torch.Tensor], step: int = 3) -> Backup:
    return Backup(run=7, step=step, owner=owner, keys=list(state), tensors=tuple(state.values()))


def test_chunks_put_together_give_the_message_back() -> None:
    state = big_state(0)
    frames, nbytes = encoded_size(backup_of("a", state))
    chunks = list(state_chunks(frames, owner="a", transfer=5, chunk_bytes=CHUNK))
    assert len(chunks) == -(-nbytes // CHUNK) > 1
    assert all(c.tensors[0].numel() <= CHUNK for c in chunks)
    inbox = ChunkedState(cap_bytes=1 << 30)
    results = [inbox.add("peer", c, max_message_bytes=1 << 30) for c in chunks]
    assert results[:-1] == [None] * (len(chunks) - 1)
    whole = results[-1]
    assert isinstance(whole, Backup) and whole.owner == "a"
    got = dict(zip(whole.keys, whole.tensors, strict=True))
    assert got.keys() == state.keys()
    assert all(torch.equal(got[k], state[k]) for k in state)


def test_a_chunk_that_does_not_fit_ends_its_transfer() -> None:
    frames, _ = encoded_size(backup_of("a", big_state(1)))
    chunks = list(state_chunks(frames, owner="a", transfer=1, chunk_bytes=CHUNK))
    inbox = ChunkedState(cap_bytes=1 << 30)
    inbox.add("peer", chunks[0], max_message_bytes=1 << 30)
    with pytest.raises(ProtocolError):
        inbox.add("peer", chunks[2], max_message_bytes=1 << 30)  # chunk 1 skipped
    with pytest.raises(ProtocolError, match="never begun"):
        inbox.add("peer", chunks[1], max_message_bytes=1 << 30)  # the transfer is gone
    # a cap smaller than the transfer refuses it at chunk 0, before holding anything
    small = ChunkedState(cap_bytes=CHUNK)
    with pytest.raises(ProtocolError):
        small.add("peer", chunks[0], max_message_bytes=1 << 30)


def test_transfers_of_two_senders_for_one_owner_do_not_mix() -> None:
    frames_a, _ = encoded_size(backup_of("a", big_state(2)))
    frames_b, _ = encoded_size(backup_of("a", big_state(3)))
    from_a = list(state_chunks(frames_a, owner="a", transfer=0, chunk_bytes=CHUNK))
    from_b = list(state_chunks(frames_b, owner="a", transfer=0, chunk_bytes=CHUNK))
    inbox = ChunkedState(cap_bytes=1 << 30)
    done: dict[str, WireMessage] = {}
    for chunk_a, chunk_b in zip(from_a, from_b, strict=True):
        for sender, chunk in (("a", chunk_a), ("b", chunk_b)):
            whole = inbox.add(sender, chunk, max_message_bytes=1 << 30)
            if whole is not None:
                done[sender] = whole
    assert isinstance(done["a"], Backup) and isinstance(done["b"], Backup)
    assert torch.equal(done["a"].tensors[0], big_state(2)["units.0.weight"])
    assert torch.equal(done["b"].tensors[0], big_state(3)["units.0.weight"])


@dataclass
class Holder:
    """Stage "b"'s probe port: a ROUTER served by the copies it holds."""

    held: CopyHolder
    endpoint: str
    kinds: list[str] = field(default_factory=list)  # what arrived
    streamed: list[bool] = field(default_factory=list)  # answers sent as a stream


def setup_of(name: str, backup_from: tuple[str, ...]) -> TrainingSetup:
    return TrainingSetup(
        run=7, epoch=1, name=name, index=1, num_stages=2, schedule="1f1b",
        num_microbatches=2, warmup=1, group=DataParallelGroup((name,), (1,)), rank=0,
        upstream=DataParallelGroup(("a",), (1,)),
        downstream=DataParallelGroup(("client",), (1,)), wait_s=1.0,
        backup_from=backup_from,
    )  # fmt: skip


class Shard:
    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state

    def training_state(self) -> dict[str, torch.Tensor]:
        return self.state


class Trainer:
    def __init__(self, setup: TrainingSetup, state: dict[str, torch.Tensor]) -> None:
        self.setup = setup
        self.shard = Shard(state)

    async def wait_for_step(self, step: int, timeout_s: float) -> None:
        return None


@pytest.fixture
async def context() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = new_context()
    yield ctx
    ctx.term()


@pytest.fixture
async def holder(context: zmq.asyncio.Context) -> AsyncIterator[Holder]:
    router = open_socket(context, zmq.ROUTER, SocketOptions())
    endpoint = bind_endpoint(router, "tcp://127.0.0.1:0")
    copies = CopyHolder(name="b", timeout_s=20.0, counters=StageCounters(), replicas=ReplicaStore())
    held = Holder(copies, endpoint)
    trainer = Trainer(setup_of("b", backup_from=("a",)), {})

    async def handler(
        message: WireMessage, key: bytes | None
    ) -> WireMessage | Iterator[WireMessage]:
        held.kinds.append(message.KIND)
        answer = await copies.on_peer_request(message, trainer)  # type: ignore[arg-type]
        held.streamed.append(not isinstance(answer, WireMessage))
        return answer

    responder = ProbeResponder(
        socket=router, link=LinkSpec(), name="b", send_timeout_s=20.0,
        max_message_bytes=2**30, peer_handler=handler,
    )  # fmt: skip
    task = asyncio.create_task(responder.serve())
    try:
        yield held
    finally:
        task.cancel()
        await responder.close()
        router.close(linger=0)


def sender_service(context: zmq.asyncio.Context, name: str) -> SnapshotService:
    service = SnapshotService(
        name=name, context=context, keypair=None, socket_options=SocketOptions(),
        timeout_s=20.0, compute=ThreadPoolExecutor(1), counters=StageCounters(),
        held=CopyHolder(
            name=name, timeout_s=20.0, counters=StageCounters(), replicas=ReplicaStore()
        ),
    )  # fmt: skip
    service.chunk_bytes = CHUNK
    return service


async def test_a_big_backup_goes_in_paced_chunks_and_is_kept_whole(
    context: zmq.asyncio.Context, holder: Holder
) -> None:
    state = big_state(4)
    sender = sender_service(context, "a")
    paced: list[int] = []

    async def pace(nbytes: int) -> None:
        paced.append(nbytes)

    request = BackupRequest(run=7, step=3, holder="b", holder_endpoint=holder.endpoint, epoch=1)
    trainer = Trainer(setup_of("a", backup_from=()), state)
    reply = await sender.backup_reply(request, trainer, pace)  # type: ignore[arg-type]
    assert reply.error == ""
    _, nbytes = encoded_size(backup_of("a", state))
    assert holder.kinds == ["state_chunk"] * -(-nbytes // CHUNK)
    assert len(paced) == len(holder.kinds) and sum(paced) == nbytes  # each chunk paced
    kept = holder.held.replicas.units("a", 7, 3, 0, 2)
    assert kept.keys() == state.keys() and all(torch.equal(kept[k], state[k]) for k in state)

    # a state that fits one chunk still goes as one backup message
    small = {"units.0.weight": torch.ones(4)}
    holder.kinds.clear()
    trainer.shard.state = small
    again = dataclasses.replace(request, step=4)
    reply = await sender.backup_reply(again, trainer, pace)  # type: ignore[arg-type]
    assert reply.error == "" and holder.kinds == ["backup"]
    assert torch.equal(
        holder.held.replicas.units("a", 7, 4, 0, 1)["units.0.weight"], small["units.0.weight"]
    )


async def test_a_chunked_backup_from_an_owner_the_plan_does_not_name_is_refused_at_once(
    context: zmq.asyncio.Context, holder: Holder
) -> None:
    sender = sender_service(context, "mallory")

    async def pace(nbytes: int) -> None:
        return None

    request = BackupRequest(run=7, step=3, holder="b", holder_endpoint=holder.endpoint, epoch=1)
    trainer = Trainer(setup_of("mallory", backup_from=()), big_state(5))
    reply = await sender.backup_reply(request, trainer, pace)  # type: ignore[arg-type]
    assert "does not back up to this stage" in reply.error
    assert holder.kinds == ["state_chunk"]  # refused at chunk 0: nothing more was sent
    assert ("mallory", 7, 3) not in holder.held.replicas


async def test_a_big_fetch_is_streamed_to_a_requester_that_offers_chunks(
    context: zmq.asyncio.Context, holder: Holder
) -> None:
    state = big_state(6)
    holder.held.replicas.put("a", 7, 3, state)
    holder.held.fetch_grants = (FetchGrant("c", "a", 7, 3, 0, 2),)
    requester = sender_service(context, "c")
    entry = {"owner": "a", "from": "b", "endpoint": holder.endpoint, "run": 7, "step": 3}
    fetched = await requester.fetched_state([{**entry, "start": 0, "end": 2}])
    assert holder.streamed == [True]
    assert fetched.keys() == state.keys() and all(torch.equal(fetched[k], state[k]) for k in state)
    # one unit's small state is one ``units`` message
    only_bias = {"units.0.bias": state["units.0.bias"]}
    holder.held.replicas.put("a", 7, 4, only_bias)
    holder.held.fetch_grants = (FetchGrant("c", "a", 7, 4, 0, 1),)
    fetched = await requester.fetched_state([{**entry, "step": 4, "start": 0, "end": 1}])
    assert holder.streamed == [True, False]
    assert torch.equal(fetched["units.0.bias"], state["units.0.bias"])
