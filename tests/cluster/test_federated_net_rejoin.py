"""An fl-client whose connection drops mid-run registers again and trains on (issue 33).

fl-server and two fl-client processes on loopback; client 1 reaches the server through
a forwarder of the test, which cuts its connection after client 1's third update. The
client's DEALER reconnects (libzmq) under the routing id the client chose, its socket
monitor sees the drop and the new connection, and it registers again; the server,
which released the id and took its task back when the connection closed, welcomes it
back, and its updates count again until the run ends. Client 0 (direct, slow) keeps
the run going meanwhile. Before the fix, the client reconnected as a new, unknown peer
whose messages the server dropped, and it waited for tasks that never came.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sklearn")

from tests._support.fl_forwarder import Forwarder
from tests._support.fl_procs import Proc

UPDATES = 40


def _client(endpoint: str, client: int, delay: str) -> list[str]:
    return [
        *("fl-client", "--server", endpoint, "--id", str(client), "--classes", f"{client},7"),
        *("--samples", "30", "--delay", delay, "--idle-timeout", "120"),
        *("--connect-timeout", "90", "--reconnect-timeout", "90"),
    ]


def test_a_client_whose_connection_drops_rejoins_and_its_updates_count(tmp_path: Path) -> None:
    # port 0: where it listens comes with its listening event (a port picked here could
    # be taken before the server bound it)
    server = Proc(
        [
            *("fl-server", "--bind", "tcp://127.0.0.1:0", "--clients", "2"),
            *("--method", "fedasync"),
            *("--concurrent", "2", "--updates", str(UPDATES), "--hidden", "8"),
            *("--local-steps", "2", "--eval-every", "1000", "--register-timeout", "90"),
            *("--duration", "240", "--task-timeout", "60", "--task-floor", "30"),
        ],
        tmp_path,
    )
    procs = [server]
    forwarder: Forwarder | None = None
    try:
        endpoint = str(server.wait_event("listening")["endpoint"])
        forwarder = Forwarder(int(endpoint.rsplit(":", 1)[1]))
        slow = Proc(_client(endpoint, 0, "1.0"), tmp_path)  # keeps the run going
        dropped = Proc(_client(forwarder.endpoint, 1, "0.1"), tmp_path)
        procs += [slow, dropped]
        for _ in range(3):
            server.wait_event("update", client=1)
        assert forwarder.cut() == 1
        server.wait_event("rejoined", client=1)  # what the old client never did
        dropped.wait_event("disconnected")
        rejoined = dropped.wait_event("rejoined")
        summary = server.wait_event("fl_server_done")
        assert server.finish() == 0, server.stderr_tail()
        dropped.wait_event("done")
        assert dropped.finish() == 0, dropped.stderr_tail()
        slow.wait_event("done")
    finally:
        for proc in procs:
            proc.stop()
        if forwarder is not None:
            forwarder.close()
    assert summary["reason"] == "updates" and summary["global_updates"] == UPDATES
    assert rejoined["gone_s"] < 90
    events: list[dict[str, Any]] = server.seen
    names = [(e.get("event"), e.get("client")) for e in events]
    back = names.index(("rejoined", 1))
    # released when its connection closed (the server's monitor), never for silence
    released = [e for e in events if e.get("event") == "released"]
    assert [(e["client"], e["reason"]) for e in released] == [(1, "its connection closed")]
    after = [e for e in events[back:] if e.get("event") == "update" and e["client"] == 1]
    assert after, "no update of client 1 counted after it rejoined"
    assert all(e["global_updates"] <= UPDATES for e in after)
