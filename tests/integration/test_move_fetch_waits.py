"""A live move's fetch that reaches its holder before the holder's flush waits there.

In a ``move`` phase a stage that flushed early fetches its new units from a holder
that may still be draining. The holder used to answer "no snapshot" and the
requester asked again every 10-100 ms; now a request with ``wait_s`` is held at the
holder until the holder keeps its snapshot (an event, no polling), for no longer
than what the requester asked and the holder's own result timeout. A request without
``wait_s`` (a recovery's) is answered at once, as before. The probe port keeps
serving pings and other peers while a fetch waits. Two snapshot services over a
real ROUTER on loopback, as two stages talk; and the store's wait alone.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest
import torch
import zmq
import zmq.asyncio

from zpipe._errors import UnitsLostError
from zpipe.protocol import WireMessage
from zpipe.protocol.peer import LinkPing, LinkPong
from zpipe.stage.fetch_entries import holder_wait_s
from zpipe.stage.linkprobe import ProbeResponder
from zpipe.stage.metrics import StageCounters
from zpipe.stage.peer_policy import FetchGrant
from zpipe.stage.peer_transfer import PeerLink
from zpipe.stage.replicas import MAX_WAITING, ReplicaStore
from zpipe.stage.snapshots import SnapshotService
from zpipe.transport.emulation import LinkSpec
from zpipe.transport.sockets import SocketOptions, bind_endpoint, new_context, open_socket

STATE = {"units.2.weight": torch.arange(6.0), "units.2.weight#opt.exp_avg": torch.ones(6)}
# generous: a loaded machine schedules these processes' threads late, never this late
PATIENCE_S = 60.0


@dataclass
class Holder:
    """Stage "b"'s probe port, served by its snapshot service; "c" may fetch units
    [2, 3) of b's snapshot after mini-batch 3 of run 7 (the coordinator's grant)."""

    service: SnapshotService
    endpoint: str
    kinds: list[str] = field(default_factory=list)
    asked: asyncio.Event = field(default_factory=asyncio.Event)  # a request arrived


@pytest.fixture
async def context() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = new_context()
    yield ctx
    ctx.term()


async def _serving(context: zmq.asyncio.Context, timeout_s: float) -> AsyncIterator[Holder]:
    router = open_socket(context, zmq.ROUTER, SocketOptions())
    endpoint = bind_endpoint(router, "tcp://127.0.0.1:0")
    service = SnapshotService(
        name="b", context=context, keypair=None, socket_options=SocketOptions(),
        timeout_s=timeout_s, compute=None, counters=StageCounters(), replicas=ReplicaStore(),  # type: ignore[arg-type]
    )  # fmt: skip
    service.fetch_grants = (FetchGrant("c", "b", 7, 3, 2, 3),)
    held = Holder(service, endpoint)

    async def handler(
        message: WireMessage, key: bytes | None
    ) -> WireMessage | Iterator[WireMessage]:
        held.kinds.append(message.KIND)
        held.asked.set()
        return await service.on_peer_request(message, None)

    responder = ProbeResponder(
        socket=router, link=LinkSpec(), name="b", send_timeout_s=PATIENCE_S,
        max_message_bytes=2**30, peer_handler=handler,
    )  # fmt: skip
    task = asyncio.create_task(responder.serve())
    try:
        yield held
    finally:
        task.cancel()
        await responder.close()
        router.close(linger=0)


@pytest.fixture
async def holder(context: zmq.asyncio.Context) -> AsyncIterator[Holder]:
    async for held in _serving(context, timeout_s=PATIENCE_S):
        yield held


def _requester(context: zmq.asyncio.Context) -> SnapshotService:
    return SnapshotService(
        name="c", context=context, keypair=None, socket_options=SocketOptions(),
        timeout_s=PATIENCE_S, compute=ThreadPoolExecutor(1), counters=StageCounters(),
        replicas=ReplicaStore(),
    )  # fmt: skip


def _entry(holder: Holder) -> dict[str, object]:
    return {"owner": "b", "from": "b", "endpoint": holder.endpoint, "run": 7, "step": 3,
            "start": 2, "end": 3}  # fmt: skip


async def _ping(context: zmq.asyncio.Context, endpoint: str) -> LinkPong:
    link = PeerLink(context, peer="b", endpoint=endpoint, server_key=None, keypair=None,
                    options=SocketOptions(), timeout_s=PATIENCE_S)  # fmt: skip
    async with link:
        pong = await link.request(LinkPing(nonce=5), LinkPong)
    assert isinstance(pong, LinkPong)
    return pong


async def test_a_fetch_before_the_holders_flush_is_answered_once_it_flushed(
    context: zmq.asyncio.Context, holder: Holder
) -> None:
    requester = _requester(context)
    fetch = asyncio.ensure_future(requester.fetched_state([_entry(holder)], wait_s=PATIENCE_S))
    await asyncio.wait_for(holder.asked.wait(), PATIENCE_S)  # the request is at the holder
    # the holder is still draining: the fetch waits, and the probe port serves on
    assert (await _ping(context, holder.endpoint)).nonce == 5
    assert not fetch.done()
    holder.service.replicas.put("b", 7, 3, STATE)  # its flush: the snapshot is kept
    fetched = await asyncio.wait_for(fetch, PATIENCE_S)
    assert fetched.keys() == STATE.keys()
    assert all(torch.equal(fetched[k], STATE[k]) for k in STATE)
    # one request, answered once: nothing was asked again (pings never reach the handler)
    assert holder.kinds == ["fetch_units"]


async def test_a_fetch_without_wait_s_is_answered_at_once_as_before(
    context: zmq.asyncio.Context, holder: Holder
) -> None:
    # a recovery's fetch (no wait_s) of a snapshot that is not there fails at once
    started = time.monotonic()
    with pytest.raises(UnitsLostError, match="no snapshot of 'b' after mini-batch 3"):
        await _requester(context).fetched_state([_entry(holder)])
    assert time.monotonic() - started < PATIENCE_S / 2
    assert holder.kinds == ["fetch_units"]


async def test_a_holder_waits_no_longer_than_its_own_timeout(
    context: zmq.asyncio.Context,
) -> None:
    async for holder in _serving(context, timeout_s=0.3):
        started = time.monotonic()
        with pytest.raises(UnitsLostError, match="no snapshot of 'b'"):
            await _requester(context).fetched_state([_entry(holder)], wait_s=PATIENCE_S)
        # the holder's 0.3 s, not the requester's minute
        assert time.monotonic() - started < PATIENCE_S / 2
        assert holder.kinds == ["fetch_units"]


async def test_only_the_holders_own_snapshot_is_waited_for(
    context: zmq.asyncio.Context, holder: Holder
) -> None:
    # a grant for a backup of a's units held here: a peer's snapshot never comes by a
    # flush of this stage, so the request is answered at once
    holder.service.fetch_grants = (FetchGrant("c", "a", 7, 3, 2, 3),)
    started = time.monotonic()
    with pytest.raises(UnitsLostError, match="no snapshot of 'a'"):
        await _requester(context).fetched_state(
            [{**_entry(holder), "owner": "a"}], wait_s=PATIENCE_S
        )
    assert time.monotonic() - started < PATIENCE_S / 2


async def test_the_stores_wait_ends_when_the_snapshot_is_put() -> None:
    store = ReplicaStore()
    key = ("b", 7, 3)
    waiting = [asyncio.ensure_future(store.until_held(key, PATIENCE_S)) for _ in range(3)]
    await asyncio.sleep(0.01)
    assert not any(w.done() for w in waiting)
    store.put(*key, STATE)
    assert await asyncio.wait_for(asyncio.gather(*waiting), PATIENCE_S) == [True] * 3
    assert await store.until_held(key, 0.0)  # held: at once, whatever the wait


async def test_the_stores_wait_gives_up_and_is_bounded() -> None:
    store = ReplicaStore()
    assert not await store.until_held(("b", 7, 3), 0.05)  # never put
    assert not await store.until_held(("b", 7, 3), 0.0)  # no wait asked
    # no more than MAX_WAITING requests wait at once: the next one is answered now
    waiting = [
        asyncio.ensure_future(store.until_held(("b", 7, i), PATIENCE_S)) for i in range(MAX_WAITING)
    ]
    await asyncio.sleep(0.01)
    started = time.monotonic()
    assert not await store.until_held(("b", 7, 99), PATIENCE_S)
    assert time.monotonic() - started < PATIENCE_S / 2
    for w in waiting:
        w.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    # the cancelled waits left nothing behind: a new one may wait again
    later = asyncio.ensure_future(store.until_held(("b", 7, 100), PATIENCE_S))
    await asyncio.sleep(0.01)
    store.put("b", 7, 100, STATE)
    assert await asyncio.wait_for(later, PATIENCE_S)


def test_the_wait_a_holder_grants_is_within_its_own_deadline() -> None:
    assert holder_wait_s(None, 5.0) == 0.0
    assert holder_wait_s(-1.0, 5.0) == 0.0
    assert holder_wait_s(math.nan, 5.0) == 0.0
    assert holder_wait_s(math.inf, 5.0) == 0.0
    assert holder_wait_s(2.5, 5.0) == 2.5
    assert holder_wait_s(3600.0, 5.0) == 5.0
