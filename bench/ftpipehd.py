"""Issue 30's five FTPipeHD figures in one summary line, each from real multi-process runs.

Runs four benches one after another, each as a process of its own, and prints their
JSON lines as they come, then ONE summary object with the five keys of issue 30's
"Done when", each beside its goal and whether it was met:

* ``async_replication_throughput_cost`` (goal <= 0.10), from
  ``bench/async_replication.py`` (part ``replication``): 1 - the throughput with live
  copies (chain every 50, global every 100) over the throughput without, three
  emulated 4x-slow devices, 200 mini-batches, 3 repeats (the flush comparison left
  out: ``--flush-every 0``);
* ``ftpipehd_over_pipedream_time_to_loss`` (goal >= 3, FTPipeHD 6.8) with
  ``measured_over_bound`` (no goal: the ratio over the cost model's bound for the
  same run), from ``bench/training_async.py`` (part ``time_to_loss``): only its
  repartition section's headline set-up ``r24_middle`` (the one its rule picks when
  every set-up runs and the model learns; ``--quick``: ``u12_middle``, shorter);
* ``async_fast_over_exact_progress_lost`` (goal < 0.5), from
  ``bench/async_recovery.py`` (part ``progress_lost``): fast recovery from live
  copies (chain 10 / global 20) against exact rollback to flush replicas every 20,
  b SIGKILLed after mini-batch 22, 26, 30, 34 and 38 (evenly across one global
  period: where a death falls decides what each loses, so the mean over the period
  is the fair figure);
* ``async_light_over_respipe_epoch_time_after_failure`` (goal >= 1.5, FTPipeHD 6.9)
  and ``async_heavy_over_light_recovery_time`` (goal >= 5), from
  ``bench/async_after_failure.py`` (part ``after_failure``; its defaults: 2 repeats).

Each part runs as a subprocess (``python -m bench.NAME``): the benches set their own
``SIGALRM`` and clusters, and their ``main`` prints its summary rather than returning
it, so a process per part keeps one part's crash, hang or leaked process from
touching the others; the part's summary line is read from its output. A part that
fails (non-zero exit without a summary, a missing key, past its timeout) leaves its
keys ``None``, ``met`` false, and an ``error`` in ``parts``; the other parts still
run and are reported. A part that exits 1 with a summary (``async_after_failure``
does when one trial failed) keeps its figures, and ``parts`` shows the exit status.

The summary: the five keys and ``measured_over_bound`` at the top level, ``goals``
and ``met`` (key -> goal text, key -> true/false), ``all_met``, ``parts`` (per part:
the command, exit status, wall seconds, load before and after, error, and a few of
its own summary's keys that explain the figure), ``load`` and ``wall_s``. The bench
exits 1 when a part failed, 0 otherwise (goals missed are figures, not failures).

Run: ``.venv/bin/python -m bench.ftpipehd`` (33 minutes on two shared cores at load
12-27: replication 2.6, time to loss 8.5, progress lost 8, after failure 13.4) or
``--quick`` (one repeat per part, b killed after 25 and 35 only, the 12-unit set-up
``u12_middle``, ``async_after_failure --quick``: 14 minutes at load 10-27).
``--parts`` runs a subset.
"""

from __future__ import annotations

import argparse
import json
import operator
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import emit, loadavg, summary

BENCH = "ftpipehd"
ROOT = Path(__file__).resolve().parent.parent

# key -> (comparison, threshold): the goals
GOALS: dict[str, tuple[str, float]] = {
    "async_replication_throughput_cost": ("<=", 0.10),
    "ftpipehd_over_pipedream_time_to_loss": (">=", 3.0),
    "async_fast_over_exact_progress_lost": ("<", 0.5),
    "async_light_over_respipe_epoch_time_after_failure": (">=", 1.5),
    "async_heavy_over_light_recovery_time": (">=", 5.0),
}
_COMPARE: dict[str, Callable[[float, float], bool]] = {
    "<=": operator.le,
    "<": operator.lt,
    ">=": operator.ge,
    ">": operator.gt,
}


@dataclass(frozen=True)
class Part:
    """One bench run for some of the keys: its module, arguments, and which of its
    summary's keys become which of ours (``keys``) or explain them (``context``)."""

    name: str
    module: str
    args: str  # the bench's flags, split on spaces
    quick_args: str
    keys: Mapping[str, str]  # ours -> the part summary's
    context: tuple[str, ...] = ()
    timeout_s: int = 1200

    def argv(self, quick: bool) -> list[str]:
        extra = (self.quick_args if quick else self.args).split()
        return [sys.executable, "-m", f"bench.{self.module}", *extra, "--timeout",
                str(self.timeout_s)]  # fmt: skip


PARTS: tuple[Part, ...] = (
    Part(
        "replication",
        "async_replication",
        "--flush-every 0",
        "--flush-every 0 --repeats 1 --steps 120",
        {"async_replication_throughput_cost": "async_replication_throughput_cost"},
        ("copies_kept", "chain_every", "global_every", "steps"),
        timeout_s=1200,
    ),
    Part(
        "time_to_loss",
        "training_async",
        "--skip-comparison --skip-straggler --setups r24_middle",
        "--skip-comparison --skip-straggler --setups u12_middle",
        {
            "ftpipehd_over_pipedream_time_to_loss": "ftpipehd_over_pipedream_time_to_loss",
            "measured_over_bound": "ftpipehd_headline_measured_over_bound",
        },
        ("ftpipehd_headline_setup", "ftpipehd_headline_bound", "ftpipehd_setups"),
        timeout_s=1200,
    ),
    Part(
        "progress_lost",
        "async_recovery",
        "--skip-flush-cost --skip-kill --steps 50 --repeats 1 --fast-kill-after 22 26 30 34 38",
        "--skip-flush-cost --skip-kill --steps 44 --repeats 1 --fast-kill-after 25 35",
        {"async_fast_over_exact_progress_lost": "async_fast_over_exact_progress_lost"},
        (
            "fast_progress_lost",
            "exact_progress_lost",
            "fast_progress_lost_if_instant",
            "async_fast_over_exact_progress_lost_if_instant",
            "async_fast_over_exact_model_progress_lost",
            "kill_points",
            "chain_copy_transfer_mb",
        ),
        timeout_s=1200,
    ),
    Part(
        "after_failure",
        "async_after_failure",
        "",
        "--quick",
        {
            "async_light_over_respipe_epoch_time_after_failure": (
                "async_light_over_respipe_epoch_time_after_failure"
            ),
            "async_heavy_over_light_recovery_time": "async_heavy_over_light_recovery_time",
        },
        (
            "async_heavy_over_light_recovery_time_with_detection",
            "light_over_respipe_per_repeat",
            "light_over_respipe_after_over_before",
            "by_system",
            "failed_trials",
            "error",
            "logs",  # the cluster's process logs, kept when a trial or the cluster failed
        ),
        timeout_s=1800,  # three repeats, --quick too
    ),
)
KEYS: tuple[str, ...] = (*GOALS, "measured_over_bound")


@dataclass
class PartResult:
    """What one part's run left: its summary line (None: none came) and how it ended."""

    name: str
    command: list[str]
    rc: int | None = None
    wall_s: float = 0.0
    load_before: list[float] | None = None
    load_after: list[float] | None = None
    summary: dict[str, Any] | None = None
    error: str | None = None
    tail: list[str] = field(default_factory=list)


def goal_text(key: str) -> str:
    comparison, threshold = GOALS[key]
    return f"{comparison} {threshold:g}"


def goal_met(key: str, value: Any) -> bool:
    """Whether ``value`` meets ``key``'s goal; a missing or non-numeric figure does not."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    comparison, threshold = GOALS[key]
    return _COMPARE[comparison](float(value), threshold)


def summary_of(lines: Iterable[str], bench: str) -> dict[str, Any] | None:
    """The last summary object of ``bench`` among a part's output lines (non-JSON
    lines and other benches' objects skipped), or None."""
    found: dict[str, Any] | None = None
    for line in lines:
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict) and obj.get("summary") is True and obj.get("bench") == bench:
            found = obj
    return found


def part_error(part: Part, result: PartResult) -> str | None:
    """Why ``part`` gave no figures (None: it did). A part that exits non-zero but
    printed its summary keeps its figures: the exit status is reported apart."""
    if result.error is not None:
        return result.error
    if result.summary is None:
        where = "; ".join(result.tail[-3:])
        return f"exit status {result.rc}, no summary line" + (f": {where}" if where else "")
    missing = [theirs for theirs in part.keys.values() if theirs not in result.summary]
    if missing:
        return f"its summary lacks {missing}"
    return None


def assemble(
    parts: Sequence[Part],
    results: Mapping[str, PartResult],
    *,
    load: list[float] | None,
    wall_s: float,
) -> dict[str, Any]:
    """The one summary's fields (without ``bench``/``summary``) from the parts' results:
    every key of ``KEYS`` (None where its part gave no figure), its goal and whether it
    was met, and per part how it ran."""
    values: dict[str, Any] = dict.fromkeys(KEYS)
    by_part: dict[str, Any] = {}
    for part in parts:
        result = results.get(part.name)
        if result is None:  # not run (``--parts``)
            continue
        error = part_error(part, result)
        theirs = result.summary or {}
        for ours, key in part.keys.items():
            values[ours] = theirs.get(key)
        by_part[part.name] = {
            "command": " ".join(["python", *result.command[1:]]),
            "rc": result.rc,
            "wall_s": round(result.wall_s, 1),
            "load_before": result.load_before,
            "load_after": result.load_after,
            "error": error,
            **{key: theirs[key] for key in part.context if key in theirs},
        }
    met = {key: goal_met(key, values[key]) for key in GOALS}
    return {
        **values,
        "goals": {key: goal_text(key) for key in GOALS},
        "met": met,
        "all_met": all(met.values()),
        "failed_parts": [name for name, info in by_part.items() if info["error"] is not None],
        "parts": by_part,
        "load": load,
        "wall_s": round(wall_s, 1),
    }


def run_part(part: Part, quick: bool, *, grace_s: float = 60.0) -> PartResult:
    """Run ``part`` as a process of its own, echoing its JSON lines to our stdout and its
    stderr to ours, and return how it ended. The part has its own
    ``--timeout``; past that plus ``grace_s`` it gets SIGINT (its clusters close on the
    way out), and SIGKILL 30 s later."""
    command = part.argv(quick)
    result = PartResult(part.name, command, load_before=loadavg())
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    started = time.monotonic()
    lines: list[str] = []
    try:
        proc = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, start_new_session=True,
        )  # fmt: skip
    except OSError as exc:
        result.error = f"could not start: {exc}"
        return result
    errors: list[str] = []
    # its stderr passes through, its last lines kept for the error
    relay = threading.Thread(target=_relay, args=(proc.stderr, errors), daemon=True)
    relay.start()
    expired: list[str] = []

    def stop() -> None:
        expired.append("timeout")
        _signal_group(proc, signal.SIGINT)
        killer = threading.Timer(30.0, _signal_group, (proc, signal.SIGKILL))
        killer.daemon = True
        killer.start()

    timer = threading.Timer(part.timeout_s + grace_s, stop)
    timer.daemon = True
    timer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            lines.append(line)
            sys.stdout.write(line + "\n")
            sys.stdout.flush()
        result.rc = proc.wait()
        relay.join(timeout=10.0)
    finally:
        timer.cancel()
    result.wall_s = time.monotonic() - started
    result.load_after = loadavg()
    result.tail = [line for line in [*lines, *errors] if line.strip()][-5:]
    result.summary = summary_of(lines, part.module)
    if expired:
        result.error = f"ran past {part.timeout_s + grace_s:g} s and was stopped"
    return result


def _relay(stream: IO[str] | None, keep: list[str]) -> None:
    """Copy ``stream`` to our stderr line by line, keeping its last 20 lines in ``keep``."""
    if stream is None:
        return
    for line in stream:
        sys.stderr.write(line)
        sys.stderr.flush()
        keep.append(line.rstrip("\n"))
        del keep[:-20]


def _signal_group(proc: subprocess.Popen[str], signum: int) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=".venv/bin/python -m bench.ftpipehd",
        description="Issue 30's five FTPipeHD figures, each from its own bench run as a "
        "process; the benches' JSON lines, then one summary with every goal.",
    )
    p.add_argument("--quick", action="store_true", help="a short version of every part")
    p.add_argument(
        "--parts",
        nargs="+",
        choices=[part.name for part in PARTS],
        default=[part.name for part in PARTS],
        help="the parts to run (default: all)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    started = time.monotonic()
    chosen = [part for part in PARTS if part.name in args.parts]
    results: dict[str, PartResult] = {}
    for part in chosen:
        emit({"bench": BENCH, "part": part.name, "starting": True, "load": loadavg()})
        results[part.name] = run_part(part, args.quick)
    fields = assemble(chosen, results, load=loadavg(), wall_s=time.monotonic() - started)
    summary(BENCH, quick=args.quick, **fields)
    return 1 if fields["failed_parts"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
