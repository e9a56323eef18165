"""Asynchronous 1F1B (PipeDream, FTPipeHD): each stage's action list and weight versions.

Pure: no I/O, no asyncio, no torch. Every mini-batch ("batch" here, FTPipeHD's word)
goes through the pipeline once; every stage runs one forward, one backward, and an
optimizer step after each backward, so a stage never waits for a round to end.
Stage ``i`` of ``n`` first forwards ``n - i`` batches (its warm-up), then alternates
one backward and one forward. P = 3 stages, forward and backward one tick each::

    stage 0 |F0 F1 F2 .  .  B0 F3 B1 F4 B2 F5 B3 F6 ...
    stage 1 |.  F0 F1 .  B0 F2 B1 F3 B2 F4 B3 F5 B4 ...
    stage 2 |.  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 ...

Weight versions. A stage's version ``t`` is its weights right after its ``t``-th
update (the update of ``B(t-1)``); version 0 is the initial weights.

- weight stashing: the backward of a batch uses the version its forward used;
- vertical sync (on by default): every stage forwards batch ``b`` with the version
  the first stage used for it, ``max(0, b - n + 1)``; without it, stage ``i`` uses its
  newest version, ``max(0, b - (n - i) + 1)`` (:func:`forward_version`).
- the run's depth: a run that recovered onto fewer stages
  (:mod:`zpipe.coordinator.runs.async_replicas`) keeps the staleness of the pipeline it
  started with, ``max(0, b - depth + 1)``, an older version than its own depth needs,
  so the recovered run trains exactly as the uninterrupted one (vertical sync only).

Weight aggregation (FTPipeHD, section III-C): stage ``i`` trains ``n - i`` versions
concurrently, each the previous one plus a gradient taken at an older version. Every
``interval`` backwards (a multiple of ``n - i``) the stage replaces its weights by the
mean of its last ``n - i`` versions, just before the backward that comes next
(``AGG`` in the action list). With FTPipeHD's Fig. 2 (n = 3, interval 3), stage 0
forwards batch 5 with version 3, aggregates versions 1-3, backwards batch 3 onto the
aggregate (version 4 there is the aggregate plus that update) and forwards batch 6
with it. The last stage has one version: nothing to aggregate.

A recovered run (fewer stages, keeping the depth ``D`` it started with) keeps the
aggregation windows of that depth too: stage ``j`` of its ``n' <= D`` stages
averages its newest ``D - j`` versions every ``multiple * (D - j)`` backwards, the
windows of the first ``n'`` stages of the pipeline it started with (its forwards
are as stale as theirs), and the backwards count from the run's start
(``batches_before``), so an aggregation falls on the same mini-batches as it would
have without the recovery (:func:`aggregation_intervals` with the depth).

The run's length is not known in advance: the list of a run of ``N`` batches is the
endless list without the forwards and backwards of batches ``>= N``
(:func:`async_stage_actions`), so a stage learns ``N`` only when the feed ends.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from zpipe._errors import ConfigError

ASYNC_SCHEDULE = "async-1f1b"
ASYNC_KINDS = ("F", "B", "STEP", "AGG")


@dataclass(frozen=True)
class AsyncSettings:
    """An asynchronous run's settings: vertical sync (on by default), aggregation
    (every ``aggregate_multiple * (n - i)`` backwards on stage ``i``), the bound on
    mini-batches in flight (None: the number of stages), and the depth whose staleness
    the forwards keep (None: the number of stages; a recovered run's is the depth
    it started with). ``chain_every`` and ``global_every``: FTPipeHD's replication
    without draining (None: off), each stage copying its units to the next stage
    (the last to the coordinator) every ``chain_every`` mini-batches and to the
    coordinator every ``global_every`` while it trains on
    (:mod:`zpipe.recovery.live_copies`)."""

    vertical_sync: bool = True
    aggregate: bool = False
    aggregate_multiple: int = 1
    max_in_flight: int | None = None
    depth: int | None = None
    chain_every: int | None = None
    global_every: int | None = None

    def __post_init__(self) -> None:
        m = self.aggregate_multiple
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ConfigError(f"aggregate_multiple must be an integer >= 1, got {m!r}")
        w = self.max_in_flight
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ConfigError(f"max_in_flight must be an integer >= 1, got {w!r}")
        d = self.depth
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise ConfigError(f"depth must be an integer >= 1, got {d!r}")
        if d is not None and not self.vertical_sync:
            raise ConfigError("a run's depth other than its stages' needs vertical sync")
        for name in ("chain_every", "global_every"):
            every = getattr(self, name)
            if every is not None and (isinstance(every, bool) or not isinstance(every, int)
                                      or every < 1):  # fmt: skip
                raise ConfigError(
                    f"{name} must be a whole number of mini-batches >= 1, got {every!r}"
                )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "vertical_sync": self.vertical_sync,
            "aggregate": self.aggregate,
            "aggregate_multiple": self.aggregate_multiple,
        }
        if self.depth is not None:
            out["depth"] = self.depth  # only when set: older peers refuse unknown settings
        for name in ("chain_every", "global_every"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out

    @property
    def live_copies(self) -> bool:
        """Whether the stages copy their units while they train (either period set)."""
        return self.chain_every is not None or self.global_every is not None

    def depth_of(self, num_stages: int) -> int:
        """The depth whose staleness a pipeline of ``num_stages`` stages keeps: ConfigError
        when it is shallower than the pipeline (its versions would not exist yet)."""
        depth = num_stages if self.depth is None else self.depth
        if depth < num_stages:
            raise ConfigError(f"a run of depth {depth} cannot run on {num_stages} stages")
        return depth

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> AsyncSettings:
        data = data or {}
        if not isinstance(data, Mapping):
            raise ConfigError(f"asynchronous settings must be a mapping, got {data!r}")
        known = {
            "vertical_sync",
            "aggregate",
            "aggregate_multiple",
            "depth",
            "chain_every",
            "global_every",
        }
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown asynchronous settings {unknown}")
        try:
            return cls(
                vertical_sync=bool(data.get("vertical_sync", True)),
                aggregate=bool(data.get("aggregate", False)),
                aggregate_multiple=int(data.get("aggregate_multiple", 1)),
                depth=None if data.get("depth") is None else int(data["depth"]),
                chain_every=_period(data.get("chain_every")),
                global_every=_period(data.get("global_every")),
            )
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"malformed asynchronous settings {data!r}: {exc}") from None


def _period(value: Any) -> int | None:
    # a float or a string is refused by the check, not rounded into a period
    return value if value is None or isinstance(value, int) else int(str(value))


@dataclass(frozen=True)
class AsyncAction:
    """``F3``/``B3``: forward/backward of batch 3; ``STEP``: the optimizer update that
    follows every backward; ``AGG``: weight aggregation."""

    kind: str
    batch: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ASYNC_KINDS:
            raise ConfigError(f"unknown async action {self.kind!r}; use one of {ASYNC_KINDS}")
        if (self.kind in ("F", "B")) != (self.batch is not None):
            raise ConfigError(f"{self.kind} {'needs' if self.kind in 'FB' else 'takes no'} batch")

    def __str__(self) -> str:
        return self.kind if self.batch is None else f"{self.kind}{self.batch}"


def _check(stage: int, num_stages: int) -> None:
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ConfigError(f"num_stages must be an integer >= 1, got {num_stages!r}")
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < num_stages:
        raise ConfigError(f"stage must be in 0..{num_stages - 1}, got {stage!r}")


def async_warmup(stage: int, num_stages: int) -> int:
    """Forwards before the first backward: ``n - i`` (PipeDream's NOAM on stage 0)."""
    _check(stage, num_stages)
    return num_stages - stage


def concurrent_versions(stage: int, num_stages: int) -> int:
    """How many weight versions stage ``i`` trains at once: ``n - i``."""
    return async_warmup(stage, num_stages)


def aggregation_interval(stage: int, num_stages: int, multiple: int = 1) -> int | None:
    """Backwards between two aggregations on ``stage``: ``multiple * (n - i)``; None
    where there is a single version (the last stage)."""
    if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
        raise ConfigError(f"the aggregation multiple must be an integer >= 1, got {multiple!r}")
    versions = concurrent_versions(stage, num_stages)
    return multiple * versions if versions > 1 else None


def forward_version(
    stage: int, num_stages: int, batch: int, *, vertical_sync: bool, depth: int | None = None
) -> int:
    """The weight version ``stage`` forwards ``batch`` with (see the module notes);
    ``depth``: the run's depth when it differs from ``num_stages`` (vertical sync)."""
    _check(stage, num_stages)
    if batch < 0:
        raise ConfigError(f"batch must be >= 0, got {batch}")
    if depth is not None and depth != num_stages:
        if not vertical_sync or depth < num_stages:
            raise ConfigError(
                f"a run of depth {depth} runs on at most as many stages, with vertical "
                f"sync (got {num_stages} stages)"
            )
        return max(0, batch - depth + 1)
    deciding = 0 if vertical_sync else stage
    return max(0, batch - async_warmup(deciding, num_stages) + 1)


def versions_read_after(
    stage: int, num_stages: int, updates: int, *, vertical_sync: bool, depth: int | None = None
) -> range:
    """The weight versions ``stage`` still reads once every batch before ``updates``
    (counted from the run's start) is done everywhere: the next forwards' (from
    :func:`forward_version` of batch ``updates`` on) and the newest ``n - i`` an
    aggregation averages, which lie within them. What a checkpoint or a replica of
    the stage keeps; under vertical sync every stage's are the same."""
    return range(
        forward_version(stage, num_stages, updates, vertical_sync=vertical_sync, depth=depth),
        updates + 1,
    )


def iter_async_actions(
    stage: int,
    num_stages: int,
    *,
    aggregate_every: int | None = None,
    first_batch: int = 0,
    batches_before: int = 0,
) -> Iterator[AsyncAction]:
    """The endless action list of ``stage``; ``aggregate_every`` backwards (a multiple
    of ``n - i``, see :func:`aggregation_interval`) an ``AGG`` before the next one.

    ``first_batch``: the list of a pipeline that was flushed after ``first_batch``
    batches (every earlier batch backwarded everywhere, a re-partition's boundary:
    :mod:`zpipe.training.repartition`): a warm-up again from that batch on. Versions
    and aggregations keep counting from the run's start, so the flush changes when
    things run, never which version a batch uses.

    ``batches_before``: the run's batches before this list's batch 0 (a run resumed
    from a replica numbers its batches from 0 again): aggregations count from the
    run's start."""
    warmup = async_warmup(stage, num_stages)
    if aggregate_every is not None and aggregate_every < 1:
        raise ConfigError(f"aggregate_every must be >= 1, got {aggregate_every}")
    for name, value in (("first_batch", first_batch), ("batches_before", batches_before)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{name} must be an integer >= 0, got {value!r}")
    for b in range(first_batch, first_batch + warmup):
        yield AsyncAction("F", b)
    k = first_batch
    while True:
        done = batches_before + k  # backwards before B_k since the run's start
        if aggregate_every is not None and done > 0 and done % aggregate_every == 0:
            yield AsyncAction("AGG")
        yield AsyncAction("B", k)
        yield AsyncAction("STEP")
        yield AsyncAction("F", k + warmup)
        k += 1


def async_stage_actions(
    stage: int,
    num_stages: int,
    num_batches: int,
    *,
    aggregate_every: int | None = None,
    first_batch: int = 0,
    batches_before: int = 0,
) -> list[AsyncAction]:
    """The action list of a run of ``num_batches`` batches: the endless list without
    the batches that never come (from ``first_batch`` on: see
    :func:`iter_async_actions`)."""
    if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 0:
        raise ConfigError(f"num_batches must be an integer >= 0, got {num_batches!r}")
    out: list[AsyncAction] = []
    if num_batches <= first_batch:
        return out
    for action in iter_async_actions(
        stage,
        num_stages,
        aggregate_every=aggregate_every,
        first_batch=first_batch,
        batches_before=batches_before,
    ):
        if action.kind in ("F", "B") and action.batch is not None and action.batch >= num_batches:
            if action.kind == "B":
                break
            continue
        out.append(action)
    # an AGG right before the backward that never comes does nothing
    while out and out[-1].kind == "AGG":
        out.pop()
    return out


def aggregation_intervals(
    num_stages: int, *, aggregate: bool, multiple: int = 1, depth: int | None = None
) -> list[int | None]:
    """Every stage's aggregation interval (None: it does not aggregate); ``depth``: the
    run's, when a recovery left fewer stages (the windows of that depth, see the
    module notes)."""
    windows = num_stages if depth is None else depth
    if windows < num_stages:
        raise ConfigError(f"a run of depth {windows} cannot run on {num_stages} stages")
    return [
        aggregation_interval(i, windows, multiple) if aggregate else None for i in range(num_stages)
    ]


def async_global_order(
    num_stages: int,
    num_batches: int,
    *,
    max_in_flight: int | None = None,
    aggregate_every: list[int | None] | None = None,
    first_batch: int = 0,
    batches_before: int = 0,
) -> list[tuple[int, AsyncAction]]:
    """One valid global order of every stage's actions: ``(stage, action)`` pairs
    (``batches_before``: as :func:`iter_async_actions`', a resumed run's).

    A forward waits for the previous stage's forward of its batch (stage 0: for the
    feed, which keeps at most ``max_in_flight`` batches whose loss has not come back:
    FTPipeHD's semaphore), a backward for the next stage's backward (the last stage:
    its own forward). Raises :class:`ConfigError` on a deadlock. Every valid order
    gives the same weights: each stage's order is fixed and versions are per stage.
    """
    n = num_stages
    window = n if max_in_flight is None else max_in_flight
    if window < 1:
        raise ConfigError(f"max_in_flight must be >= 1, got {window}")
    every = aggregate_every or [None] * n
    lists = [
        async_stage_actions(
            i,
            n,
            num_batches,
            aggregate_every=every[i],
            first_batch=first_batch,
            batches_before=batches_before,
        )
        for i in range(n)
    ]
    cursor = [0] * n
    forwarded: list[set[int]] = [set() for _ in range(n)]
    backwarded: list[set[int]] = [set() for _ in range(n)]
    order: list[tuple[int, AsyncAction]] = []
    while any(cursor[i] < len(lists[i]) for i in range(n)):
        progressed = False
        for i in range(n):
            while cursor[i] < len(lists[i]):
                action = lists[i][cursor[i]]
                b = action.batch
                if action.kind == "F":
                    assert b is not None
                    if i == 0:
                        ready = b - window < first_batch or (b - window) in forwarded[n - 1]
                    else:
                        ready = b in forwarded[i - 1]
                    if not ready:
                        break
                    forwarded[i].add(b)
                elif action.kind == "B":
                    assert b is not None
                    ready = b in (forwarded[i] if i == n - 1 else backwarded[i + 1])
                    if not ready:
                        break
                    backwarded[i].add(b)
                order.append((i, action))
                cursor[i] += 1
                progressed = True
        if not progressed:
            stuck = {i: str(lists[i][cursor[i]]) for i in range(n) if cursor[i] < len(lists[i])}
            raise ConfigError(f"the asynchronous schedule deadlocks at {stuck}")
    return order
