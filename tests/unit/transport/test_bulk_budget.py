"""A sender's half-sent bulk transfers are bounded: a budget on what its open
transfers announce, and a deadline on their progress (issue 33, finding 5). Pure:
the clock is a number the test sets."""

from __future__ import annotations

import pytest

from zpipe._errors import ProtocolError, TransferBudgetError
from zpipe.transport.bulk import ChunkHeader, Inbox, stall_after_s


def _open(inbox: Inbox, transfer: int, nbytes: int, now: float = 0.0) -> None:
    """Chunk 0 of a transfer of ``nbytes`` in ``nbytes`` chunks of one byte."""
    assert inbox.add(ChunkHeader(transfer, 0, nbytes, nbytes, (nbytes,)), b"x", now=now) is None


def test_what_open_transfers_announce_counts_against_the_budget_from_chunk_0() -> None:
    inbox = Inbox(cap_bytes=100, budget_bytes=150)
    _open(inbox, 1, 100)
    assert (inbox.held_bytes, inbox.received_bytes) == (100, 1)
    with pytest.raises(TransferBudgetError, match="past its budget of 150") as refused:
        _open(inbox, 2, 60)
    assert (refused.value.announced, refused.value.held, refused.value.budget) == (60, 100, 150)
    assert isinstance(refused.value, ProtocolError)  # handled as every bad chunk is
    assert inbox.open_transfers == 1 and inbox.refused == 1
    # nothing of the refused one was kept: its next chunk was never begun
    with pytest.raises(ProtocolError, match="never begun"):
        inbox.add(ChunkHeader(2, 1, 60, 60), b"y", now=0.0)
    _open(inbox, 3, 50)  # what still fits is taken
    assert inbox.held_bytes == 150


def test_the_budget_defaults_to_one_whole_message_and_a_finished_transfer_frees_it() -> None:
    inbox = Inbox(cap_bytes=4)
    assert inbox.budget_bytes == 4
    _open(inbox, 1, 4)
    with pytest.raises(TransferBudgetError):
        _open(inbox, 2, 1)
    for seq in (1, 2):
        assert inbox.add(ChunkHeader(1, seq, 4, 4), b"x") is None
    (whole,) = inbox.add(ChunkHeader(1, 3, 4, 4), b"x") or []
    assert bytes(whole) == b"xxxx" and inbox.held_bytes == 0
    _open(inbox, 2, 4)


def test_a_transfer_started_over_is_not_counted_twice() -> None:
    inbox = Inbox(cap_bytes=100, budget_bytes=100)
    _open(inbox, 1, 100)
    _open(inbox, 1, 100)  # the sender gave up on it and starts it again
    assert inbox.open_transfers == 1 and inbox.held_bytes == 100


def test_the_oldest_making_room_for_a_new_transfer_is_not_counted() -> None:
    inbox = Inbox(cap_bytes=100, budget_bytes=100, max_open=1)
    _open(inbox, 1, 100)
    _open(inbox, 2, 100)  # 1 goes (abandoned) to make room: within the budget
    assert inbox.abandoned == 1 and inbox.held_bytes == 100


def test_what_a_sender_holds_in_other_inboxes_counts_too() -> None:
    inbox = Inbox(cap_bytes=100, budget_bytes=100)
    with pytest.raises(TransferBudgetError):
        inbox.add(ChunkHeader(1, 0, 50, 50, (50,)), b"x", held_elsewhere=60)
    _open(inbox, 1, 40)


def test_a_transfer_without_a_chunk_for_stall_s_is_dropped_and_the_others_stay() -> None:
    inbox = Inbox(cap_bytes=100, budget_bytes=200, stall_s=10.0)
    _open(inbox, 1, 100, now=0.0)
    _open(inbox, 2, 100, now=0.0)
    assert inbox.add(ChunkHeader(1, 1, 100, 100), b"x", now=8.0) is None  # progress
    assert inbox.expire(9.9) == []
    assert inbox.expire(10.0) == [(2, 1)]  # transfer 2: one byte had come, now freed
    assert (inbox.open_transfers, inbox.expired, inbox.held_bytes) == (1, 1, 100)
    with pytest.raises(ProtocolError, match="never begun"):
        inbox.add(ChunkHeader(2, 1, 100, 100), b"x", now=10.5)
    assert inbox.expire(18.0) == [(1, 2)]
    assert inbox.open_transfers == 0 and inbox.received_bytes == 0
    _open(inbox, 3, 100, now=18.0)  # the budget is free for the next


def test_without_stall_s_nothing_expires() -> None:
    inbox = Inbox(cap_bytes=100)
    _open(inbox, 1, 10)
    assert inbox.expire(1e9) == [] and inbox.open_transfers == 1


def test_stall_s_must_be_positive_and_defaults_to_two_send_deadlines() -> None:
    with pytest.raises(ValueError, match="stall_s"):
        Inbox(cap_bytes=1, stall_s=0.0)
    assert stall_after_s(30.0) == 60.0
