"""The coordinator's shell in one process: one bad message never ends its receive loop."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from zpipe.coordinator.control_port import RECEIVE_TURN_EVERY, ControlPort
from zpipe.coordinator.events import ClientRequest, Event
from zpipe.coordinator.persistence import StateStore
from zpipe.coordinator.server import Coordinator, CoordinatorConfig
from zpipe.protocol.stage_control import Heartbeat
from zpipe.stage.metrics import StageCounters
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


async def _burst_seen_by_another_task(count: int) -> tuple[list[int], int]:
    """``count`` heartbeats queued on the coordinator's control port before its
    receive loop reads any; how many it had handled each time another task got a turn."""
    fed: list[Event] = []
    all_fed = asyncio.Event()

    def feed(event: Event, *, peer: bytes) -> None:
        fed.append(event)
        if len(fed) == count:
            all_fed.set()

    config = CoordinatorConfig(bind="inproc://burst")
    port = ControlPort(
        options=config.socket_options,
        max_frame_bytes=config.max_frame_bytes,
        keys_dir=None,
        public_keys={},
        on_event=feed,
    )
    endpoint = port.open(config.bind)
    dealer = port.context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    heartbeat = Heartbeat(name="s0", metrics=StageCounters().to_dict()).to_message()
    frames = [bytes(f) for f in codec.encode(heartbeat)]
    for _ in range(count):  # inproc: each is in the router's queue when send returns
        await dealer.send_multipart(frames)
    seen: list[int] = []

    async def watch() -> None:
        while True:
            seen.append(len(fed))
            await asyncio.sleep(0)

    receiving = asyncio.create_task(port.receive_loop())
    watching = asyncio.create_task(watch())
    try:
        await asyncio.wait_for(all_fed.wait(), 30)
    finally:
        for task in (receiving, watching):
            task.cancel()
        await asyncio.gather(receiving, watching, return_exceptions=True)
        dealer.close()
        port.close()
    return seen, len(fed)


def test_a_burst_of_queued_messages_leaves_the_other_tasks_a_turn_every_few_messages() -> None:
    # zmq.asyncio returns a queued message without suspending: without the turns the
    # receive loop gives, the watcher would see 0 handled and then all of them
    count = 20 * RECEIVE_TURN_EVERY
    seen, handled = asyncio.run(_burst_seen_by_another_task(count))
    assert handled == count
    during = sorted({n for n in seen if 0 < n < count})
    assert len(during) >= count // RECEIVE_TURN_EVERY - 2, seen
    steps = [b - a for a, b in zip([0, *during], [*during, count], strict=True)]
    assert max(steps) <= RECEIVE_TURN_EVERY, steps
