"""What the coordinator knows of the current run and of its latest replica.

Both turn into plain maps and back (:meth:`Run.to_saved`, :meth:`Run.from_saved`),
so that :mod:`zpipe.coordinator.persistence` can keep them on disk and a
restarted coordinator can take the run over where the old one left it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from zpipe.planner import Plan
from zpipe.planner.training_plan import TrainingPlan
from zpipe.protocol.client_control import RunReady, RunRequest
from zpipe.training.repartition import RepartitionDecision

if TYPE_CHECKING:
    import torch


@dataclass
class Run:
    run: int
    epoch: int
    client: bytes
    plan: Plan
    client_key: str | None = None
    failed: set[str] = field(default_factory=set)
    # every device taking part (a training stage may have several)
    devices: list[str] = field(default_factory=list)
    # training with data-parallel groups: each device's all-reduce ring endpoint
    ring_endpoints: dict[str, str] = field(default_factory=dict)
    groups: list[list[str]] = field(default_factory=list)
    # inference streams: the request, to re-plan without a dead stage and replay
    request: RunRequest | None = None
    recover: bool = False
    streaming: bool = False
    # training: the plan of device groups the stages run, and the share by which a
    # re-balanced plan must shorten the measured bottleneck to be worth a restart
    training_plan: TrainingPlan | None = None
    rebalance: float | None = None
    # training: where replicas go ("global": all to the coordinator; "chain" and
    # "topology": each stage keeps a snapshot and backs it up to a neighbour)
    replication: str = "global"
    # the client takes progress notices while it waits on slow state (it offered them)
    client_progress: bool = False
    # The client's id of the request that started the run, and the coordinator's answer
    # (``run_ready``): the same request sent again after a reconnection (the answer
    # may have been lost with the connection) is answered with it, not started anew.
    request_id: str | None = None
    ready: RunReady | None = None
    # training with live re-partitions: what a restarted coordinator's controller
    # must go on from: its plan epoch (commits so far), and a look's move the client
    # paused for, not yet carried out (zpipe.coordinator.runs.async_repartition)
    repartition_epoch: int = 0
    repartition_pending: RepartitionDecision | None = None
    # Not saved. While the run is being admitted or re-planned (its stages assigned,
    # not all ready and connected) a state file keeps what it was before: ``before``,
    # or no run at all when it is None (see :meth:`saved`).
    changing: bool = field(default=False, compare=False)
    # Not saved. Being ended because its client is gone (zpipe.coordinator.admission):
    # no longer in flight; a restarted coordinator finds out again at the next request.
    abandoned: bool = field(default=False, compare=False)
    before: dict[str, Any] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.devices:
            self.devices = list(self.plan.devices)

    @property
    def broken(self) -> bool:
        """A stage of its plan was declared dead and no re-plan is under way: the run
        goes on only if its client starts it again (a training run's resume)."""
        return not self.changing and any(d in self.failed for d in self.devices)

    def begin_change(self) -> None:
        """The run's plan is about to change: until :meth:`settle`, it is saved as it is
        now. A restarted coordinator then takes over a run its stages run (and
        re-plans it again if a stage is still gone), never a plan they were only
        assigned: nobody would tell them to connect."""
        if not self.changing:
            self.before, self.changing = self.to_saved(), True

    def settle(self) -> None:
        """Every stage of the run's plan is ready (and connected, for a re-plan)."""
        self.before, self.changing = None, False

    def saved(self) -> dict[str, Any] | None:
        """The run as a state file keeps it (None: no run; see :meth:`begin_change`)."""
        return self.before if self.changing else self.to_saved()

    def to_saved(self) -> dict[str, Any]:
        """The run as plain data."""
        return {
            "run": self.run,
            "epoch": self.epoch,
            "client": self.client,
            "plan": self.plan.to_dict(),
            "client_key": self.client_key,
            "failed": sorted(self.failed),
            "devices": list(self.devices),
            "ring_endpoints": dict(self.ring_endpoints),
            "groups": [list(g) for g in self.groups],
            "request": None if self.request is None else self.request.body(),
            "recover": self.recover,
            "streaming": self.streaming,
            "training_plan": (None if self.training_plan is None else self.training_plan.to_dict()),
            "rebalance": self.rebalance,
            "replication": self.replication,
            "client_progress": self.client_progress,
            "request_id": self.request_id,
            "repartition": {
                "plan_epoch": self.repartition_epoch,
                "pending": (
                    None if self.repartition_pending is None else self.repartition_pending.to_dict()
                ),
            },
            "ready": (
                None
                if self.ready is None
                else {"body": self.ready.body(), "epoch": self.ready.epoch}
            ),
        }

    @classmethod
    def from_saved(cls, data: Mapping[str, Any]) -> Run:
        request = data.get("request")
        tplan = data.get("training_plan")
        ready = data.get("ready")  # absent from the files of older coordinators
        request_id = data.get("request_id")
        repartition = dict(data.get("repartition") or {})
        pending = repartition.get("pending")
        return cls(
            run=int(data["run"]),
            epoch=int(data["epoch"]),
            client=bytes(data["client"]),
            plan=Plan.from_dict(data["plan"]),
            client_key=None if data.get("client_key") is None else str(data["client_key"]),
            failed={str(d) for d in data.get("failed") or ()},
            devices=[str(d) for d in data["devices"]],
            ring_endpoints={str(k): str(v) for k, v in dict(data["ring_endpoints"]).items()},
            groups=[[str(d) for d in g] for g in data["groups"]],
            request=None if request is None else RunRequest.from_body(request),
            recover=bool(data["recover"]),
            streaming=bool(data["streaming"]),
            training_plan=None if tplan is None else TrainingPlan.from_dict(tplan),
            rebalance=None if data.get("rebalance") is None else float(data["rebalance"]),
            replication=str(data.get("replication") or "global"),
            client_progress=bool(data.get("client_progress", False)),
            request_id=None if request_id is None else str(request_id),
            repartition_epoch=int(repartition.get("plan_epoch") or 0),
            repartition_pending=None if pending is None else _decision(pending),
            ready=(
                None
                if ready is None
                else RunReady.from_body(ready["body"], epoch=int(ready["epoch"]))
            ),
        )


def _decision(data: Mapping[str, Any]) -> RepartitionDecision:
    """A look's decision as :meth:`RepartitionDecision.to_dict` wrote it."""
    bounds = data.get("bounds")
    return RepartitionDecision(
        at=int(data["at"]),
        current=tuple(int(b) for b in data["current"]),
        bounds=None if bounds is None else tuple(int(b) for b in bounds),
        period_s=float(data["period_s"]),
        new_period_s=float(data["new_period_s"]),
        measured=bool(data["measured"]),
        capacities={str(d): float(c) for d, c in dict(data.get("capacities") or {}).items()},
        fixed_s={str(d): float(f) for d, f in dict(data.get("fixed_s") or {}).items()},
        reason=str(data.get("reason") or ""),
        devices=None if data.get("devices") is None else tuple(str(d) for d in data["devices"]),
    )


@dataclass(frozen=True)
class KeptReplica:
    """A replica of training run ``run`` after mini-batch ``step``, and the plan it was
    taken under. A global replica (FTPipeHD) holds every unit's weights and
    optimizer state in ``state``; a chain or topology replica holds here only what
    was backed up to the coordinator, the rest being snapshots the stages keep:
    each device its own, and ``holders[device]`` a backup of it. Chain replication
    with a global copy (FTPipeHD runs both) holds every unit here at the steps the
    global copy was taken; between them ``fallback`` is the newest such replica,
    older, which a recovery takes when the chain copies of some unit all died."""

    run: int
    step: int
    plan: TrainingPlan
    state: dict[str, torch.Tensor]
    holders: Mapping[str, str] = field(default_factory=dict)
    fallback: KeptReplica | None = None
    # every unit's state is here (None: as the holders say, none for a global replica)
    global_copy: bool | None = None
    # `fast` consistency: the survivors' newest state was merged in here; the stages'
    # snapshots are older than it and serve only the units no survivor sent
    fast: bool = False

    @property
    def at_stages(self) -> bool:
        return bool(self.holders)

    @property
    def complete(self) -> bool:
        """Whether every unit's state is here (a global copy)."""
        return not self.holders if self.global_copy is None else self.global_copy

    def newest_global(self) -> KeptReplica | None:
        """This replica if it holds every unit here, else its fallback."""
        return self if self.complete else self.fallback
