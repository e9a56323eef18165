"""Hostile peers against a live inference stream: does any process crash, hang, lose a
live stage or grow without bound?

One :class:`~zpipe.cluster.LocalCluster` (a coordinator and ``--stages`` stage
processes on loopback, a tiny MLP) streams ``--batches`` batches while this process
attacks every port it can reach, one attack class after another:

* ``poison_shape``: valid-looking data messages whose tensor has no elements but a
  dimension of 2**63 (or ``[0, 2**62, 2**62]``), which once made the decoder raise
  ``TypeError``/``RuntimeError`` outside its ``ProtocolError`` net;
* ``garbage``: random bytes in 1-4 frames;
* ``fill_and_hang_up``: a PUSH that connects to a data port, sends 40 small messages
  and hangs up at once (libzmq 4.3.5 aborted with ``!_io_error`` when ZMTP heartbeats
  were set on a socket whose input was stopped at its queue limit);
* ``flood``: small messages as fast as the socket takes them (heartbeats and probes
  must not starve behind them);
* ``probe_flood``: ``--probe-flood-connections`` connections at once flood one
  stage's probe port for ``--probe-flood-s`` (issue 33, finding 6: without keys each
  connection has a rate-limit bucket of its own); its line carries the target's CPU
  seconds, the coordinator's ``stage_suspect`` and ``stage_dead`` lines meanwhile;
  ``probe_flood_control`` sends the same floods to a process that only receives
  (what the attacker's and the machine's load cost the cluster without a stage
  decoding anything);
* ``raw_tcp`` and ``connection_flood``: plain TCP connections that send junk, and
  many connections opened and dropped;
* ``big_frames``: ``--big-count`` frames of ``--big-mb`` MB to each stage's data port
  (memory must stay bounded where nothing reads);
* ``factory``: a ``run_request`` naming ``os:system`` as a model factory, whose
  command would create a marker file (it must not appear);
* ``model_bomb``: a ``run_request`` for a built-in MLP of ``dims [10**9, 10**9]``
  (4 EB of weights), which must be refused before anything is allocated;
* ``backup_plant``: ``backup`` messages of 4 MiB under made-up owners to every
  stage's probe port (none may be kept), and ``fetch_units`` of another stage's
  snapshot from every probe port (no units may come back).

Targets: the coordinator's ROUTER, every stage's data (PULL) and probe (ROUTER)
ports, and the client's sink (PULL). After the attacks the stream must have finished
with outputs equal to a single-process run, every process must still run, no stage
may have been declared dead (the coordinator's log says ``stage_dead``), and each
process's peak resident memory (``VmHWM``) is compared with its idle value.

Prints one JSON line per attack class and one summary with the goals of the
hostile-peers issue: 0 crashes, 0 hangs, 0 false deaths, peak RSS under 2x idle.
Linux only (reads ``/proc``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgpack
import torch
import zmq

from bench._common import emit, loadavg, summary
from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.models import ModelSpec, build_full_model, load_layer_sequence
from zpipe.protocol.client_control import RunFailed
from zpipe.protocol.peer import BackupOk, Units
from zpipe.transport.codec import Message, decode, encode
from zpipe.transport.ports import free_tcp_port

PROTOCOL_VERSION = 1


def _rss_kib(pid: int, field: str) -> int | None:
    """``VmRSS`` or ``VmHWM`` of a process in KiB, or None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _last_error(log: str) -> str:
    """The last line of a process's log that says why it stopped."""
    lines = [ln for ln in log.splitlines() if ln.strip()]
    for line in reversed(lines):
        if any(w in line for w in ("Error", "error", "Assertion", "Traceback", "exit")):
            return line[-300:]
    return lines[-1][-300:] if lines else ""


def _header(kind: str, body: dict[str, Any], metas: list[Any], epoch: int = 1) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, "k": kind, "e": epoch, "b": body, "t": metas})


def poison_messages() -> Iterator[list[bytes]]:
    while True:
        yield from _poison_once()


def _poison_once() -> Iterator[list[bytes]]:
    body = {"run": 1, "mb": 0, "src": "attacker"}
    for shape in ([0, 2**63], [0, 2**64 - 1], [0, 2**62, 2**62], [2**40, 2**40], [-1, 4]):
        yield [_header("data", body, [["float32", shape]]), b""]
    yield [_header("data", body, [["float32", [4]]]), b"\0" * 3]  # short frame
    yield [_header("data", body, [["complex128", [1]]]), b"\0" * 16]  # unknown dtype
    yield [_header("heartbeat", {"name": "x", "metrics": {"m": [[[[[]]]]]}}, [])]


def garbage_messages(rng: random.Random) -> Iterator[list[bytes]]:
    while True:
        yield [rng.randbytes(rng.randint(0, 256)) for _ in range(rng.randint(1, 4))]


class Attacker:
    """Sends one attack class to one endpoint from its own zmq context."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], seed: int) -> None:
        self.context = context
        self.rng = random.Random(seed)

    def _socket(self, kind: int, endpoint: str) -> zmq.Socket[bytes]:
        sock = self.context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, 200)
        sock.setsockopt(zmq.SNDHWM, 1000)
        sock.connect(endpoint)
        return sock

    def send_all(
        self, kind: int, endpoint: str, messages: Iterator[list[bytes]], count: int
    ) -> int:
        sock = self._socket(kind, endpoint)
        sent = 0
        try:
            for frames in messages:
                if sent >= count:
                    break
                try:
                    sock.send_multipart(frames)
                    sent += 1
                except zmq.Again:
                    break
        finally:
            sock.close(linger=0)
        return sent

    def fill_and_hang_up(self, endpoint: str, rounds: int) -> int:
        sent = 0
        for _ in range(rounds):
            sock = self._socket(zmq.PUSH, endpoint)
            for _ in range(40):
                try:
                    sock.send(b"x" * 64)
                    sent += 1
                except zmq.Again:
                    break
            sock.close(linger=0)
        return sent

    def flood(self, kind: int, endpoint: str, seconds: float) -> int:
        sock = self._socket(kind, endpoint)
        sock.setsockopt(zmq.SNDTIMEO, 0)
        header = _header("probe", {"nonce": 1}, [])
        sent, deadline = 0, time.monotonic() + seconds
        try:
            while time.monotonic() < deadline:
                try:
                    sock.send_multipart([header])
                    sent += 1
                except zmq.Again:
                    time.sleep(0.001)
        finally:
            sock.close(linger=0)
        return sent

    def probe_flood(self, endpoint: str, seconds: float, connections: int) -> int:
        """``connections`` floods of one probe port at once, each on its own socket
        and thread (libzmq sockets are used by one thread each)."""
        counts = [0] * connections

        def one(i: int) -> None:
            counts[i] = self.flood(zmq.DEALER, endpoint, seconds)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(connections)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(seconds + 30)
        return sum(counts)

    def raw_tcp(self, endpoint: str, connections: int, junk: bool) -> int:
        host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
        sent = 0
        for _ in range(connections):
            try:
                with socket.create_connection((host, int(port)), timeout=1.0) as conn:
                    if junk:
                        conn.sendall(self.rng.randbytes(self.rng.randint(1, 4096)))
                    sent += 1
            except OSError:
                pass
        return sent

    def requests(
        self, endpoint: str, messages: list[list[bytes]], timeout_s: float = 10.0
    ) -> list[Message]:
        """Send each message on one DEALER and collect the replies that come back."""
        sock = self._socket(zmq.DEALER, endpoint)
        replies: list[Message] = []
        try:
            for frames in messages:
                sock.send_multipart(frames)
                if sock.poll(int(timeout_s * 1000)):
                    replies.append(decode(sock.recv_multipart(copy=False)))
        finally:
            sock.close(linger=0)
        return replies

    def big_frames(self, endpoint: str, count: int, megabytes: int) -> int:
        sock = self._socket(zmq.PUSH, endpoint)
        sock.setsockopt(zmq.SNDTIMEO, 5000)
        frame = bytes(megabytes << 20)
        sent = 0
        try:
            for _ in range(count):
                try:
                    sock.send(frame, copy=False)
                    sent += 1
                except zmq.Again:
                    break
        finally:
            sock.close(linger=0)
        return sent


def _batches(count: int, seed: int) -> list[tuple[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 32, generator=generator),) for _ in range(count)]


SPEC = ModelSpec("mlp", {"dims": [32, 64, 64, 64, 16]})


def run_stream_client(
    coordinator: str, sink: str, stages: list[str], folder: Path, args: argparse.Namespace
) -> dict[str, Any]:
    """The client under attack (its own process, so that its crash is seen, not shared):
    stream batches until ``folder/stop`` appears (``folder/started`` once the first
    output is in), then compare every output with a single-process run."""
    from zpipe.client import PipelineClient
    from zpipe.config import Timeouts

    generator = torch.Generator().manual_seed(args.seed)
    sent: list[tuple[torch.Tensor]] = []
    outputs: list[Any] = []

    async def feed() -> Any:
        while not (folder / "stop").exists() and len(sent) < args.batches:
            batch = (torch.randn(4, 32, generator=generator),)
            sent.append(batch)
            yield batch
            await asyncio.sleep(args.pace_s)

    async def run() -> None:
        timeouts = Timeouts(heartbeat_interval_s=0.5)
        async with PipelineClient(coordinator, sink_bind=sink, timeouts=timeouts) as client:
            stream = client.infer_stream(SPEC, feed(), microbatch_size=2, stage_names=stages)
            async for output in stream:
                if not outputs:
                    (folder / "started").touch()
                outputs.append(output)

    started = time.monotonic()
    try:
        asyncio.run(run())
    except Exception as exc:
        (folder / "started").touch()
        peak = _rss_kib(os.getpid(), "VmHWM")
        return {"ok": False, "error": repr(exc), "batches": len(outputs), "peak": peak}
    model = build_full_model(SPEC).eval()
    with torch.no_grad():
        expected = [model(*b) for b in sent]
    exact = len(outputs) == len(expected) and all(
        torch.allclose(o[0], e[0], atol=1e-5) for o, e in zip(outputs, expected, strict=True)
    )
    seconds = round(time.monotonic() - started, 3)
    peak = _rss_kib(os.getpid(), "VmHWM")
    return {"ok": True, "exact": exact, "batches": len(outputs), "seconds": seconds, "peak": peak}


def _attacks(
    members: list[dict[str, Any]],
    coordinator: str,
    sink: str,
    args: argparse.Namespace,
    control: str = "",
) -> list[tuple[str, str, Callable[[Attacker], int]]]:
    data = [m["data_endpoint"] for m in members]
    probes = [str(m["info"].get("probe_endpoint") or "") for m in members]
    probes = [p for p in probes if p]
    pulls = [*data, sink]
    routers = [coordinator, *probes]
    n = args.messages
    plan: list[tuple[str, str, Callable[[Attacker], int]]] = []
    for ep in pulls:
        plan.append(
            ("poison_shape", ep, lambda a, ep=ep: a.send_all(zmq.PUSH, ep, poison_messages(), n))
        )
    for ep in routers:
        plan.append(
            ("poison_shape", ep, lambda a, ep=ep: a.send_all(zmq.DEALER, ep, poison_messages(), n))
        )
    for ep in pulls:
        plan.append(
            ("garbage", ep, lambda a, ep=ep: a.send_all(zmq.PUSH, ep, garbage_messages(a.rng), n))
        )
    for ep in routers:
        plan.append(
            ("garbage", ep, lambda a, ep=ep: a.send_all(zmq.DEALER, ep, garbage_messages(a.rng), n))
        )
    for ep in data:
        plan.append(("fill_and_hang_up", ep, lambda a, ep=ep: a.fill_and_hang_up(ep, args.rounds)))
    for ep in routers:
        plan.append(("flood", ep, lambda a, ep=ep: a.flood(zmq.DEALER, ep, args.flood_s)))
    flood_s, connections = args.probe_flood_s, args.probe_flood_connections
    for ep in probes:
        plan.append(("probe_flood", ep, lambda a, ep=ep: a.probe_flood(ep, flood_s, connections)))
        if control:  # as many floods of a port whose owner only receives
            plan.append(
                (
                    "probe_flood_control",
                    control,
                    lambda a, ep=control: a.probe_flood(ep, flood_s, connections),
                )
            )
    for ep in [*pulls, *routers]:
        plan.append(("raw_tcp", ep, lambda a, ep=ep: a.raw_tcp(ep, args.rounds, junk=True)))
        plan.append(
            ("connection_flood", ep, lambda a, ep=ep: a.raw_tcp(ep, 10 * args.rounds, junk=False))
        )
    for ep in data:
        plan.append(
            ("big_frames", ep, lambda a, ep=ep: a.big_frames(ep, args.big_count, args.big_mb))
        )
    if args.only:
        wanted = set(args.only.split(","))
        plan = [step for step in plan if step[0] in wanted]
    return plan


# a ROUTER that receives and discards (probe_flood_control's target)
_RECEIVER = (
    "import sys, zmq\n"
    "ctx = zmq.Context(); sock = ctx.socket(zmq.ROUTER); sock.bind(sys.argv[1])\n"
    "while True:\n"
    "    sock.recv_multipart()\n"
)


def _cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) process ``pid`` has used so far."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _suspects(log: str) -> list[dict[str, Any]]:
    """The coordinator's ``stage_suspect`` lines: a stage silent past its deadline."""
    return [
        json.loads(line)
        for line in log.splitlines()
        if '"stage_suspect"' in line and line.startswith("{")
    ]


def _factory_request(marker: Path) -> list[bytes]:
    model = {
        "family": "sequential",
        "config": {
            "factory": "os:system",
            "kwargs": {"command": f"touch {marker}"},
            "input_shape": [4],
        },
    }
    body = {
        "model": model,
        "dtype": "float32",
        "wait_for_stages_s": 1.0,
        "mode": "infer",
        "sink_endpoint": "tcp://127.0.0.1:1",
    }
    return [_header("run_request", body, [], epoch=0)]


def _model_bomb_request() -> list[bytes]:
    body = {
        "model": {"family": "mlp", "config": {"dims": [10**9, 10**9]}},
        "dtype": "float32",
        "wait_for_stages_s": 1.0,
        "mode": "infer",
        "sink_endpoint": "tcp://127.0.0.1:1",
    }
    return [_header("run_request", body, [], epoch=0)]


def _planted_backups(count: int) -> list[list[bytes]]:
    """Backups of 4 MiB each under made-up owners (frames as the codec writes them)."""
    out = []
    for i in range(count):
        body = {"run": 1, "step": i, "owner": f"mallory{i}", "keys": ["units.0.linear.weight"]}
        message = Message("backup", body, tensors=(torch.zeros(1 << 20),))
        out.append([bytes(memoryview(f)) for f in encode(message)])
    return out


def _fetches(owner: str, count: int) -> list[list[bytes]]:
    body = {"owner": owner, "run": 1, "step": 0, "start": 0, "end": 4}
    return [[_header("fetch_units", {**body, "step": i}, [], epoch=0)] for i in range(count)]


def _peer_request_attacks(
    attacker: Attacker, members: list[dict[str, Any]], count: int
) -> dict[str, dict[str, Any]]:
    """Backups planted on, and units fetched from, every stage's probe port."""
    plant: dict[str, Any] = {"sent": 0, "targets": 0, "kept": 0, "refused": 0}
    fetch: dict[str, Any] = {"sent": 0, "targets": 0, "leaked_units": 0, "refused": 0}
    names = [str(m["name"]) for m in members]
    for member in members:
        endpoint = str(member["info"].get("probe_endpoint") or "")
        if not endpoint:
            continue
        replies = attacker.requests(endpoint, _planted_backups(count))
        plant["sent"] += count
        plant["targets"] += 1
        oks = [BackupOk.from_message(r) for r in replies if r.kind == BackupOk.KIND]
        plant["kept"] += sum(1 for ok in oks if not ok.error)
        plant["refused"] += sum(1 for ok in oks if ok.error)
        other = next((n for n in names if n != member["name"]), names[0])
        replies = attacker.requests(endpoint, _fetches(other, count))
        fetch["sent"] += count
        fetch["targets"] += 1
        units = [Units.from_message(r) for r in replies if r.kind == Units.KIND]
        fetch["leaked_units"] += sum(len(u.tensors) for u in units)
        fetch["refused"] += sum(1 for u in units if u.error)
    return {"backup_plant": plant, "fetch_units": fetch}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", type=int, default=3, help="stage processes (default: 3)")
    p.add_argument("--batches", type=int, default=5000, help="most batches streamed")
    p.add_argument("--pace-s", type=float, default=0.02, help="seconds between batches")
    p.add_argument("--messages", type=int, default=2000, help="messages per poison/garbage attack")
    p.add_argument("--rounds", type=int, default=20, help="connections per hang-up/TCP attack")
    p.add_argument("--flood-s", type=float, default=2.0, help="seconds of each flood")
    p.add_argument(
        "--probe-flood-s", type=float, default=10.0, help="seconds of each probe port's flood"
    )
    p.add_argument(
        "--probe-flood-connections", type=int, default=4, help="connections per probe flood"
    )
    p.add_argument(
        "--only", default="", help="comma-separated attack classes to run (default: all)"
    )
    p.add_argument("--big-count", type=int, default=8, help="big frames per data port")
    p.add_argument("--big-mb", type=int, default=200, help="size of a big frame in MB")
    p.add_argument(
        "--stream-timeout", type=float, default=300.0, help="seconds the stream may take"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stream-client", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.stream_client:
        coordinator, sink, folder, *stages = args.stream_client.split(",")
        result = run_stream_client(coordinator, sink, stages, Path(folder), args)
        (Path(folder) / "stream.json").write_text(json.dumps(result))
        return 0
    assert load_layer_sequence(SPEC).num_units >= args.stages
    devices = [DeviceSpec(f"h{i}") for i in range(args.stages)]
    marker = Path(tempfile.gettempdir()) / f"zpipe-hostile-{os.getpid()}"
    marker.unlink(missing_ok=True)
    with LocalCluster(devices, heartbeat_interval_s=0.5, log_level="info") as cluster:
        members = cluster.wait_for_stages(args.stages, timeout_s=60)
        pids = {name: proc.pid for name, proc in cluster.processes.items()}
        idle = {name: _rss_kib(pid, "VmRSS") for name, pid in pids.items()}
        sink = f"tcp://127.0.0.1:{free_tcp_port()}"
        folder = Path(tempfile.mkdtemp(prefix="zpipe-hostile-"))
        client_args = [
            sys.executable,
            "-m",
            "bench.hostile",
            "--batches",
            str(args.batches),
            "--pace-s",
            str(args.pace_s),
            "--seed",
            str(args.seed),
            "--stream-client",
            ",".join([cluster.coordinator_endpoint, sink, str(folder), *[d.name for d in devices]]),
        ]
        client = subprocess.Popen(client_args, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while not (folder / "started").exists() and time.monotonic() < deadline:
            time.sleep(0.1)  # the attacks begin once the stream runs
        pids["client"] = client.pid
        idle["client"] = _rss_kib(client.pid, "VmRSS")
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        attacker = Attacker(context, args.seed)
        per_class: dict[str, dict[str, Any]] = {}
        dead_after: dict[str, str] = {}
        started = time.monotonic()
        only = set(args.only.split(",")) if args.only else None
        if only is None or "factory" in only:
            sent = attacker.send_all(
                zmq.DEALER, cluster.coordinator_endpoint, iter([_factory_request(marker)]), 1
            )
            per_class["factory"] = {"sent": sent, "targets": 1}
        if only is None or "model_bomb" in only:
            bomb = attacker.requests(cluster.coordinator_endpoint, [_model_bomb_request()], 60.0)
            failed = [RunFailed.from_message(m) for m in bomb[:1] if m.kind == RunFailed.KIND]
            bomb_error = failed[0].error if failed else ""
            per_class["model_bomb"] = {
                "sent": 1,
                "targets": 1,
                "reply": bomb[0].kind if bomb else None,
                "error": bomb_error[:160],
            }
        if only is None or {"backup_plant", "fetch_units"} & only:
            per_class.update(_peer_request_attacks(attacker, members, min(args.messages, 24)))
        # which process owns a flooded port (a probe flood's target)
        flooded = {str(m["info"].get("probe_endpoint")): pids[str(m["name"])] for m in members}
        receiver = None
        if only is None or "probe_flood_control" in only:
            control = f"tcp://127.0.0.1:{free_tcp_port()}"
            receiver = subprocess.Popen([sys.executable, "-c", _RECEIVER, control])
            flooded[control] = receiver.pid
        else:
            control = ""
        plan = _attacks(members, cluster.coordinator_endpoint, sink, args, control)
        for klass, endpoint, attack in plan:
            t0 = time.monotonic()
            target = flooded.get(endpoint) if klass.startswith("probe_flood") else None
            cpu_before = _cpu_s(target) if target else None
            log_before = cluster.logs("coordinator")
            suspects_before = len(_suspects(log_before))
            deaths_before = log_before.count('"stage_dead"')
            try:
                sent = attack(attacker)
                error = ""
            except Exception as exc:  # the attacker's own failure, not the target's
                sent, error = 0, repr(exc)
            entry = per_class.setdefault(klass, {"sent": 0, "targets": 0, "seconds": 0.0})
            if target is not None:
                # what the flood cost its target, and how late the coordinator heard it
                time.sleep(args.probe_flood_s / 4)  # a suspicion may come just after
                cpu_after = _cpu_s(target)
                log_after = cluster.logs("coordinator")
                new = _suspects(log_after)[suspects_before:]
                owner = next((n for n, pid in pids.items() if pid == target), "receiver")
                mine = [e for e in new if e.get("stage") == owner]
                entry.setdefault("per_target", []).append(
                    {
                        "target": owner,
                        "cpu_s": round(cpu_after - cpu_before, 2)
                        if cpu_after is not None and cpu_before is not None
                        else None,
                        "suspects": len(mine),
                        "max_silent_s": max(
                            (float(e["silent_s"]) for e in mine if "silent_s" in e), default=None
                        ),
                        "suspects_other_stages": len(new) - len(mine),
                        "deaths": log_after.count('"stage_dead"') - deaths_before,
                    }
                )
            for name, proc in cluster.processes.items():
                if proc.poll() is not None and name not in dead_after:
                    # the first attack after which a process was gone: the likely killer
                    dead_after[name] = klass
                    entry.setdefault("killed", []).append({"process": name, "target": endpoint})
            entry["sent"] += sent
            entry["targets"] += 1
            entry["seconds"] = round(entry["seconds"] + time.monotonic() - t0, 3)
            if error:
                entry.setdefault("attacker_errors", []).append(error)
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
        alive = {name: cluster.processes[name].poll() is None for name in cluster.processes}
        exits = {
            name: {"status": proc.returncode, "last_log": _last_error(cluster.logs(name))}
            for name, proc in cluster.processes.items()
            if proc.poll() is not None
        }
        alive["client"] = hung or client.returncode == 0
        result_file = folder / "stream.json"
        stream = json.loads(result_file.read_text()) if result_file.exists() else {}
        peak = {name: _rss_kib(pid, "VmHWM") for name, pid in pids.items()}
        # the client measured its own peak before it exited
        peak["client"] = stream.pop("peak", None)
        log = cluster.logs("coordinator")
        deaths = [
            json.loads(line)
            for line in log.splitlines()
            if '"stage_dead"' in line and line.startswith("{")
        ]
        context.destroy(linger=0)
    exact = bool(stream.get("exact"))
    for klass, entry in per_class.items():
        emit({"bench": "hostile", "attack": klass, **entry})
    ratios = {
        name: round(peak[name] / idle[name], 3)
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
            "false_deaths": [d.get("stage") for d in deaths],
            "attack_s": round(attack_s, 2),
            "loadavg": loadavg(),
        }
    )
    crashes = sum(not a for a in alive.values())
    summary(
        "hostile",
        crashes=crashes,
        hangs=int(hung),
        false_deaths=len(deaths),
        stream_exact=exact,
        code_executed=code_executed,
        model_bomb_refused=bool(per_class.get("model_bomb", {"error": "skipped"})["error"]),
        backups_planted=per_class.get("backup_plant", {}).get("kept", 0),
        units_leaked=per_class.get("fetch_units", {}).get("leaked_units", 0),
        max_peak_over_idle_rss=max(ratios.values()) if ratios else None,
        goals_met=crashes == 0
        and not hung
        and not deaths
        and exact
        and not code_executed
        and bool(per_class.get("model_bomb", {"error": "skipped"})["error"])
        and per_class.get("backup_plant", {}).get("kept", 0) == 0
        and per_class.get("fetch_units", {}).get("leaked_units", 0) == 0
        and all(r < 2.0 for r in ratios.values()),
        messages_sent=sum(int(e.get("sent", 0)) for e in per_class.values()),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
