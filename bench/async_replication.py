"""What replication without draining costs an asynchronous 1F1B run (FTPipeHD III-E).

One LocalCluster of three emulated devices (``--slowdowns``, default 4x each: the
emulated speeds, not the contention for this machine's cores, set the period), an
MLP of three equal hidden layers cut one layer per stage, Adam, the same seeded
random mini-batches (``--steps``) for every run. After an untimed warm-up run the
systems alternate (``--repeats`` each; the median throughput is reported):

* ``async``: ``fit(schedule="async-1f1b")``, no replication;
* ``live_copies``: the same with ``live_copies=True`` at FTPipeHD's periods
  (``--chain-every`` 50, ``--global-every`` 100): each stage snapshots its units
  right after the update that reaches a period and sends the copy (to the next
  stage, and to the coordinator) while the pipeline trains on;
* ``flush_every_R`` (``--flush-every``, default 20; 0 leaves it out): the
  replicas at flush points that asynchronous runs made before (the pipeline drains
  before every R-th mini-batch), for comparison.

The summary: ``async_replication_throughput_cost`` = 1 - live_copies / async
throughput (the issue's goal: at most 0.10), ``flush_every_R_throughput_cost`` the same for
the flushes, and ``copies_kept`` (the coordinator's ``async_copy_kept`` events in one
run, on average: every copy it received or was told of; 3 stages, 200 mini-batches
and periods 50 and 100 make 18). The machine is shared: the load
average is printed beside every number.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench._common import emit, loadavg, on_alarm, summary
from zpipe.client import TrainReport
from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.models import ModelSpec

BENCH = "async_replication"
ADAM = {"name": "adam", "lr": 1e-3}
NAMES = ["a", "b", "c"]
PARTITION = [[0, 2], [2, 3], [3, 4]]


def batches(count: int, size: int, width: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(size, width, generator=generator), torch.randint(0, 10, (size,)))
        for _ in range(count)
    ]


def fit(cluster: LocalCluster, spec: ModelSpec, data: list[Any], **extra: Any) -> TrainReport:
    return cluster.fit(
        spec, data, optimizer=ADAM, num_microbatches=1, schedule="async-1f1b",
        partition=PARTITION, stage_names=NAMES, progress=False, **extra,
    )  # fmt: skip


def copies_logged(cluster: LocalCluster) -> int:
    count = 0
    for line in cluster.logs("coordinator").splitlines():
        try:
            count += json.loads(line).get("event") == "async_copy_kept"
        except ValueError:
            continue
    return count


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slowdowns", type=float, nargs=3, default=[4.0, 4.0, 4.0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=200, help="mini-batches per run")
    parser.add_argument("--chain-every", type=int, default=50)
    parser.add_argument("--global-every", type=int, default=100)
    parser.add_argument("--flush-every", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=int, default=900, help="seconds for the whole bench")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(args.timeout)
    h = args.hidden
    spec = ModelSpec("mlp", {"dims": [64, h, h, h, 10], "activation": "relu"}, seed=1)
    data = batches(args.steps, args.batch_size, 64)
    devices = [DeviceSpec(n, slowdown=s) for n, s in zip(NAMES, args.slowdowns, strict=True)]
    systems: dict[str, dict[str, Any]] = {
        "async": {},
        "live_copies": {
            "live_copies": True,
            "chain_every": args.chain_every,
            "global_every": args.global_every,
        },
    }
    if args.flush_every:
        systems[f"flush_every_{args.flush_every}"] = {
            "recover": True,
            "replicate_every": args.flush_every,
        }
    speeds: dict[str, list[float]] = {k: [] for k in systems}
    copies = 0.0
    with LocalCluster(
        devices, heartbeat_interval_s=0.5, suspect_after=6, probe_intervals=4,
        log_level="info",
    ) as cluster:  # fmt: skip
        fit(cluster, spec, data[:6])  # untimed: the stages warm up
        for repeat in range(args.repeats):
            for name, extra in systems.items():
                before = copies_logged(cluster)
                report = fit(cluster, spec, data, **extra)
                speeds[name].append(report.samples_per_s)
                # the last mini-batch's copies may come after the run's end: counted below
                kept = copies_logged(cluster) - before
                emit({"bench": BENCH, "system": name, "repeat": repeat,
                      "samples_s": round(report.samples_per_s, 2), "copies_kept": kept,
                      "load": loadavg()})  # fmt: skip
        # every copy the coordinator received or was told of, per run with copies
        copies = copies_logged(cluster) / args.repeats
    base = statistics.median(speeds["async"])
    ratios: dict[str, Any] = {
        "async_replication_throughput_cost": round(
            1 - statistics.median(speeds["live_copies"]) / base, 3
        ),
        "chain_every": args.chain_every,
        "global_every": args.global_every,
        "steps": args.steps,
        "copies_kept": copies,
    }
    if args.flush_every:
        flushed = statistics.median(speeds[f"flush_every_{args.flush_every}"])
        ratios[f"flush_every_{args.flush_every}_throughput_cost"] = round(1 - flushed / base, 3)
    summary(BENCH, **ratios, load=loadavg())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
