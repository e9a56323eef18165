"""A live re-partition's pause in parts, from the stamps of the run's log events.

For ``bench/training_async.py``: the client's loss times (wall clock) and the JSON
events of the coordinator (``repartition_started``, ``repartition_fetching``,
``repartition_considered``) and of the stages (``repartition_prepared`` with its
``flush_wait_s`` and ``snapshot_s``, ``repartition_fetched``,
``repartition_committed`` with its ``regroup_s``); every process runs on this host,
so the stamps share one clock.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from zpipe.log import read_events


def _stamp(record: dict[str, Any]) -> float:
    return datetime.fromisoformat(str(record["timestamp"])).timestamp()


def _events(text: str, *names: str) -> list[dict[str, Any]]:
    return read_events(text, *names)


COORDINATOR_EVENTS = (
    "repartition_started",
    "repartition_fetching",
    "repartition_considered",
    "repartitioned",
)


def pause_parts(
    logs: dict[str, str], step: int, last_loss: float, next_loss: float
) -> dict[str, Any]:
    """A look's pause in parts, from the client's loss times (wall clock) and the
    stamps of the coordinator's and stages' events (same host, same clock)."""
    events = [r for r in _events(logs["coordinator"], *COORDINATOR_EVENTS) if r.get("step") == step]
    # the look made while the pipeline ran (``flush`` False) before the move's pause
    looked = {r["event"]: _stamp(r) for r in events if r.get("flush") is False}
    coordinator = {r["event"]: _stamp(r) for r in events if r.get("flush") is not False}
    stages: dict[str, list[dict[str, Any]]] = {}
    for name, text in logs.items():
        if name == "coordinator":
            continue
        for r in _events(text, "repartition_prepared", "repartition_fetched",
                         "repartition_committed"):  # fmt: skip
            if r.get("step") == step:
                stages.setdefault(str(r["event"]), []).append(r)
    if "repartition_started" not in coordinator or "repartition_prepared" not in stages:
        return {}
    started = coordinator["repartition_started"]
    prepared = max(_stamp(r) for r in stages["repartition_prepared"])
    considered = coordinator.get("repartition_considered", prepared)
    fetched = max((_stamp(r) for r in stages.get("repartition_fetched", [])), default=considered)
    committed = max(_stamp(r) for r in stages.get("repartition_committed", [])) if stages.get(
        "repartition_committed") else fetched  # fmt: skip
    parts = {
        "request_s": started - last_loss,  # the client's drain check and its request
        "prepare_s": prepared - started,  # every stage flushed and kept a snapshot
        "look_s": considered - prepared,  # the replies and the decision
        "allow_s": coordinator.get("repartition_fetching", considered) - considered,
        "fetch_s": fetched - coordinator.get("repartition_fetching", considered),
        "commit_s": committed - fetched,  # includes building the new shards
        "resume_s": next_loss - committed,  # the reply, the feed, one batch through
        "flush_wait_max_s": max(float(r["flush_wait_s"]) for r in stages["repartition_prepared"]),
        "snapshot_max_s": max(float(r["snapshot_s"]) for r in stages["repartition_prepared"]),
        "regroup_max_s": max(
            (float(r.get("regroup_s", 0.0)) for r in stages.get("repartition_committed", [])),
            default=0.0,
        ),
    }
    if "repartition_started" in looked and "repartition_considered" in looked:
        # the look apart from the move: its own time (the stages' counters and the
        # decision, the pipeline running) and from its answer to the move's request
        # (the client pausing its feed, every loss in flight back)
        parts["look_before_s"] = looked["repartition_considered"] - looked["repartition_started"]
        parts["drain_s"] = started - looked["repartition_considered"]
    return {k: round(v, 3) for k, v in parts.items()}


def speed_verdicts(coordinator_log: str) -> list[dict[str, Any]]:
    """The stages' speed verdicts the coordinator relayed or dropped (the forward
    watch's, ``zpipe.coordinator.runs.async_speed``), in order: which stage, at which
    of its mini-batches, how much slower, and why a dropped one was."""
    out = []
    for r in _events(coordinator_log, "speed_change_relayed", "speed_change_dropped"):
        entry = {k: r.get(k) for k in ("stage", "step", "ratio", "plan_epoch")}
        entry["relayed"] = r["event"] == "speed_change_relayed"
        if not entry["relayed"]:
            entry["why"] = r.get("why")
        out.append(entry)
    return out
