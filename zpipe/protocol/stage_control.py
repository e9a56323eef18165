"""Stage <-> coordinator: membership, liveness, assignment, profiles, weights, replicas, links.

On the coordinator's ROUTER and each stage's DEALER::

    stage -> coordinator   register, heartbeat, ready, connected, assign_failed,
                           profile_reply, metrics, weights, backed_up, async_copy,
                           link_peers_ok, link_probe_reply
    coordinator -> stage   registered, refused, heartbeat_ack, register_again, assign,
                           connect, profile_request, metrics_request, weights_request,
                           backup_request, link_peers, link_probe_request, shutdown
    either way             probe, probe_ack (liveness on the probe socket)

``weights_request`` also goes client -> coordinator, which fans it out.
"""

from __future__ import annotations

from typing import Any, ClassVar

from zpipe.protocol._schema import (
    BOOL,
    INT,
    LIST,
    MAP,
    NUM,
    OPT_BOOL,
    OPT_INT,
    OPT_LIST,
    OPT_MAP,
    OPT_NUM,
    OPT_STR,
    STR,
    TensorMessage,
    WireMessage,
    wire,
    wire_message,
)


@wire_message
class Register(WireMessage):
    KIND: ClassVar[str] = "register"
    name: str = wire(STR)
    data_endpoint: str = wire(STR)
    info: dict[str, Any] = wire(MAP)
    public_key: str | None = wire(OPT_STR, default=None)
    # the stage process's resident memory before any model arrives (its base cost, in
    # bytes); absent (an older stage): planned with DEFAULT_STAGE_BASE_BYTES
    base_bytes: int | None = wire(OPT_INT, default=None, omit_if_none=True)


@wire_message
class Registered(WireMessage):
    KIND: ClassVar[str] = "registered"
    name: str = wire(STR)
    heartbeat_interval: float = wire(NUM)
    # ties the stage's bulk connection to it (zpipe.protocol.bulk); an older coordinator
    # sends none, and the stage then sends its state on this connection as before
    bulk_token: str | None = wire(OPT_STR, default=None, omit_if_none=True)
    # the coordinator's clock: it stamps heartbeat_acks, so the stage's heartbeats may
    # carry ``clock`` (an older coordinator sends none, and gets none)
    clock: float | None = wire(OPT_NUM, default=None, omit_if_none=True)


@wire_message
class Refused(WireMessage):
    KIND: ClassVar[str] = "refused"
    reason: str = wire(STR)


@wire_message
class Heartbeat(WireMessage):
    KIND: ClassVar[str] = "heartbeat"
    name: str = wire(STR)
    metrics: dict[str, Any] = wire(MAP)
    # the stage's clock when it sent this, for a coordinator that stamps its acks
    clock: float | None = wire(OPT_NUM, default=None, omit_if_none=True)


@wire_message
class HeartbeatAck(WireMessage):
    """``echo``: the heartbeat's ``clock``; ``clock``: the coordinator's, when it
    answered: a round trip that estimates the offset of the two clocks."""

    KIND: ClassVar[str] = "heartbeat_ack"
    echo: float | None = wire(OPT_NUM, default=None, omit_if_none=True)
    clock: float | None = wire(OPT_NUM, default=None, omit_if_none=True)


@wire_message
class RegisterAgain(WireMessage):
    """A coordinator that does not know a heartbeating stage (it restarted without
    its state): the stage registers again and keeps serving."""

    KIND: ClassVar[str] = "register_again"
    reason: str = wire(STR)


@wire_message
class Probe(WireMessage):
    KIND: ClassVar[str] = "probe"
    nonce: int = wire(INT)


@wire_message
class ProbeAck(WireMessage):
    KIND: ClassVar[str] = "probe_ack"
    nonce: int = wire(INT)


@wire_message
class Assign(TensorMessage):
    """Units [start, end) of a run's model. Training resumed from a replica carries the
    stage's weights and optimizer state as tensors named by ``state_keys``, and the units
    it gets from snapshots kept by the stages in ``fetch`` (chain replication):
    [{"from", "endpoint", "key", "owner", "run", "step", "start", "end"}]."""

    KIND: ClassVar[str] = "assign"
    run: int = wire(INT)
    model: dict[str, Any] = wire(MAP)
    start: int = wire(INT)
    end: int = wire(INT)
    index: int = wire(INT)
    num_stages: int = wire(INT)
    upstream: str = wire(STR)
    upstream_key: str | None = wire(OPT_STR, default=None)
    downstream: str = wire(STR)
    downstream_endpoint: str = wire(STR)
    downstream_key: str | None = wire(OPT_STR, default=None)
    dtype: str = wire(STR)
    mode: str | None = wire(STR, default=None)
    train: dict[str, Any] | None = wire(OPT_MAP, default=None, omit_if_none=True)
    upstream_endpoint: str | None = wire(STR, default=None)
    state_keys: list[Any] | None = wire(OPT_LIST, default=None, omit_if_none=True)
    fetch: list[Any] | None = wire(OPT_LIST, default=None, omit_if_none=True)


@wire_message
class Ready(WireMessage):
    KIND: ClassVar[str] = "ready"
    run: int = wire(INT)
    name: str = wire(STR)
    build_s: float = wire(NUM)
    ring_endpoint: str | None = wire(STR, default=None)
    # the most bytes one frame may have on this stage's data port (its MAXMSGSIZE)
    max_message_bytes: int | None = wire(OPT_INT, default=None, omit_if_none=True)


@wire_message
class Connect(WireMessage):
    """Second phase: connect downstream only once every stage allows its upstream;
    ``ring``: the all-reduce ring of a data-parallel group ({"endpoints", "keys"})."""

    KIND: ClassVar[str] = "connect"
    run: int = wire(INT)
    ring: dict[str, Any] | None = wire(OPT_MAP, default=None, omit_if_none=True)


@wire_message
class Connected(WireMessage):
    KIND: ClassVar[str] = "connected"
    run: int = wire(INT)
    name: str = wire(STR)


@wire_message
class AssignFailed(WireMessage):
    KIND: ClassVar[str] = "assign_failed"
    run: int = wire(INT)
    name: str = wire(STR)
    error: str = wire(STR)


@wire_message
class ProfileRequest(WireMessage):
    """``train``: also backward times and saved activation bytes. ``batch_sizes``: every
    size to profile (``batch_size`` among them), sent only to stages that reported their
    device at registration (they understand it); an older stage profiles ``batch_size``."""

    KIND: ClassVar[str] = "profile_request"
    model: dict[str, Any] = wire(MAP)
    batch_size: int = wire(INT)
    dtype: str = wire(STR)
    repeats: int = wire(INT)
    train: bool | None = wire(BOOL, default=None)
    batch_sizes: list[Any] | None = wire(OPT_LIST, default=None, omit_if_none=True)


@wire_message
class ProfileReply(WireMessage):
    KIND: ClassVar[str] = "profile_reply"
    name: str = wire(STR)
    profile: dict[str, Any] | None = wire(OPT_MAP)
    error: str = wire(STR)


@wire_message
class MetricsRequest(WireMessage):
    KIND: ClassVar[str] = "metrics_request"
    run: int = wire(INT)
    # ask for the run's timeline too (only when the client asked for a trace)
    timeline: bool | None = wire(OPT_BOOL, default=None, omit_if_none=True)


@wire_message
class Metrics(WireMessage):
    KIND: ClassVar[str] = "metrics"
    run: int = wire(INT)
    name: str = wire(STR)
    metrics: dict[str, Any] = wire(MAP)
    # when asked: {"spans": [[mb, phase, start, end], ...], "dropped", "offset_s", "rtt_s"}
    timeline: dict[str, Any] | None = wire(OPT_MAP, default=None, omit_if_none=True)


@wire_message
class Shutdown(WireMessage):
    KIND: ClassVar[str] = "shutdown"
    reason: str = wire(STR)


@wire_message
class WeightsRequest(WireMessage):
    """Training weights after round ``step`` (``optimizer``: with the optimizer's state,
    for a replica to resume from). ``latest``: the state as it is now, without waiting
    for the round; the stage stops training that run first."""

    KIND: ClassVar[str] = "weights_request"
    run: int = wire(INT)
    step: int = wire(INT)
    optimizer: bool | None = wire(BOOL, default=None)
    latest: bool | None = wire(BOOL, default=None)
    # heavy recovery: the snapshots kept here to send instead (this stage's own, or
    # backups), as [{"owner", "run", "step", "start", "end"}]
    snapshot: list[Any] | None = wire(OPT_LIST, default=None, omit_if_none=True)
    # with ``latest``, an asynchronous run's fast recovery: the stage keeps its state
    # as its own snapshot after its update count and the reply names the keys without
    # the tensors (the new plan fetches the units peer to peer)
    keep: bool | None = wire(OPT_BOOL, default=None, omit_if_none=True)


@wire_message
class Weights(TensorMessage):
    """A stage's state, its tensors named by ``keys``; ``metrics``: its counters at that
    round; ``completed``: the rounds it had completed (with ``latest``)."""

    KIND: ClassVar[str] = "weights"
    run: int = wire(INT)
    name: str = wire(STR)
    step: int = wire(INT)
    keys: list[Any] = wire(LIST)
    error: str = wire(STR)
    metrics: dict[str, Any] | None = wire(OPT_MAP, default=None, omit_if_none=True)
    completed: int | None = wire(INT, default=None)
    # an asynchronous stage's update count (its weight version) with ``latest``: what a
    # fast recovery compares with the copies' mini-batches
    updates: int | None = wire(OPT_INT, default=None, omit_if_none=True)


@wire_message
class BackupRequest(WireMessage):
    """Chain replication (FTPipeHD) and Asteroid's topology-driven replication: after
    round ``step`` a stage keeps a snapshot of its state and sends a copy to its backup
    ``holder``: a stage (at ``holder_endpoint``, its probe socket), the coordinator (in
    the reply), or nobody ("")."""

    KIND: ClassVar[str] = "backup_request"
    run: int = wire(INT)
    step: int = wire(INT)
    holder: str = wire(STR)
    holder_endpoint: str | None = wire(OPT_STR, default=None, omit_if_none=True)
    holder_key: str | None = wire(OPT_STR, default=None, omit_if_none=True)


@wire_message
class BackedUp(TensorMessage):
    KIND: ClassVar[str] = "backed_up"
    run: int = wire(INT)
    name: str = wire(STR)
    step: int = wire(INT)
    holder: str = wire(STR)
    keys: list[Any] = wire(LIST)
    nbytes: int = wire(INT, key="bytes")
    error: str = wire(STR)
    metrics: dict[str, Any] | None = wire(OPT_MAP, default=None, omit_if_none=True)


@wire_message
class AsyncCopy(TensorMessage):
    """Stage -> coordinator, unasked, on the bulk connection: a copy of this stage's
    units ``[start, end)`` after ``step`` mini-batches, made while it trains on
    (FTPipeHD's replication without draining, :mod:`zpipe.recovery.live_copies`):
    ``kind`` "global", or "chain" from the last stage. ``digest``: the
    :func:`~zpipe.recovery.live_copies.state_digest` of the tensors."""

    KIND: ClassVar[str] = "async_copy"
    run: int = wire(INT)
    name: str = wire(STR)
    kind: str = wire(STR)
    step: int = wire(INT)
    start: int = wire(INT)
    end: int = wire(INT)
    keys: list[Any] = wire(LIST)
    digest: str | None = wire(OPT_STR, default=None, omit_if_none=True)
    # the stage that keeps a chain copy, announced without its tensors (None: the
    # coordinator holds this copy, sent with it)
    holder: str | None = wire(OPT_STR, default=None, omit_if_none=True)


@wire_message
class LinkPeers(WireMessage):
    """The peers a stage's probe socket allows (name -> public key); ``fetches``, when
    present, replaces the unit fetches this stage answers: maps of ``peer`` (the device
    the new plan assigns the units to), ``owner``, ``run``, ``step``, ``start``, ``end``."""

    KIND: ClassVar[str] = "link_peers"
    keys: dict[str, Any] = wire(MAP)
    fetches: list[Any] | None = wire(OPT_LIST, default=None, omit_if_none=True)


@wire_message
class LinkPeersOk(WireMessage):
    KIND: ClassVar[str] = "link_peers_ok"
    name: str = wire(STR)


@wire_message
class LinkProbeRequest(WireMessage):
    """Measure the link to ``target`` (one stage at a time)."""

    KIND: ClassVar[str] = "link_probe_request"
    target: str = wire(STR)
    endpoint: str = wire(STR)
    key: str | None = wire(OPT_STR, default=None)


@wire_message
class LinkProbeReply(WireMessage):
    KIND: ClassVar[str] = "link_probe_reply"
    name: str = wire(STR)
    target: str = wire(STR)
    bandwidth_bps: float | None = wire(OPT_NUM)
    rtt_s: float | None = wire(OPT_NUM)
    error: str = wire(STR)


MESSAGES: tuple[type[WireMessage], ...] = (
    Register,
    Registered,
    Refused,
    Heartbeat,
    HeartbeatAck,
    RegisterAgain,
    Probe,
    ProbeAck,
    Assign,
    Ready,
    Connect,
    Connected,
    AssignFailed,
    ProfileRequest,
    ProfileReply,
    MetricsRequest,
    Metrics,
    Shutdown,
    WeightsRequest,
    Weights,
    BackupRequest,
    BackedUp,
    AsyncCopy,
    LinkPeers,
    LinkPeersOk,
    LinkProbeRequest,
    LinkProbeReply,
)
