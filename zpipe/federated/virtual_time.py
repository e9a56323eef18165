"""fl-sim's clock as a sans-IO controller: simulated time for any transport.

A federated run in simulated time is a heap of events: evaluations every
``eval_every_s``, latency changes every ``change_every_s`` (after which every
client is profiled again), and each task's completion at dispatch time plus
the client's profiled latency times a per-task jitter. The clock owns that
heap and the server (:mod:`zpipe.federated.server`); it never trains a model
nor talks to a client. Its shell asks :meth:`VirtualClock.advance` what the
run needs next and answers:

- :class:`NeedResult`: the next event is task T's completion; the shell hands
  back the client's trained weights (:meth:`on_result`), or ``None`` when the
  client failed (the server drops it from its group, Eco-FL's drop-out);
- :class:`NeedProfiles`: a latency-change tick; the shell reports every
  client's current latency it could measure (:meth:`on_profiles`), in
  client order, as Eco-FL's continuous profiling does;
- :class:`Finished`: the budget (or ``max_updates``) is reached.

Tasks the server hands out come back from every call as ``dispatched``: the
shell may start them at once (they depend only on the weights they carry),
so a transport with many clients trains them concurrently while the clock
still merges their results in simulated-time order. fl-sim trains inline;
the Flower ServerApp (:mod:`zpipe.federated.flower_app`) sends them as Flower
messages. Both drive this one loop, so for one seed they take the same
decisions and reach the same weights.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from zpipe._errors import ConfigError, ProtocolError
from zpipe.federated.server import ClientUpdate, FederatedServer, TrainTask

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class NeedResult:
    now: float
    task: TrainTask


@dataclass(frozen=True)
class NeedProfiles:
    now: float
    tick: int  # the k-th latency change (the first profiling, before the run, is tick 0)


@dataclass(frozen=True)
class Finished:
    now: float


Step = NeedResult | NeedProfiles | Finished


@dataclass(frozen=True)
class ClockConfig:
    seed: int = 0
    jitter: float = 0.05
    budget_s: float = 2000.0
    eval_every_s: float = 50.0
    change_every_s: float = 100.0

    def __post_init__(self) -> None:
        if not (self.budget_s > 0 and self.eval_every_s > 0 and self.change_every_s > 0):
            raise ConfigError("budget, evaluation and change intervals must be > 0")
        if self.jitter < 0:
            raise ConfigError("jitter must be >= 0")


def task_spread(seed: int, task_id: int, jitter: float) -> float:
    """The factor a task's response time takes on its client's latency (>= 0.1)."""
    rng = np.random.default_rng([seed, 4, task_id])
    return max(0.1, 1.0 + jitter * float(rng.normal()))


@dataclass
class _Log:
    curve_t: list[float] = field(default_factory=list)
    curve_acc: list[float] = field(default_factory=list)
    client_tasks: int = 0
    failed_tasks: int = 0


class VirtualClock:
    """The event loop of a simulated-time run around one :class:`FederatedServer`."""

    def __init__(
        self,
        server: FederatedServer,
        latencies: Mapping[int, float],
        config: ClockConfig,
        *,
        evaluate: Callable[[FloatArray], float],
        max_updates: int | None = None,
    ) -> None:
        missing = sorted(set(server.profiles) - set(latencies))
        if missing:
            raise ConfigError(f"no latency profiled for clients {missing[:5]}")
        self.server, self.config, self.evaluate = server, config, evaluate
        self.latency = {c: float(v) for c, v in latencies.items()}
        self.max_updates = max_updates
        self.now = 0.0
        self.log = _Log()
        self.reached: dict[str, float] = {}
        self.dispatched: list[TrainTask] = []  # handed out, not yet collected by the shell
        self._events: list[tuple[float, int, str, TrainTask | None]] = []
        self._order = itertools.count()
        self._sent_at: dict[int, float] = {}
        self._awaiting: TrainTask | None = None
        self._profiling = False
        self._ticks = 0
        self._finished = False
        for k in range(math.floor(config.budget_s / config.eval_every_s) + 1):
            self._push(k * config.eval_every_s, "eval", None)
        for k in range(1, math.floor(config.budget_s / config.change_every_s) + 1):
            self._push(k * config.change_every_s, "change", None)
        self._schedule(server.start())

    def _push(self, at: float, kind: str, task: TrainTask | None) -> None:
        heapq.heappush(self._events, (at, next(self._order), kind, task))

    def _schedule(self, tasks: list[TrainTask]) -> None:
        for task in tasks:
            spread = task_spread(self.config.seed, task.task_id, self.config.jitter)
            self._sent_at[task.task_id] = self.now
            self._push(self.now + self.latency[task.client_id] * spread, "done", task)
            self.dispatched.append(task)

    def take_dispatched(self) -> list[TrainTask]:
        """The tasks handed out since the last call, in order (the shell starts them)."""
        tasks, self.dispatched = self.dispatched, []
        return tasks

    def advance(self) -> Step:
        """Run events up to the next one that needs the shell."""
        if self._awaiting is not None or self._profiling:
            raise ProtocolError("answer the clock's last request before advancing it")
        while self._events and not self._finished:
            now, _, kind, task = heapq.heappop(self._events)
            if now > self.config.budget_s:
                break
            self.now = now
            if kind == "eval":
                self.log.curve_t.append(now)
                self.log.curve_acc.append(self.evaluate(self.server.global_weights))
            elif kind == "change":
                self._profiling = True
                self._ticks += 1
                return NeedProfiles(now, self._ticks)
            else:
                assert task is not None
                self._awaiting = task
                return NeedResult(now, task)
        self._finished = True
        return Finished(self.now)

    def on_profiles(self, latencies: Mapping[int, float]) -> list[TrainTask]:
        """Every latency measured at the tick; clients that did not answer keep theirs."""
        if not self._profiling:
            raise ProtocolError("the clock asked for no profiles")
        self._profiling = False
        for client_id, latency in latencies.items():
            if client_id in self.latency:
                self.latency[client_id] = float(latency)
        # one client at a time, as fl-sim always did: each observation may start tasks
        for client_id in sorted(latencies):
            if client_id in self.latency:
                self._schedule(self.server.observe_latency(client_id, self.latency[client_id]))
        return self.take_dispatched()

    def on_result(self, weights: FloatArray | None, n_samples: int = 0) -> list[TrainTask]:
        """The awaited task's trained weights, or ``None``: its client failed."""
        task = self._awaiting
        if task is None:
            raise ProtocolError("the clock awaits no result")
        self._awaiting = None
        if weights is None:
            self.log.failed_tasks += 1
            waited = self.now - self._sent_at.pop(task.task_id)
            # the silence first: a client it drops out must not be picked again by the
            # new round its failure may start (fl-server's controller does the same)
            self._schedule(self.server.observe_silence(task.client_id, waited))
            self._schedule(self.server.on_task_failed(task.task_id))
            return self.take_dispatched()
        self._sent_at.pop(task.task_id, None)
        self.log.client_tasks += 1
        update = ClientUpdate(task.task_id, task.client_id, weights, n_samples)
        self._schedule(self.server.on_update(update))
        if self.max_updates is not None and self.server.version >= self.max_updates:
            self.reached = {
                "updates_reached_s": self.now,
                "acc_at_updates": self.evaluate(self.server.global_weights),
            }
            self._finished = True
        return self.take_dispatched()
