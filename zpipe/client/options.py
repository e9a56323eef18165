"""The options of a run: :class:`InferOptions` and :class:`TrainOptions`.

Frozen and checked when made, so a bad value is refused with a
:class:`~zpipe.ConfigError` that names it before anything is sent. The keyword
calls (``client.infer_stream(spec, batches, microbatch_size=4)``,
``client.fit(spec, batches, optimizer=..., num_microbatches=4)``) build these
through :meth:`InferOptions.from_keywords` / :meth:`TrainOptions.from_keywords`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from zpipe._errors import ConfigError
from zpipe.planner.async_schedule import ASYNC_SCHEDULE
from zpipe.planner.bucketing import parse_bucketing
from zpipe.planner.plan import Plan
from zpipe.planner.profile import ModelProfile
from zpipe.planner.training_plan import TrainingPlan
from zpipe.recovery import POLICIES as RECOVERY_POLICIES
from zpipe.recovery import REPLICATIONS, DeadlinePolicy
from zpipe.recovery.live_copies import DEFAULT_CHAIN_EVERY, DEFAULT_GLOBAL_EVERY
from zpipe.training.async_recovery import async_recovery_refusal
from zpipe.training.lr_schedules import check_lr_schedule
from zpipe.training.objectives import (
    ASYNC_RESUME_LIVE_COPIES,
    async_start_step_refusal,
    check_loss,
    check_optimizer,
)
from zpipe.training.repartition import RepartitionSettings
from zpipe.training.warmup import check_warmup_policy

# FTPipeHD replicates globally every 100 mini-batches and along the chain every 50.
DEFAULT_REPLICATE_EVERY = 50
# FTPipeHD's periods of the copies an asynchronous run makes without draining
DEFAULT_LIVE_CHAIN_EVERY = DEFAULT_CHAIN_EVERY
DEFAULT_LIVE_GLOBAL_EVERY = DEFAULT_GLOBAL_EVERY
# how a recovery treats the work since the replica (see TrainOptions.consistency)
CONSISTENCIES = ("exact", "fast")

_Options = TypeVar("_Options", "InferOptions", "TrainOptions")


def _from_keywords(
    cls: type[_Options], options: _Options | None, keywords: Mapping[str, Any], caller: str
) -> _Options:
    known = {f.name for f in dataclasses.fields(cls)}
    for name in keywords:
        if name not in known:
            raise TypeError(f"{caller}() got an unexpected keyword argument {name!r}")
    if options is None:
        return cls(**keywords)
    if not isinstance(options, cls):
        raise ConfigError(f"options must be {cls.__name__}, got {type(options).__name__}")
    return dataclasses.replace(options, **keywords) if keywords else options


def _check_choice(name: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ConfigError(f"unknown {name} {value!r}; choose one of {', '.join(choices)}")


def _check_count(name: str, value: object, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be >= 1, got {value}")


def _check_wait(value: object) -> None:
    if isinstance(value, bool) or not (
        isinstance(value, (int, float)) and math.isfinite(value) and value >= 0
    ):
        raise ConfigError(f"wait_for_stages_s must be a number of seconds >= 0, got {value!r}")


def _ranges(partition: Sequence[Sequence[int]] | None) -> tuple[tuple[int, ...], ...] | None:
    if partition is None:
        return None
    try:
        return tuple(tuple(int(u) for u in r) for r in partition)
    except (TypeError, ValueError):
        raise ConfigError(
            f"partition must be unit ranges such as [[0, 2], [2, 4]], got {partition!r}"
        ) from None


def _names(stage_names: Sequence[str] | None) -> tuple[str, ...] | None:
    if stage_names is None:
        return None
    if isinstance(stage_names, str):
        raise ConfigError(f"stage_names must be a list of names, got the string {stage_names!r}")
    return tuple(str(n) for n in stage_names)


def _check_trace(trace: object) -> None:
    # found now, not after the whole run
    if trace is None:
        return
    if not isinstance(trace, (str, Path)) or not str(trace):
        raise ConfigError(f"trace must be a file path, got {trace!r}")
    folder = Path(trace).parent
    if not folder.is_dir():
        raise ConfigError(f"trace {trace}: the directory {folder} does not exist")


def _normalize_placement(options: InferOptions | TrainOptions) -> None:
    # frozen: lists become tuples so that the options cannot change under a run
    object.__setattr__(options, "partition", _ranges(options.partition))
    object.__setattr__(options, "stage_names", _names(options.stage_names))
    _check_count("stages", options.stages, optional=True)
    _check_count("microbatch_size", options.microbatch_size, optional=True)
    _check_wait(options.wait_for_stages_s)


@dataclasses.dataclass(frozen=True, kw_only=True)
class InferOptions:
    """How an inference stream runs (:meth:`PipelineClient.infer_stream`).

    The coordinator plans the run with ``planner`` ("pipeedge" by default,
    "pipedream" or "even") from each stage's own profile of the model at
    ``microbatch_size`` (or from ``profile``, scaled by each stage's
    slowdown), unless ``partition`` gives the unit ranges; ``stage_names`` says
    which stages may take part, ``stages`` how many (waiting up to
    ``wait_for_stages_s`` for them). ``dtype="bfloat16"`` computes under
    autocast. At most ``max_in_flight`` micro-batches are in the pipeline;
    ``progress(received, sent)`` is called after each result.

    With ``recover`` (the default), a stage that dies mid-stream is planned
    around: the coordinator re-plans over the surviving stages, and the
    micro-batches without a result are sent again (the client keeps each
    input until its result arrives); every output is still delivered once,
    in order. Without it, or when no stage is left, the stream raises
    :class:`StageFailedError`. ``recovery`` chooses how the survivors are
    planned: "lightweight" (Asteroid: the same stages in the same order, their
    boundaries shifted so that each one's work matches its speed, units moving
    only between neighbours), "heavy" (the full planner over the survivors)
    or "respipe" (the next stage takes all of the dead one's units).
    ``stall_deadline``: how late the next result may be before the coordinator
    probes the stages (see :class:`TrainOptions`; default
    :data:`zpipe.recovery.DEFAULT_STALL_DEADLINE`).
    ``bucketing``: how the PipeEdge planner treats the stages' measured speeds and
    links: "auto" (the default: exact for a few distinct devices, else snapped to 5 %
    buckets, with a certified bound in the plan's prediction), "exact", or a
    tolerance such as 0.05 (:mod:`zpipe.planner.bucketing`).

    ``on_plan(plan)`` is called with the coordinator's :class:`~zpipe.planner.Plan`
    once it arrives, before any input is sent (again after each re-plan).
    ``phases``: name the long phases on stderr (waiting for the plan while the stages
    profile and the coordinator measures links and plans; default: when stderr is a
    terminal). ``trace``: a file to write the run's per-micro-batch timeline to, as
    Chrome trace-event JSON (open it in https://ui.perfetto.dev or chrome://tracing).
    """

    microbatch_size: int | None = None
    partition: Sequence[Sequence[int]] | None = None
    stages: int | None = None
    stage_names: Sequence[str] | None = None
    dtype: str = "float32"
    planner: str | None = None
    bucketing: str | float = "auto"
    profile: ModelProfile | None = None
    max_in_flight: int = 4
    wait_for_stages_s: float = 30.0
    progress: Callable[[int, int], None] | None = None
    recover: bool = True
    recovery: str = "lightweight"
    stall_deadline: DeadlinePolicy | None = None
    on_plan: Callable[[Plan], None] | None = None
    phases: bool | None = None
    trace: str | Path | None = None

    def __post_init__(self) -> None:
        _check_choice("recovery", self.recovery, RECOVERY_POLICIES)
        _normalize_placement(self)
        _check_count("max_in_flight", self.max_in_flight)
        parse_bucketing(self.bucketing)
        _check_trace(self.trace)

    @classmethod
    def from_keywords(
        cls,
        options: InferOptions | None = None,
        keywords: Mapping[str, Any] | None = None,
        *,
        caller: str = "infer_stream",
    ) -> InferOptions:
        """``options`` (or the defaults) with ``keywords`` in place of its fields."""
        return _from_keywords(cls, options, keywords or {}, caller)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainOptions:
    """How a training run goes (:func:`zpipe.client.fit`).

    ``optimizer``: the optimizer's settings (``{"name": "sgd", "lr": 0.1}``);
    ``num_microbatches``: the parts each mini-batch is split into; ``loss``: the
    objective; ``schedule``: "1f1b" or "gpipe"; ``warmups``: each stage's
    forwards before its first backward (1F1B's K_p); without them, ``warmup`` picks the
    rule: "asteroid" (2(P - p) - 1), "torch" (P - p, as Schedule1F1B) or "auto" (the
    default: Asteroid's, chosen by measurement; see
    :mod:`zpipe.training.warmup`); ``max_steps_in_flight``:
    mini-batches fed ahead of their losses (default 2; for "async-1f1b" the number of
    stages, FTPipeHD's semaphore).
    ``schedule="async-1f1b"``: asynchronous 1F1B (PipeDream, FTPipeHD): every stage
    updates after each backward, with weight stashing; ``num_microbatches`` must be 1.
    ``vertical_sync`` (default on): every stage forwards a mini-batch with the weight
    version the first stage used; ``aggregate``: FTPipeHD's weight aggregation, stage
    ``i`` of ``n`` averaging its newest ``n - i`` versions every
    ``aggregate_multiple * (n - i)`` backwards (after a recovery onto fewer stages,
    those of the depth the run started with: :mod:`zpipe.training.async_recovery`).
    ``repartition`` (one device per stage; with ``recover`` for "async-1f1b" only):
    FTPipeHD's live re-partitioning, True or a
    :class:`~zpipe.training.repartition.RepartitionSettings` (or its map: ``first``,
    ``every``, ``gain``): the feed pauses after ``first`` mini-batches and then every
    ``every``, the stages' capacities are measured and their units move between
    them when the predicted period shrinks by ``gain``.
    ``plan``: a training plan (device groups, unit ranges, shares, warm-ups; e.g. from
    :func:`zpipe.planner.hpp.plan_training`); its schedule, micro-batch count and
    warm-ups replace those arguments. Without one the coordinator plans a straight
    pipeline or groups: ``planner`` is ``"hpp"`` (the default when the micro-batch size is
    known: Asteroid's hybrid plan from every stage's training profile), ``"straight"``,
    ``"data-parallel"`` or ``"even"`` (training planners), or ``"pipeedge"`` (a straight
    pipeline planned from forward times); ``partition`` over ``stage_names`` skips planning.
    ``microbatch_size``: the samples per micro-batch to plan for (default: the first
    batch's size over ``num_microbatches``, when ``batches`` is a sequence).
    ``progress``: show a progress bar (default: when stderr is a terminal).
    ``on_step(step, loss)`` is called after each mini-batch's loss is known (again for
    a mini-batch that a recovery replays).
    ``recover``: survive the death of stages (see the module notes); the coordinator
    keeps a replica every ``replicate_every`` mini-batches (default 50, as FTPipeHD's
    global replication; each one drains the pipeline once), and ``recovery`` is how
    the survivors are planned: "lightweight" (the same stages, boundaries moved to
    their speeds), "heavy" (the planner again over the survivors) or "respipe" (the
    next stage takes the dead one's units).
    ``rebalance`` (with ``recover``): at each replica, when the stages' measured speeds
    say that moving unit boundaries between neighbours would shorten the slowest
    stage by at least this share (0.2: 20 %), the run goes on from the replica on
    that plan (Eco-FL's workload migration, for a device that turned slow). A
    device that registers during the run (one of ``stage_names``, if given; a dead
    one that comes back, say) joins the run the same way at a replica, when the
    planner predicts a round shorter by the share with it.
    ``consistency`` (with ``recover``): "exact" rolls every stage back to the replica
    and trains the mini-batches since it again, so the model equals an uninterrupted
    run's; "fast" (as FTPipeHD and Asteroid recover) keeps the survivors' newest
    weights, takes only the dead stage's units from the replica, and goes on from the
    first mini-batch whose loss had not come back (nothing completed is trained twice).
    ``stall_deadline``: how long to wait for the next mini-batch's loss before the
    coordinator probes the run's stages (FTPipeHD's deadline at the data source,
    adapted to the latencies seen: median + k MAD; default
    :data:`zpipe.recovery.DEFAULT_STALL_DEADLINE`). A dead stage is then found without waiting for
    its heartbeats to lapse; a slow one answers the probe and stays.
    ``replication`` (with ``recover``): where replicas go. "global" (FTPipeHD's
    global replication): every unit's state to the coordinator. "chain" (FTPipeHD's
    chain replication): each device keeps a snapshot and each stage backs it up to
    the next stage, the last to the coordinator; "topology" (Asteroid): the same,
    the last stage backing up to the first, and a data-parallel stage keeping no
    backup (a surviving member restores it). After a failure the stages fetch their
    units from those snapshots directly (the coordinator sends only what no live
    stage holds); a stage whose snapshot and backup holder are both lost cannot be
    recovered from them.
    ``chain_every`` and ``global_every`` (with "chain" or "topology"): FTPipeHD runs
    both replications at once, chain every ``chain_every`` mini-batches (default
    ``replicate_every``) and a global copy of every unit to the coordinator every
    ``global_every`` (default: none). With both, a recovery takes each unit from
    its nearest holder (the stage's own snapshot, a neighbour's backup, the
    coordinator) at the newest chain replica, and when some unit lost every chain
    copy (two adjacent stages died: one held the other's backup) the run goes on
    from the newest global copy instead of failing (``exact`` consistency; the
    client keeps the mini-batches since that copy to train them again).
    ``live_copies`` (``async-1f1b`` only): FTPipeHD's replication without draining.
    Each stage copies its units (the weights after a known mini-batch, with the
    stashed versions and optimizer state) to the next stage every ``chain_every``
    mini-batches (default 50; the last stage to the coordinator) and to the
    coordinator every ``global_every`` (default 100), while the pipeline trains on;
    the coordinator keeps its copies in its state directory. A recovering run
    (``recover``) with ``consistency="exact"`` still rolls back exactly to its flush
    replicas (``replicate_every``, global replication). With ``consistency="fast"``
    it takes no flush replica at all and recovers as FTPipeHD does: the survivors
    keep their weights and optimizer state, the dead stage's units come from the
    nearest copy (the chain copy the next stage holds, else the coordinator's global
    copy: two adjacent deaths lose the chain copy), the survivors are re-cut by eq.
    5, and the run resumes at the first mini-batch whose loss had not come back.
    The report says how many mini-batches of progress that lost
    (:attr:`TrainReport.progress_lost`) and where each unit came from
    (:attr:`TrainReport.unit_sources`).
    ``loss`` and ``optimizer["name"]`` may name user code, "package.module:function"
    (see :mod:`zpipe.training.objectives`): each stage imports it only if its
    operator allowed it with ``--allow-factory``.
    ``lr_schedule``: ``{"name": "constant" | "linear" | "cosine", "warmup_steps": W,
    "total_steps": T}`` (see :mod:`zpipe.training.lr_schedules`), counted from
    ``start_step``, the mini-batches trained before this run (when resuming).
    ``optimizer_state``: gather the optimizer's state with the trained weights, so
    that :meth:`TrainReport.save` writes a checkpoint a later run resumes from.
    ``resume_optimizer``: every stage restores its units' optimizer state from the
    spec's weights file (such a checkpoint), reading only its own tensors.
    ``profile`` (with ``plan``): the training profile the plan was made from; with
    ``rebalance``, the coordinator weighs units by its times (without it, and without
    its own stages' profiles, every unit alike).
    ``on_plan(plan)``: called with each attempt's :class:`TrainingPlan` as soon as the
    coordinator sends it, before training starts. ``progress`` also names the wait for
    the plan on stderr. ``trace``: a file for the per-micro-batch timeline (Chrome
    trace-event JSON, see :class:`InferOptions`).
    """

    optimizer: Mapping[str, Any]
    num_microbatches: int
    loss: str = "cross_entropy"
    schedule: str = "1f1b"
    warmups: Sequence[int] | None = None
    warmup: str = "auto"
    plan: TrainingPlan | None = None
    partition: Sequence[Sequence[int]] | None = None
    stages: int | None = None
    stage_names: Sequence[str] | None = None
    planner: str | None = None
    microbatch_size: int | None = None
    wait_for_stages_s: float = 30.0
    max_steps_in_flight: int | None = None
    progress: bool | None = None
    on_step: Callable[[int, float], None] | None = None
    recover: bool = False
    replicate_every: int | None = None
    recovery: str = "lightweight"
    rebalance: float | None = None
    consistency: str = "exact"
    stall_deadline: DeadlinePolicy | None = None
    replication: str = "global"
    chain_every: int | None = None
    global_every: int | None = None
    live_copies: bool = False
    lr_schedule: Mapping[str, Any] | None = None
    start_step: int = 0
    optimizer_state: bool = False
    resume_optimizer: bool = False
    on_plan: Callable[[TrainingPlan], None] | None = None
    trace: str | Path | None = None
    vertical_sync: bool = True
    aggregate: bool = False
    aggregate_multiple: int = 1
    repartition: RepartitionSettings | Mapping[str, Any] | bool | None = None
    profile: ModelProfile | None = None

    def __post_init__(self) -> None:
        _check_trace(self.trace)
        if self.profile is not None and (self.plan is None or not self.profile.has_training):
            raise ConfigError("profile goes with plan: the training profile the plan was made from")
        _check_choice("replication", self.replication, REPLICATIONS)
        _check_choice("consistency", self.consistency, CONSISTENCIES)
        _check_choice("recovery", self.recovery, RECOVERY_POLICIES)
        _check_count("replicate_every", self.replicate_every, optional=True)
        _check_count("chain_every", self.chain_every, optional=True)
        _check_count("global_every", self.global_every, optional=True)
        periods = (self.chain_every, self.global_every)
        if not isinstance(self.live_copies, bool):
            raise ConfigError(f"live_copies must be True or False, got {self.live_copies!r}")
        if self.live_copies:
            _check_live_copies(self)
        elif periods != (None, None) and self.replication == "global":
            raise ConfigError(
                "chain_every and global_every go with replication='chain' or 'topology' "
                "(with 'global' replication, replicate_every is the period)"
            )
        if (
            not self.live_copies
            and None not in (self.chain_every, self.replicate_every)
            and (self.chain_every != self.replicate_every)
        ):
            raise ConfigError(
                f"chain_every={self.chain_every} and replicate_every={self.replicate_every} "
                "name the same period; give one"
            )
        if self.rebalance is not None and not (self.recover and 0 < self.rebalance < 1):
            raise ConfigError(
                f"rebalance needs recover=True and a share in (0, 1), got {self.rebalance}"
            )
        check_loss(self.loss)
        check_optimizer(self.optimizer)
        object.__setattr__(self, "lr_schedule", check_lr_schedule(self.lr_schedule))
        if isinstance(self.start_step, bool) or not isinstance(self.start_step, int):
            raise ConfigError(f"start_step must be an integer >= 0, got {self.start_step!r}")
        if self.start_step < 0:
            raise ConfigError(f"start_step must be an integer >= 0, got {self.start_step}")
        # a copy: the caller's dict may change while the run goes on
        object.__setattr__(self, "optimizer", dict(self.optimizer))
        _check_count("num_microbatches", self.num_microbatches)
        _check_count("max_steps_in_flight", self.max_steps_in_flight, optional=True)
        _check_count("aggregate_multiple", self.aggregate_multiple)
        if self.schedule.lower() == ASYNC_SCHEDULE:
            if self.num_microbatches != 1:
                raise ConfigError(
                    f"{ASYNC_SCHEDULE} trains every mini-batch whole: use num_microbatches=1"
                )
            if self.start_step and not self.resume_optimizer:
                raise ConfigError(async_start_step_refusal(self.start_step))
            if self.resume_optimizer and self.live_copies:
                raise ConfigError(ASYNC_RESUME_LIVE_COPIES)
            refusal = (
                async_recovery_refusal(
                    vertical_sync=self.vertical_sync,
                    consistency=self.consistency,
                    rebalance=self.rebalance,
                    live_copies=self.live_copies,
                )
                if self.recover
                else None
            )
            if refusal is not None:
                raise ConfigError(refusal)
        object.__setattr__(self, "repartition", _repartition_settings(self))
        if self.warmups is not None:
            object.__setattr__(self, "warmups", tuple(self.warmups))
        check_warmup_policy(self.warmup)
        _normalize_placement(self)

    @property
    def repartition_settings(self) -> RepartitionSettings | None:
        """Live re-partitioning's settings (None: the partition stays)."""
        assert self.repartition is None or isinstance(self.repartition, RepartitionSettings)
        return self.repartition

    @property
    def replica_period(self) -> int | None:
        """Mini-batches between replicas (None: no replicas, the run does not recover)."""
        if not self.recover or self.fast_live_recovery:
            return None  # a fast recovery restores from the live copies: no flush
        if self.live_copies:  # the periods are the copies'; the flush replicas are global
            return self.replicate_every or DEFAULT_REPLICATE_EVERY
        return self.chain_every or self.replicate_every or DEFAULT_REPLICATE_EVERY

    @property
    def fast_live_recovery(self) -> bool:
        """Whether a stage's death is recovered FTPipeHD's way: an ``async-1f1b`` run
        with ``live_copies`` and ``consistency="fast"`` (no flush replicas; the
        survivors keep their weights, the dead's units come from their copies)."""
        return self.recover and self.live_copies and self.consistency == "fast"

    @property
    def global_period(self) -> int | None:
        """Mini-batches between global copies beside chain replicas (None: none)."""
        return self.global_every if self.recover and not self.live_copies else None

    @property
    def live_copy_periods(self) -> tuple[int, int] | None:
        """(chain, global) periods of the copies made without draining (None: none)."""
        if not self.live_copies:
            return None
        return (
            self.chain_every or DEFAULT_LIVE_CHAIN_EVERY,
            self.global_every or DEFAULT_LIVE_GLOBAL_EVERY,
        )

    @classmethod
    def from_keywords(
        cls,
        options: TrainOptions | None = None,
        keywords: Mapping[str, Any] | None = None,
        *,
        caller: str = "fit",
    ) -> TrainOptions:
        """``options`` with ``keywords`` in place of its fields (without ``options``,
        ``optimizer`` and ``num_microbatches`` are required keywords)."""
        if options is None:
            missing = [n for n in ("optimizer", "num_microbatches") if n not in (keywords or {})]
            if missing:
                raise TypeError(f"{caller}() needs the keyword arguments {', '.join(missing)}")
        return _from_keywords(cls, options, keywords or {}, caller)


def _check_live_copies(options: TrainOptions) -> None:
    if options.schedule.lower() != ASYNC_SCHEDULE:
        raise ConfigError(
            f"live_copies is for {ASYNC_SCHEDULE} runs (a synchronous run replicates at "
            "its round boundaries: use recover with replication='chain')"
        )
    if options.replication != "global":
        raise ConfigError(
            "live_copies are the chain and global copies themselves: leave replication "
            f"at 'global' (a recovering run's flush replicas), not {options.replication!r}"
        )


def _repartition_settings(options: TrainOptions) -> RepartitionSettings | None:
    """``repartition`` as settings: True takes FTPipeHD's (after 10 mini-batches, then
    every 100, a gain of 0.1); an asynchronous run needs vertical sync for them."""
    given = options.repartition
    if given is None or given is False:
        return None
    if options.recover and options.schedule.lower() != ASYNC_SCHEDULE:
        # an asynchronous run's replicas and moves share its flush points
        # (zpipe.training.async_recovery); a synchronous one rebalances at a replica
        raise ConfigError(
            "repartition moves units live; a synchronous run with recover=True "
            f"uses rebalance=... ({ASYNC_SCHEDULE} runs recover and re-partition)"
        )
    if not options.vertical_sync:
        raise ConfigError("repartition needs vertical sync (the weight versions it moves)")
    if given is True:
        return RepartitionSettings()
    if isinstance(given, RepartitionSettings):
        return given
    if isinstance(given, Mapping):
        return RepartitionSettings.from_dict(given)
    raise ConfigError(f"repartition takes True, a mapping or RepartitionSettings, not {given!r}")
