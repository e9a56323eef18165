"""zpipe at scale: emulated clusters of 2 to 64 devices, and a coordinator holding 300 peers.

Emulated clusters (PipeEdge's Fig. 4, throughput as devices are added): one
:class:`~zpipe.cluster.LocalCluster` of ``max(--sizes)`` homogeneous devices whose
stages are forked from this process (``fork_stages``) and emulate their compute
(``--emulate-compute``): each sleeps for the profiled time of its units and sends
zero tensors of the real shapes (ViT-Large by default, one image per
micro-batch). The profile's unit times are the model's FLOPs, counted on
the meta device, scaled so that one image takes ``--model-s`` seconds on one
device (8 s by default, about what PipeEdge's MinnowBoards take for ViT-Large:
1.95 images/s on 16 of them at a 7.48x speedup); a transformer block's four
sub-layers send up to 3.8 MB between stages. For each size N the client
streams ``N + --steady`` images through the first N devices, planned by the
coordinator's PipeEdge planner from that profile; the planner's prediction
(``throughput_samples_per_s``) is compared with the measured steady throughput
(results after the first, over their time): ``measured_over_predicted``, and the
speedup over the smallest size against the ideal (PipeEdge reports 7.48x at 16
devices against the 2-device run, ideal 8).

Recovery with many stages: a stream through ``--recovery-stages`` (32) devices,
one stage in the middle of the plan killed (SIGKILL) after ``--kill-after``
results: ``detection_s`` (silence until declared dead), ``replan_s`` (from then
until the survivors run the new plan) and ``recovery_s`` (kill to the first
result after the new plan: what a user waits, one pipeline latency more than
``resumed_s``, the kill to the client's notice of the new plan), as
``bench/recovery.py`` defines them.

Coordinator at scale: a real coordinator process and ``--peers`` (300)
heartbeat-only fake peers (:mod:`zpipe.testing.fake_peers`, one asyncio process)
for ``--hold-s`` seconds, against the same with ``--baseline-peers`` (30):
the coordinator's event-loop lag (how late its tick loop woke; p50, p99, from its
``loop_lag`` log), the heartbeat round trips the peers saw, its CPU share, and
false deaths (``stage_dead`` in its log, or a peer asked to register again).
``register_all_s_300``: from launching the coordinator to every peer registered,
split into ``coordinator_listening_s_300`` (its start-up: the interpreter and its
imports; torch is not among them until the first run request,
zpipe/coordinator/run_kinds.py) and ``register_after_listening_s_300``. Then the same
300 again under ``--oversubscribe`` (2) times as many busy-loop processes as there
are cores: ``loop_lag_p99_ms_oversubscribed`` is the worst 99th percentile of the
coordinator's loop lag over every window from its start to the hold's end, while
the peers register and while they heartbeat.

Launching (``--launch-stages``, 4): the time to start that many emulated stages and
see them registered, forked against fresh interpreters (``python -m zpipe.stage``),
and their mean proportional memory: ``fork_over_spawn_start_s``,
``fork_over_spawn_pss``.

Every figure is measured on this machine's cores, shared with whatever else runs
(load average printed): the emulated stages sleep, but their messages, heartbeats
and the coordinator really run. Prints JSON lines, then a summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch.utils.flop_counter import FlopCounterMode

from bench._common import emit, loadavg, summary
from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.cluster.coordinator_process import CoordinatorStart
from zpipe.log import configure_logging
from zpipe.models import ModelSpec, load_layer_sequence, run_units
from zpipe.planner.profile import ModelProfile
from zpipe.stage.emulated_compute import profile_with_times
from zpipe.testing.fake_peers import FakePeers

BENCH = "scale"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=".venv/bin/python bench/scale.py",
        description="Emulated-compute clusters of 2-64 devices (PipeEdge Fig. 4, measured "
        "over predicted throughput, recovery with 32 stages) and a coordinator with 300 "
        "fake peers (loop lag, false deaths). Prints JSON lines, then a summary.",
    )
    p.add_argument("--sizes", default="2,4,8,16,32,64", help="cluster sizes (default: 2..64)")
    p.add_argument("--model", default="vit-large", help="model preset (default: vit-large)")
    p.add_argument("--batch-size", type=int, default=1, help="images per micro-batch")
    p.add_argument(
        "--model-s", type=float, default=8.0, help="seconds per micro-batch on one device"
    )
    p.add_argument("--steady", type=int, default=8, help="results past the fill, per size")
    p.add_argument("--recovery-stages", type=int, default=32, help="devices of the recovery run")
    p.add_argument("--kill-after", type=int, default=8, help="results before the kill")
    p.add_argument("--recovery-batches", type=int, default=40, help="images of the recovery run")
    p.add_argument("--heartbeat-s", type=float, default=0.5, help="heartbeat interval")
    p.add_argument("--peers", type=int, default=300, help="fake peers (default: 300)")
    p.add_argument("--baseline-peers", type=int, default=30, help="fake peers of the baseline")
    p.add_argument("--hold-s", type=float, default=30.0, help="seconds the peers are held")
    p.add_argument("--peer-heartbeat-s", type=float, default=1.0, help="their heartbeat interval")
    p.add_argument(
        "--register-timeout-s",
        type=float,
        default=300.0,
        help="how long the peers wait for a coordinator that starts slowly (default: 300)",
    )
    p.add_argument(
        "--oversubscribe",
        type=float,
        default=2.0,
        help="busy-loop processes per core of the oversubscribed hold (default: 2)",
    )
    p.add_argument(
        "--skip-oversubscribed", action="store_true", help="leave the oversubscribed hold out"
    )
    p.add_argument("--launch-stages", type=int, default=4, help="stages of the launch section")
    p.add_argument("--skip-launch", action="store_true", help="leave fork against spawn out")
    p.add_argument("--skip-emulated", action="store_true", help="leave the clusters out")
    p.add_argument("--skip-recovery", action="store_true", help="leave the recovery run out")
    p.add_argument("--skip-peers", action="store_true", help="leave the fake peers out")
    p.add_argument("--quick", action="store_true", help="sizes 2,8,16; 2 s model; 10 s holds")
    p.add_argument(
        "--log-dir", default=None, help="keep the peers' coordinator logs here (default: not kept)"
    )
    p.add_argument(
        "--profile-dir",
        default=None,
        help="run each peers' coordinator under cProfile and keep its profile here, "
        "start-up included (default: not profiled)",
    )
    return p


# ------------------------------------------------------------ the profile


def unit_flops(spec: ModelSpec, batch_size: int) -> list[float]:
    """Each unit's forward FLOPs (on the meta device: nothing is allocated)."""
    sequence = load_layer_sequence(spec)
    with torch.device("meta"):
        units = sequence.build_units(0, sequence.num_units)
    values = tuple(t.to("meta") for t in sequence.example_input(batch_size))
    flops = []
    with torch.inference_mode():
        for unit in units:
            with FlopCounterMode(display=False) as counter:
                values = run_units([unit], values)
            flops.append(float(counter.get_total_flops()))
    return flops


def flop_profile(spec: ModelSpec, batch_size: int, model_s: float) -> ModelProfile:
    """The model's real byte counts, and unit times in proportion to their FLOPs (a
    unit of no matmul, a norm say, a hundredth of the mean) adding up to ``model_s``."""
    flops = unit_flops(spec, batch_size)
    floor = 0.01 * sum(flops) / len(flops)
    weights = [max(f, floor) for f in flops]
    total = sum(weights)
    return profile_with_times(spec, [model_s * w / total for w in weights], batch_size=batch_size)


# ------------------------------------------------------------ emulated clusters


def _steady_throughput(arrivals: list[float], samples_per_result: int) -> float | None:
    """Samples per second over the results after the first (the pipeline is full then)."""
    if len(arrivals) < 3 or arrivals[-1] <= arrivals[1]:
        return None
    return (len(arrivals) - 2) * samples_per_result / (arrivals[-1] - arrivals[1])


def _stream(
    cluster: LocalCluster,
    spec: ModelSpec,
    profile: ModelProfile,
    names: list[str],
    count: int,
    args: argparse.Namespace,
    *,
    kill_after: int | None = None,
    planned: list[str] | None = None,
) -> tuple[list[float], Any, float, str]:
    """Stream ``count`` images through ``names``; returns the arrivals, the report, the
    kill time (inf without one) and the victim: after ``kill_after`` results, the
    middle one of ``planned`` (the devices the plan uses, where known)."""
    sequence = load_layer_sequence(spec)
    batches = [sequence.example_input(args.batch_size, seed=i)[0] for i in range(count)]
    arrivals: list[float] = []
    killed_at = [math.inf]
    victim = [""]

    def progress(received: int, _sent: int) -> None:
        arrivals.append(time.monotonic())
        if kill_after is not None and received == kill_after and not victim[0]:
            used = planned or names
            victim[0] = used[len(used) // 2]
            killed_at[0] = time.monotonic()
            cluster.kill(victim[0])

    _, report = cluster.infer(
        spec,
        batches,
        profile=profile,
        planner="pipeedge",
        microbatch_size=args.batch_size,
        stage_names=names,
        max_in_flight=len(names) + 2,
        progress=progress,
    )
    return arrivals, report, killed_at[0], victim[0]


def _stage_pss_mb(cluster: LocalCluster) -> float | None:
    """Mean proportional set size of the stage processes (shared pages split)."""
    sizes = []
    for name, process in cluster.processes.items():
        if name == "coordinator" or process.poll() is not None:
            continue
        try:
            text = Path(f"/proc/{process.pid}/smaps_rollup").read_text()
        except OSError:
            return None
        for line in text.splitlines():
            if line.startswith("Pss:"):
                sizes.append(int(line.split()[1]) / 1024)
    return sum(sizes) / len(sizes) if sizes else None


def emulated_section(args: argparse.Namespace, sizes: list[int]) -> dict[str, Any]:
    spec = ModelSpec.preset(args.model)
    profile = flop_profile(spec, args.batch_size, args.model_s)
    largest = max([*sizes, args.recovery_stages if not args.skip_recovery else 0])
    devices = [DeviceSpec(f"d{i:02d}") for i in range(largest)]
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="zpipe-scale-") as tmp:
        path = Path(tmp) / "profile.json"
        profile.save(path)
        started = time.monotonic()
        with LocalCluster(
            devices,
            emulate_compute=path,
            fork_stages=True,
            measure_links=False,
            heartbeat_interval_s=args.heartbeat_s,
            start_timeout_s=300.0,
            log_level="warning",
        ) as cluster:
            start_s = time.monotonic() - started
            pss = _stage_pss_mb(cluster)
            emit({"bench": BENCH, "kind": "cluster_started", "stages": largest,
                  "start_s": round(start_s, 2), "stage_pss_mb_mean": pss,
                  "model": args.model, "units": profile.num_units, "model_s": args.model_s,
                  "activation_mb": round(max(profile.output_bytes(args.batch_size)) / 2**20, 3),
                  "loadavg": loadavg()})  # fmt: skip
            result["start_s_largest"] = round(start_s, 2)
            result["stage_pss_mb_mean"] = None if pss is None else round(pss, 1)
            curve: dict[int, dict[str, Any]] = {}
            plans: dict[int, list[str]] = {}
            for size in sizes:
                names = [d.name for d in devices[:size]]
                arrivals, report, _, _ = _stream(
                    cluster, spec, profile, names, size + args.steady + 2, args
                )
                plans[size] = [s.device for s in report.plan.stages]
                predicted = float(report.plan.predicted["throughput_samples_per_s"])
                measured = _steady_throughput(arrivals, args.batch_size)
                line = {
                    "bench": BENCH,
                    "kind": "emulated_cluster",
                    "devices": size,
                    "stages_planned": len(report.plan.stages),
                    "predicted_samples_per_s": round(predicted, 4),
                    "measured_samples_per_s": None if measured is None else round(measured, 4),
                    "measured_over_predicted": None
                    if measured is None
                    else round(measured / predicted, 4),
                    "loadavg": loadavg(),
                }
                curve[size] = line
                emit(line)
            smallest = min(sizes)
            base = curve[smallest]["measured_samples_per_s"]
            for size, line in curve.items():
                speedup = None if not base else line["measured_samples_per_s"] / base
                emit({"bench": BENCH, "kind": "fig4", "devices": size,
                      "speedup_over_smallest": None if speedup is None else round(speedup, 3),
                      "ideal": size / smallest})  # fmt: skip
            ratios = [c["measured_over_predicted"] for c in curve.values()]
            result["measured_over_predicted"] = {str(s): c["measured_over_predicted"]
                                                 for s, c in curve.items()}  # fmt: skip
            result["measured_over_predicted_min"] = min(r for r in ratios if r is not None)
            result["measured_over_predicted_max"] = max(r for r in ratios if r is not None)
            if 16 in curve and base:
                result["speedup_16_over_smallest"] = round(
                    curve[16]["measured_samples_per_s"] / base, 3
                )
            if not args.skip_recovery:
                planned = plans.get(args.recovery_stages)
                result.update(recovery_run(cluster, spec, profile, devices, planned, args))
    return result


def recovery_run(
    cluster: LocalCluster,
    spec: ModelSpec,
    profile: ModelProfile,
    devices: list[DeviceSpec],
    planned: list[str] | None,
    args: argparse.Namespace,
) -> dict[str, Any]:
    names = [d.name for d in devices[: args.recovery_stages]]
    arrivals, report, killed_at, victim = _stream(
        cluster,
        spec,
        profile,
        names,
        args.recovery_batches,
        args,
        kill_after=args.kill_after,
        planned=planned,
    )
    recovered = report.recoveries[0] if report.recoveries else None
    after = [t for t in arrivals if recovered is not None and t >= recovered["at"]]
    line = {
        "bench": BENCH,
        "kind": "recovery",
        "stages": args.recovery_stages,
        "victim": victim,
        "recovered": recovered is not None,
        "results": len(arrivals),
        "detection_s": recovered["detected_s"] if recovered else None,
        "replan_s": recovered["recovered_s"] if recovered else None,
        "resumed_s": round(recovered["at"] - killed_at, 3) if recovered else None,
        "recovery_s": round(after[0] - killed_at, 3) if after else None,
        "replayed": recovered["replayed"] if recovered else None,
        "stages_after": len(report.plan.stages),
        "heartbeat_s": args.heartbeat_s,
        "loadavg": loadavg(),
    }
    emit(line)
    n = args.recovery_stages
    return {
        f"recovery_s_{n}": line["recovery_s"],
        f"recovery_resumed_s_{n}": line["resumed_s"],
        f"recovery_detection_s_{n}": line["detection_s"],
        f"recovery_replan_s_{n}": line["replan_s"],
        "recovery_all_results": len(arrivals) == args.recovery_batches,
    }


# ------------------------------------------------------------ launching


def launch_section(args: argparse.Namespace) -> dict[str, Any]:
    spec = ModelSpec.preset(args.model)
    profile = flop_profile(spec, args.batch_size, args.model_s)
    devices = [DeviceSpec(f"l{i}") for i in range(args.launch_stages)]
    seen: dict[str, tuple[float, float | None]] = {}
    with tempfile.TemporaryDirectory(prefix="zpipe-launch-") as tmp:
        path = Path(tmp) / "profile.json"
        profile.save(path)
        for how, fork in (("spawn", False), ("fork", True)):
            started = time.monotonic()
            with LocalCluster(
                devices,
                emulate_compute=path,
                fork_stages=fork,
                measure_links=False,
                start_timeout_s=300.0,
                log_level="warning",
            ) as cluster:
                seen[how] = (time.monotonic() - started, _stage_pss_mb(cluster))
            emit({"bench": BENCH, "kind": "launch", "how": how, "stages": len(devices),
                  "start_s": round(seen[how][0], 2), "stage_pss_mb_mean": seen[how][1],
                  "loadavg": loadavg()})  # fmt: skip
    spawn_pss, fork_pss = seen["spawn"][1], seen["fork"][1]
    return {
        "fork_over_spawn_start_s": round(seen["fork"][0] / seen["spawn"][0], 3),
        "fork_over_spawn_pss": round(fork_pss / spawn_pss, 3) if fork_pss and spawn_pss else None,
    }


# ------------------------------------------------------------ fake peers


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# Spins until killed, or until the bench is gone: a bench that died of a signal (once,
# libzmq's assertion in the fake peers' process) left four of these spinning.
_SPIN = "import os\nparent = os.getppid()\nwhile os.getppid() == parent: pass"


def _busy_loops(count: int) -> list[subprocess.Popen[bytes]]:
    """``count`` processes that spin on a core each until killed."""
    return [
        subprocess.Popen([sys.executable, "-c", _SPIN], stdin=subprocess.DEVNULL)
        for _ in range(count)
    ]


def _stop(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        process.kill()
    for process in processes:
        process.wait()


def _at(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(event["timestamp"]).timestamp()


# how often the coordinator reports its loop lag (zpipe.coordinator.loop_lag)
LAG_REPORT_S = 10.0


def _wait_for_lag_report(log_path: Path, *, after: float, timeout_s: float) -> None:
    """Wait until the coordinator has logged a lag report later than ``after``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in log_path.read_text().splitlines():
            if line.startswith("{") and '"loop_lag"' in line and _at(json.loads(line)) > after:
                return
        time.sleep(0.5)


def bytecode_env(cache_dir: Path) -> dict[str, str]:
    """The environment of a coordinator that starts from compiled bytecode, as an
    installed one does (pip compiles at install; a checkout writes ``__pycache__`` at
    its first start). Where this environment forbids writing bytecode
    (PYTHONDONTWRITEBYTECODE, as in some sandboxes), every start compiled all of
    zpipe from source (0.3-0.5 s of CPU, 12 % of the start-up): the coordinator's
    imports are compiled once here, into a cache of the bench's own, and read from it."""
    env = dict(os.environ)
    if not sys.flags.dont_write_bytecode:
        return env
    env["PYTHONPYCACHEPREFIX"] = str(cache_dir)
    warm = {k: v for k, v in env.items() if k != "PYTHONDONTWRITEBYTECODE"}
    subprocess.run(
        [sys.executable, "-c", "import zpipe.cli.coordinator"],
        env=warm, check=True, timeout=600, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    return env


def hold_peers(
    count: int, args: argparse.Namespace, *, busy: int = 0, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """A coordinator process and ``count`` fake peers for ``--hold-s`` seconds, beside
    ``busy`` busy-loop processes started before the coordinator."""
    spinning = _busy_loops(busy)
    try:
        return _hold_peers(count, args, busy, env)
    finally:
        _stop(spinning)


def _hold_peers(
    count: int, args: argparse.Namespace, busy: int, env: dict[str, str] | None
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="zpipe-peers-") as tmp:
        log_path = Path(tmp) / "coordinator.log"
        # the coordinator binds port 0 and writes the endpoint it got: a port picked
        # here could be taken by another socket before the coordinator binds it
        endpoint_path = Path(tmp) / "coordinator.endpoint"
        launched_at = time.time()
        launched = time.monotonic()
        with open(log_path, "wb") as log_file:
            profiled: list[str] = []
            if args.profile_dir:
                Path(args.profile_dir).mkdir(parents=True, exist_ok=True)
                name = f"coordinator-{count}-peers-{busy}-busy-{os.getpid()}.prof"
                profiled = ["-m", "cProfile", "-o", str(Path(args.profile_dir) / name)]
            coordinator = subprocess.Popen(
                [sys.executable, *profiled, "-m", "zpipe.coordinator",
                 "--bind", "tcp://127.0.0.1:0", "--endpoint-file", str(endpoint_path),
                 "--heartbeat-interval", str(args.peer_heartbeat_s),
                 "--log-format", "json", "--log-level", "debug",
                 "--parent-pid", str(os.getpid())],
                stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            )  # fmt: skip

        held: list[float] = []  # time.time(): all registered, the hold began, it ended
        start_cpu: list[float] = []  # the coordinator's CPU seconds when all had registered

        async def hold() -> tuple[dict[str, Any], float, float]:
            endpoint = await CoordinatorStart(
                coordinator, endpoint_path, log_path.read_text, args.register_timeout_s
            ).wait_async()
            # from the launch, as when the peers connected before the coordinator listened
            started = launched
            async with FakePeers(
                endpoint, count, register_timeout_s=args.register_timeout_s
            ) as peers:
                registered_s = time.monotonic() - started
                held.append(time.time())  # every peer registered
                start_cpu.append(_cpu_s(coordinator.pid))
                await asyncio.sleep(2 * args.peer_heartbeat_s)  # the registrations settle
                peers.reset_stats()
                held.append(time.time())
                cpu0, t0 = _cpu_s(coordinator.pid), time.monotonic()
                await asyncio.sleep(args.hold_s)
                cpu = (_cpu_s(coordinator.pid) - cpu0) / (time.monotonic() - t0)
                held.append(time.time())
                return peers.summary().to_dict(), registered_s, cpu

        try:
            seen, registered_s, cpu = asyncio.run(hold())
            # the lag window in progress at the hold's end is reported up to 10 s later:
            # a stall in it (31.6 s once, before the receive loop gave turns) counts
            _wait_for_lag_report(log_path, after=held[-1], timeout_s=LAG_REPORT_S + 5.0)
        finally:
            coordinator.send_signal(signal.SIGTERM)
            try:
                coordinator.wait(timeout=30)
            except subprocess.TimeoutExpired:
                coordinator.kill()
                coordinator.wait()
        text = log_path.read_text()
        if args.log_dir:
            kept = Path(args.log_dir) / f"coordinator-{count}-peers-{busy}-busy-{os.getpid()}.log"
            kept.parent.mkdir(parents=True, exist_ok=True)
            kept.write_text(text)
        events = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    registered_at, hold_from, hold_to = held
    reports = [e for e in events if e.get("event") == "loop_lag"]
    # the coordinator's lag reports of windows (10 s each) wholly within the hold
    lags = [e for e in reports if hold_from + 10.0 <= _at(e) <= hold_to]
    listening = [_at(e) for e in events if e.get("event") == "coordinator_listening"]
    # and of every window that began before the hold's end (each window runs from the
    # report before it): its start, the registrations and the whole hold included
    starts = [*listening[:1], *(_at(e) for e in reports)]
    lags_all = [e for e, start in zip(reports, starts, strict=False) if start < hold_to]
    worst = max(lags, key=lambda e: e["p99_ms"]) if lags else None
    line = {
        "bench": BENCH,
        "kind": "coordinator_peers",
        "peers": count,
        "busy_processes": busy,
        "register_all_s": round(registered_s, 2),
        "coordinator_listening_s": round(listening[0] - launched_at, 2) if listening else None,
        "register_after_listening_s": round(registered_at - listening[0], 3) if listening else None,
        # what the start-up and the registrations cost in CPU: steadier under load
        "register_all_cpu_s": round(start_cpu[0], 3),
        "loop_lag_p99_ms_with_registration": max((e["p99_ms"] for e in lags_all), default=None),
        "loop_lag_max_ms_with_registration": max((e["max_ms"] for e in lags_all), default=None),
        "loop_lag_reports_with_registration": len(lags_all),
        # the loop thread's own CPU within a sample: a lag far above it waited for a core
        "loop_busy_p99_ms_with_registration": max(
            (e.get("busy_p99_ms", 0.0) for e in lags_all), default=None
        ),
        "loop_busy_max_ms_with_registration": max(
            (e.get("busy_max_ms", 0.0) for e in lags_all), default=None
        ),
        "loop_lag_p50_ms": None if worst is None else max(e["p50_ms"] for e in lags),
        "loop_lag_p99_ms": None if worst is None else worst["p99_ms"],
        "loop_lag_max_ms": None if worst is None else max(e["max_ms"] for e in lags),
        "loop_lag_reports": len(lags),
        "heartbeat_rtt_p50_ms": round(seen["round_trip_p50_s"] * 1e3, 3),
        "heartbeat_rtt_p99_ms": round(seen["round_trip_p99_s"] * 1e3, 3),
        "peers_own_lag": seen["own_lag"],
        "coordinator_cpu_share": round(cpu, 3),
        # its CPU (every thread) per heartbeat the peers sent during the hold
        "coordinator_cpu_us_per_heartbeat": round(cpu * args.hold_s / seen["heartbeats"] * 1e6, 1)
        if seen["heartbeats"]
        else None,
        "heartbeats": seen["heartbeats"],
        "acks": seen["acks"],
        # while the peers were held (after it, the bench closes them, then waits)
        "false_deaths": sum(
            1 for e in events if e.get("event") == "stage_dead" and _at(e) <= hold_to
        ),
        "suspected": sum(
            1 for e in events if e.get("event") == "stage_suspect" and _at(e) <= hold_to
        ),
        "asked_to_register_again": seen["register_again"],
        "loadavg": loadavg(),
    }
    emit(line)
    return line


def peers_section(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="zpipe-pyc-") as cache:
        return _peers_section(args, bytecode_env(Path(cache)))


def _peers_section(args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    base = hold_peers(args.baseline_peers, args, env=env)
    many = hold_peers(args.peers, args, env=env)
    n = args.peers
    result: dict[str, Any] = {
        "bytecode_cache": "PYTHONPYCACHEPREFIX" in env and bool(sys.flags.dont_write_bytecode),
        f"register_all_s_{n}": many["register_all_s"],
        f"register_all_cpu_s_{n}": many["register_all_cpu_s"],
        f"coordinator_listening_s_{n}": many["coordinator_listening_s"],
        f"register_after_listening_s_{n}": many["register_after_listening_s"],
    }
    if not args.skip_oversubscribed:
        busy = round(args.oversubscribe * (os.cpu_count() or 1))
        loaded = hold_peers(n, args, busy=busy, env=env)
        result.update(
            {
                "busy_processes": busy,
                "loop_lag_p99_ms_oversubscribed": loaded["loop_lag_p99_ms_with_registration"],
                "loop_lag_max_ms_oversubscribed": loaded["loop_lag_max_ms_with_registration"],
                "loop_busy_p99_ms_oversubscribed": loaded["loop_busy_p99_ms_with_registration"],
                "loop_busy_max_ms_oversubscribed": loaded["loop_busy_max_ms_with_registration"],
                "heartbeat_rtt_p99_ms_oversubscribed": loaded["heartbeat_rtt_p99_ms"],
                f"register_all_s_{n}_oversubscribed": loaded["register_all_s"],
                f"coordinator_listening_s_{n}_oversubscribed": loaded["coordinator_listening_s"],
                f"register_after_listening_s_{n}_oversubscribed": loaded[
                    "register_after_listening_s"
                ],
                "false_deaths_oversubscribed": loaded["false_deaths"]
                + loaded["asked_to_register_again"],
            }
        )

    def ratio(key: str) -> float | None:
        if not base[key] or many[key] is None:
            return None
        return round(many[key] / base[key], 3)

    return {
        "peers": args.peers,
        "loop_lag_p50_ms": many["loop_lag_p50_ms"],
        "loop_lag_p99_ms": many["loop_lag_p99_ms"],
        "loop_lag_p99_ratio_vs_baseline": ratio("loop_lag_p99_ms"),
        "heartbeat_rtt_p99_ms": many["heartbeat_rtt_p99_ms"],
        "coordinator_cpu_share": many["coordinator_cpu_share"],
        "coordinator_cpu_us_per_heartbeat": many["coordinator_cpu_us_per_heartbeat"],
        "cpu_ratio_vs_baseline": ratio("coordinator_cpu_share"),
        "false_deaths": many["false_deaths"] + many["asked_to_register_again"],
        **result,
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.sizes, args.model_s, args.hold_s = "2,8,16", 2.0, 15.0
        args.recovery_stages = min(args.recovery_stages, 16)
    configure_logging(level="warning")
    sizes = sorted({int(s) for s in args.sizes.split(",") if s.strip()})
    emit({"bench": BENCH, "kind": "setup", "sizes": sizes, "cores": os.cpu_count(),
          "loadavg": loadavg()})  # fmt: skip
    result: dict[str, Any] = {}
    if not args.skip_launch:
        result.update(launch_section(args))
    if not args.skip_emulated:
        result.update(emulated_section(args, sizes))
    if not args.skip_peers:
        result.update(peers_section(args))
    result["loadavg"] = loadavg()
    summary(BENCH, **result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
