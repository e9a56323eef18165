"""``bench/recovery.py``'s liveness section: how fast a dead stage is detected, and
that busy ones are not declared dead (split out of that script to keep it small;
behaviour unchanged).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import replace
from typing import Any

from bench._common import emit, loadavg
from bench._recovery_faults import (
    _coordinator_events,
)
from bench._recovery_rebalance import (
    OPTIMIZER,
)
from bench._recovery_stream import (
    BENCH,
    Batch,
)
from zpipe import ZpipeError
from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.models import ModelSpec

_BURNER = """
import os, sys, threading

def exit_when_orphaned() -> None:
    sys.stdin.buffer.read()
    os._exit(0)

threading.Thread(target=exit_when_orphaned, daemon=True).start()
while True:
    pass
"""


def _deaths_in(cluster: LocalCluster, since: int) -> list[dict[str, Any]]:
    """The coordinator's ``stage_dead`` events logged after character ``since``."""
    events = _coordinator_events(cluster.logs("coordinator")[since:])
    return [e for e in events if e["event"] == "stage_dead"]


def _liveness_run(
    devices: list[DeviceSpec],
    spec: ModelSpec,
    batches: list[Batch],
    args: argparse.Namespace,
    *,
    label: str,
    burners: int = 0,
) -> dict[str, Any]:
    """Train with a replica every mini-batch and nothing killed: every stage declared
    dead is a false death (with ``burners`` busy processes taking the CPU from the
    moment the stages have registered: the load is on the run, not on start-up)."""
    busy: list[subprocess.Popen[bytes]] = []
    line: dict[str, Any] = {"bench": BENCH, "kind": "liveness", "label": label}
    line["burners"] = burners
    try:
        with LocalCluster(
            devices,
            heartbeat_interval_s=args.heartbeat_s,
            suspect_after=args.suspect_after,
            probe_intervals=args.probe_intervals,
            log_level="info",
            start_timeout_s=180.0,
        ) as cluster:
            busy += [
                subprocess.Popen([sys.executable, "-c", _BURNER], stdin=subprocess.PIPE)
                for _ in range(burners)
            ]
            started = time.monotonic()
            try:
                report = cluster.fit(
                    spec,
                    batches,
                    optimizer=OPTIMIZER,
                    num_microbatches=args.train_microbatches,
                    progress=False,
                    recover=True,
                    replicate_every=1,
                )
                line["recoveries"] = [r["dead"] for r in report.recoveries]
                line["replicas"] = report.replicas
            except ZpipeError as exc:
                line["error"] = f"{type(exc).__name__}: {exc}"
            line["wall_s"] = time.monotonic() - started
            events = _coordinator_events(cluster.logs("coordinator"))
            deaths = [e for e in events if e["event"] == "stage_dead"]
            line["false_deaths"] = len(deaths)
            line["deaths"] = [f"{e.get('stage')}: {e.get('reason')}" for e in deaths]
            line["suspicions"] = sum(e["event"] == "stage_suspect" for e in events)
    except ZpipeError as exc:  # the cluster did not start under this load
        line["error"] = f"cluster start: {type(exc).__name__}: {exc}"
        line["false_deaths"] = None
    finally:
        for process in busy:
            process.kill()
        for process in busy:
            process.wait(timeout=10)
    line["loadavg"] = loadavg()
    return line


def _detection_trial(
    devices: list[DeviceSpec], args: argparse.Namespace, *, warm_s: float = 10.0
) -> dict[str, Any]:
    """SIGKILL one stage of an idle cluster once its deadlines have samples: the kill
    to the coordinator's ``stage_dead``, against its adaptive deadlines."""
    line: dict[str, Any] = {"bench": BENCH, "kind": "detection", "interval_s": args.heartbeat_s}
    with LocalCluster(
        devices,
        heartbeat_interval_s=args.heartbeat_s,
        suspect_after=args.suspect_after,
        probe_intervals=args.probe_intervals,
        log_level="info",
    ) as cluster:
        victim = devices[-1].name
        time.sleep(warm_s)  # heartbeats fill the victim's window of gaps
        since = len(cluster.logs("coordinator"))
        killed_wall = time.time()
        cluster.kill(victim)
        deadline = time.monotonic() + 120.0
        while time.monotonic() < deadline and not _deaths_in(cluster, since):
            time.sleep(0.05)
        events = _coordinator_events(cluster.logs("coordinator")[since:])
        dead = next((e for e in events if e["event"] == "stage_dead"), None)
        suspect = next(
            (e for e in events if e["event"] == "stage_suspect" and e.get("stage") == victim),
            None,
        )
        line["victim"] = victim
        line["other_deaths"] = sum(
            e["event"] == "stage_dead" and e.get("stage") != victim for e in events
        )
        if dead is None or suspect is None:
            line["error"] = "no stage_dead (or stage_suspect) for the victim within 120 s"
            return line
        detection = dead["t"] - killed_wall
        suspect_s = float(suspect.get("deadline_s") or 0.0)
        probe_s = float(suspect.get("probe_deadline_s") or 0.0)
        line.update(
            {
                "detection_time_s": detection,
                "suspect_deadline_s": suspect_s,
                "probe_deadline_s": probe_s,
                "detection_over_heartbeat_interval": detection / args.heartbeat_s,
                "detection_beyond_suspect_deadline_intervals": (detection - suspect_s)
                / args.heartbeat_s,
                "reason": dead.get("reason"),
            }
        )
    return line


def _liveness_section(
    devices: dict[str, DeviceSpec],
    spec: ModelSpec,
    batches: list[Batch],
    args: argparse.Namespace,
) -> dict[str, Any]:
    cores = os.cpu_count() or 1
    burners = 2 * cores if args.burners is None else args.burners
    plain = list(devices.values())
    slow = [replace(d, bandwidth_mbps=args.slow_link_mbps) for d in plain]
    loaded = _liveness_run(plain, spec, batches, args, label="under_load", burners=burners)
    emit(loaded)
    print(f"  liveness under load: {loaded}", file=sys.stderr, flush=True)
    links = _liveness_run(slow, spec, batches, args, label="slow_links")
    emit(links)
    print(f"  liveness over slow links: {links}", file=sys.stderr, flush=True)
    detection = _detection_trial(plain, args)
    emit(detection)
    print(f"  detection: {detection}", file=sys.stderr, flush=True)
    return {
        "false_deaths_under_load": loaded.get("false_deaths"),
        "false_deaths_under_load_burners": burners,
        "false_deaths_under_load_run_ok": "error" not in loaded,
        "false_deaths_slow_links": links.get("false_deaths"),
        "false_deaths_slow_links_mbps": args.slow_link_mbps,
        "false_deaths_slow_links_run_ok": "error" not in links,
        "detection_time_s": detection.get("detection_time_s"),
        "detection_over_heartbeat_interval": detection.get("detection_over_heartbeat_interval"),
        "detection_beyond_suspect_deadline_intervals": detection.get(
            "detection_beyond_suspect_deadline_intervals"
        ),
        "detection_adaptive_deadline_s": (
            detection["suspect_deadline_s"] + detection["probe_deadline_s"]
            if "suspect_deadline_s" in detection
            else None
        ),
    }
