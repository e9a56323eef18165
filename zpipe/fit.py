"""Training a model across the cluster from Python: the client side of a training run.

``await client.fit(spec, batches, optimizer={...}, num_microbatches=4)`` asks
the coordinator for a training run, feeds each mini-batch's micro-batches to
the first stage and their labels to the last, collects the per-micro-batch
losses, and at the end gathers the trained weights (through the coordinator)
into one state dict with the full model's keys, which
:meth:`TrainReport.model` loads into ``build_full_model(spec)``.

Each item of ``batches`` is one mini-batch ``(inputs..., labels)``: the last
tensor is the labels, the others the model's inputs. A mini-batch is split
into exactly ``num_microbatches`` parts (sizes differ by at most one), and one
optimizer step follows each mini-batch, so the result equals single-process
training on the same mini-batches (up to float summation order).

With ``recover=True`` a run survives the death of a stage, exactly: every
``replicate_every`` mini-batches (and before the first) the pipeline drains
and the coordinator keeps a global replica of every unit's weights and
optimizer state (FTPipeHD's global replication). When a stage dies, the
client starts the run again over the survivors from that replica, planned by
``recovery`` (see :data:`zpipe.recovery.POLICIES`), and replays the
mini-batches since it, which it keeps until the next replica. The trained
model then equals an uninterrupted run's.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import zmq
from tqdm import tqdm

from zpipe._errors import (
    ConfigError,
    PipelineError,
    ProtocolError,
    RemoteStageError,
    StageFailedError,
    TransportTimeout,
)
from zpipe.log import get_logger
from zpipe.models import ModelSpec, build_full_model
from zpipe.models.weights import save_weights
from zpipe.planner import Plan
from zpipe.planner.training_plan import TrainingPlan
from zpipe.recovery import DEFAULT_STALL_DEADLINE, REPLICATIONS, DeadlinePolicy, StallWatch
from zpipe.recovery import POLICIES as RECOVERY_POLICIES
from zpipe.training.objectives import check_loss, check_optimizer
from zpipe.training.routing import split_rows
from zpipe.transport import security
from zpipe.transport.codec import Message
from zpipe.transport.sockets import open_socket, recv_frames, send

if TYPE_CHECKING:
    from zpipe.client import PipelineClient

log = get_logger("zpipe.fit")

CLIENT_NAME = "client"
Batch = Sequence[torch.Tensor]


@dataclass
class TrainReport:
    run: int
    plan: Plan
    model_spec: ModelSpec
    schedule: str
    num_microbatches: int
    training_plan: TrainingPlan | None = None
    losses: list[float] = field(default_factory=list)  # the mean loss of each mini-batch
    samples: int = 0  # samples trained (after a recovery, replays count again)
    elapsed_s: float = 0.0
    state_dict: dict[str, torch.Tensor] = field(default_factory=dict)
    stages: dict[str, Any] = field(default_factory=dict)
    # one entry per stage lost mid-run (recover=True): who, when, what was replayed
    recoveries: list[dict[str, Any]] = field(default_factory=list)
    # mini-batches after which the coordinator kept a global replica
    replicas: list[int] = field(default_factory=list)
    # plans the run moved to at a replica because the stages' speeds changed
    rebalances: list[dict[str, Any]] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return len(self.losses)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def model(self) -> torch.nn.Module:
        """The trained model, in one process (``build_full_model(spec)`` + the weights)."""
        full = build_full_model(self.model_spec)
        full.load_state_dict(self.state_dict)
        return full

    def save(self, path: str | Path) -> None:
        """Write the trained weights (.safetensors or .pt), loadable with ``ModelSpec.weights``."""
        save_weights(self.model(), path)


def split_minibatch(batch: Batch, num_microbatches: int) -> list[tuple[torch.Tensor, ...]]:
    """``num_microbatches`` parts along dim 0, sizes differing by at most one."""
    tensors = tuple(batch)
    if len(tensors) < 2 or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise ConfigError("a training batch is a sequence of tensors: (inputs..., labels)")
    sizes = {int(t.shape[0]) if t.dim() > 0 else -1 for t in tensors}
    if len(sizes) != 1 or -1 in sizes:
        raise ConfigError(f"every tensor of a batch needs the same batch size, got {sizes}")
    (size,) = sizes
    if size < num_microbatches:
        raise ConfigError(
            f"a mini-batch of {size} samples cannot be split into {num_microbatches} "
            "micro-batches; drop the last incomplete batch (drop_last=True) or use fewer"
        )
    parts = [torch.tensor_split(t, num_microbatches) for t in tensors]
    return [tuple(p[i].contiguous() for p in parts) for i in range(num_microbatches)]


async def fit(
    client: PipelineClient,
    model: ModelSpec,
    batches: Iterable[Batch] | AsyncIterable[Batch],
    *,
    optimizer: Mapping[str, Any],
    num_microbatches: int,
    loss: str = "cross_entropy",
    schedule: str = "1f1b",
    warmups: Sequence[int] | None = None,
    plan: TrainingPlan | None = None,
    partition: Sequence[Sequence[int]] | None = None,
    stages: int | None = None,
    stage_names: Sequence[str] | None = None,
    planner: str | None = None,
    microbatch_size: int | None = None,
    wait_for_stages_s: float = 30.0,
    max_steps_in_flight: int = 2,
    progress: bool | None = None,
    on_step: Callable[[int, float], None] | None = None,
    recover: bool = False,
    replicate_every: int | None = None,
    recovery: str = "lightweight",
    rebalance: float | None = None,
    consistency: str = "exact",
    stall_deadline: DeadlinePolicy | None = None,
    replication: str = "global",
) -> TrainReport:
    """Train ``model`` on ``batches``; returns the losses and the trained weights.

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
    :data:`DEFAULT_STALL_DEADLINE`). A dead stage is then found without waiting for
    its heartbeats to lapse; a slow one answers the probe and stays.
    ``replication`` (with ``recover``): where replicas go. "global" (FTPipeHD's
    global replication): every unit's state to the coordinator. "chain" (FTPipeHD's
    chain replication): each device keeps a snapshot and each stage backs it up to
    the next stage, the last to the coordinator; "topology" (Asteroid): the same,
    the last stage backing up to the first, and a data-parallel stage keeping no
    backup (a surviving member restores it). After a failure the stages fetch their
    units from those snapshots directly (the coordinator sends only what it holds);
    a stage whose snapshot and backup holder are both lost cannot be recovered.
    """
    if replication not in REPLICATIONS:
        raise ConfigError(
            f"unknown replication {replication!r}; choose one of {', '.join(REPLICATIONS)}"
        )
    if consistency not in CONSISTENCIES:
        raise ConfigError(
            f"unknown consistency {consistency!r}; choose one of {', '.join(CONSISTENCIES)}"
        )
    if recovery not in RECOVERY_POLICIES:
        raise ConfigError(
            f"unknown recovery {recovery!r}; choose one of {', '.join(RECOVERY_POLICIES)}"
        )
    if replicate_every is not None and (isinstance(replicate_every, bool) or replicate_every < 1):
        raise ConfigError(f"replicate_every must be >= 1, got {replicate_every}")
    if rebalance is not None and not (recover and 0 < rebalance < 1):
        raise ConfigError(f"rebalance needs recover=True and a share in (0, 1), got {rebalance}")
    if client._control is None or client._sink is None or client._context is None:
        raise PipelineError("open() the client first")
    check_loss(loss)
    check_optimizer(optimizer)
    if isinstance(num_microbatches, bool) or num_microbatches < 1:
        raise ConfigError(f"num_microbatches must be >= 1, got {num_microbatches}")
    if max_steps_in_flight < 1:
        raise ConfigError(f"max_steps_in_flight must be >= 1, got {max_steps_in_flight}")
    every = (replicate_every or DEFAULT_REPLICATE_EVERY) if recover else None
    if microbatch_size is None and isinstance(batches, Sequence) and batches:
        first = batches[0]
        if first and isinstance(first[0], torch.Tensor) and first[0].dim() > 0:
            microbatch_size = -(-int(first[0].shape[0]) // num_microbatches)
    if planner is None:
        planner = "hpp" if microbatch_size is not None else "pipeedge"
    request: dict[str, Any] = {
        "model": model.to_dict(),
        "partition": [list(r) for r in partition] if partition is not None else None,
        "stages": stages,
        "stage_names": list(stage_names) if stage_names is not None else None,
        "dtype": "float32",
        "planner": planner,
        "microbatch_size": microbatch_size,
        "sink_endpoint": client.sink_endpoint,
        "wait_for_stages_s": float(wait_for_stages_s),
        "mode": "train",
        "rebalance": rebalance,
        "replication": replication,
        # at a replica, devices of these that register (again) may join the plan
        "admit": list(stage_names) if stage_names is not None else None,
        "train": {
            "schedule": schedule,
            "num_microbatches": num_microbatches,
            "loss": loss,
            "optimizer": dict(optimizer),
            "warmups": list(warmups) if warmups is not None else None,
            "plan": plan.to_dict() if plan is not None else None,
        },
    }
    source = _BatchSource(batches)
    done: list[float] = []  # the losses of the mini-batches before this attempt's first
    recoveries: list[dict[str, Any]] = []
    earlier_samples, first_started = 0, None  # of the attempts that failed
    rebalances: list[dict[str, Any]] = []
    while True:
        reply = await client._control.request(
            Message("run_request", request),
            expect=("run_ready", "run_failed"),
            timeout_s=wait_for_stages_s + client.timeouts.assign_s + client.timeouts.reply_s,
            awaited="run_ready",
        )
        if reply.kind == "run_failed":
            raise PipelineError(
                f"the coordinator could not start the training run: {reply['error']}"
            )
        if plan is not None:
            schedule, num_microbatches = plan.schedule, plan.num_microbatches
        run = _TrainRun(client, reply, model, schedule, num_microbatches, max_steps_in_flight)
        run.stall = StallWatch(stall_deadline or DEFAULT_STALL_DEADLINE)
        run.offset, run.replicate_every = source.kept_from, every
        if recoveries:
            recoveries[-1]["restart_s"] = time.monotonic() - recoveries[-1]["noticed_at"]
        try:
            started = await client._control.request(
                Message("run_go", {"run": run.run}),
                expect=("run_started", "run_failed"),
                timeout_s=client.timeouts.reply_s * 2,
                awaited="run_started",
            )
            if started.kind == "run_failed":
                raise PipelineError(f"the coordinator could not start the run: {started['error']}")
            try:
                await run.train(source, progress, on_step)
            except _Rebalance as move:
                done = (done + run.report.losses)[: source.replica_step]
                earlier_samples += run.report.samples
                first_started = first_started or run.started
                rebalances.append({"at": source.replica_step, "plan": move.plan.to_dict()})
                assert source.resume is not None
                request = {
                    **request,
                    "partition": None,
                    "stages": None,
                    "stage_names": list(move.plan.devices),
                    "resume": {"run": source.resume[0], "step": source.resume[1], "dead": []},
                    "train": {**request["train"], "plan": move.plan.to_dict()},
                }
                plan = move.plan
                continue
            try:
                await run.gather_weights()
            except PipelineError:
                # A stage that dies after the last mini-batch fails the gather; with
                # recover, the run resumes from its replica as for any other death.
                failure = None
                if every is not None:
                    failure = await run.stage_failure_within(client.timeouts.reply_s)
                if failure is None:
                    raise
                raise failure from None
            # The last round ends when every stage has stepped, which the gather waited for.
            run.report.elapsed_s = time.perf_counter() - run.started
        except StageFailedError as failure:
            if every is None or source.resume is None:
                raise
            tplan = run.report.training_plan
            assert tplan is not None
            dead = sorted({*(r["dead"] for r in recoveries), failure.stage})
            survivors = [d for d in tplan.devices if d not in dead]
            if not survivors:
                raise
            if consistency == "fast":
                # Every completed mini-batch stays: only those in flight go again.
                done = done + run.report.losses
                source.forget_before(len(done))
            else:
                # What the replica holds stays; what came after it is trained again.
                done = (done + run.report.losses)[: source.replica_step]
            earlier_samples += run.report.samples
            first_started = first_started or run.started
            recoveries.append(
                {
                    "dead": failure.stage,
                    "reason": failure.reason,
                    "noticed_at": time.monotonic(),
                    "resumed_from": source.kept_from,
                    "replica": source.replica_step,
                    "replayed": len(source.kept),
                    "policy": recovery,
                    "consistency": consistency,
                }
            )
            log.warning(
                "training_recovering",
                run=run.run,
                dead=failure.stage,
                resume_from=source.kept_from,
                consistency=consistency,
                replay=len(source.kept),
                policy=recovery,
            )
            request = _resume_request(
                request, survivors, dead, recovery, source.resume, consistency
            )
            plan = None
            continue
        finally:
            await run.close()
        break
    report = await client._control.request(
        Message("run_end", {"run": run.run}),
        expect=("run_report",),
        timeout_s=client.timeouts.reply_s * 2,
        awaited="run report",
        resend_on_reconnect=True,
    )
    run.report.stages = dict(report["stages"])
    run.report.losses = done + run.report.losses
    if first_started is not None:
        # the whole fit, failed attempts included: samples count replays again
        run.report.samples += earlier_samples
        run.report.elapsed_s += run.started - first_started
    run.report.recoveries = recoveries
    run.report.rebalances = rebalances
    run.report.replicas = list(source.replicas)
    return run.report


# FTPipeHD replicates globally every 100 mini-batches and along the chain every 50.
DEFAULT_REPLICATE_EVERY = 50
# how a recovery treats the work since the replica (see fit's ``consistency``)
CONSISTENCIES = ("exact", "fast")


def _resume_request(
    request: dict[str, Any],
    survivors: list[str],
    dead: list[str],
    recovery: str,
    resume: tuple[int, int],
    consistency: str,
) -> dict[str, Any]:
    """The run request that resumes from the replica over the survivors."""
    resumed = {
        **request,
        "partition": None,
        "stages": None,
        "stage_names": survivors,
        "recovery": recovery,
        "resume": {"run": resume[0], "step": resume[1], "dead": dead, "consistency": consistency},
        "train": {**request["train"], "plan": None},
    }
    if request["partition"] is not None or request["train"].get("plan") is not None:
        # The user's own partition named the dead: plan the survivors ("heavy") instead.
        resumed["planner"] = "hpp" if request["microbatch_size"] is not None else "even"
    return resumed


class _Rebalance(Exception):
    """The coordinator proposes a better-balanced plan at the replica just kept."""

    def __init__(self, plan: TrainingPlan) -> None:
        super().__init__("rebalance")
        self.plan = plan


_END = object()


class _BatchSource:
    """The mini-batches, once each, and those since the last replica, kept to replay.

    ``replica_step``: the mini-batch the coordinator's replica was taken before
    (every mini-batch before it is in the replica); ``resume``: that replica's
    (run, the run's own step); ``kept_from``: the mini-batch ``kept[0]`` is, where
    the next attempt starts (the replica's, or with `fast` consistency the first
    mini-batch that had not completed).
    """

    def __init__(self, batches: Iterable[Batch] | AsyncIterable[Batch]) -> None:
        self._sync: Iterator[Batch] | None = None
        self._async: AsyncIterator[Batch] | None = None
        if isinstance(batches, AsyncIterable):
            self._async = aiter(batches)
        else:
            self._sync = iter(batches)
        self._pending: asyncio.Future[Any] | None = None
        self.kept: list[Batch] = []
        self.kept_from = 0
        self.replica_step = 0
        self.resume: tuple[int, int] | None = None
        self.replicas: list[int] = []

    def forget_before(self, step: int) -> None:
        """Mini-batches before ``step`` will not be trained again."""
        self.kept = self.kept[step - self.kept_from :]
        self.kept_from = step

    async def iterate(self) -> AsyncIterator[Batch]:
        """The kept mini-batches again, then new ones (kept too)."""
        for batch in list(self.kept):
            yield batch
        while True:
            batch = await self._next()
            if batch is _END:
                return
            self.kept.append(batch)
            yield batch

    async def _next(self) -> Any:
        if self._sync is not None:
            return next(self._sync, _END)
        assert self._async is not None
        if self._pending is None:
            self._pending = asyncio.ensure_future(anext(self._async, _END))
        # Shielded: a recovery may cancel the feed while the source makes its next
        # batch; that batch then goes to the next attempt instead of being lost.
        batch = await asyncio.shield(self._pending)
        self._pending = None
        return batch

    def replicated(self, step: int, run: int, run_step: int) -> None:
        """The coordinator holds a replica taken before mini-batch ``step``."""
        self.forget_before(step)
        self.replica_step = step
        self.resume = (run, run_step)
        self.replicas.append(step)


class _TrainRun:
    def __init__(
        self,
        client: PipelineClient,
        ready: Message,
        spec: ModelSpec,
        schedule: str,
        num_microbatches: int,
        max_steps_in_flight: int,
    ) -> None:
        assert client._context is not None
        self.client = client
        self.run = int(ready["run"])
        self.epoch = ready.epoch
        self.first_stage = str(ready["first_stage"])
        self.last_stage = str(ready["last_stage"])
        self.m = num_microbatches
        self.report = TrainReport(
            run=self.run,
            plan=Plan.from_dict(ready["plan"]),
            model_spec=spec,
            schedule=schedule,
            num_microbatches=num_microbatches,
        )
        described = ready.get("training_plan")
        if not isinstance(described, dict):
            raise PipelineError("the coordinator sent no training plan")
        tplan = TrainingPlan.from_dict(described)
        self.report.training_plan = tplan
        endpoints, keys = dict(described["endpoints"]), dict(described["keys"])
        first, last = tplan.stages[0], tplan.stages[-1]
        # (device, its shares' group, socket): inputs go to the first group, labels to the last
        self.first_group = [(n, self._push(str(endpoints[n]), keys.get(n))) for n in first.devices]
        self.first_shares = list(first.shares)
        self.last_group = [(n, self._push(str(endpoints[n]), keys.get(n))) for n in last.devices]
        self.last_shares = list(last.shares)
        self.last_names = set(last.devices)
        if client._sink_allow is not None:
            client._sink_allow.replace([str(keys[n]).encode() for n in last.devices if keys.get(n)])
        self.window = asyncio.Semaphore(max_steps_in_flight)
        self.started = time.perf_counter()
        self.step_losses: dict[int, list[float]] = {}
        self.losses_per_step = self.m * len(self.last_group)
        self.sent_steps = 0
        self.done_steps = 0
        self.all_sent = asyncio.Event()
        self.finished = asyncio.Event()
        self.step_finished = asyncio.Event()
        self.stage_failure: StageFailedError | None = None
        self.failure_seen = asyncio.Event()
        # the first mini-batch's number across recoveries, and the replica period
        self.offset = 0
        self.replicate_every: int | None = None
        self.tasks: list[asyncio.Task[None]] = []
        self.stall = StallWatch(DEFAULT_STALL_DEADLINE)

    def _push(self, endpoint: str, key: object) -> zmq.asyncio.Socket:
        client = self.client
        assert client._context is not None
        sock = open_socket(client._context, zmq.PUSH, client.options)
        if client._keypair is not None:
            if not key:
                raise PipelineError(f"the coordinator sent no key for {endpoint}")
            security.secure_client(sock, client._keypair, str(key).encode())
        sock.connect(endpoint)
        return sock

    async def train(
        self,
        source: _BatchSource,
        progress: bool | None,
        on_step: Callable[[int, float], None] | None,
    ) -> None:
        bar = tqdm(unit="batch", desc=f"training run {self.run}", disable=_no_bar(progress))
        self.started = started = time.perf_counter()
        failure: asyncio.Queue[BaseException] = asyncio.Queue()

        def step_done(step: int, loss: float) -> None:
            bar.update(1)
            elapsed = time.perf_counter() - started
            bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{self.report.samples / elapsed:.1f}")
            if on_step is not None:
                on_step(self.offset + step, loss)

        async def guarded(coro: Any) -> None:
            try:
                await coro
            except BaseException as exc:
                if not isinstance(exc, asyncio.CancelledError):
                    failure.put_nowait(exc)
                raise

        control = self.client._control
        assert control is not None
        self.tasks = [
            asyncio.create_task(guarded(self._feed(source))),
            asyncio.create_task(guarded(self._drain(step_done))),
            asyncio.create_task(guarded(self._watch_failures())),
            asyncio.create_task(
                guarded(control.report_stalls(self.stall, lambda: self.run, "training"))
            ),
        ]
        done = asyncio.create_task(self.finished.wait())
        failed = asyncio.create_task(failure.get())
        try:
            await asyncio.wait({done, failed}, return_when=asyncio.FIRST_COMPLETED)
            if failed.done():
                raise failed.result()
        finally:
            done.cancel()
            failed.cancel()
            bar.close()

    async def _feed(self, source: _BatchSource) -> None:
        async for batch in source.iterate():
            step, every = self.offset + self.sent_steps, self.replicate_every
            # a replica before every ``every``-th mini-batch, the first one included,
            # unless this run resumed from the one taken there
            fresh = source.resume is None or source.replica_step != step
            if every is not None and step % every == 0 and fresh:
                await self._replicate(source)
            await self._send_minibatch(batch)
        self.all_sent.set()
        if self.done_steps == self.sent_steps:
            self.finished.set()

    async def _replicate(self, source: _BatchSource) -> None:
        """Drain the pipeline and have the coordinator keep a replica of every stage."""
        timeout = self.client.timeouts.result_s
        while self.done_steps < self.sent_steps:
            self.step_finished.clear()
            try:
                await asyncio.wait_for(self.step_finished.wait(), timeout)
            except asyncio.TimeoutError:
                raise TransportTimeout(
                    self.last_stage, "the losses before a replica", timeout
                ) from None
        control = self.client._control
        assert control is not None
        reply = await control.request(
            Message("replicate", {"run": self.run, "step": self.done_steps}),
            expect=("replicated",),
            timeout_s=timeout + self.client.timeouts.reply_s,
            awaited="the replica",
            resend_on_reconnect=True,
        )
        if reply["error"]:
            # The previous replica still stands; a recovery replays a little more.
            log.warning("replica_not_kept", run=self.run, error=reply["error"])
            return
        source.replicated(self.offset + self.done_steps, self.run, self.done_steps)
        if reply.get("rebalance") is not None:
            raise _Rebalance(TrainingPlan.from_dict(reply["rebalance"]))
        log.info("replica_kept", run=self.run, step=self.offset + self.done_steps,
                 nbytes=reply["bytes"])  # fmt: skip

    async def _send_minibatch(self, batch: Batch) -> None:
        parts = split_minibatch(batch, self.m)
        samples = int(batch[0].shape[0])
        await self.window.acquire()  # at most max_steps_in_flight mini-batches outstanding
        step = self.sent_steps
        self.sent_steps += 1
        self.stall.sent(time.monotonic())
        self.report.samples += samples
        for i, part in enumerate(parts):
            mb = step * self.m + i
            total = int(part[0].shape[0])
            labels = part[-1:]
            for (name, sock), (lo, hi) in zip(
                self.last_group, split_rows(total, self.last_shares), strict=True
            ):
                body = {"run": self.run, "mb": mb, "src": CLIENT_NAME, "rows": [lo, hi]}
                body.update(total=total, samples=samples)
                rows = tuple(t[lo:hi] for t in labels) if hi > lo else ()
                await self._send(
                    sock, Message("labels", body, epoch=self.epoch, tensors=rows), name
                )
            inputs = part[:-1]
            for (name, sock), (lo, hi) in zip(
                self.first_group, split_rows(total, self.first_shares), strict=True
            ):
                body = {"run": self.run, "mb": mb, "src": CLIENT_NAME, "rows": [lo, hi]}
                body["total"] = total
                rows = tuple(t[lo:hi] for t in inputs) if hi > lo else ()
                await self._send(sock, Message("data", body, epoch=self.epoch, tensors=rows), name)

    async def _send(self, sock: zmq.asyncio.Socket, message: Message, peer: str) -> None:
        await send(sock, message, timeout_s=self.client.timeouts.send_s, peer=peer)

    async def _drain(self, step_done: Callable[[int, float], None]) -> None:
        sink = self.client._sink
        assert sink is not None
        while True:
            try:
                frames = await recv_frames(
                    sink,
                    timeout_s=self.client.timeouts.result_s,
                    peer=self.last_stage,
                    awaited="the losses of the next mini-batch",
                )
            except TransportTimeout:
                if self.done_steps < self.sent_steps:
                    raise
                continue  # nothing was in flight (a replica drained the pipeline): no loss due
            try:
                message = self.client.decode_sink_message(frames)
                self._check(message)
            except ProtocolError as exc:
                log.warning("dropped_message", peer=self.last_stage, error=str(exc))
                continue
            if message.kind == "error":
                raise RemoteStageError(
                    str(message["stage"]), int(message["mb"]), message["message"]
                )
            step = int(message["step"])
            losses = self.step_losses.setdefault(step, [])
            losses.append(float(message["loss"]))
            if len(losses) == self.losses_per_step:
                # Steps finish in order: a stage runs its rounds one after another.
                loss = sum(self.step_losses.pop(step))
                self.report.losses.append(loss)
                self.done_steps += 1
                self.stall.completed(time.monotonic())
                self.step_finished.set()
                self.window.release()
                step_done(step, loss)
                if self.all_sent.is_set() and self.done_steps == self.sent_steps:
                    self.finished.set()

    def _check(self, message: Message) -> None:
        if message.kind not in ("loss", "error"):
            raise ProtocolError(f"{message.kind!r} does not belong on a training sink")
        if message.epoch != self.epoch or message["run"] != self.run:
            raise ProtocolError(f"a message of epoch {message.epoch}, expected {self.epoch}")
        if message.kind == "loss":
            if message["src"] not in self.last_names:
                raise ProtocolError(f"a loss from {message['src']!r}, not a last-stage device")
            step = int(message["step"])
            if not self.done_steps <= step < self.sent_steps:
                raise ProtocolError(f"a loss for mini-batch {step}, which is not in flight")

    async def _watch_failures(self) -> None:
        control = self.client._control
        assert control is not None
        while True:
            notice = await control.failures.get()
            if notice["run"] == self.run:
                self.stage_failure = StageFailedError(str(notice["stage"]), str(notice["reason"]))
                self.failure_seen.set()
                raise self.stage_failure

    async def stage_failure_within(self, timeout_s: float) -> StageFailedError | None:
        """The death of one of the run's stages, if the coordinator reports one in time."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.failure_seen.wait(), timeout_s)
        return self.stage_failure

    async def gather_weights(self) -> None:
        control = self.client._control
        assert control is not None
        reply = await control.request(
            Message("weights_request", {"run": self.run, "step": self.done_steps}),
            expect=("checkpoint", "run_failed"),
            timeout_s=self.client.timeouts.result_s + self.client.timeouts.reply_s,
            awaited="the trained weights",
            resend_on_reconnect=True,
        )
        if reply.kind == "run_failed":
            raise PipelineError(f"could not gather the trained weights: {reply['error']}")
        keys = [str(k) for k in reply["keys"]]
        if len(keys) != len(reply.tensors):
            raise ProtocolError("the checkpoint's keys and tensors do not match")
        state: dict[str, torch.Tensor] = {}
        for key, tensor in zip(keys, reply.tensors, strict=True):
            kept = state.get(key)
            if kept is None:
                # A copy: the received frame's memory belongs to a zmq message.
                state[key] = tensor.clone()
            elif not tensor.is_floating_point():
                # Counters such as BatchNorm's num_batches_tracked count the forwards each
                # replica ran (none for a share of 0): keep the largest.
                state[key] = torch.maximum(kept, tensor)
            elif not torch.equal(kept, tensor):
                # Every device of a data-parallel group must hold the same weights.
                raise PipelineError(f"the replicas of {key} differ after training")
        self.report.state_dict = state

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for _, sock in [*self.first_group, *self.last_group]:
            sock.close(linger=0)


def _no_bar(progress: bool | None) -> bool | None:
    # tqdm: disable=None hides the bar when stderr is not a terminal
    if progress is None:
        return None
    return not progress
