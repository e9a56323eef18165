"""The set-up the asynchronous fast-recovery cluster tests share
(tests/cluster/test_async_fast_recovery*.py).

Each test runs one ``async-1f1b`` fit with ``consistency="fast"`` on the session's
a, b, c (the ``async_recovery_cluster`` fixture) over a 0-1 | b 1-3 | c 3-4,
kills stages from its ``on_step`` once an event it waits for has been logged,
and reads the logs from where its own fit began (never an earlier test's:
the cluster is shared). Killed stages are started again before the next test.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, cast

from tests._support.async_training import ADAM, SPEC, make_batches
from tests._support.training_recovery import _events
from zpipe.cluster import DeviceSpec, LocalCluster

NAMES = ["a", "b", "c"]
PARTITION = [[0, 1], [1, 3], [3, 4]]
STEPS = 16
DEADLINE_S = 180.0  # generous: every wait here is for an event that comes much sooner


class FastRecoveryRun:
    """One fast-recovery fit on the shared a, b, c, and what it logged."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.since = {n: len(cluster.logs(n)) for n in ["coordinator", *NAMES]}
        self.steps: list[int] = []  # the steps whose losses came back, in order
        self.killed: list[str] = []

    def logs(self, name: str) -> str:
        """What ``name`` logged since this run began."""
        return self.cluster.logs(name)[self.since[name] :]

    def events(self, name: str, event: str) -> list[dict[str, Any]]:
        """The ``event`` lines ``name`` logged since this run began."""
        return cast("list[dict[str, Any]]", _events(self.logs(name), event))

    def wait_for(self, what: str, until: Callable[[], bool], poll_s: float = 0.1) -> None:
        """Wait (the caller's thread with it) until ``until()``; fail saying ``what``
        after the deadline."""
        deadline = time.monotonic() + DEADLINE_S
        while not until():
            assert time.monotonic() < deadline, what
            threading.Event().wait(poll_s)

    def kill(self, *names: str) -> None:
        self.killed.extend(names)
        for name in names:
            self.cluster.kill(name)

    def kill_after(
        self, step: int, *names: str, ready: Callable[[], bool] | None = None, what: str = ""
    ) -> Callable[[int], None]:
        """An ``on_step`` hook: once mini-batch ``step``'s loss came back, wait for
        ``ready()`` (an event, not a timing) and kill ``names`` (once)."""

        def hook(at: int) -> None:
            if at >= step and not self.killed:
                if ready is not None:
                    self.wait_for(what or f"not ready to kill {names}", ready)
                self.kill(*names)

        return hook

    def fit(
        self,
        seed: int,
        on_step: Callable[[int], None] | None = None,
        on_end: Callable[[], None] | None = None,
        **options: Any,
    ) -> Any:
        """The fit (chain copies every 2 mini-batches, global every 4, unless
        ``options`` say otherwise). After it, whatever it raised, ``on_end`` (a test's
        killer thread stops there), then the stages it killed start again."""

        def step(at: int, _loss: float) -> None:
            self.steps.append(at)
            if on_step is not None:
                on_step(at)

        copies = {"chain_every": 2, "global_every": 4, **options}
        try:
            return self.cluster.fit(
                SPEC, make_batches(STEPS, 5, seed=seed), optimizer=ADAM, num_microbatches=1,
                schedule="async-1f1b", progress=False, partition=PARTITION, stage_names=NAMES,
                recover=True, live_copies=True, consistency="fast", on_step=step, **copies,
            )  # fmt: skip
        finally:
            if on_end is not None:
                on_end()
            for name in self.killed:
                self.cluster.start_stage(DeviceSpec(name))
            self.cluster.wait_for_stages(len(NAMES), timeout_s=120)

    def copy_kept(self, owner: str, kind: str | None = None, holder: str | None = None) -> bool:
        """Whether the coordinator's ledger has a copy of ``owner``'s units (of this
        run's fit) of that kind, at that holder."""
        return any(
            e["owner"] == owner
            and (kind is None or e["kind"] == kind)
            and (holder is None or e["holder"] == holder)
            for e in self.events("coordinator", "async_copy_kept")
        )

    def fast_restore_planned(self) -> dict[str, Any]:
        """The coordinator's one restore plan of the fast recovery."""
        (planned,) = [
            e for e in self.events("coordinator", "restore_planned") if e["recovery"] == "fast"
        ]
        return planned
