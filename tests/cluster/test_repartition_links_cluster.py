"""Live re-partitioning costs the links in a real run: a planned asynchronous run's
looks have the links between its stages probed again while it trains (FTPipeHD
eq. 5's 2 x T_c; the pure parts are in tests/unit/training/test_repartition_links.py
and tests/unit/coordinator/test_repartition_links_flow.py)."""

from __future__ import annotations

import time
from itertools import pairwise

import torch

from tests._support.log_events import logged as _logged
from zpipe.cluster import LocalCluster
from zpipe.models import ModelSpec

SPEC = ModelSpec("mlp", {"dims": [12, 24, 24, 24, 20, 4], "activation": "gelu"}, seed=5)
ADAM = {"name": "adam", "lr": 0.01, "betas": [0.8, 0.99]}
DEADLINE_S = 60.0  # the probes run after the looks, in the background


def test_a_planned_async_run_probes_its_links_again_after_a_look(cluster: LocalCluster) -> None:
    g = torch.Generator().manual_seed(3)
    batches = [
        (torch.randn(4, 12, generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(12)
    ]
    since = len(cluster.logs("coordinator"))
    report = cluster.fit(
        SPEC,
        batches,
        optimizer=ADAM,
        num_microbatches=1,
        schedule="async-1f1b",
        # planned (no partition): the stages profile the model and measure their links;
        # a gain no measurement reaches keeps the cuts, so every look probes after it
        repartition={"first": 3, "every": 3, "gain": 0.95},
        progress=False,
    )
    assert report.steps == len(batches)
    assert report.training_plan is not None
    devices = list(report.training_plan.devices)
    looks = report.repartitions
    assert looks and not any(r["moved"] for r in looks)
    # every look costed the links between consecutive stages (eq. 5's 2 x T_c)
    considered = _logged(cluster.logs("coordinator")[since:], "repartition_considered")
    assert considered and all(
        len(e.get("links_mbit_s") or []) == len(devices) - 1 for e in considered
    ), considered
    consecutive = {f"{x}>{y}" for a, b in pairwise(devices) for x, y in ((a, b), (b, a))}
    deadline = time.monotonic() + DEADLINE_S
    while True:
        measured = _logged(cluster.logs("coordinator")[since:], "repartition_links_measured")
        if measured or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if len(devices) < 2:
        assert not measured  # one stage: no link to cost
        return
    assert measured, "no look had the links probed again"
    for event in measured:
        assert set(event["mbit_s"]) <= consecutive, event
        assert all(v > 0 for v in event["mbit_s"].values())
    # s2 sends through its emulated 400 Mbit/s uplink: a probe from it measures that
    from_s2 = [v for e in measured for k, v in e["mbit_s"].items() if k.startswith("s2>")]
    assert all(100.0 < v < 800.0 for v in from_s2), from_s2
