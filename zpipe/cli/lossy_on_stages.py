"""``python -m zpipe lossy --coordinator EP`` and ``--multiprocess``: the experiment's
runs on ordinary stages.

Each configuration trains on the first ``--devices`` stages (by name) of the
cluster the coordinator at ``EP`` keeps (``python -m zpipe coordinator`` and
``python -m zpipe.stage``), or, with ``--multiprocess``, of a
:class:`~zpipe.cluster.LocalCluster` started for the command: the coordinator
partitions and maps, the stages run their partial layers
(:mod:`zpipe.client.runs.lossy`). Each run is checked against the in-process
simulation of the same seed: its training (drops, losses, weights) and its final
test-time inference under loss (the stages' test passes on their final weights,
keyed as :func:`zpipe.lossy.simulate.run_training`'s final evaluation, against the
simulation's on the simulated weights: the same drops and predictions).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

from zpipe.client.pipeline_client import PipelineClient
from zpipe.client.runs.lossy import run_lossy
from zpipe.lossy.data import Dataset
from zpipe.lossy.death_sim import evaluate_after, train_with_death
from zpipe.lossy.simulate import RunConfig, final_eval_index, prepare_run
from zpipe.lossy.trace import same_run, train_in_process


def run_stage_configs(
    args: argparse.Namespace, configs: list[tuple[RunConfig, float | None]], data: Dataset
) -> list[dict[str, Any]]:
    """Every configuration on the cluster's stages, each checked against the simulation."""
    return _run_all(args, configs, data, coordinator=args.coordinator, keys=args.keys)


def run_on_local_cluster(
    args: argparse.Namespace, configs: list[tuple[RunConfig, float | None]], data: Dataset
) -> list[dict[str, Any]]:
    """Every configuration on a local cluster of ordinary stages started for it (as many
    stages as the largest configuration has devices), then stopped."""
    from zpipe.cluster import LocalCluster

    n_stages = max(cfg.n_devices for cfg, _ in configs)
    with LocalCluster(n_stages, log_level="warning") as cluster:
        return _run_all(args, configs, data, coordinator=cluster.coordinator_endpoint, keys=None)


def _run_all(
    args: argparse.Namespace,
    configs: list[tuple[RunConfig, float | None]],
    data: Dataset,
    *,
    coordinator: str,
    keys: Path | None,
) -> list[dict[str, Any]]:
    async def run_all() -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        async with PipelineClient(coordinator, keys_dir=keys) as client:
            for cfg, value in configs:
                prepared = prepare_run(cfg, data)
                n_slots = prepared.clock.n_slots if prepared.clock is not None else 0
                eval_index = final_eval_index(cfg, n_slots)
                result = await run_lossy(
                    client,
                    prepared,
                    data,
                    stages=cfg.n_devices,
                    mode=args.wait_mode,
                    slot_s=args.slot_s,
                    wait_for_stages_s=args.wait_for_stages_s,
                    test_repeats=cfg.test_repeats,
                    test_eval_index=eval_index,
                    on_death=getattr(args, "on_death", "null-fill"),
                    replica_every=getattr(args, "replica_every", None),
                )
                # a stage that died mid-run: the simulation plays the same death
                death = result.death(prepared.n_data) if len(result.dead) == 1 else None
                simulated = (
                    train_in_process(prepared, data)
                    if death is None
                    else train_with_death(prepared, data, death)
                )
                test_matches = True
                if result.test is not None:
                    # without a null-filled dead device, or on the allocation switched to
                    simulated_test = evaluate_after(
                        prepared, simulated.params, data.x_test, result.test.spec, death
                    )
                    test_matches = result.test.same_as(simulated_test)
                summary = result.trace.summary()
                summary.pop("losses")
                rows.append(
                    {
                        "config": cfg.as_dict(),
                        "sweep_value": value,
                        "wait_mode": args.wait_mode,
                        "stages": result.stages,
                        **summary,
                        "late": result.late,
                        "wall_s": result.wall_s,
                        "protocol_errors": sum(result.protocol_errors.values()),
                        # what r-TX and ACK really put on the wire, all stages
                        "wire": result.wire_totals(),
                        # device -> [stage, first mini-batch that ran without it]
                        "dead": {str(d): list(v) for d, v in result.dead.items()},
                        # device -> first mini-batch of the allocation it was re-mapped by
                        "remapped": {str(d): k for d, _, k, *_ in result.remaps},
                        # test-time inference under loss across the stages
                        "final_test_acc": result.test_acc,
                        "final_test_acc_lossless": result.test_acc_lossless,
                        "test_traffic": None
                        if result.test is None
                        else result.test.traffic.as_dict(),
                        "test_matches_simulation": test_matches,
                        "matches_simulation": test_matches
                        and same_run(result.trace, simulated, rtol=1e-10),
                    }
                )
                print(
                    f"[{len(rows)}/{len(configs)}] {cfg.label} seed={cfg.seed} on stages"
                    f" steps={summary['n_data']} prop={summary['propagation_rate']:.3f}"
                    f" acc={rows[-1]['final_test_acc']}"
                    f" lossless={rows[-1]['final_test_acc_lossless']}"
                    f" wall={result.wall_s:.2f}s"
                    f" matches_simulation={rows[-1]['matches_simulation']}",
                    file=sys.stderr,
                )
        return rows

    return asyncio.run(run_all())
