"""r-TX copies and ACK acknowledgements as messages (zpipe.stage.executors.lossy_recovery): what a
stage's receive side does with repeated copies and with acknowledgements, good and bad.
The multi-process runs that put them on the wire are in tests/cluster/test_lossy_stages.py."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from tests._support.lossy_executor import EPOCH, _executor, _partial, _setup, _setup_only
from zpipe._errors import ProtocolError
from zpipe.lossy.links import Direction, LossKey, ack_key
from zpipe.lossy.wire import partial_message
from zpipe.protocol import REGISTRY
from zpipe.protocol.lossy import LossyAck, LossyPartial
from zpipe.stage.executors.lossy_recovery import AckBook, WireCounts
from zpipe.transport.codec import Message, decode, encode
from zpipe.transport.emulation import LossKey as EmulationLossKey


def _ack(data: int, kind: str, layer: int, src: int, copy: int, *, run: int = 5) -> Message:
    m = LossyAck(run=run, data=data, kind=kind, layer=layer, src=src, copy=copy).to_message()
    return Message(m.kind, m.body, epoch=EPOCH)


def test_a_partials_later_copies_are_discarded_and_counted_as_duplicates() -> None:
    executor = _executor([])
    asyncio.run(_setup_only(executor, _setup(1)))  # device 1 owns layer 1 (vertical)
    st, inbox = executor.state, executor._inbox
    assert st is not None and inbox is not None
    first = _partial(1, "F", 0, 0, (2, 6))
    assert executor._on_data(REGISTRY.parse(first)) is not None
    twice = partial_message(5, 1, "F", 0, 0, np.full((2, 6), 2.0), copy=1)
    executor._on_data(
        REGISTRY.parse(Message(twice.kind, twice.body, epoch=EPOCH, tensors=twice.tensors))
    )
    assert inbox.wire.duplicates == 1
    assert float(inbox.control.partials[(1, "F", 0)][0][0, 0]) == 1.0  # the first copy is kept
    # a copy after the pass ran is a duplicate, not a late partial
    inbox.control.consumed.add((1, "F", 0))
    executor._on_data(REGISTRY.parse(first))
    assert inbox.wire.duplicates == 2 and st.late == 0
    # a duplicate of a layer this stage does not own is refused like any such partial
    with pytest.raises(ProtocolError, match="owns no part"):
        executor._on_data(REGISTRY.parse(_partial(1, "F", 1, 0, (2, 4))))
    assert inbox.wire.duplicates == 2


def test_acknowledgements_of_copies_a_stage_did_not_send_are_dropped_and_counted() -> None:
    executor = _executor([])
    asyncio.run(_setup_only(executor, _setup(1)))
    inbox = executor._inbox
    assert inbox is not None
    inbox.acks.expect((1, "F", 1, 2, 0))  # the pass loop sent copy 0 of F1:1 to device 2
    executor._on_data(REGISTRY.parse(_ack(1, "F", 1, 2, 0)))
    assert inbox.wire.acks_received == 1 and inbox.wire.acks_dropped == 0
    # the same acknowledgement again, another copy, step, layer or peer: dropped, counted
    for ack in (_ack(1, "F", 1, 2, 0), _ack(1, "F", 1, 2, 1), _ack(2, "F", 1, 2, 0),
                _ack(1, "F", 0, 2, 0), _ack(1, "F", 1, 7, 0)):  # fmt: skip
        assert executor._on_data(REGISTRY.parse(ack)) is None
    assert inbox.wire.acks_received == 1 and inbox.wire.acks_dropped == 5
    assert executor.protocol_errors == 0
    # another run's: stale
    executor._on_data(REGISTRY.parse(_ack(1, "F", 1, 2, 0, run=6)))
    assert executor.stale == 1 and inbox.wire.acks_dropped == 5


def test_a_sender_waits_for_an_acknowledgement_until_it_comes_or_its_wait_ends() -> None:
    counts = WireCounts()
    book = AckBook(counts)
    book.expect((3, "B", 0, 1, 2))
    assert not book.wait((3, "B", 0, 1, 2), 0.05, lambda: False)  # nobody answers
    heard = threading.Timer(0.05, book.arrived, args=[(3, "B", 0, 1, 2)])
    heard.start()
    assert book.wait((3, "B", 0, 1, 2), 30.0, lambda: False)
    heard.join()
    assert counts.acks_received == 1
    book.expect((4, "B", 0, 1, 0))
    assert not book.wait((4, "B", 0, 1, 0), 30.0, lambda: True)  # the run stopped


def test_an_acknowledgements_drop_key_is_its_copys_reversed_in_the_ack_space() -> None:
    data = LossKey(0, 2, 3, 7, int(Direction.BACKWARD), 1)
    ack = ack_key(data)
    assert ack == EmulationLossKey(2, 0, 3, 7, int(Direction.ACK) * 8 + 1, 1)


def test_copies_and_acknowledgements_round_trip_with_their_optional_fields() -> None:
    m = partial_message(5, 1, "B", 0, 2, np.zeros((2, 3)), copy=1, link_layer=1, direction=1)
    back = LossyPartial.from_message(decode(encode(m)))
    assert (back.copy, back.link_layer, back.direction) == (1, 1, 1)
    plain = LossyPartial.from_message(
        decode(encode(partial_message(5, 1, "B", 0, 2, np.zeros((2, 3)))))
    )
    assert plain.copy is None and "copy" not in plain.to_message().body
    ack = LossyAck.from_message(decode(encode(_ack(1, "F", 0, 2, 3))))
    assert (ack.data, ack.kind, ack.layer, ack.src, ack.copy) == (1, "F", 0, 2, 3)
