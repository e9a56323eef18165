"""Eco-FL Figs. 10-11 on real kernel links: a pipeline client against data
parallelism over a home whose Wi-Fi is a tbf cap, not an emulation.

The same home, model, plans and steady-state measure as
:mod:`bench._federated_pipeline` (Jetson Xavier NX, TX2 and two Nanos as emulated
compute slowdowns; a 64-512x4-10 MLP; mini-batches of 32), but every device runs in
a network namespace of its own (:class:`~zpipe.cluster.netcluster.LabCluster`) whose
uplink ``tc tbf`` caps at ``--pipeline-client-mbps`` (100 Mbit/s: a home's Wi-Fi), so
the pipeline's activations and gradients and data parallelism's all-reduce cross
real veth pairs and a real queue. The stages emulate no bandwidth: the planners are
told the cap, the kernel enforces it. The systems take turns, each repeat starting
with the other.

Summary keys: ``pipeline_client_over_dp_throughput_netns`` (the ratio of medians),
its predicted value, both systems' samples/s and runs. Needs root, ``ip`` and ``tc``;
without them the section reports ``pipeline_client_netns_skipped`` with the reason.

Run alone: ``python -m bench._federated_netns [--pipeline-client-steps N]
[--pipeline-client-repeats R] [--pipeline-client-mbps M]``; it prints JSON lines
and a summary, as every bench does.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch

from bench._common import emit, loadavg, summary
from bench._federated_pipeline import (
    BATCH,
    DIMS,
    HOME,
    SKIP,
    add_flags,
    check_flags,
    plans,
    slowdown_scale,
)
from zpipe.cluster import DeviceSpec
from zpipe.cluster.netcluster import LabCluster
from zpipe.cluster.netlab import NetLab, unavailable_reason
from zpipe.cluster.netlayout import Node, TbfCap
from zpipe.federated.fedprox import FACTORY, optimizer_config
from zpipe.models import ModelSpec

COORDINATOR_NODE = "coord"


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    rng = np.random.default_rng(0)  # the same data as bench/_federated_pipeline.py
    x = torch.tensor(rng.normal(size=(BATCH * steps, DIMS[0])))
    y = torch.tensor(rng.integers(0, DIMS[-1], size=len(x)))
    return [(x[i : i + BATCH].float(), y[i : i + BATCH]) for i in range(0, len(x), BATCH)]


def netns_section(args: argparse.Namespace) -> dict[str, Any]:
    """Pipeline against data parallelism on the netns harness; the keys above."""
    reason = unavailable_reason()
    if reason is not None:
        return {"pipeline_client_netns_skipped": reason}
    started = time.perf_counter()
    cores = os.cpu_count() or 1
    threads = max(1, cores // len(HOME))
    scale = args.pipeline_client_scale or slowdown_scale(threads, cores)
    mbps = args.pipeline_client_mbps
    pipeline, dp, devices = plans(mbps, scale)
    batches = _batches(args.pipeline_client_steps)
    spec = ModelSpec("mlp", {"dims": DIMS, "activation": "relu"}, seed=0)
    # no emulated bandwidth: the cap below is the link
    stages = [DeviceSpec(d.name, slowdown=1.0 / d.speed, threads=threads) for d in devices]
    cap = TbfCap.at(mbps)
    nodes = [Node(COORDINATOR_NODE), *(Node(d.name, uplink=cap) for d in devices)]
    systems = [("pipeline", pipeline), ("dp", dp)]
    measured: dict[str, list[float]] = {name: [] for name, _ in systems}
    with (
        NetLab(nodes) as lab,
        LabCluster(
            lab,
            stages,
            coordinator_node=COORDINATOR_NODE,
            measure_links=False,
            allow_factories=(FACTORY,),
            start_timeout_s=240.0,
        ) as cluster,
    ):
        for repeat in range(args.pipeline_client_repeats):
            turn = repeat % len(systems)  # none always runs first (or last)
            for system, plan in systems[turn:] + systems[:turn]:
                stamps: list[float] = []
                cluster.fit(
                    spec,
                    batches,
                    optimizer=optimizer_config(0.05, 0.05),
                    num_microbatches=plan.num_microbatches,
                    plan=plan,
                    progress=False,
                    on_step=lambda step, loss, stamps=stamps: stamps.append(time.perf_counter()),
                )
                steady = (len(stamps) - SKIP) * BATCH / (stamps[-1] - stamps[SKIP - 1])
                measured[system].append(steady)
                emit(
                    {
                        "bench": "federated",
                        "section": "pipeline_client_netns",
                        "system": system,
                        "steady_samples_per_s": round(steady, 2),
                        "tbf_mbit": mbps,
                        "loadavg": loadavg(),
                    }
                )
    pipe_sps = statistics.median(measured["pipeline"])
    dp_sps = statistics.median(measured["dp"])
    return {
        "pipeline_client_over_dp_throughput_netns": round(pipe_sps / dp_sps, 3),
        "pipeline_client_netns_predicted_over_dp": round(
            pipeline.predicted["samples_per_s"] / dp.predicted["samples_per_s"], 3
        ),
        "pipeline_client_netns_samples_per_s": round(pipe_sps, 2),
        "dp_client_netns_samples_per_s": round(dp_sps, 2),
        "pipeline_client_netns_runs": {k: [round(v, 2) for v in vs] for k, vs in measured.items()},
        "pipeline_client_netns_tbf_mbit": mbps,
        "pipeline_client_netns_wall_s": round(time.perf_counter() - started, 1),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_flags(p)
    args = p.parse_args(argv)
    check_flags(p, args)
    out = netns_section(args)
    summary("federated_netns", loadavg=loadavg(), **out)


if __name__ == "__main__":
    main()
