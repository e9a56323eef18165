"""How soon a stage's speed watch sees its device slow down: forwards alone, or
forwards and backwards (issue 30).

Real processes on loopback, shaped as ``bench/training_async.py``'s ``r24_middle``:
four emulated devices (``--capacities``, default 4, 8, 20, 40), a residual MLP of
24 units (hidden 256) on even cuts, asynchronous 1F1B, the stages' watch on
(``forward_watch``, ``--factor``) and no scheduled look (each run ends at
``--steps`` mini-batches). Device ``d1`` turns ``--slowing`` times slower
``--change-s`` seconds after its start. Each run is traced, and d1's real pass
times, in the order they ran, go through two watches offline: one fed its forwards
only (what stages ran before) and one fed both kinds
(:class:`zpipe.training.forward_watch.ForwardWatch`). Both see the same series, so
the load and the look schedule (which make ``training_async``'s ``decide_s`` swing
between runs) cancel out of their ratio.

The onset is d1's first pass of a run of five passes, each over 4x its kind's median
before it (one or two slow passes are a hiccup). Per watch: the passes, forwards and
seconds from the onset's start to the end of the pass that completed its first
verdict. The stage's own verdict in the run (from its log) is printed beside them:
it matches the replay of the watch the stage ran. The summary: the medians, and
``both_over_forwards_seconds`` (median of the per-run ratios). Every line has the
load average: the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import emit, loadavg, summary
from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.log import read_events
from zpipe.models import ModelSpec
from zpipe.training.forward_watch import ForwardWatch, PassKind

ONSET_RUN = 5  # slow passes in a row that make an onset
ONSET_TIMES = 4.0  # over the kind's median before


def _passes(trace: Path, stage: str) -> list[tuple[float, PassKind, int, float]]:
    """``stage``'s forwards and backwards in the order they ran: (start, kind,
    mini-batch, seconds)."""
    events = json.loads(trace.read_text())["traceEvents"]
    pids = [
        e["pid"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name" and e["args"]["name"] == stage
    ]
    out = []
    for e in events:
        kind = e.get("name", "").split(" ")[0]
        if e.get("ph") == "X" and e.get("pid") in pids and kind in ("forward", "backward"):
            out.append((e["ts"] / 1e6, kind, int(e["args"]["mb"]), e["dur"] / 1e6))
    return sorted(out)


def _onset(passes: list[tuple[float, PassKind, int, float]]) -> int | None:
    def slow(i: int) -> bool:
        before = [s for _, kind, _, s in passes[:i] if kind == passes[i][1]]
        return len(before) >= 10 and passes[i][3] > ONSET_TIMES * statistics.median(before)

    starts = range(len(passes) - ONSET_RUN)
    return next((i for i in starts if all(slow(j) for j in range(i, i + ONSET_RUN))), None)


def _first_verdict(
    passes: list[tuple[float, PassKind, int, float]], onset: int, kinds: set[str], factor: float
) -> dict[str, Any] | None:
    watch = ForwardWatch(factor)
    for i, (start, kind, mb, seconds) in enumerate(passes):
        if kind in kinds and watch.observe(seconds, kind) is not None:
            if i < onset:
                return {"before_onset": True, "pass": [kind, mb]}
            return {
                "passes": i - onset + 1,
                "forwards": sum(1 for p in passes[onset : i + 1] if p[1] == "forward"),
                "seconds": round(start + seconds - passes[onset][0], 3),
                "pass": [kind, mb],
            }
    return None


def _stage_verdicts(log: str) -> list[dict[str, Any]]:
    keys = ("kind", "step", "ratio", "plan_epoch")
    return [{k: r.get(k) for k in keys} for r in read_events(log, "speed_changed")]


def one_run(args: argparse.Namespace, run: int, trace: Path) -> dict[str, Any]:
    caps = list(args.capacities)
    slow = caps[1]
    devices = [
        DeviceSpec(
            f"d{i}",
            threads=1,
            **(
                {"slowdown_schedule": f"0:{slow:g},{args.change_s:g}:{slow * args.slowing:g}"}
                if i == 1
                else {"slowdown": c}
            ),
        )
        for i, c in enumerate(caps)
    ]
    spec = ModelSpec(
        "mlp", {"dims": [64, *[256] * 23, 10], "activation": "relu", "residual": True}, seed=1
    )
    generator = torch.Generator().manual_seed(5 + run)
    batches = [
        (torch.randn(32, 64, generator=generator), torch.randint(0, 10, (32,), generator=generator))
        for _ in range(args.steps)
    ]
    load_before = loadavg()
    with LocalCluster(devices, log_level="info") as cluster:
        cluster.fit(
            spec,
            batches,
            optimizer={"name": "adam", "lr": 3e-4},
            num_microbatches=1,
            schedule="async-1f1b",
            partition=[[0, 6], [6, 12], [12, 18], [18, 24]],
            repartition={"first": 10**6, "every": 10**6, "forward_watch": args.factor},
            progress=False,
            trace=str(trace),
        )
        stage = _stage_verdicts(cluster.logs("d1"))
    passes = _passes(trace, "d1")
    onset = _onset(passes)
    line: dict[str, Any] = {"bench": "speed_watch_onset", "run": run, "stage_verdicts": stage[:2]}
    if onset is None:
        line["onset"] = None
    else:
        line["onset"] = [passes[onset][1], passes[onset][2]]
        line["forwards_only"] = _first_verdict(passes, onset, {"forward"}, args.factor)
        line["both_kinds"] = _first_verdict(passes, onset, {"forward", "backward"}, args.factor)
    line["loadavg_before"], line["loadavg"] = load_before, loadavg()
    emit(line)
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=160, help="mini-batches per run")
    parser.add_argument("--factor", type=float, default=2.0, help="the watch's factor")
    parser.add_argument("--slowing", type=float, default=10.0, help="d1's slowdown")
    parser.add_argument("--change-s", type=float, default=6.0)
    parser.add_argument("--capacities", type=float, nargs=4, default=[4.0, 8.0, 20.0, 40.0])
    parser.add_argument("--keep-traces", type=Path, default=None, metavar="DIR")
    args = parser.parse_args()
    lines = []
    with tempfile.TemporaryDirectory() as scratch:
        folder = args.keep_traces or Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        for run in range(args.runs):
            lines.append(one_run(args, run, folder / f"run{run}.json"))
    both = [ln for ln in lines if (ln.get("both_kinds") or {}).get("seconds") is not None]
    pairs = [ln for ln in both if (ln.get("forwards_only") or {}).get("seconds") is not None]

    def median_of(watch: str, key: str) -> float | None:
        values = [ln[watch][key] for ln in pairs]
        return statistics.median(values) if values else None

    summary(
        "speed_watch_onset",
        runs=len(lines),
        compared=len(pairs),
        forwards_only_passes=median_of("forwards_only", "passes"),
        both_kinds_passes=median_of("both_kinds", "passes"),
        forwards_only_seconds=median_of("forwards_only", "seconds"),
        both_kinds_seconds=median_of("both_kinds", "seconds"),
        both_over_forwards_seconds=(
            round(
                statistics.median(
                    ln["both_kinds"]["seconds"] / ln["forwards_only"]["seconds"] for ln in pairs
                ),
                3,
            )
            if pairs
            else None
        ),
        loadavg=loadavg(),
    )


if __name__ == "__main__":
    main()
