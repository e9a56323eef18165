"""Every registered stage's bulk link: its token, its bulk connection, its transfers. Plain data.

See :mod:`zpipe.coordinator.bulk` for what the coordinator does with them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from zpipe.config import Timeouts
from zpipe.coordinator.bulk_budget import Planned, planned_budget, planned_state
from zpipe.transport.bulk import Inbox, stall_after_s
from zpipe.transport.codec import DEFAULT_MAX_MESSAGE_BYTES, Message

# Transfers refused whose later chunks are not answered again, per connection.
_REFUSED_REMEMBERED = 64


@dataclass
class BulkLink:
    """One registered stage's bulk side: its token and, once opened, its connection."""

    name: str
    token: str
    control_route: bytes
    inbox: Inbox
    route: bytes | None = None


@dataclass(frozen=True)
class Expired:
    """A transfer of stage ``name`` dropped for want of a chunk (``received``: its
    bytes that had arrived, freed)."""

    name: str
    transfer: int
    received: int


@dataclass
class BulkLinks:
    """Every stage's bulk link, by name. ``cap_bytes``: the most one transfer may carry;
    ``budget_bytes``: the most a stage's open transfers may announce together (None:
    ``cap_bytes``; less for a stage that reports less usable memory); ``stall_s``: how
    long a transfer is kept without a chunk."""

    cap_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    budget_bytes: int | None = None
    stall_s: float = stall_after_s(Timeouts().send_s)
    # Per stage, the parameter bytes of the units the current run's plan gives it
    # (zpipe.coordinator.bulk_budget); None: no run planned (the rule before a plan).
    planned: Planned | None = None
    _links: dict[str, BulkLink] = field(default_factory=dict)
    _refused: dict[bytes, list[int]] = field(default_factory=dict)
    _planned_for: Any = None  # the run and plan ``planned`` was sized for

    def budget_for(self, memory_mb: object) -> int:
        """What the open transfers of a stage that reports ``memory_mb`` of usable
        memory may announce: ``budget_bytes``, and no more than twice what the stage
        can hold (its state, and a copy of it in flight beside: an asynchronous copy
        while its weights go)."""
        budget = self.cap_bytes if self.budget_bytes is None else self.budget_bytes
        if isinstance(memory_mb, int | float) and not isinstance(memory_mb, bool):
            if math.isfinite(memory_mb) and memory_mb > 0:
                budget = min(budget, int(2 * memory_mb * (1 << 20)))
        return budget

    def budget_of(self, name: str, memory_mb: object) -> int:
        """Stage ``name``'s budget: :meth:`budget_for`, and once a run is planned no more
        than the state of the units it holds allows (none: the margin only)."""
        base = self.budget_for(memory_mb)
        if self.planned is None:
            return base
        return planned_budget(self.planned.get(name, 0), base)

    def plan(self, run: Any, model: Mapping[str, Any] | None) -> None:
        """The current run (None: none) and its model's spec: size what each stage
        holds, once per plan."""
        key = None if run is None else (run.run, run.epoch, run.plan, run.training_plan)
        if key == self._planned_for and (key is None) == (self.planned is None):
            return
        self._planned_for = key
        self.planned = planned_state(run, model)

    def issue(
        self, name: str, token: str, control_route: bytes, *, memory_mb: object = None
    ) -> str:
        """A stage (re)registered: the token it is to use. A registration sent again on
        the same connection (its first answer was slow) keeps the token it was given,
        so the answers a stage sees in any order all name one token; transfers in
        progress are void either way."""
        link = self._links.get(name)
        if link is not None and link.control_route == control_route:
            link.inbox.clear()
            return link.token
        inbox = Inbox(
            cap_bytes=self.cap_bytes, budget_bytes=self.budget_for(memory_mb), stall_s=self.stall_s
        )
        self._links[name] = BulkLink(name, token, control_route, inbox)
        return token

    def drop_transfers(self, name: str) -> int:
        """Forget the transfers stage ``name`` has in progress (it died: nothing it
        left half-sent will be finished); the bytes of them that had arrived."""
        link = self._links.get(name)
        if link is None:
            return 0
        dropped = link.inbox.received_bytes
        link.inbox.clear()
        return dropped

    def expire(self, now: float) -> list[Expired]:
        """Drop every transfer with no chunk for ``stall_s`` by ``now``."""
        return [
            Expired(link.name, transfer, received)
            for link in self._links.values()
            for transfer, received in link.inbox.expire(now)
        ]

    def get(self, name: str) -> BulkLink | None:
        return self._links.get(name)

    def route_for(self, control_route: bytes, message: Message) -> BulkLink | None:
        """The open bulk link a message to ``control_route`` goes through instead: one
        that carries tensors, to a stage whose bulk connection is open."""
        if not message.tensors:
            return None
        for link in self._links.values():
            if link.control_route == control_route and link.route is not None:
                return link
        return None

    def refuse_once(self, route: bytes, transfer: int) -> bool:
        """Whether a refusal of ``transfer`` on ``route`` is the first (it is answered once)."""
        refused = self._refused.setdefault(route, [])
        if transfer in refused:
            return False
        refused.append(transfer)
        del refused[:-_REFUSED_REMEMBERED]
        if len(self._refused) > _REFUSED_REMEMBERED:
            self._refused.pop(next(iter(self._refused)))
        return True
