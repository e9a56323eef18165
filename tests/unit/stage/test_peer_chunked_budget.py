"""A holder's half-sent backups from peers: one sender's, under every owner, within
one budget; a stalled one dropped (issue 33, finding 5). Pure."""

from __future__ import annotations

import pytest
import torch

from zpipe._errors import TransferBudgetError
from zpipe.protocol.peer import Backup, StateChunk
from zpipe.stage.peer_transfer import ChunkedState, encoded_size, state_chunks


def _chunks(owner: str, transfer: int) -> list[StateChunk]:
    backup = Backup(owner=owner, run=1, step=0, keys=["w"], tensors=(torch.ones(64),))
    frames, _ = encoded_size(backup)
    return list(state_chunks(frames, owner=owner, transfer=transfer, chunk_bytes=64))


def test_one_sender_s_open_backups_under_every_owner_share_its_budget() -> None:
    a = _chunks("a", 1)
    size = a[0].nbytes
    state = ChunkedState(cap_bytes=size * 3 // 2)
    assert state.add("s1", a[0], max_message_bytes=1 << 20) is None
    with pytest.raises(TransferBudgetError):  # another owner, the same sender
        state.add("s1", _chunks("b", 2)[0], max_message_bytes=1 << 20)
    # another sender has a budget of its own
    assert state.add("s2", _chunks("b", 2)[0], max_message_bytes=1 << 20) is None
    assert state.held_bytes == 2 * size
    whole = None
    for chunk in a[1:]:
        whole = state.add("s1", chunk, max_message_bytes=1 << 20)
    assert isinstance(whole, Backup) and whole.owner == "a"
    assert state.add("s1", _chunks("b", 3)[0], max_message_bytes=1 << 20) is None


def test_a_stalled_backup_is_dropped_when_the_next_chunk_arrives() -> None:
    state = ChunkedState(cap_bytes=1 << 20, stall_s=10.0)
    a = _chunks("a", 1)
    assert state.add("s1", a[0], max_message_bytes=1 << 20, now=0.0) is None
    assert state.add("s2", _chunks("b", 1)[0], max_message_bytes=1 << 20, now=9.0) is None
    assert state.held_bytes == 2 * a[0].nbytes
    assert state.expire(10.0) == a[0].tensors[0].numel()  # s1's: its first chunk's bytes
    assert state.held_bytes == a[0].nbytes
    assert state.expire(19.0) > 0 and state.held_bytes == 0
