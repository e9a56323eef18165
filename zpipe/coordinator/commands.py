"""What the coordinator's controllers ask the shell to do: commands, as plain data.

A controller never touches a socket, a clock or a file. It returns these and
the shell (:mod:`zpipe.coordinator.server`) carries them out:

- :class:`Send`, :class:`Persist`, :class:`Log`, :class:`Record`,
  :class:`StartTimer`, :class:`FailRequests` and :class:`GiveBackMemory` are done at
  once, in order;
- an :class:`Await` suspends the flow that yielded it (:mod:`zpipe.coordinator.flows`)
  until its result comes back as an event: :class:`AwaitReplies` is answered by the
  stages' replies themselves, a :class:`ShellJob` by the shell, which gathers or computes
  off the event loop and feeds back one ``JobDone`` (or ``JobFailed``) event.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from zpipe.coordinator.membership import Member
from zpipe.coordinator.records import SavedReplica
from zpipe.models import ModelSpec
from zpipe.protocol import Message, WireMessage


@dataclass(frozen=True)
class Send:
    """Send ``message`` (a protocol object) to the peer at ``to``; ``stage``: a failed
    send to this stage becomes a ``RequestFailed`` event (waits on its replies fail at
    once)."""

    to: bytes
    message: WireMessage
    peer: str
    timeout_s: float | None = None  # None: the send deadline from configuration
    stage: str | None = None

    @property
    def wire(self) -> Message:
        """The message as the codec frames it."""
        return self.message.to_message()

    @property
    def kind(self) -> str:
        """The kind's name on the wire (for logs)."""
        return self.message.KIND


@dataclass(frozen=True)
class Persist:
    """Save counters, live members and the current run (small; on every change).

    ``soon``: a change a coordinator taking over can do without for a moment (a stage
    that registered: a successor that does not know it asks it to register again at
    its next heartbeat), saved once with the others of a burst, not once each."""

    soon: bool = False


@dataclass(frozen=True)
class Log:
    level: str  # "debug", "info", "warning", "error"
    event: str
    fields: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Record:
    """Append ``event`` to the coordinator's event list (what happened to runs)."""

    event: Mapping[str, Any]


@dataclass(frozen=True)
class StartTimer:
    """Feed ``TimerFired(tag)`` after ``delay_s`` seconds."""

    tag: int
    delay_s: float


@dataclass(frozen=True)
class FailRequests:
    """A stage died: requests the shell has out to it (profiles, link probes) fail now."""

    stage: str
    error: Exception


@dataclass(frozen=True)
class GiveBackMemory:
    """Freed memory of this size or more (a dropped half-sent transfer): hand the C
    heap's free pages back to the system (glibc keeps them resident otherwise)."""

    nbytes: int


@dataclass(frozen=True)
class Deliver:
    """A stage's reply to a request the shell made itself (a profile, a link probe)."""

    stage: str
    message: WireMessage


@dataclass(frozen=True)
class RunJob:
    """Carry out ``job`` and feed back ``JobDone(tag, result)`` or ``JobFailed(tag, error)``."""

    tag: int
    job: ShellJob


@dataclass(frozen=True)
class Now:
    """Yielded by a flow to learn the time of the event that resumed it."""


class Await:
    """Something a flow waits for; the flow resumes with its result."""


@dataclass(frozen=True)
class AwaitReplies(Await):
    """Every stage's reply of class ``reply``: resumes with ``{stage: reply}``.

    A reply of class ``fail`` from one of them, its death, or no reply within
    ``timeout_s`` raise in the flow, unless ``partial``: then the flow resumes with
    the replies that came. ``run``: replies of another run are late, and dropped.

    ``requests``: the sends that ask for the replies, made when the wait starts;
    with ``resend_s``, a stage that has neither answered nor moved a chunk since
    gets its request again every ``resend_s``. A request sent while a stage's
    connection is being replaced (a healed partition: ``ROUTER_HANDOVER``) goes
    down the stale connection and is lost; stages answer a repeated request once.
    """

    stages: tuple[str, ...]
    reply: type[WireMessage]
    timeout_s: float
    awaited: str
    run: int | None = None
    fail: type[WireMessage] | None = None
    partial: bool = False
    requests: tuple[Send, ...] = ()
    resend_s: float | None = None
    # (stage, commands): carried out if that stage dies while the wait is on it
    # (telling the others, say); a partial wait then goes on without it
    on_lost: tuple[tuple[str, tuple[Send, ...]], ...] = ()
    # a partial wait ends at the first death of a stage it waits on (the flow decides
    # what the death changes, and waits again for the rest)
    stop_on_lost: bool = False
    # sent (at most every PROGRESS_NOTICE_S) while a stage it waits on moves state: a
    # client waiting on this flow's answer then waits on from the latest progress too
    on_progress: Send | None = None


class ShellJob(Await):
    """Work for the shell: I/O gathers and planning, which runs off the event loop."""


@dataclass(frozen=True)
class AwaitStages(ShellJob):
    """The live stages a run asks for, waiting up to ``wait_s`` for them to register
    (chosen by :func:`zpipe.coordinator.decisions.pick_stages`)."""

    names: tuple[str, ...] | None
    count: int | None
    wait_s: float


@dataclass(frozen=True)
class CountUnits(ShellJob):
    """The number of units of ``spec``'s model (built off the loop: it may be large).
    ``declared``: the count the client sent (run_request's num_units), which spares
    the coordinator building a user-code model at all."""

    spec: ModelSpec
    declared: int | None = None


@dataclass(frozen=True)
class AwaitConfirmed(ShellJob):
    """Until every member among ``names`` restored from disk spoke or was declared dead."""

    names: tuple[str, ...]


@dataclass(frozen=True)
class AwaitSettled(ShellJob):
    """Until no member among ``names`` is suspect: each answered its probe or was
    declared dead (bounded by their deadlines). A resume plans over the members alive
    now, and a stage the client's stall report had probed (every stage of the run is)
    is alive until its probe goes unanswered: it must not be planned out as dead."""

    names: tuple[str, ...]


@dataclass(frozen=True)
class PlanInference(ShellJob):
    """Profile (and measure links) as needed, then plan off the loop: ``(plan, baseline)``."""

    spec: ModelSpec
    num_units: int
    members: tuple[Member, ...]
    algo: str
    partition: Sequence[Sequence[int]] | None
    batch_size: int
    dtype: str
    profile: Mapping[str, Any] | None = None
    bucketing: str = "auto"  # measured values for PipeEdge: "auto", "exact" or a tolerance


@dataclass(frozen=True)
class PlanTraining(ShellJob):
    """Training profiles and links of ``members``, then HPP (or another) off the loop."""

    spec: ModelSpec
    members: tuple[Member, ...]
    microbatch_size: int
    num_microbatches: int
    algo: str
    schedule: str
    optimizer: str


@dataclass(frozen=True)
class PlanLossy(ShellJob):
    """A lossy run's allocation: Algorithm 1, then Algorithm 2 on ``prr`` (the genetic
    search runs for a while), by :func:`zpipe.lossy.mapping.partition_and_map`."""

    layer_sizes: tuple[int, ...]
    allocation: str
    n_devices: int
    prr: Any  # the reception ratios, an n x n float64 array
    mapping: str
    seed: int
    # a CNN's layers (zpipe.lossy.cnn.CnnSpec): convolution layers allocated layer-wise
    # on conv_devices devices (None: an MLP)
    cnn: Any = None
    conv_devices: int = 0


@dataclass(frozen=True)
class TrainingModel(ShellJob):
    """The training profile and cluster of ``members``: ``(ModelProfile, ClusterSpec)``."""

    spec: ModelSpec
    members: tuple[Member, ...]
    microbatch_size: int


@dataclass(frozen=True)
class AllowPeers(ShellJob):
    """Tell every member which peers may reach its probe socket; ``fetches`` (None:
    unchanged) which unit fetches each member answers from now on (by member name;
    a member not named answers none)."""

    members: tuple[Member, ...]
    fetches: Mapping[str, Sequence[Any]] | None = None


@dataclass(frozen=True)
class MeasureLinks(ShellJob):
    """Probe again the links between consecutive ``members`` (in stage order), both
    directions, that were measured before: the latest replace the cached ones (a pair
    that fails keeps its last). Returns ``{(sender, receiver): MeasuredLink}`` of what
    was measured now; nothing when the coordinator does not measure links."""

    members: tuple[Member, ...]


@dataclass(frozen=True)
class ReachClient(ShellJob):
    """Send ``message`` to the client at ``to``: True once the socket took it, False
    when the client is not connected (``ROUTER_MANDATORY`` refuses a routing id whose
    connection dropped, a killed process's at once). A client connected but slow to
    read (the send waits past ``timeout_s``) is there: True."""

    to: bytes
    message: WireMessage
    timeout_s: float


@dataclass(frozen=True)
class SaveReplica(ShellJob):
    replica: SavedReplica


Command = (
    Send | Persist | Log | Record | StartTimer | FailRequests | GiveBackMemory | Deliver | RunJob
)
