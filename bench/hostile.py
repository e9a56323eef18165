"""Hostile peers against a live inference stream: does any process crash, hang, lose a
live stage or grow without bound?

One :class:`~zpipe.cluster.LocalCluster` (a coordinator, ``--stages`` stage
processes that stream and one idle stage, on loopback, a tiny MLP) streams batches
while this process attacks every port it can reach, one attack class after another:

* ``factory``: a ``run_request`` naming ``os:system`` as a model factory, whose
  command would create a marker file (it must not appear);
* ``model_bomb``: a ``run_request`` for a built-in MLP of ``dims [10**9, 10**9]``
  (4 EB of weights), which must be refused before anything is allocated;
* ``backup_plant`` and ``fetch_units``: ``backup`` messages of 4 MiB under made-up
  owners to every stage's probe port (none may be kept), and ``fetch_units`` of
  another stage's snapshot from every probe port (no units may come back);
* ``poison_shape``: valid-looking data messages whose tensor has no elements but a
  dimension of 2**63 (or ``[0, 2**62, 2**62]``);
* ``garbage``: random bytes in 1-4 frames;
* ``fill_and_hang_up``: a PUSH that connects to a data port, sends 40 small messages
  and hangs up at once (libzmq 4.3.5 once aborted with ``!_io_error``);
* ``flood``: small messages as fast as the socket takes them;
* ``probe_flood``: ``--probe-flood-connections`` connections at once flood one
  stage's probe port for ``--probe-flood-s`` (issue 33, finding 6); its line carries
  the target's CPU seconds, the coordinator's ``stage_suspect`` and ``stage_dead``
  lines meanwhile, and the target's ``connection_cut`` lines (``cut_lines``, a floor:
  rate-limited) and probe port reopens (``reopens``); ``probe_flood_control`` sends
  the same floods to a process that only receives (what the attacker's and the
  machine's load cost);
* ``raw_tcp`` and ``connection_flood``: plain TCP connections that send junk, and
  many connections opened and dropped;
* ``big_frames``: ``--big-count`` frames of ``--big-mb`` MB to each data port;

and issue 33's findings, each a class (``python -m bench.hostile --only CLASS``):

* ``frame_amplification`` (finding 1): ``--amp-connections`` connections each send
  ``--amp-messages`` messages of ``--amp-frames`` 1-byte frames to the coordinator;
* ``max_model_bypass`` (finding 2): a stage of its own with ``--max-model-mb 64`` is
  asked, through a coordinator of its own, for the always-allowed example factory
  with a hidden width of ``--bypass-hidden`` (must be refused, the stage not grown);
* ``data_port_frames`` (finding 3): ``--dp-connections`` connections each send one
  message of ``--dp-frames`` frames of ``--dp-kb`` kB to the idle stage's data port
  and to the first streaming stage's; its sub-case ``data_port_frames_unadmitted``
  (run with it) sends the same from 127.0.0.2, an address no assignment names: every
  handshake must be refused (``handshakes_refused``, ``handshakes_admitted``);
* ``fl_identities`` (finding 4): an fl-server of its own (FedAsync, one real
  fl-client): absurd registrations (each must get ``fl_error``), ``--fl-identities``
  silent client ids from one peer (global updates per window before and during),
  one message of 16 frames of 60 MB;
* ``half_bulk`` (finding 5): a registered fake stage leaves 4 bulk transfers
  announced at 1 GiB with 192 MB sent each and goes silent (the coordinator's
  memory after the fake's ``stage_dead``);
* ``slowloris`` (finding 7): ``--slow-connections`` TCP connections that each speak
  ZMTP by hand, send ``--slow-mb`` MB of a 2 GiB-1 frame to the coordinator and hold.

Finding 8 (log volume) is measured for every class: the log bytes each process
wrote in the class's window, and the events that took most of them.

Each class is judged in its own window, from just before its first attack to the
stream's next output after its last: crashes (a process gone), hangs (no output
within ``--stall-s`` after the class), false deaths (``stage_dead`` for a stage that
is not the class's own fake), the stream's exactness (the client compares every
output with a single-process forward as it arrives) and the peak resident memory
sampled meanwhile over each process's idle value. Prints one JSON line per class
(with ``goals_met``) and one summary: 0 crashes, 0 hangs, 0 false deaths, the stream
exact, peak RSS under 2x idle. Linux only (reads ``/proc``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, BinaryIO

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import zmq

from bench._common import emit, loadavg, summary
from bench._hostile_attacker import Attacker
from bench._hostile_judge import (
    RSS_GOAL,
    Snapshot,
    class_goals_met,
    log_events,
    merge,
    stage_deaths,
    stream_marks,
    window_figures,
)
from bench._hostile_plan import SUB_CASES, Step, attack_plan, peer_request_steps
from bench._hostile_proc import RssSampler, cpu_s, mib, rss_kib
from bench._hostile_wire import garbage_messages, poison_messages
from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.models import ModelSpec, build_full_model, load_layer_sequence

# what bench/chaos.py's malformed bursts take from here
__all__ = ["Attacker", "_rss_kib", "garbage_messages", "main", "poison_messages"]
_rss_kib = rss_kib

SPEC = ModelSpec("mlp", {"dims": [32, 64, 64, 64, 16]})
IDLE_STAGE = "idle0"


def run_stream_client(
    coordinator: str, sink: str, stages: list[str], folder: Path, args: argparse.Namespace
) -> dict[str, Any]:
    """The client under attack (its own process, so that its crash is seen, not shared):
    stream batches until ``folder/stop`` appears (``folder/started`` once the first
    output is in), marking each output in ``folder/marks`` as it arrives (``1``: equal
    to a single-process forward, ``0``: not), then compare every output again."""
    from zpipe.client import PipelineClient
    from zpipe.config import Timeouts

    generator = torch.Generator().manual_seed(args.seed)
    sent: list[tuple[torch.Tensor]] = []
    outputs: list[Any] = []
    model = build_full_model(SPEC).eval()

    async def feed() -> Any:
        while not (folder / "stop").exists() and len(sent) < args.batches:
            batch = (torch.randn(4, 32, generator=generator),)
            sent.append(batch)
            yield batch
            await asyncio.sleep(args.pace_s)

    async def run(marks: BinaryIO) -> None:
        timeouts = Timeouts(heartbeat_interval_s=0.5)
        async with PipelineClient(coordinator, sink_bind=sink, timeouts=timeouts) as client:
            # where the sink was bound (port 0), for the attacks: written whole
            (folder / "sink.tmp").write_text(client.sink_endpoint)
            (folder / "sink.tmp").rename(folder / "sink")
            stream = client.infer_stream(SPEC, feed(), microbatch_size=2, stage_names=stages)
            async for output in stream:
                if not outputs:
                    (folder / "started").touch()
                with torch.no_grad():
                    expected = model(*sent[len(outputs)])  # a tuple, as the stream's output
                marks.write(b"1" if torch.allclose(output[0], expected[0], atol=1e-5) else b"0")
                outputs.append(output)

    started = time.monotonic()
    try:
        with open(folder / "marks", "ab", buffering=0) as marks:
            asyncio.run(run(marks))
    except Exception as exc:
        (folder / "started").touch()
        peak = rss_kib(os.getpid(), "VmHWM")
        return {"ok": False, "error": repr(exc), "batches": len(outputs), "peak": peak}
    with torch.no_grad():
        expected = [model(*b) for b in sent]
    exact = len(outputs) == len(expected) and all(
        torch.allclose(o[0], e[0], atol=1e-5) for o, e in zip(outputs, expected, strict=True)
    )
    seconds = round(time.monotonic() - started, 3)
    peak = rss_kib(os.getpid(), "VmHWM")
    return {"ok": True, "exact": exact, "batches": len(outputs), "seconds": seconds, "peak": peak}


def _last_error(log: str) -> str:
    """The last line of a process's log that says why it stopped."""
    lines = [ln for ln in log.splitlines() if ln.strip()]
    for line in reversed(lines):
        if any(w in line for w in ("Error", "error", "Assertion", "Traceback", "exit")):
            return line[-300:]
    return lines[-1][-300:] if lines else ""


def _suspects(log: str) -> list[dict[str, Any]]:
    """The coordinator's ``stage_suspect`` lines: a stage silent past its deadline."""
    return [
        json.loads(line)
        for line in log.splitlines()
        if '"stage_suspect"' in line and line.startswith("{")
    ]


# a ROUTER that receives and discards (probe_flood_control's target); it binds port 0
# and prints where (a port picked by the bench could be taken before it bound it)
_RECEIVER = (
    "import zmq\n"
    "ctx = zmq.Context(); sock = ctx.socket(zmq.ROUTER); sock.bind('tcp://127.0.0.1:0')\n"
    "print(sock.getsockopt_string(zmq.LAST_ENDPOINT), flush=True)\n"
    "while True:\n"
    "    sock.recv_multipart()\n"
)


def _receiver_endpoint(receiver: subprocess.Popen[str], timeout_s: float) -> str:
    """The endpoint the receiver printed once bound, within ``timeout_s``."""
    assert receiver.stdout is not None
    ready, _, _ = select.select([receiver.stdout], [], [], timeout_s)
    line = receiver.stdout.readline().strip() if ready else ""
    if not line.startswith("tcp://"):
        receiver.kill()
        receiver.wait()
        raise RuntimeError(f"the control receiver did not say where it listens: {line!r}")
    return line


class Watch:
    """What the bench reads between attacks: the processes, their logs (from where it
    last read), the stream's marks."""

    def __init__(self, cluster: LocalCluster, pids: dict[str, int], folder: Path) -> None:
        self.cluster = cluster
        self.pids = pids
        self.folder = folder
        self.client: subprocess.Popen[bytes] | None = None
        self._offsets: dict[str, int] = {}
        self._deaths: tuple[str, ...] = ()
        self.window_text: dict[str, str] = {}

    def marks(self) -> tuple[int, int]:
        path = self.folder / "marks"
        return stream_marks(path.read_bytes() if path.exists() else b"")

    def _new_text(self, name: str) -> str:
        assert self.cluster.log_dir is not None
        path = self.cluster.log_dir / f"{name}.log"
        try:
            with open(path, "rb") as f:
                f.seek(self._offsets.get(name, 0))
                data = f.read()
        except OSError:
            return ""
        self._offsets[name] = self._offsets.get(name, 0) + len(data)
        return data.decode(errors="replace")

    def snapshot(self) -> Snapshot:
        alive = {name: proc.poll() is None for name, proc in self.cluster.processes.items()}
        if self.client is not None:
            alive["client"] = self.client.poll() is None or self.client.returncode == 0
        sizes = {}
        for name in self.cluster.processes:
            text = self._new_text(name)
            self.window_text[name] = self.window_text.get(name, "") + text
            if name == "coordinator":
                self._deaths += stage_deaths(text)
            sizes[name] = self._offsets.get(name, 0)
        outputs, mismatches = self.marks()
        return Snapshot(outputs, mismatches, self._deaths, alive, sizes)

    def resumed_after(self, outputs: int, stall_s: float) -> float | None:
        """Seconds until the stream gives an output past ``outputs``; None if it
        gives none within ``stall_s`` (or its client is gone)."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < stall_s:
            if self.marks()[0] > outputs:
                return round(time.monotonic() - t0, 3)
            if self.client is not None and self.client.poll() is not None:
                return None
            time.sleep(0.05)
        return None

    def wait_for_death(self, name: str, timeout_s: float) -> float | None:
        """Seconds until the coordinator declares ``name`` dead (None: not in time)."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if name in stage_deaths(self.cluster.logs("coordinator")):
                return round(time.monotonic() - t0, 2)
            time.sleep(0.25)
        return None


def _run_step(
    step: Step,
    attacker: Attacker,
    watch: Watch,
    idle: dict[str, int | None],
    args: argparse.Namespace,
    marks: dict[str, Any],
) -> dict[str, Any]:
    """One attack in its window; the window's figures and the attack's own."""
    watch.window_text = {}
    before = watch.snapshot()
    sampler = RssSampler(watch.pids).start()
    target_pid = watch.pids.get(step.target) if step.target else None
    rss_before = rss_kib(target_pid) if target_pid else None
    cpu_before = cpu_s(target_pid) if target_pid and step.cpu else None
    suspects_before = len(_suspects(watch.cluster.logs("coordinator"))) if step.cpu else 0
    marks.clear()
    marks["target_pid"] = target_pid
    t0 = time.monotonic()
    extra: dict[str, Any] = {}
    try:
        result = step.attack(attacker)
        sent, extra = (result, {}) if isinstance(result, int) else result
    except Exception as exc:  # the attacker's own failure, not the target's
        sent, extra = 0, {"attacker_error": repr(exc)[:300]}
    seconds = time.monotonic() - t0
    outputs_at_end = watch.marks()[0]
    for name in step.expected_deaths:
        extra["declared_dead_after_s"] = watch.wait_for_death(name, args.death_s)
    if step.leave_s:
        time.sleep(step.leave_s)
    resumed = watch.resumed_after(outputs_at_end, args.stall_s)
    peak = sampler.stop()
    after = watch.snapshot()
    figures = window_figures(
        before,
        after,
        peak_kib=peak,
        idle_kib=idle,
        resumed_s=resumed,
        expected_deaths=step.expected_deaths,
    )
    if target_pid:
        extra.update(
            {
                "target": step.target,
                "rss_before_mib": mib(rss_before),
                "rss_peak_mib": mib(peak.get(step.target or "")),
                "rss_after_mib": mib(marks.get("rss_sent")),
                "rss_after_leave_mib": mib(rss_kib(target_pid)),
            }
        )
    if step.cpu and target_pid:
        cpu_after = cpu_s(target_pid)
        new = _suspects(watch.cluster.logs("coordinator"))[suspects_before:]
        mine = [e for e in new if e.get("stage") == step.target]
        extra["cpu_s"] = (
            round(cpu_after - cpu_before, 2)
            if cpu_after is not None and cpu_before is not None
            else None
        )
        extra["suspects"] = len(mine)
        extra["max_silent_s"] = max(
            (float(e["silent_s"]) for e in mine if "silent_s" in e), default=None
        )
        extra["suspects_other_stages"] = len(new) - len(mine)
        # what the target's probe port did about it (connection_cut lines are
        # rate-limited per peer address and port, so a floor; reopens are all logged)
        mine_text = watch.window_text.get(step.target or "", "")
        extra["cut_lines"] = mine_text.count('"connection_cut"')
        extra["reopens"] = mine_text.count('"probe_port_reopened"')
    # liveness seen from both ends: a stage's "coordinator_away", the coordinator's
    # "stage_suspect" (finding 1 made stages log coordinator_away 13 times)
    texts = watch.window_text
    figures["coordinator_away"] = sum(
        t.count('"coordinator_away"') for n, t in texts.items() if n != "coordinator"
    )
    # ...and a stage that found the coordinator silent past its --coordinator-timeout
    # but its connection up, so waited on (it exited before: issue 33, 60.6 s)
    figures["silent_but_connected"] = sum(
        t.count('"coordinator_silent_but_connected"')
        for n, t in texts.items()
        if n != "coordinator"
    )
    figures["stage_suspect"] = texts.get("coordinator", "").count('"stage_suspect"')
    top = {n: log_events(t) for n, t in texts.items() if t}
    figures["log_top_events"] = {n: ev for n, ev in top.items() if ev}
    figures["sent"] = sent
    figures["seconds"] = round(seconds, 3)
    figures["extra"] = extra
    return figures


def _add_to_class(entry: dict[str, Any], endpoint: str, figures: dict[str, Any]) -> None:
    extra = figures.pop("extra")
    top = figures.pop("log_top_events")
    entry["sent"] = entry.get("sent", 0) + figures.pop("sent")
    entry["targets"] = entry.get("targets", 0) + 1
    entry["seconds"] = round(entry.get("seconds", 0.0) + figures.pop("seconds"), 3)
    for key in ("coordinator_away", "silent_but_connected", "stage_suspect"):
        entry[key] = entry.get(key, 0) + figures.pop(key)
    merge(entry, figures)
    if top:
        entry.setdefault("log_top_events", []).append({"endpoint": endpoint, **top})
    if extra:
        entry.setdefault("per_target", []).append({"endpoint": endpoint, **extra})
        if "refused" in extra:  # every target refused what it must
            entry["refused"] = bool(entry.get("refused", True)) and bool(extra["refused"])
        for key in ("kept", "leaked_units"):
            if key in extra:
                entry[key] = entry.get(key, 0) + int(extra[key])
        crashes = int(extra.get("target_crashes", 0))
        entry["crashes"] = entry.get("crashes", 0) + crashes
        entry["target_crashes"] = entry.get("target_crashes", 0) + crashes
        entry["hangs"] = entry.get("hangs", 0) + int(extra.get("target_hangs", 0))
        # a class's own target (its own stage, an fl-server) is judged as the cluster is
        ratio = extra.get("target_peak_over_idle_rss")
        if ratio is not None and ratio > (entry.get("peak_over_idle_rss") or 0.0):
            entry["peak_over_idle_rss"] = ratio
            entry["peak_over_idle_process"] = f"{endpoint}'s target"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--stages", type=int, default=3, help="streaming stage processes (default: 3)")
    a("--batches", type=int, default=1_000_000, help="most batches streamed")
    a("--pace-s", type=float, default=0.02, help="seconds between batches")
    a("--messages", type=int, default=2000, help="messages per poison/garbage attack")
    a("--rounds", type=int, default=20, help="connections per hang-up/TCP attack")
    a("--flood-s", type=float, default=2.0, help="seconds of each flood")
    a("--probe-flood-s", type=float, default=10.0, help="seconds of each probe port's flood")
    a("--probe-flood-connections", type=int, default=4, help="connections per probe flood")
    a("--only", default="", help="comma-separated attack classes to run (default: all)")
    a("--big-count", type=int, default=8, help="big frames per data port")
    a("--big-mb", type=int, default=200, help="size of a big frame in MB")
    a("--amp-connections", type=int, default=3, help="frame_amplification's connections")
    a("--amp-messages", type=int, default=6, help="frame_amplification's messages each")
    a("--amp-frames", type=int, default=1_000_000, help="frames of one such message")
    a("--bypass-hidden", type=int, default=16_384, help="max_model_bypass's hidden width")
    a("--dp-connections", type=int, default=3, help="data_port_frames' connections")
    a("--dp-frames", type=int, default=8000, help="frames of its one message each")
    a("--dp-kb", type=int, default=60, help="kB of one such frame")
    a("--fl-identities", type=int, default=300, help="client ids fl_identities registers")
    a("--fl-window-s", type=float, default=20.0, help="seconds of each updates window")
    a("--bulk-transfers", type=int, default=4, help="half_bulk's transfers")
    a("--bulk-mb", type=int, default=192, help="MB half_bulk sends of each 1 GiB one")
    a("--slow-connections", type=int, default=8, help="slowloris' connections")
    a("--slow-mb", type=int, default=200, help="MB each sends of its 2 GiB-1 frame")
    a("--hold-s", type=float, default=5.0, help="seconds an attacker holds its connections")
    a("--leave-s", type=float, default=5.0, help="seconds after it left, memory read again")
    a("--death-s", type=float, default=60.0, help="seconds a fake stage's death may take")
    a("--stall-s", type=float, default=30.0, help="seconds without output that are a hang")
    a("--stream-timeout", type=float, default=300.0, help="seconds the stream may take")
    a("--seed", type=int, default=0)
    a("--log-dir", default="", help="keep the cluster's logs here (default: a temporary one)")
    a("--stream-client", default="", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.stream_client:
        coordinator, sink, folder, *stages = args.stream_client.split(",")
        result = run_stream_client(coordinator, sink, stages, Path(folder), args)
        (Path(folder) / "stream.json").write_text(json.dumps(result))
        return 0
    assert load_layer_sequence(SPEC).num_units >= args.stages
    only = set(args.only.split(",")) if args.only else None
    devices = [DeviceSpec(f"h{i}") for i in range(args.stages)]
    marker = Path(tempfile.gettempdir()) / f"zpipe-hostile-{os.getpid()}"
    marker.unlink(missing_ok=True)
    bench_started = time.monotonic()
    log_dir = Path(args.log_dir) if args.log_dir else None
    with LocalCluster(
        [*devices, DeviceSpec(IDLE_STAGE)],
        heartbeat_interval_s=0.5,
        log_level="info",
        log_dir=log_dir,
    ) as cluster:
        members = cluster.wait_for_stages(args.stages + 1, timeout_s=120)
        pids = {name: proc.pid for name, proc in cluster.processes.items()}
        # the client binds its sink on port 0 and writes where (folder/sink): a port
        # picked here could be taken before the client bound it
        folder = Path(tempfile.mkdtemp(prefix="zpipe-hostile-"))
        stream_of = ",".join([cluster.coordinator_endpoint, "tcp://127.0.0.1:0", str(folder)])
        with open(folder / "client.log", "wb") as client_log:
            client = subprocess.Popen(
                [
                    sys.executable,
                    *("-m", "bench.hostile", "--batches", str(args.batches)),
                    *("--pace-s", str(args.pace_s), "--seed", str(args.seed)),
                    *("--stream-client", ",".join([stream_of, *[d.name for d in devices]])),
                ],
                stdin=subprocess.DEVNULL,
                stdout=client_log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 180
        while not (folder / "started").exists() and time.monotonic() < deadline:
            time.sleep(0.1)  # the attacks begin once the stream runs
        if not (folder / "sink").exists():
            client.kill()
            client.wait()
            log = (folder / "client.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"the stream client never bound its sink:\n{log}")
        sink = (folder / "sink").read_text()
        pids["client"] = client.pid
        idle = {name: rss_kib(pid) for name, pid in pids.items()}
        watch = Watch(cluster, pids, folder)
        watch.client = client
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        attacker = Attacker(context, args.seed)
        receiver = None
        control = ""
        if only is None or "probe_flood_control" in only:
            receiver = subprocess.Popen(
                [sys.executable, "-c", _RECEIVER], stdout=subprocess.PIPE, text=True
            )
            control = _receiver_endpoint(receiver, timeout_s=120)
            pids["receiver"] = receiver.pid
        marks: dict[str, Any] = {}

        def on_sent() -> None:  # what an attack's target holds while the attacker stays
            if marks.get("target_pid"):
                marks["rss_sent"] = rss_kib(marks["target_pid"])

        streaming = [m for m in members if m["name"] != IDLE_STAGE]
        idle_member = next(m for m in members if m["name"] == IDLE_STAGE)
        plan = [
            *peer_request_steps(
                members, cluster.coordinator_endpoint, min(args.messages, 24), str(marker)
            ),
            *attack_plan(
                members,
                cluster.coordinator_endpoint,
                sink,
                args,
                control=control,
                idle_data=str(idle_member["data_endpoint"]),
                first_data=str(streaming[0]["data_endpoint"]),
                on_sent=on_sent,
            ),
        ]
        if only is not None:
            only |= {sub for klass in only for sub in SUB_CASES.get(klass, ())}
            plan = [step for step in plan if step.klass in only]
        per_class: dict[str, dict[str, Any]] = {}
        started = time.monotonic()
        for step in plan:
            figures = _run_step(step, attacker, watch, idle, args, marks)
            _add_to_class(per_class.setdefault(step.klass, {}), step.endpoint, figures)
        if receiver is not None:
            receiver.kill()
            receiver.wait()
        (folder / "stop").touch()
        attack_s = time.monotonic() - started
        try:
            client.wait(timeout=args.stream_timeout)
            hung = False
        except subprocess.TimeoutExpired:
            hung = True
            client.kill()
            client.wait()
        time.sleep(2.0)  # a factory call, if any, has run by now
        code_executed = marker.exists()
        marker.unlink(missing_ok=True)
        pids.pop("receiver", None)
        alive = {name: cluster.processes[name].poll() is None for name in cluster.processes}
        exits = {
            name: {"status": proc.returncode, "last_log": _last_error(cluster.logs(name))}
            for name, proc in cluster.processes.items()
            if proc.poll() is not None
        }
        alive["client"] = hung or client.returncode == 0
        result_file = folder / "stream.json"
        stream = json.loads(result_file.read_text()) if result_file.exists() else {}
        peak = {name: rss_kib(pid, "VmHWM") for name, pid in pids.items()}
        peak["client"] = stream.pop("peak", None)  # measured by the client before it exited
        deaths = stage_deaths(cluster.logs("coordinator"))
        context.destroy(linger=0)
    if "factory" in per_class:
        per_class["factory"]["refused"] = not code_executed
    expected_deaths = {d for step in plan for d in step.expected_deaths}
    false_deaths = [d for d in deaths if d not in expected_deaths]
    for klass, entry in per_class.items():
        emit({"bench": "hostile", "attack": klass, **entry, "goals_met": class_goals_met(entry)})
    ratios = {
        name: round(peak[name] / idle[name], 3)  # type: ignore[operator]
        for name in pids
        if peak.get(name) and idle.get(name)
    }
    emit(
        {
            "bench": "hostile",
            "processes": {
                name: {"alive": alive[name], "idle_rss_kib": idle[name], "peak_rss_kib": peak[name]}
                for name in pids
            },
            "stream": stream,
            "exits": exits,
            "false_deaths": false_deaths,
            "attack_s": round(attack_s, 2),
            "client_folder": str(folder),
            "wall_s": round(time.monotonic() - bench_started, 1),
            "loadavg": loadavg(),
        }
    )
    # the cluster's processes once each, and the processes of the classes' own targets
    crashes = sum(not a for a in alive.values()) + sum(
        int(e.get("target_crashes", 0)) for e in per_class.values()
    )
    exact = bool(stream.get("exact"))
    failed = sorted(k for k, e in per_class.items() if not class_goals_met(e))
    summary(
        "hostile",
        crashes=crashes,
        hangs=int(hung) + sum(int(e.get("hangs", 0)) for e in per_class.values()),
        false_deaths=len(false_deaths),
        stream_exact=exact,
        code_executed=code_executed,
        model_bomb_refused=per_class.get("model_bomb", {}).get("refused"),
        max_model_bypass_refused=per_class.get("max_model_bypass", {}).get("refused"),
        backups_planted=per_class.get("backup_plant", {}).get("kept", 0),
        units_leaked=per_class.get("fetch_units", {}).get("leaked_units", 0),
        max_peak_over_idle_rss=max(ratios.values()) if ratios else None,
        log_bytes_per_class={k: e.get("log_bytes_total", 0) for k, e in per_class.items()},
        classes_failed=failed,
        goals_met=crashes == 0
        and not hung
        and not false_deaths
        and exact
        and not code_executed
        and not failed
        and all(r < RSS_GOAL for r in ratios.values()),
        messages_sent=sum(int(e.get("sent", 0)) for e in per_class.values()),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
