"""Bytes of an asynchronous unit's moved state (a re-partition move or a replica).

The model of ``bench/async_recovery.py`` (an MLP of three equal hidden layers, Adam,
depth 3), trained in one process for a few mini-batches, then flushed: every unit's
state as :func:`~zpipe.training.async_regroup.unit_state_tensors` puts it on the
wire, against the previous format, which sent the newest weight version again
beside the live weights it equals. Pure arithmetic on tensors: no timing, so no
load average matters; it is printed anyway.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench._common import emit, loadavg, summary
from zpipe.models import ModelSpec, load_layer_sequence
from zpipe.models.weights import OPTIMIZER_KEY, unit_key
from zpipe.training.async_regroup import VERSION_KEY, needed_versions, unit_state_tensors
from zpipe.training.async_stage import AsyncStageCompute, UnitState

BENCH = "async_unit_bytes"
ADAM = {"name": "adam", "lr": 1e-3}


def previous_format(unit: int, state: UnitState, versions: range) -> dict[str, torch.Tensor]:
    out = {unit_key(unit, k): t for k, t in state.module.state_dict().items()}
    for v in versions:
        kept = state.versions[v]
        out.update({f"{unit_key(unit, n)}{VERSION_KEY}{v}": t for n, t in kept.items()})
    for name, entries in state.optimizer.items():
        out.update({f"{unit_key(unit, name)}{OPTIMIZER_KEY}{k}": t for k, t in entries.items()})
    return out


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6, help="mini-batches before the flush")
    args = parser.parse_args(argv)
    h = args.hidden
    spec = ModelSpec("mlp", {"dims": [64, h, h, h, 10], "activation": "relu"}, seed=1)
    sequence = load_layer_sequence(spec)
    units = sequence.build_units(0, sequence.num_units)
    compute = AsyncStageCompute(
        units, first=True, last=True, loss="cross_entropy", optimizer=dict(ADAM)
    )
    generator = torch.Generator().manual_seed(1)
    for b in range(args.steps):
        x, y = torch.randn(8, 64, generator=generator), torch.randint(0, 10, (8,))
        compute.forward(b, compute.updates, (x,), y)
        compute.backward(b)
        compute.step(b)
    versions = needed_versions(compute.updates, args.depth)
    totals = {"before": 0, "after": 0}
    for unit, state in enumerate(compute.export_units()):
        before = nbytes(previous_format(unit, state, versions))
        after = nbytes(unit_state_tensors(unit, state, versions))
        totals["before"] += before
        totals["after"] += after
        emit({"bench": BENCH, "unit": unit, "bytes_before": before, "bytes_after": after,
              "load": loadavg()})  # fmt: skip
    emit({"bench": BENCH, "hidden": h, "depth": args.depth,
          "replica_bytes_before": totals["before"], "replica_bytes_after": totals["after"],
          "load": loadavg()})  # fmt: skip
    summary(BENCH, unit_bytes_after_over_before=round(totals["after"] / totals["before"], 4))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
