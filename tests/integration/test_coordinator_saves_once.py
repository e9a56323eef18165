"""The shell saves the state once for a batch of commands however many ask for it: the
state written is the one after the whole batch, and each save is an fsync (about
20 ms on this machine's disk) that holds the event loop. A stage's death and the
stream re-plan it starts each ask (zpipe.coordinator.runs.inference)."""

from __future__ import annotations

from pathlib import Path

import pytest

from zpipe.coordinator.commands import Log, Persist, Send
from zpipe.coordinator.persistence import StateStore
from zpipe.coordinator.server import Coordinator, CoordinatorConfig
from zpipe.protocol.stage_control import Shutdown


def test_a_batch_is_saved_once_before_its_sends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    coordinator = Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0", state_dir=tmp_path))
    order: list[str] = []
    monkeypatch.setattr(StateStore, "save_state", lambda self, state: order.append("save"))
    monkeypatch.setattr(coordinator._sends, "soon", lambda sends: order.append("send"))
    try:
        send = Send(b"a", Shutdown(reason="x"), "a", 1.0)
        coordinator._carry_out([Persist(), send, Log("info", "x", {}), Persist()])
        assert order == ["save", "send"]
        order.clear()
        coordinator._carry_out([send])  # nothing asked: nothing saved
        coordinator._carry_out([Persist()])
        assert order == ["send", "save"]
    finally:
        coordinator._close()
