"""Replication without draining in a real asynchronous pipeline (FTPipeHD III-E).

Real stage processes on loopback: an ``async-1f1b`` run with ``live_copies`` makes
chain copies every 2 mini-batches and global copies every 4 while it trains. The
stage timelines show the copies' snapshots and sends and no flush; the copies at
the next stage and at the coordinator are the same bits, of the version of their
mini-batch (the last one equals the trained weights bit for bit; one made while
training went on equals the single-process reference of that many mini-batches);
and a restarted coordinator holds the copies again from its state directory.
Waits are for log events, each with a generous deadline.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tests._support.async_training import SGD, SPEC, make_batches
from tests._support.coordinator_restart import _cluster, _events
from zpipe.coordinator.persistence import StateStore
from zpipe.recovery.live_copies import state_digest
from zpipe.training.async_reference import train_async_reference

NAMES = ["a", "b", "c"]
PARTITION = [[0, 1], [1, 3], [3, 4]]
BOUNDS = [0, 1, 3, 4]
DEADLINE_S = 180.0


def _until(what: str, found: Callable[[], Any]) -> Any:
    """``found()`` once it is truthy, looking again as the logs grow (a deadline, not a
    timing: a loaded machine only makes it look more often)."""
    deadline = time.monotonic() + DEADLINE_S
    pause = threading.Event()
    while True:
        result = found()
        if result:
            return result
        assert time.monotonic() < deadline, f"no {what} within {DEADLINE_S} s"
        pause.wait(0.2)


def _weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # the live version's tensors: no stashed versions (#v), optimizer state or markers
    return {k: v for k, v in state.items() if "#" not in k}


def test_copies_flow_while_the_pipeline_trains_and_survive_a_restart(tmp_path: Path) -> None:
    batches = make_batches(10, 5, seed=21)
    state_dir = tmp_path / "state"
    trace = tmp_path / "trace.json"
    with _cluster(NAMES, state_dir) as cluster:
        report = cluster.fit(
            SPEC, batches, optimizer=SGD, num_microbatches=1, schedule="async-1f1b",
            partition=PARTITION, stage_names=NAMES, progress=False, trace=trace,
            live_copies=True, chain_every=2, global_every=4,
        )  # fmt: skip
        assert report.steps == 10

        def kept() -> list[dict[str, object]]:
            events = _events(cluster.logs("coordinator"), "async_copy_kept")
            newest = {(e["owner"], e["kind"]): e["step"] for e in events}
            want = {(n, k): s for n in NAMES for k, s in (("chain", 10), ("global", 8))}
            return events if newest == want else []

        events = _until("copy of every stage at the coordinator", kept)
        held = {
            (str(e["owner"]), str(e["kind"]), int(e["step"])): e  # type: ignore[call-overload]
            for e in events
        }
        # every period's copy came, and the chain copies of a and b are held by the next stage
        for name in NAMES:
            assert {s for (o, k, s) in held if (o, k) == (name, "chain")} == {2, 4, 6, 8, 10}
            assert {s for (o, k, s) in held if (o, k) == (name, "global")} == {4, 8}
        assert [held[(n, "chain", 10)]["holder"] for n in NAMES] == ["b", "c", "coordinator"]

        # the stage timelines: the copies were snapshotted and sent, and nothing drained
        spans = json.loads(trace.read_text())["traceEvents"]
        phases = [e for e in spans if e.get("ph") == "X"]
        assert not [e for e in phases if e["cat"] == "flush"]
        names = {e["pid"]: e["args"]["name"] for e in spans if e.get("name") == "process_name"}
        for pid, stage in names.items():
            snapshots = sorted(
                e["args"]["mb"] for e in phases if e["pid"] == pid and e["cat"] == "snapshot"
            )
            assert snapshots == [2, 4, 6, 8, 10], stage
            assert [e for e in phases if e["pid"] == pid and e["cat"] == "copy"], stage
            # every update is on the timeline, after its backward
            steps = {e["args"]["mb"]: e for e in phases if e["pid"] == pid and e["cat"] == "step"}
            assert sorted(steps) == list(range(10)), stage
            for mb, step_span in steps.items():
                (back,) = [e for e in phases if e["pid"] == pid and e["cat"] == "backward"
                           and e["args"]["mb"] == mb]  # fmt: skip
                assert step_span["ts"] >= back["ts"] + back["dur"] - 1, (stage, mb)
            # batches stayed in flight across each copy: forwarded before its snapshot,
            # backwarded after it (a flush would have backwarded them first); the last
            # stage backwards each batch right after its forward (warm-up 1)
            for step in (2, 4, 6, 8) if stage != NAMES[-1] else ():
                (snap,) = [e for e in phases if e["pid"] == pid and e["cat"] == "snapshot"
                           and e["args"]["mb"] == step]  # fmt: skip
                mine = [e for e in phases if e["pid"] == pid]
                before = {e["args"]["mb"] for e in mine if e["cat"] == "forward"
                          and e["ts"] < snap["ts"]}  # fmt: skip
                after = {e["args"]["mb"] for e in mine if e["cat"] == "backward"
                         and e["ts"] > snap["ts"]}  # fmt: skip
                assert before & after, (stage, step)

        # bits: the next stage keeps what the coordinator keeps, of the same mini-batch
        saved = {(r.owner, r.kind): (r, s) for r, s in StateStore(state_dir).load_copies()}
        for owner, holder in (("a", "b"), ("b", "c")):
            at_holder = [
                e for e in _events(cluster.logs(holder), "live_copy_kept")
                if e["owner"] == owner and e["step"] == 8
            ]  # fmt: skip
            record, state = saved[(owner, "global")]
            assert record.step == 8 and at_holder
            assert at_holder[-1]["digest"] == state_digest(state) == record.digest
        # a copy says which version it is, and holds that version's weights: the global
        # copies of mini-batch 8, made while 9 and 10 trained on, equal the reference
        # of 8 mini-batches; the chain copies of the last mini-batch, the trained weights
        reference = train_async_reference(SPEC, batches[:8], bounds=BOUNDS, optimizer=SGD)
        for name in NAMES:
            record, state = saved[(name, "global")]
            markers = [v for k, v in state.items() if k.endswith("#live_versions")]
            assert markers and all(m.tolist() == [8] for m in markers)
            for key, value in _weights(state).items():
                torch.testing.assert_close(value, reference.state_dict[key], rtol=1e-6, atol=1e-7)
        last = saved[("c", "chain")]
        assert last[0].step == 10
        for key, value in _weights(last[1]).items():
            assert torch.equal(value, report.state_dict[key]), key

        # a restarted coordinator holds every copy again (once the newest are on disk:
        # a copy is saved after it is kept)
        def saved() -> bool:
            events = _events(cluster.logs("coordinator"), "async_copy_saved")
            on_disk = {(e["owner"], e["kind"], e["step"]) for e in events}
            return all(
                (n, k, s) in on_disk for n in NAMES for k, s in (("chain", 10), ("global", 8))
            )

        _until("the newest copies on disk", saved)
        started = len(_events(cluster.logs("coordinator"), "coordinator_restored"))
        cluster.kill("coordinator")
        cluster.restart_coordinator()

        def restored() -> list[dict[str, object]]:
            events = _events(cluster.logs("coordinator"), "coordinator_restored")
            return events if len(events) > started else []

        summary = _until("restart", restored)[-1]["copies"]
        assert sorted((c["owner"], c["kind"], c["step"]) for c in summary) == sorted(
            (n, k, s) for n in NAMES for k, s in (("chain", 10), ("global", 8))
        )
