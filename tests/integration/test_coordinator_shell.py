"""The coordinator's shell in one process: one bad message never ends its receive loop."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from zpipe.coordinator.events import ClientRequest
from zpipe.coordinator.persistence import StateStore
from zpipe.coordinator.server import Coordinator, CoordinatorConfig
from zpipe.testing.fake_peers import FakePeers
from zpipe.transport import codec
from zpipe.transport.codec import Message


async def _serve_and_ask(coordinator: Coordinator, messages: list[list[bytes]]) -> Message:
    ready = asyncio.Event()
    serving = asyncio.create_task(coordinator.serve(ready=ready))
    await asyncio.wait_for(ready.wait(), 10)
    context = zmq.asyncio.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(coordinator.endpoint)
    try:
        for frames in messages:
            await dealer.send_multipart(frames)
        ask = codec.encode(Message("cluster_request"))
        await dealer.send_multipart([bytes(f) for f in ask])
        reply = await asyncio.wait_for(dealer.recv_multipart(), 10)
        assert not serving.done()  # still serving after everything it was sent
        return codec.decode(reply)
    finally:
        dealer.close()
        context.term()
        coordinator.stop()
        await asyncio.wait_for(serving, 10)


def test_a_message_whose_handling_raises_is_logged_and_the_loop_goes_on() -> None:
    coordinator = Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0"))
    core_on_event = coordinator.core.on_event
    raised: list[str] = []

    def on_event(event: Any, now: float) -> Any:
        # a bug the first cluster_request hits: any exception, not only a ProtocolError
        if isinstance(event, ClientRequest) and not raised:
            raised.append(event.message.KIND)
            raise RuntimeError("a controller bug")
        return core_on_event(event, now)

    coordinator.core.on_event = on_event  # type: ignore[method-assign]
    first = [bytes(f) for f in codec.encode(Message("cluster_request"))]
    garbage = [b"\x00not msgpack", b"\xff" * 3]
    reply = asyncio.run(_serve_and_ask(coordinator, [first, garbage, [b""]]))
    assert raised == ["cluster_request"]
    assert reply.kind == "cluster_state" and reply.body["members"] == []


def test_a_loop_that_dies_fails_the_coordinator_loudly() -> None:
    coordinator = Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0"))

    async def broken_ticks() -> None:
        raise RuntimeError("the tick loop broke")

    coordinator._tick_loop = broken_ticks  # type: ignore[method-assign]

    async def serve() -> None:
        await asyncio.wait_for(coordinator.serve(), 10)

    with pytest.raises(RuntimeError, match="the tick loop broke"):
        asyncio.run(serve())


async def _register_peers_with_state_dir(coordinator: Coordinator, count: int) -> list[int]:
    """Register ``count`` fake peers; the number of members each save held."""
    store = coordinator._store
    assert store is not None
    saved: list[int] = []
    all_saved = asyncio.Event()
    save_state = store.save_state

    def counted(state: Any) -> None:
        saved.append(len(state.members))
        save_state(state)
        if len(state.members) == count:
            all_saved.set()

    store.save_state = counted  # type: ignore[method-assign]
    ready = asyncio.Event()
    serving = asyncio.create_task(coordinator.serve(ready=ready))
    try:
        await asyncio.wait_for(ready.wait(), 30)
        async with FakePeers(coordinator.endpoint, count, register_timeout_s=60.0):
            # the registrations' save, asked for soon, comes after PERSIST_SOON_S
            await asyncio.wait_for(all_saved.wait(), 30)
    finally:
        coordinator.stop()
        await asyncio.wait_for(serving, 30)
    return saved


def test_a_burst_of_registrations_is_saved_in_a_few_writes_with_every_member(
    tmp_path: Path,
) -> None:
    coordinator = Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0", state_dir=tmp_path))
    saved = asyncio.run(_register_peers_with_state_dir(coordinator, 40))
    assert saved and saved[-1] == 40  # every member on disk in the end
    assert len(saved) < 40  # not one save of every member per registration
    state = StateStore(tmp_path).load_state()
    assert state is not None and len(state.members) == 40
