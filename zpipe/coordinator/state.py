"""What the coordinator's controllers share: membership, counters, keys, profiles, flows.

Plain data and pure methods only; the shell owns one and hands it to the core,
which hands it to each run's controller.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from zpipe.config import Timeouts
from zpipe.coordinator.bulk_links import BulkLinks
from zpipe.coordinator.current_run import KeptReplica
from zpipe.coordinator.flows import Answers, FlowRunner
from zpipe.coordinator.membership import Member, Membership
from zpipe.coordinator.runs.async_copies import HeldCopies
from zpipe.models import ModelSpec
from zpipe.planner import ClusterLink
from zpipe.planner.memory import DEFAULT_MEMORY_MARGIN
from zpipe.planner.profile import ModelProfile

CLIENT_NAME = "client"

_ProfileKey = tuple[ModelSpec, int, str, str, float, bool]


class ProfileCache:
    """Each stage's own profile of a model, kept until the stage registers again."""

    def __init__(self) -> None:
        self._profiles: dict[_ProfileKey, ModelProfile] = {}

    @staticmethod
    def _key(
        spec: ModelSpec, batch_size: int, dtype: str, member: Member, train: bool
    ) -> _ProfileKey:
        return (spec, batch_size, dtype, member.name, member.joined_at, train)

    def get(
        self, spec: ModelSpec, batch_size: int, dtype: str, member: Member, *, train: bool
    ) -> ModelProfile | None:
        return self._profiles.get(self._key(spec, batch_size, dtype, member, train))

    def put(
        self,
        spec: ModelSpec,
        batch_size: int,
        dtype: str,
        member: Member,
        profile: ModelProfile,
        *,
        train: bool,
    ) -> None:
        self._profiles[self._key(spec, batch_size, dtype, member, train)] = profile


@dataclass
class LossyInFlight:
    """A lossy run set up on its stages and not yet answered: its id, its client's route;
    ``abandoned``: its client was found gone (it no longer holds others off)."""

    run: int
    client: bytes
    abandoned: bool = False


@dataclass
class ControlState:
    """What the core and every run's controller share (the shell owns it). Not the
    state file's record: that is :class:`zpipe.protocol.storage.CoordinatorState`."""

    timeouts: Timeouts
    membership: Membership
    # the memory model's safety margin (--memory-margin; zpipe.planner.memory)
    memory_margin: float = DEFAULT_MEMORY_MARGIN
    public_keys: Mapping[str, bytes] = field(default_factory=dict)
    profiles: ProfileCache = field(default_factory=ProfileCache)
    flows: FlowRunner = field(default_factory=FlowRunner)
    epoch: int = 0
    run_counter: int = 0
    # the latest replica of a training run (FTPipeHD's global replication)
    replica: KeptReplica | None = None
    # members restored from disk that have not spoken to this process yet
    unconfirmed: set[str] = field(default_factory=set)
    # what happened to runs (deaths, recoveries), newest last
    events: list[dict[str, Any]] = field(default_factory=list)
    # whether a state directory keeps replicas on disk
    saves_replicas: bool = False
    # whether stages may still hold fetch grants (``link_peers``) of a restore or a move;
    # the next backup revokes them. True at start: a restarted coordinator cannot know
    # what an earlier one granted.
    fetch_grants_out: bool = True
    # the current run's controller (an InferenceController or a SyncTrainingController), if any
    current: Any = None
    answers: Answers = field(default_factory=Answers)
    # lossy runs waiting for their results, by run id (their stages' replicas go there:
    # zpipe.coordinator.runs.lossy_remap)
    lossy_runs: dict[int, Any] = field(default_factory=dict)
    # the lossy run whose stages are set up and not yet answered, if any: a lossy run
    # has no controller as current, and is in flight all the same (one run at a time:
    # zpipe.coordinator.one_run)
    lossy_in_flight: LossyInFlight | None = None
    # the copies asynchronous stages made without draining (kept across restarts)
    async_copies: HeldCopies = field(default_factory=HeldCopies)
    # every registered stage's bulk connection (zpipe.coordinator.bulk)
    bulk: BulkLinks = field(default_factory=BulkLinks)
    # where new bulk tokens come from (tests give a predictable one)
    new_token: Callable[[], str] = lambda: secrets.token_urlsafe(16)
    # this host's own addresses and names: a stage advertising one of them shares the
    # host of a client with a loopback sink (see zpipe.coordinator.sink_check)
    local_hosts: frozenset[str] = frozenset()
    # the links measured so far between members (the shell's cache; measures nothing):
    # re-planners cost links from them, as the planner did
    measured_links: Callable[[Sequence[Member]], Mapping[tuple[str, str], ClusterLink]] = (
        lambda members: {}
    )

    def key_of(self, name: str, client_key: str | None = None) -> str | None:
        """A peer's public key (the client's: the key it authenticated with)."""
        if name == CLIENT_NAME:
            return client_key
        key = self.public_keys.get(name)
        return key.decode() if key is not None else None

    def next_epoch(self) -> int:
        self.epoch += 1
        return self.epoch

    def next_run(self) -> int:
        self.run_counter += 1
        return self.run_counter

    def confirm(self, name: str) -> None:
        """``name`` spoke to this process, or died: it is no longer only restored."""
        self.unconfirmed.discard(name)
