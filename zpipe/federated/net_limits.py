"""Two bounds of an open fl-server, each over one client's or one address's history.

Pure: the controller (:class:`zpipe.federated.net_controller.FlServerController`)
asks them; nothing here does I/O.

- :class:`TaskDeadlines`: when a task's silence is news. A task is taken back from a
  client silent for :data:`DEADLINE_FACTOR` times the slowest of its last
  :data:`LATENCY_HISTORY` measured latencies, never sooner than ``--task-floor``,
  never later than ``--task-timeout``: a client's own history says it.
- :class:`IdsPerAddress`: how many client ids one address may hold on a server
  without keys (``--ids-per-address``): one peer registered 300 silent ids and
  starved the real client of tasks (issue 33, finding 4). A key is bounded by its
  own rule (one id).
"""

from __future__ import annotations

from collections import deque

from zpipe._errors import ProtocolError

DEADLINE_FACTOR = 4.0
LATENCY_HISTORY = 8


class TaskDeadlines:
    """Each client's last latencies, and the deadline they give its next task."""

    def __init__(self, floor_s: float, timeout_s: float) -> None:
        self.floor_s = floor_s
        self.timeout_s = timeout_s
        self._latencies: dict[int, deque[float]] = {}  # client id -> its last latencies

    def measured(self, client: int, latency_s: float) -> None:
        history = self._latencies.setdefault(client, deque(maxlen=LATENCY_HISTORY))
        history.append(latency_s)

    def deadline_s(self, client: int) -> float:
        """DEADLINE_FACTOR times the slowest of ``client``'s recent latencies, at least
        the floor; the timeout for a client never measured (and at most that for any)."""
        history = self._latencies.get(client)
        if not history:
            return self.timeout_s
        return min(self.timeout_s, max(self.floor_s, DEADLINE_FACTOR * max(history)))


class IdsPerAddress:
    """The client ids each peer address holds, at most ``limit`` each."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held: dict[str, set[int]] = {}  # peer address -> the client ids it holds

    def check(self, origin: str | None, client: int) -> None:
        """ProtocolError when ``origin`` already holds ``limit`` other ids (None: a
        server with keys, where this bound does not apply)."""
        if origin is None:
            return
        held = self._held.get(origin, set())
        if client not in held and len(held) >= self.limit:
            raise ProtocolError(
                f"address {origin} already holds {len(held)} client ids, the most one "
                f"address may hold (fl-server --ids-per-address {self.limit}); give each "
                "client a key of its own (--keys) or raise the limit"
            )

    def add(self, origin: str | None, client: int) -> None:
        if origin is not None:
            self._held.setdefault(origin, set()).add(client)
