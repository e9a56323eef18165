"""When an fl-client registers again after its connection dropped (sans-IO).

The client's DEALER reconnects by itself (libzmq), under the same routing id the
client chose at start, but the server may have released the id meanwhile (its
socket monitor saw the connection close: the task taken back, the client set
aside). So after a drop the client registers again, and keeps registering until
a welcome comes:

    registered --disconnected--> down --connected (handshake)--> rejoining
        ^                          ^                                  |
        |                          +------------disconnected----------+
        +------------------------- welcome -------------------------- +

:class:`ServerLink` is fed the socket monitor's events, the server's welcomes and
the time, and says when to send ``fl_register`` (the first after a short random
delay, so that the clients of a restarted server do not all register in the same
instant; again after ``reply_timeout_s`` plus a jittered, doubling back-off,
bounded by :attr:`Backoff.cap_s`, if no welcome came) and when the server has been
gone for longer than ``gone_timeout_s`` (the client then exits with an error).
It never touches a socket or a clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from zpipe._errors import ConfigError

LinkState = Literal["registered", "down", "rejoining"]


@dataclass(frozen=True)
class Backoff:
    """Full-jitter exponential back-off: the n-th wait is uniform in
    [0, min(cap_s, base_s * 2**n)] (``draw`` in [0, 1) picks the point)."""

    base_s: float = 0.5
    cap_s: float = 8.0

    def __post_init__(self) -> None:
        if not (0 < self.base_s <= self.cap_s and math.isfinite(self.cap_s)):
            raise ConfigError("a back-off needs 0 < base <= cap, both finite")

    def delay_s(self, attempt: int, draw: float) -> float:
        bound = min(self.cap_s, self.base_s * 2.0 ** min(attempt, 62))
        return bound * min(max(draw, 0.0), 1.0)


class ServerLink:
    """One client's registration with its server, across dropped connections."""

    def __init__(
        self,
        *,
        reply_timeout_s: float,
        gone_timeout_s: float,
        backoff: Backoff | None = None,
        draw: Callable[[], float],
    ) -> None:
        if not (reply_timeout_s > 0 and gone_timeout_s > 0):
            raise ConfigError("the reply and reconnect timeouts must be > 0")
        self.reply_timeout_s = reply_timeout_s
        self.gone_timeout_s = gone_timeout_s
        self.backoff = backoff or Backoff()
        self._draw = draw
        self.state: LinkState = "registered"
        self.gone_since: float | None = None  # when the server was last known to hold us
        self.attempts = 0  # registrations sent since the drop
        self._send_at = math.inf

    def disconnected(self, now: float) -> None:
        """The monitor saw the connection close (a drop, a frozen server's heartbeat
        timeout, a server restart)."""
        if self.gone_since is None:
            self.gone_since = now
        self.state = "down"
        self._send_at = math.inf  # nothing can be delivered until a connection is back

    def connected(self, now: float) -> None:
        """A connection's handshake succeeded; after a drop, register again soon."""
        if self.state != "down":
            return  # the first connection, or one the client never saw drop
        self.state = "rejoining"
        self._send_at = now + self.backoff.delay_s(0, self._draw())

    def register_due(self, now: float) -> bool:
        return self.state == "rejoining" and now >= self._send_at

    def registration_sent(self, now: float) -> None:
        """An ``fl_register`` went out: unanswered, it is sent again after the reply
        timeout and the next back-off."""
        self.attempts += 1
        wait = self.backoff.delay_s(self.attempts, self._draw())
        self._send_at = now + self.reply_timeout_s + wait

    def welcomed(self) -> bool:
        """The server welcomed this client; True if that ended a rejoin."""
        rejoined = self.state != "registered" or self.gone_since is not None
        self.state = "registered"
        self.gone_since = None
        self.attempts = 0
        self._send_at = math.inf
        return rejoined

    def gone_for(self, now: float) -> float:
        """How long the server has been gone (0 while this client is registered)."""
        return 0.0 if self.gone_since is None else now - self.gone_since

    def expired(self, now: float) -> bool:
        """The server has been gone for ``gone_timeout_s``: the client gives up."""
        return self.gone_since is not None and self.gone_for(now) >= self.gone_timeout_s

    def next_event(self) -> float:
        """When a registration is next due or the server's absence times out."""
        give_up = math.inf if self.gone_since is None else self.gone_since + self.gone_timeout_s
        return min(self._send_at, give_up)
