"""Client <-> coordinator: starting, watching and ending a run; replicas and the cluster.

On the coordinator's ROUTER and the client's DEALER::

    client -> coordinator   run_request, run_go, run_end, stalled, replicate,
                            cluster_request (and weights_request, see stage_control)
    coordinator -> client   run_ready, run_failed, run_started, run_report,
                            stage_failed, run_replanned, replicated, checkpoint,
                            cluster_state
    client -> coordinator   notice_ack (for a stage_failed or run_replanned with a seq)
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
class RunRequest(WireMessage):
    """Start a run.

    ``recover``: re-plan without a stage that dies mid-stream, and replay (inference);
    ``recovery``: how ("lightweight", "heavy" or "respipe", zpipe.recovery.POLICIES).
    Training: ``resume`` run "run" from its replica after mini-batch "step", without the
    "dead" stages; ``rebalance`` at a replica when the bottleneck would shrink by this
    share; ``replication`` "global" (all at the coordinator), "chain" (FTPipeHD) or
    "topology" (Asteroid); ``admit``: devices that may join the plan at a replica when
    they register (or come back), null for any. ``num_units``: the model's unit
    count as the (trusted) client computed it, sent only for families that run user
    code (``sequential``, ``traced``), so that the coordinator never imports a
    peer-named factory to count units (:func:`zpipe.models.count_units`).
    """

    KIND: ClassVar[str] = "run_request"
    model: dict[str, Any] = wire(MAP)
    partition: list[Any] | None = wire(OPT_LIST, default=None)
    stages: int | None = wire(OPT_INT, default=None)
    stage_names: list[Any] | None = wire(OPT_LIST, default=None)
    dtype: str = wire(STR)
    planner: str | None = wire(STR, default=None)
    microbatch_size: int | None = wire(OPT_INT, default=None)
    profile: dict[str, Any] | None = wire(OPT_MAP, default=None)
    sink_endpoint: str = wire(STR)
    wait_for_stages_s: float = wire(NUM)
    recover: bool | None = wire(BOOL, default=None)
    recovery: str | None = wire(STR, default=None)
    mode: str | None = wire(STR, default=None)
    rebalance: float | None = wire(OPT_NUM, default=None, omit_if_none=True)
    replication: str | None = wire(STR, default=None)
    admit: list[Any] | None = wire(OPT_LIST, default=None, omit_if_none=True)
    train: dict[str, Any] | None = wire(OPT_MAP, default=None, omit_if_none=True)
    resume: dict[str, Any] | None = wire(OPT_MAP, default=None, omit_if_none=True)
    num_units: int | None = wire(OPT_INT, default=None, omit_if_none=True)
    # the client takes ``progress`` notices while it waits on state that moves slowly
    progress: bool | None = wire(BOOL, default=None, omit_if_none=True)
    # how PipeEdge treats measured values ("exact" or a tolerance such as "0.05"); sent
    # only when not "auto", so that an older coordinator still understands the request
    bucketing: str | None = wire(OPT_STR, default=None, omit_if_none=True)
    # The request's own id (the client's, fresh for each request): a request the
    # client sends again after it reconnected to a (restarted) coordinator is
    # answered once, with where the run it started stands, never started twice.
    # Sent by clients that send requests again; absent from older ones.
    request_id: str | None = wire(OPT_STR, default=None, omit_if_none=True)

    # The one default of each optional field a reader needs a value of (absent: None on
    # the wire, and in the fields above): every reader takes it from here.
    DEFAULT_MODE: ClassVar[str] = "infer"
    # Asteroid's choice: keep the stages, shift their boundaries (zpipe.recovery.replanning)
    DEFAULT_RECOVERY: ClassVar[str] = "lightweight"
    DEFAULT_REPLICATION: ClassVar[str] = "global"
    DEFAULT_PLANNER: ClassVar[str] = "pipeedge"
    DEFAULT_BUCKETING: ClassVar[str] = "auto"
    # one sample a micro-batch, when neither the request nor a plan says
    DEFAULT_MICROBATCH_SIZE: ClassVar[int] = 1

    @property
    def run_mode(self) -> str:
        return self.mode or self.DEFAULT_MODE

    @property
    def recovery_policy(self) -> str:
        return self.recovery or self.DEFAULT_RECOVERY

    @property
    def replication_kind(self) -> str:
        return self.replication or self.DEFAULT_REPLICATION

    @property
    def planner_name(self) -> str:
        return self.planner or self.DEFAULT_PLANNER

    @property
    def bucketing_mode(self) -> str:
        return self.DEFAULT_BUCKETING if self.bucketing is None else self.bucketing

    def microbatch_size_or(self, planned: int | None = None) -> int:
        """The samples per micro-batch the run is planned for: the request's; else what
        the run's plan was made for (a training plan says: ``planned``); else one."""
        if self.microbatch_size:
            return self.microbatch_size
        return planned if planned is not None else self.DEFAULT_MICROBATCH_SIZE

    @property
    def train_settings(self) -> dict[str, Any]:
        """A copy of the training settings (none: empty)."""
        return dict(self.train or {})


@wire_message
class RunReady(WireMessage):
    KIND: ClassVar[str] = "run_ready"
    run: int = wire(INT)
    plan: dict[str, Any] = wire(MAP)
    baseline: dict[str, Any] | None = wire(OPT_MAP, default=None)
    first_endpoint: str = wire(STR)
    first_stage: str = wire(STR)
    first_key: str | None = wire(OPT_STR, default=None)
    last_stage: str = wire(STR)
    last_key: str | None = wire(OPT_STR, default=None)
    last_endpoint: str | None = wire(STR, default=None)
    training_plan: dict[str, Any] | None = wire(OPT_MAP, default=None, omit_if_none=True)
    # the first stage's data port limit per frame: a client checks what it sends
    first_max_message_bytes: int | None = wire(OPT_INT, default=None, omit_if_none=True)
    # a resumed run restored from an older global replica than the one it asked for
    # (the chain copies of some unit all died): {"run", "step"}; the client replays more
    resumed: dict[str, Any] | None = wire(OPT_MAP, default=None, omit_if_none=True)
    # an asynchronous run's fast recovery (FTPipeHD): where it resumed, the progress each
    # unit lost, each unit's source (zpipe.recovery.fast_recovery.FastRecoveryPlan)
    fast_recovery: dict[str, Any] | None = wire(OPT_MAP, default=None, omit_if_none=True)


@wire_message
class RunFailed(WireMessage):
    """A request the coordinator could not serve. ``in_flight``: the run that kept a
    ``run_request`` from starting (a coordinator holds one run at a time, and
    another client's run was in flight): nothing was started or stopped."""

    KIND: ClassVar[str] = "run_failed"
    error: str = wire(STR)
    in_flight: int | None = wire(OPT_INT, default=None, omit_if_none=True)


@wire_message
class RunGo(WireMessage):
    KIND: ClassVar[str] = "run_go"
    run: int = wire(INT)


@wire_message
class RunStarted(WireMessage):
    KIND: ClassVar[str] = "run_started"
    run: int = wire(INT)


@wire_message
class RunEnd(WireMessage):
    KIND: ClassVar[str] = "run_end"
    run: int = wire(INT)
    # the client wants each stage's timeline in the report (a trace)
    timeline: bool | None = wire(OPT_BOOL, default=None, omit_if_none=True)


@wire_message
class RunReport(WireMessage):
    KIND: ClassVar[str] = "run_report"
    run: int = wire(INT)
    stages: dict[str, Any] = wire(MAP)
    # stage name -> its timeline (see Metrics), when the run_end asked for them
    timelines: dict[str, Any] | None = wire(OPT_MAP, default=None, omit_if_none=True)


@wire_message
class StageFailed(WireMessage):
    KIND: ClassVar[str] = "stage_failed"
    run: int = wire(INT)
    stage: str = wire(STR)
    reason: str = wire(STR)
    # the notice's number within its run: sent again until the client acknowledges it
    seq: int | None = wire(OPT_INT, default=None, omit_if_none=True)


@wire_message
class RunReplanned(WireMessage):
    """A stream re-planned without a dead stage: where to resend what has no result yet.
    ``detected_s``: how long the stage was silent when declared dead; ``recovered_s``:
    from then to the new plan."""

    KIND: ClassVar[str] = "run_replanned"
    run: int = wire(INT)
    plan: dict[str, Any] = wire(MAP)
    dead: str = wire(STR)
    detected_s: float | None = wire(NUM, default=None)
    recovered_s: float = wire(NUM)
    first_endpoint: str = wire(STR)
    first_stage: str = wire(STR)
    first_key: str | None = wire(OPT_STR)
    last_stage: str = wire(STR)
    last_key: str | None = wire(OPT_STR)
    last_endpoint: str = wire(STR)
    seq: int | None = wire(OPT_INT, default=None, omit_if_none=True)
    first_max_message_bytes: int | None = wire(OPT_INT, default=None, omit_if_none=True)
    # the coordinator's clock when the new plan ran (a trace marks the recovery there)
    clock: float | None = wire(OPT_NUM, default=None, omit_if_none=True)


@wire_message
class NoticeAck(WireMessage):
    """The client has the run's notice ``seq`` (``stage_failed``, ``run_replanned``):
    the coordinator stops sending it again."""

    KIND: ClassVar[str] = "notice_ack"
    run: int = wire(INT)
    seq: int = wire(INT)


@wire_message
class Stalled(WireMessage):
    """The client waited past its adaptive deadline for the run's next result
    (FTPipeHD's deadline at the data source): probe the run's stages now."""

    KIND: ClassVar[str] = "stalled"
    run: int = wire(INT)
    waited_s: float = wire(NUM)
    deadline_s: float = wire(NUM)


@wire_message
class Replicate(WireMessage):
    """A global replica: the coordinator keeps every stage's state after ``step``."""

    KIND: ClassVar[str] = "replicate"
    run: int = wire(INT)
    step: int = wire(INT)
    # chain replication: also a global copy of every unit (FTPipeHD runs both at once)
    global_copy: bool | None = wire(BOOL, key="global", default=None, omit_if_none=True)


@wire_message
class Replicated(WireMessage):
    """``rebalance``: a plan that balances the stages' measured speeds, to resume on."""

    KIND: ClassVar[str] = "replicated"
    run: int = wire(INT)
    step: int = wire(INT)
    tensor_count: int = wire(INT, key="tensors")
    nbytes: int = wire(INT, key="bytes")
    error: str = wire(STR)
    rebalance: dict[str, Any] | None = wire(OPT_MAP, default=None, omit_if_none=True)
    # every unit's state is at the coordinator now (global replication, or a global copy)
    global_copy: bool | None = wire(BOOL, key="global", default=None, omit_if_none=True)


@wire_message
class Checkpoint(TensorMessage):
    KIND: ClassVar[str] = "checkpoint"
    run: int = wire(INT)
    step: int = wire(INT)
    keys: list[Any] = wire(LIST)


@wire_message
class Progress(WireMessage):
    """State the client awaits (``awaited``: "weights", "backed_up") is still moving
    for run ``run``: its wait runs on from now. Sent (at most every few seconds) only
    to a client whose ``run_request`` offered ``progress``."""

    KIND: ClassVar[str] = "progress"
    run: int = wire(INT)
    awaited: str = wire(STR)


# A ``progress`` about this is no news: the coordinator looks whether a run's client is
# still connected (a send to a dropped connection fails); the client drops it.
PRESENCE = "presence"


@wire_message
class ClusterRequest(WireMessage):
    KIND: ClassVar[str] = "cluster_request"


@wire_message
class ClusterState(WireMessage):
    KIND: ClassVar[str] = "cluster_state"
    members: list[Any] = wire(LIST)


MESSAGES: tuple[type[WireMessage], ...] = (
    RunRequest,
    RunReady,
    RunFailed,
    RunGo,
    RunStarted,
    RunEnd,
    RunReport,
    StageFailed,
    RunReplanned,
    NoticeAck,
    Stalled,
    Replicate,
    Replicated,
    Checkpoint,
    Progress,
    ClusterRequest,
    ClusterState,
)
