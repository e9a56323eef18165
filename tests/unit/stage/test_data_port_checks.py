"""The data port checks a received body once, in the codec, and still refuses a bad
one with a typed error (issue 34)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from zpipe._errors import ProtocolError
from zpipe.protocol import Message, WireMessage
from zpipe.protocol.data_plane import Data, MicroBatchError
from zpipe.protocol.stage_control import Assign, Connect, Registered
from zpipe.stage.dataport import DataPort
from zpipe.stage.lifecycle import DataRoute, StageLifecycle
from zpipe.stage.metrics import StageCounters
from zpipe.transport import codec

RUN, EPOCH = 1, 1


def _running_port() -> tuple[DataPort, StageCounters]:
    """A data port of a stage running inference run RUN, upstream 'client'."""
    lifecycle = StageLifecycle(
        name="s0",
        coordinator="c",
        registration={},  # type: ignore[arg-type]  # never sent here
        connect_s=1.0,
        silence_limit_s=1.0,
        now=0.0,
    )
    lifecycle.registration_reply(Registered(name="s0", heartbeat_interval=1.0), 0.0)
    assign = Assign(
        run=RUN, model={}, start=0, end=1, index=0, num_stages=1, upstream="client",
        downstream="client", downstream_endpoint="", dtype="float32", epoch=EPOCH,
    )  # fmt: skip
    lifecycle.control_message(assign, 0.0)
    lifecycle.assignment_ready(RUN, EPOCH, build_s=0.0)
    lifecycle.control_message(Connect(run=RUN, epoch=EPOCH), 0.0)
    lifecycle.connected(RUN, DataRoute.inference(EPOCH, "client"))
    counters = StageCounters()
    port = DataPort(
        socket=None,  # type: ignore[arg-type]  # accept never touches it
        lifecycle=lifecycle,
        counters=counters,
        name="s0",
        max_message_bytes=1 << 20,
    )
    return port, counters


def _frames(message: WireMessage) -> list[Any]:
    return [bytes(frame) for frame in codec.encode(message.to_message())]


def test_a_received_message_is_not_checked_again_after_the_codec(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    port, _ = _running_port()
    checked_again: list[str] = []
    from_message = WireMessage.from_message.__func__  # type: ignore[attr-defined]

    def spy(cls: type[WireMessage], message: Message) -> WireMessage:
        checked_again.append(message.kind)
        return from_message(cls, message)

    monkeypatch.setattr(WireMessage, "from_message", classmethod(spy))
    sent = Data(run=RUN, mb=3, src="client", tensors=(torch.arange(6.0).view(2, 3),), epoch=EPOCH)
    error = MicroBatchError(run=RUN, mb=4, src="client", stage="s9", message="x", epoch=EPOCH)
    got = [port.accept(_frames(sent)), port.accept(_frames(error))]
    assert checked_again == []  # the old port parsed through from_message: one check more each
    assert got == [sent, error]
    assert isinstance(got[0], Data) and torch.equal(got[0].tensors[0], sent.tensors[0])


def test_a_bad_body_is_still_refused_and_the_next_message_accepted() -> None:
    port, counters = _running_port()
    bad = codec._packer().pack(
        {"v": 1, "k": "data", "e": EPOCH, "b": {"run": RUN, "mb": -2, "src": "client"}, "t": []}
    )
    with pytest.raises(ProtocolError, match="'mb' must be >= 0"):
        port.accept([bad])
    with pytest.raises(ProtocolError, match="unknown message kind"):
        port.accept([codec._packer().pack({"v": 1, "k": "nope", "e": 0, "b": {}, "t": []})])
    sent = Data(run=RUN, mb=0, src="client", tensors=(torch.ones(2),), epoch=EPOCH)
    assert port.accept(_frames(sent)) == sent
    assert counters.bytes_in > 0
