"""An ACK sender stops waiting for a silent receiver's acknowledgements
(zpipe.lossy.ack_patience), and what it sends never depends on its waits.

The pure decision is fed events; the pass loop (zpipe.stage.executors.lossy_passes) is driven
with fake peer sockets: a receiver that never answers costs its sender one ``wait_s``,
not one per promised acknowledgement, until it is heard from again; the copies on the
wire are the seeded decision's whether the receiver answers or not.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import zmq

from tests._support.lossy_executor import EPOCH, _executor, _setup, _setup_only
from zpipe.lossy.ack_patience import AckPatience, AckWaitCounts
from zpipe.lossy.engine import LinkChannel
from zpipe.lossy.links import Direction, LossKey, Recovery, ack_key, deliver_over
from zpipe.protocol.lossy import LossyPartial
from zpipe.stage.executors.lossy_passes import PassLoop, SharedInbox
from zpipe.transport.codec import decode

SEED, PRR = 4, 0.7
ACK = Recovery("ack", max_attempts=3)
RECEIVER = 2  # device 1 (layer 1, vertical) sends its forward partials to device 2
N_MESSAGES = 12


def test_one_overdue_acknowledgement_silences_a_receiver_until_it_is_heard_from() -> None:
    patience = AckPatience()
    assert patience.should_wait(2) and patience.should_wait(3)
    patience.overdue(2)
    assert patience.is_silent(2) and not patience.is_silent(3)
    assert [patience.should_wait(2) for _ in range(3)] == [False] * 3
    assert patience.should_wait(3)  # another receiver is not affected
    patience.heard(3)  # hearing from a receiver that is not silent changes nothing
    patience.heard(2)
    assert patience.should_wait(2)
    patience.overdue(2)
    assert not patience.should_wait(2)
    assert patience.counts[2] == AckWaitCounts(awaited=2, overdue=2, unawaited=4, heard_again=1)
    assert patience.counts[3] == AckWaitCounts(awaited=2)
    assert patience.as_body() == {
        "2": {"awaited": 2, "overdue": 2, "unawaited": 4, "heard_again": 1},
        "3": {"awaited": 2, "overdue": 0, "unawaited": 0, "heard_again": 0},
    }


class _PeerSocket:
    """A peer's PUSH socket: keeps what is sent; ``answer`` plays the receiver."""

    def __init__(self, answer: Callable[[LossyPartial], None] | None = None, *, full: bool = False):
        self.sent: list[LossyPartial] = []
        self._answer = answer
        self._full = full

    def send_multipart(self, frames: list[Any], flags: int = 0, copy: bool = True) -> None:
        if self._full:
            raise zmq.Again()
        partial = LossyPartial.from_message(decode(frames))
        self.sent.append(partial)
        if self._answer is not None:
            self._answer(partial)

    def poll(self, timeout_ms: int, flags: int) -> int:
        return 0


def _pass_loop(
    socket: _PeerSocket | None = None, *, wait_s: float = 0.05
) -> tuple[PassLoop, SharedInbox]:
    executor = _executor([])
    asyncio.run(_setup_only(executor, _setup(1)))
    st = executor.state
    assert st is not None
    prr = np.full((3, 3), PRR)
    st.spec = replace(st.spec, prr=prr, seed=SEED, recovery=ACK, lossless=False,
                      mode="emulated", wait_s=wait_s)  # fmt: skip
    st.channel = LinkChannel(prr=prr, seed=SEED, recovery=ACK)
    inbox = SharedInbox(st)
    peers: dict[int, Any] = {RECEIVER: socket if socket is not None else _PeerSocket()}
    loop = PassLoop(st, inbox, index=1, epoch=EPOCH, peers=peers, send_timeout_s=0.05,
                    stage="s1")  # fmt: skip
    return loop, inbox


def _post(loop: PassLoop, data_ids: range) -> None:
    from zpipe.lossy.shard import Outgoing

    for data in data_ids:
        out = Outgoing(RECEIVER, "F", 1, 1, Direction.FORWARD, np.zeros((2, 4)))
        loop._post(data, [out])


def _seeded(data_ids: range) -> tuple[list[tuple[int, int]], int]:
    """The copies (data, copy) the seeded decision puts on the wire, and how many
    acknowledgements it promises (a copy that arrived whose acknowledgement comes)."""
    lost = LinkChannel(prr=np.full((3, 3), PRR), seed=SEED).keyed_loss()
    copies: list[tuple[int, int]] = []
    promised = 0
    for data in data_ids:

        def transmit(key: LossKey, data: int = data) -> bool:
            nonlocal promised
            if key.src == 1:
                if not lost(key):
                    copies.append((data, key.copy))
                return not lost(key)
            promised += int(not lost(key))
            return not lost(key)

        deliver_over(transmit, 1, RECEIVER, 1, data, Direction.FORWARD, recovery=ACK)
    return copies, promised


def test_a_silent_receiver_costs_its_sender_one_wait_and_the_copies_stay_seeded() -> None:
    first, then = range(1, N_MESSAGES + 1), range(N_MESSAGES + 1, 2 * N_MESSAGES + 1)
    copies, promised = _seeded(first)
    later_copies, later_promised = _seeded(then)
    assert promised >= 3 and later_promised >= 3  # the test means something

    silent = _PeerSocket()  # never answers
    loop, inbox = _pass_loop(silent)
    _post(loop, first)
    assert inbox.acks.waits_body() == {
        "2": {"awaited": 1, "overdue": 1, "unawaited": promised - 1, "heard_again": 0}
    }
    assert inbox.wire.acks_overdue == 1
    # heard from again (a partial of its came): its acknowledgements are awaited again
    inbox.acks.heard_from(RECEIVER)
    _post(loop, then)
    assert inbox.acks.waits_body()["2"] == {
        "awaited": 2, "overdue": 2, "unawaited": promised + later_promised - 2, "heard_again": 1,
    }  # fmt: skip
    # what went on the wire is the seeded decision's, however long the sender waited
    assert [(p.data, p.copy) for p in silent.sent] == copies + later_copies
    assert inbox.wire.copies_sent == len(copies + later_copies)
    want = LinkChannel(prr=np.full((3, 3), PRR), seed=SEED, recovery=ACK)
    for data in [*first, *then]:
        want.send(1, RECEIVER, 1, data, Direction.FORWARD)
    assert loop.st.channel.traffic["forward"] == want.traffic["forward"]

    # a receiver that answers every copy (its link back drops what the seed says): the
    # sender waits for every promised acknowledgement, and sends the same copies
    book: list[SharedInbox] = []
    lost = LinkChannel(prr=np.full((3, 3), PRR), seed=SEED).keyed_loss()

    def answer(p: LossyPartial) -> None:
        assert p.copy is not None and p.link_layer is not None and p.direction is not None
        data_key = LossKey(1, RECEIVER, p.link_layer, p.data, p.direction, p.copy)
        if not lost(ack_key(data_key)):
            book[0].acks.arrived((p.data, p.kind, p.layer, RECEIVER, p.copy))

    prompt = _PeerSocket(answer)
    loop, inbox = _pass_loop(prompt, wait_s=30.0)
    book.append(inbox)
    _post(loop, first)
    assert inbox.acks.waits_body() == {
        "2": {"awaited": promised, "overdue": 0, "unawaited": 0, "heard_again": 0}
    }
    assert [(p.data, p.copy) for p in prompt.sent] == copies
    assert inbox.wire.acks_received == promised


def test_no_acknowledgement_is_awaited_for_a_copy_that_never_left() -> None:
    # the receiver's socket stays full: each send times out, nothing can be acknowledged
    loop, inbox = _pass_loop(_PeerSocket(full=True), wait_s=30.0)
    _post(loop, range(1, 3))
    assert inbox.wire.copies_sent == 0 and inbox.wire.acks_overdue == 0
    assert inbox.acks.waits_body() == {}
