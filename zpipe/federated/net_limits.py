"""The bounds of an open fl-server, each over one client's or one address's history.

Pure: the controller (:class:`zpipe.federated.net_controller.FlServerController`)
asks them; nothing here does I/O.

- :class:`TaskDeadlines`: when a task's silence is news. A task is taken back from a
  client silent for :data:`DEADLINE_FACTOR` times the slowest of its last
  :data:`LATENCY_HISTORY` measured latencies, never sooner than ``--task-floor``,
  never later than ``--task-timeout``: a client's own history says it.
- :class:`IdsPerAddress`: how many client ids one address may hold on a server
  without keys (``--ids-per-address``): one peer registered 300 silent ids and
  starved the real client of tasks (issue 33, finding 4). A key is bounded by its
  own rule (one id). The limit counts live ids: an id is released when its client
  is gone (:meth:`IdsPerAddress.release`), so an address whose clients left may
  register new ones.
- :class:`LastHeard`: which set-aside clients have been silent past
  ``--release-after``: such an id is released as if its connection had closed.
- :class:`SilenceStrikes`: how often each id and each address had an id released for
  silence; past :data:`PROBATION_AFTER` such releases a registration is on probation
  (it gets no task until it answers a probe), so that a silent peer cannot win its
  ids back and hold a task slot each, every ``--release-after`` seconds.
- :class:`Connections`: which routing ids spoke over which connection (the socket's
  file descriptor), so that a closed connection names the ids it carried.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable

from zpipe._errors import ProtocolError

DEADLINE_FACTOR = 4.0
LATENCY_HISTORY = 8
# releases for silence (of one id, or of any id of one address) after which that id,
# or any id of that address, must answer a probe before it is given a task again:
# one silence (a phone asleep, a link down) costs nothing, a habit does
PROBATION_AFTER = 2


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
    """The live client ids each peer address holds, at most ``limit`` each."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held: dict[str, set[int]] = {}  # peer address -> the client ids it holds
        self._origin: dict[int, str] = {}  # client id -> the address that holds it

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
            self.release(client)  # an id re-registered from another address moves
            self._held.setdefault(origin, set()).add(client)
            self._origin[client] = origin

    def release(self, client: int) -> str | None:
        """``client`` is gone: its address holds one id fewer. The address, or None
        where no address held it (a keyed server, an id already released)."""
        origin = self._origin.pop(client, None)
        if origin is not None:
            held = self._held[origin]
            held.discard(client)
            if not held:
                del self._held[origin]  # an address with nothing held costs nothing
        return origin

    def held(self, origin: str) -> int:
        return len(self._held.get(origin, ()))


class LastHeard:
    """When each client was last heard from (any message of its own, or its
    registration), and which of some candidates have been silent for
    ``release_after_s``. The candidates are the clients the server has set aside
    for silence: one that holds no task and is not asked anything is not silent,
    only unasked, so silence alone never releases it."""

    def __init__(self, release_after_s: float) -> None:
        self.release_after_s = release_after_s
        self._at: dict[int, float] = {}  # client id -> when it was last heard from

    def heard(self, client: int, now: float) -> None:
        self._at[client] = now

    def last(self, client: int) -> float:
        return self._at[client]

    def silent_past(self, now: float, candidates: Iterable[int]) -> list[int]:
        """The candidates last heard ``release_after_s`` or longer ago."""
        return sorted(
            c for c in set(candidates) if now - self._at.get(c, now) >= self.release_after_s
        )

    def next_release(self, candidates: Iterable[int]) -> float:
        """When the first candidate will have been silent for ``release_after_s``."""
        times = [self._at[c] + self.release_after_s for c in candidates if c in self._at]
        return min(times, default=math.inf)


class SilenceStrikes:
    """Releases for silence, counted per client id and per peer address (None: a
    server with keys, where a key holds one id and the id is what counts)."""

    def __init__(self, probation_after: int = PROBATION_AFTER) -> None:
        self.probation_after = probation_after
        self._by_client: dict[int, int] = {}
        self._by_origin: dict[str, int] = {}

    def record(self, client: int, origin: str | None) -> None:
        self._by_client[client] = self._by_client.get(client, 0) + 1
        if origin is not None:
            self._by_origin[origin] = self._by_origin.get(origin, 0) + 1

    def of(self, client: int, origin: str | None) -> int:
        """The strikes that count for ``client`` registering from ``origin``."""
        by_origin = 0 if origin is None else self._by_origin.get(origin, 0)
        return max(self._by_client.get(client, 0), by_origin)

    def on_probation(self, client: int, origin: str | None) -> bool:
        return self.of(client, origin) >= self.probation_after


class Connections:
    """The routing ids seen on each connection (the socket's file descriptor, which
    libzmq's monitor names when the connection closes).

    A file descriptor is reused once closed; the monitor's event for the closing is
    queued before the descriptor is closed, so before any message of the next
    connection on it can be received: the shell reads the monitor's events before it
    handles each message (:meth:`closed` first, then :meth:`seen`)."""

    def __init__(self) -> None:
        self._routes: dict[int, set[bytes]] = {}
        # each routing id's latest connection: a client that reconnects keeps its
        # routing id (ROUTER_HANDOVER), and its old connection's close, which may be
        # seen after the new one spoke, is not news about it
        self._fd_of: dict[bytes, int] = {}

    def seen(self, fd: int, routing_id: bytes) -> None:
        previous = self._fd_of.get(routing_id)
        if previous is not None and previous != fd:
            held = self._routes.get(previous)
            if held is not None:
                held.discard(routing_id)
                if not held:
                    del self._routes[previous]
        self._fd_of[routing_id] = fd
        self._routes.setdefault(fd, set()).add(routing_id)

    def closed(self, fd: int) -> list[bytes]:
        """The routing ids the connection on ``fd`` carried last (it closed)."""
        routes = sorted(self._routes.pop(fd, ()))
        for routing_id in routes:
            del self._fd_of[routing_id]
        return routes
