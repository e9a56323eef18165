"""How many bytes one connection may make libzmq hold for it, and whom to cut: pure.

libzmq hands a multipart message to its reader only once the last frame has
arrived, and holds every frame until then, plus up to ``RCVHWM`` whole messages
per connection; ``MAXMSGSIZE`` is per frame. So what a peer makes a process hold
is bounded by nothing the application sees message by message (issue 33: a
million 1-byte frames, 3 MB on the wire, are some 64 MB inside libzmq).

What the application *can* see, per connection: the bytes the kernel received
on it (``TCP_INFO``'s ``tcpi_bytes_received``) and the bytes of the messages it
has taken from that connection (each received frame names its source descriptor).
The difference is what libzmq (and the kernel's receive buffer) holds for that
connection now: :func:`held_bytes`. The I/O shell
(:mod:`zpipe.transport.conn_guard`) samples both and cuts what
:func:`connections_to_cut` names.

Two rules:

- per connection: a connection that holds more than its port's budget (the most a
  legitimate peer may have in flight: the largest message times the queue) is cut;
- per process, for many small frames (each costs libzmq about 64 bytes for 3 on
  the wire, so a wire budget large enough for a legitimate bulk chunk lets a
  million frames through): while the process's resident memory has grown more
  than ``rss_growth_bytes`` since it was last quiet (no connection held
  ``min_held_to_cut``) *and* more than ``amplification`` times the bytes all its
  connections received meanwhile (memory that what peers sent does not explain:
  a replica the process keeps grows it by about what was received), the
  connection that holds most is cut, one per look, one that sent messages past
  the port's bounds first, never one holding less than ``min_held_to_cut``;
- per connection, for floods of small messages on a port whose legitimate large
  messages come with their size known (a probe port): a connection whose messages
  so far average under ``small_message_wire`` wire bytes may hold only
  ``small_message_held`` (:func:`sends_small_messages`). The mean is by message
  count, so a flooder that mixes in a few large messages to look large must send
  as many bytes as the per-connection budget already counts at about their cost.

Bytes that are not messages (the ZMTP greeting and handshake, heartbeat commands)
are never taken by the application; :class:`GuardBudget`'s slack (a constant plus a
rate over the connection's age) absorbs them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

# ZMTP 3 frame header: a flags byte and a 1-byte size below 256 bytes, else 8 bytes
SHORT_FRAME_HEADER = 2
LONG_FRAME_HEADER = 9
SHORT_FRAME_MAX = 255
# CURVE wraps every frame in a MESSAGE command: name (8), nonce (8), MAC (16), flags (1)
CURVE_FRAME_WRAPPING = 33


def frame_wire_bytes(length: int, wrapping: int = 0) -> int:
    """The bytes one frame of ``length`` takes on the wire (ZMTP 3, after ``wrapping``
    bytes a security mechanism adds to its body)."""
    body = length + wrapping
    return body + (SHORT_FRAME_HEADER if body <= SHORT_FRAME_MAX else LONG_FRAME_HEADER)


def message_wire_bytes(lengths: Iterable[int], wrapping: int = 0) -> int:
    """The wire bytes of a message whose frames have ``lengths``."""
    return sum(frame_wire_bytes(n, wrapping) for n in lengths)


def discarded_wire_bytes(frames: int, nbytes: int, wrapping: int = 0) -> int:
    """The wire bytes of a discarded message of which only the frame count and the
    total length are known: every frame taken at the mean length. Exact when its
    frames are all short or all long (the floods this guards against)."""
    if frames <= 0:
        return 0
    mean = (nbytes + frames * wrapping) // frames
    header = SHORT_FRAME_HEADER if mean <= SHORT_FRAME_MAX else LONG_FRAME_HEADER
    return nbytes + frames * (wrapping + header)


@dataclass(frozen=True)
class GuardBudget:
    """What the connections of one listening socket may make the process hold.

    ``per_connection_bytes``: wire bytes one connection may have sent that the
    application has not taken (None: no per-connection rule). ``rss_growth_bytes``:
    how far the resident memory may grow beyond its last quiet value before the
    process rule looks for a connection to cut (None: no process rule), and
    ``amplification``: how many times the bytes received meanwhile that growth must
    also be. ``slack_bytes`` and ``slack_bytes_per_s``: bytes that are not messages
    (handshakes, heartbeats), allowed on top, the latter per second of age."""

    per_connection_bytes: int | None
    rss_growth_bytes: int | None = None
    amplification: float = 4.0
    min_held_to_cut: int = 1 << 20
    slack_bytes: int = 64 << 10
    slack_bytes_per_s: float = 256.0
    # a connection whose taken messages average under this many wire bytes may hold
    # only ``small_message_held`` (None: no such rule; :func:`sends_small_messages`)
    small_message_wire: int | None = None
    small_message_held: int = 1 << 20

    def __post_init__(self) -> None:
        if self.per_connection_bytes is not None and self.per_connection_bytes < 1:
            raise ValueError(f"per_connection_bytes must be positive, got {self}")
        if self.rss_growth_bytes is not None and self.rss_growth_bytes < 1:
            raise ValueError(f"rss_growth_bytes must be positive, got {self}")
        if self.min_held_to_cut < 0 or self.slack_bytes < 0 or self.slack_bytes_per_s < 0:
            raise ValueError(f"a guard's slack and minimum cannot be negative: {self}")
        if self.amplification < 0:
            raise ValueError(f"amplification cannot be negative: {self}")
        if self.small_message_wire is not None and (
            self.small_message_wire < 1 or self.small_message_held < 1
        ):
            raise ValueError(f"a small-message rule needs positive sizes, got {self}")

    def slack(self, age_s: float) -> int:
        return self.slack_bytes + int(self.slack_bytes_per_s * max(0.0, age_s))


@dataclass(frozen=True)
class MemoryGrowth:
    """The process since it was last quiet: how much its resident memory grew and
    how many bytes all its guarded connections received meanwhile."""

    rss_growth: int
    received: int

    def unexplained(self, budget: GuardBudget) -> bool:
        """Whether the process rule applies: grown past the budget, and by more than
        the bytes received meanwhile could explain."""
        limit = budget.rss_growth_bytes
        if limit is None or self.rss_growth <= limit:
            return False
        return self.rss_growth > budget.amplification * self.received


# The process rule of a control port (a coordinator's ROUTER): what its resident
# memory may grow, unexplained by what peers sent, before a connection is cut. A
# coordinator idles at about 240 MB; issue 33's goal is a peak under twice that. With
# 128 MiB, bench/hostile.py's frame_amplification still peaked at 2.0x (cuts come
# after the growth, and what is already queued whole is still delivered).
CONTROL_PORT_RSS_GROWTH = 64 << 20


def control_port_budget(max_frame_bytes: int) -> GuardBudget:
    """A control port's budget: a connection may hold two of its largest frames (one
    arriving while the last waits to be read; bulk chunks and state resent whole are
    the large ones); many small frames are the process rule's."""
    return GuardBudget(
        per_connection_bytes=2 * frame_wire_bytes(max_frame_bytes, CURVE_FRAME_WRAPPING),
        rss_growth_bytes=CONTROL_PORT_RSS_GROWTH,
    )


# The process rule of a data port. Its socket has no receive mark (libzmq's abort:
# zpipe.stage.ports.DATA_PORT_RECV_HWM), so while the stage computes and reads
# nothing, libzmq queues whatever an admitted peer sends, and a message costs it about
# 64 bytes however short: empty frames (2 bytes on the wire) are some 32 times their
# wire bytes, past what a connection's byte budget sees. A stage's own memory grows
# too (a build, a replica, a forward's intermediates), unexplained by what peers sent,
# but the rule cuts only a connection that holds at least ``min_held_to_cut`` unread
# (a legitimate upstream rarely holds a megabyte while the stage grows by this much
# more than four times what it received since it was last quiet); 256 MiB leaves
# room for a forward's intermediates that the control port's 64 MiB does not.
DATA_PORT_RSS_GROWTH = 256 << 20


def data_port_budget(
    queued_bytes: int, message_max_bytes: int, message_max_frames: int, recv_hwm: int
) -> GuardBudget:
    """A data port's budget: what its limits let one connection queue (``queued_bytes``:
    ``recv_hwm`` activations of the largest size, what a legitimate sender has in
    flight) and one more message of the most a message may hold arriving, with every
    frame's framing; and the process rule (:data:`DATA_PORT_RSS_GROWTH`) for floods of
    small messages, which libzmq no longer stops at a mark."""
    framing = (recv_hwm + 1) * message_max_frames * (CURVE_FRAME_WRAPPING + LONG_FRAME_HEADER)
    return GuardBudget(
        per_connection_bytes=queued_bytes + message_max_bytes + framing,
        rss_growth_bytes=DATA_PORT_RSS_GROWTH,
    )


# The probe port's small-message rule. Its legitimate small messages come one at a
# time (a link ping waits for its pong, a fetch request for its units); its large
# ones (a link burst's chunks of at least 64 KiB, a backup's tensors) average far
# above this. A probe flood's messages are tens of bytes, each costing libzmq about
# 100 bytes while queued, and the byte budget (sized for a backup's largest frame:
# gigabytes) never cut one (bench/hostile.py probe_flood: stages grew 70-170 MiB): a
# sender whose messages average under 1 KiB may hold 1 MiB of them on the wire, a
# few MiB inside libzmq.
PROBE_SMALL_MESSAGE_WIRE = 1 << 10
PROBE_SMALL_MESSAGE_HELD = 1 << 20


def probe_port_budget(
    queued_bytes: int, message_max_bytes: int, message_max_frames: int, recv_hwm: int
) -> GuardBudget:
    """A probe port's budget: a data port's (:func:`data_port_budget`: a link burst and
    a backup's frame fit) and the small-message rule for floods of probes."""
    return replace(
        data_port_budget(queued_bytes, message_max_bytes, message_max_frames, recv_hwm),
        small_message_wire=PROBE_SMALL_MESSAGE_WIRE,
        small_message_held=PROBE_SMALL_MESSAGE_HELD,
    )


def held_bytes(received: int, taken: int, age_s: float, budget: GuardBudget) -> int:
    """What a connection holds beyond its slack: bytes received minus the wire bytes
    of the messages taken from it, less the slack for non-message bytes; >= 0."""
    return max(0, received - taken - budget.slack(age_s))


@dataclass(frozen=True)
class ConnectionHolding:
    """One connection as the guard saw it: its descriptor, its peer's address, what
    it holds (:func:`held_bytes`) and how many of its messages were past the port's
    bounds (read and discarded)."""

    fd: int
    peer: str
    held: int
    refused_messages: int = 0
    # the wire bytes and the count of the messages the application took from it
    taken_bytes: int = 0
    taken_messages: int = 0


def sends_small_messages(holding: ConnectionHolding, budget: GuardBudget) -> bool:
    """Whether the small-message rule holds ``holding`` to ``small_message_held``:
    its messages taken so far average under ``small_message_wire``. A connection none
    of whose messages were taken yet is not judged by it (a large backup may arrive
    whole before the application reads anything); the byte budget covers it."""
    limit = budget.small_message_wire
    if limit is None or holding.taken_messages == 0:
        return False
    return holding.taken_bytes < limit * holding.taken_messages


@dataclass(frozen=True)
class Cut:
    """A connection to cut and why (``"connection"``: over its own budget;
    ``"small messages"``: a sender of small messages over ``small_message_held``;
    ``"memory"``: the process over its RSS budget and this one holds most)."""

    fd: int
    peer: str
    held: int
    reason: str


def connections_to_cut(
    holdings: Sequence[ConnectionHolding], budget: GuardBudget, memory: MemoryGrowth | None = None
) -> list[Cut]:
    """The connections to cut now: each over the per-connection budget, and, while
    ``memory`` shows growth the bytes received do not explain
    (:meth:`MemoryGrowth.unexplained`), the one that holds most of the others (one
    that sent messages past the port's bounds before any that did not); each sender
    of small messages over ``small_message_held`` (:func:`sends_small_messages`)."""
    cuts: list[Cut] = []
    limit = budget.per_connection_bytes
    for h in holdings:
        if limit is not None and h.held > limit:
            cuts.append(Cut(h.fd, h.peer, h.held, "connection"))
        elif h.held > budget.small_message_held and sends_small_messages(h, budget):
            cuts.append(Cut(h.fd, h.peer, h.held, "small messages"))
    if memory is not None and memory.unexplained(budget):
        cut_fds = {c.fd for c in cuts}
        suspects = [h for h in holdings if h.fd not in cut_fds and h.held >= budget.min_held_to_cut]
        if suspects:
            worst = max(suspects, key=lambda h: (h.refused_messages > 0, h.held))
            cuts.append(Cut(worst.fd, worst.peer, worst.held, "memory"))
    return cuts


def quiet(holdings: Sequence[ConnectionHolding], budget: GuardBudget) -> bool:
    """Whether no connection holds enough to be cut for memory: the resident memory
    now is the process's own (a new baseline for :class:`MemoryGrowth`)."""
    return all(h.held < budget.min_held_to_cut for h in holdings)
