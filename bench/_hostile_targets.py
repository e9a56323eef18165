"""bench/hostile.py's attacks that need more than one message: a fake stage that
leaves bulk transfers half-sent (finding 5), a stage with ``--max-model-mb`` asked
for a huge example model (finding 2), and an fl-server whose registrations are
abused (finding 4). Each returns the figures its finding measured.

The last two attack targets of their own: a second run request on the stream's
coordinator would replace the stream's run (a coordinator runs one run at a time),
and the stream's cluster has no fl-server.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from bench._hostile_attacker import Attacker
from bench._hostile_proc import RssSampler, mib, rss_kib
from bench._hostile_wire import (
    absurd_fl_registrations,
    bulk_chunks,
    fl_registration,
    frames_of,
    many_frames,
    registration,
    tiny_sequential_bytes,
    tiny_sequential_request,
)
from zpipe.protocol import REGISTRY
from zpipe.protocol.bulk import BulkOpen, BulkOpened
from zpipe.protocol.client_control import RunFailed
from zpipe.protocol.federated import FlError, FlWelcome
from zpipe.protocol.stage_control import Registered
from zpipe.transport.codec import decode


def _await_kind(
    sock: zmq.Socket[bytes], kinds: tuple[str, ...], timeout_s: float
) -> tuple[Any, list[str]]:
    """The first reply of one of ``kinds`` (parsed), and the kinds of all replies seen."""
    deadline = time.monotonic() + timeout_s
    seen: list[str] = []
    while (left := deadline - time.monotonic()) > 0:
        if not sock.poll(int(left * 1000)):
            break
        message = decode(sock.recv_multipart(copy=False))
        seen.append(message.kind)
        if message.kind in kinds:
            return REGISTRY.parse(message), seen
    return None, seen


def _ratio(peak: int | None, idle: int | None) -> float | None:
    return round(peak / idle, 3) if peak and idle else None


# ------------------------------------------------------------------------ finding 5


def half_bulk(
    attacker: Attacker,
    coordinator: str,
    *,
    name: str,
    transfers: int,
    announced: int,
    sent_bytes: int,
    on_sent: Callable[[], None],
) -> tuple[int, dict[str, Any]]:
    """Register as stage ``name``, open its bulk connection, send the first
    ``sent_bytes`` of ``transfers`` transfers announced at ``announced`` bytes each,
    then go silent (``on_sent()`` just before: what the coordinator holds then)."""
    control = attacker.socket(zmq.DEALER, coordinator, sndtimeo_ms=10_000)
    bulk = attacker.socket(zmq.DEALER, coordinator, sndtimeo_ms=30_000)
    figures: dict[str, Any] = {"registered": False, "bulk_opened": False, "chunks_sent": 0}
    sent = 0
    try:
        control.send_multipart(registration(name))
        sent += 1
        reply, seen = _await_kind(control, (Registered.KIND,), 60.0)
        if not isinstance(reply, Registered) or not reply.bulk_token:
            figures["replies"] = seen
            return sent, figures
        figures["registered"] = True
        bulk.send_multipart(frames_of(BulkOpen(name=name, token=reply.bulk_token).to_message()))
        sent += 1
        opened, seen = _await_kind(bulk, (BulkOpened.KIND,), 30.0)
        if not isinstance(opened, BulkOpened):
            figures["replies"] = seen
            return sent, figures
        figures["bulk_opened"] = True
        for transfer in range(transfers):
            for frames in bulk_chunks(name, reply.bulk_token, transfer, announced, sent_bytes):
                bulk.send_multipart(frames, copy=False)
                figures["chunks_sent"] += 1
                sent += 1
        time.sleep(3.0)  # the last chunks are in before it is seen holding them
        on_sent()
    finally:  # silent from now on: no heartbeat, no probe answered
        control.close(linger=0)
        bulk.close(linger=0)
    return sent, figures


# ------------------------------------------------------------------------ finding 2


def max_model_bypass(
    attacker: Attacker, *, hidden: int, max_model_mb: int, log_level: str
) -> tuple[int, dict[str, Any]]:
    """A coordinator and one stage with ``--max-model-mb``; a run request for the
    example factory with hidden width ``hidden``: it must be refused, and the stage
    must not grow by the model's size."""
    from zpipe.cluster import DeviceSpec, LocalCluster

    figures: dict[str, Any] = {
        "hidden": hidden,
        "max_model_mb": max_model_mb,
        "model_mb": round(tiny_sequential_bytes(hidden) / 2**20, 1),
    }
    with LocalCluster([], heartbeat_interval_s=0.5, log_level=log_level) as bomb:
        bomb.start_stage(DeviceSpec("bomb0", threads=1), "--max-model-mb", str(max_model_mb))
        bomb.wait_for_stages(1, timeout_s=180)
        pids = {name: proc.pid for name, proc in bomb.processes.items()}
        idle = {name: rss_kib(pid) for name, pid in pids.items()}
        sampler = RssSampler(pids).start()
        sink = attacker.context.socket(zmq.PULL)  # the run's sink: a real, bound one
        sink.bind("tcp://127.0.0.1:0")
        sink_endpoint = sink.getsockopt_string(zmq.LAST_ENDPOINT)
        sock = attacker.socket(zmq.DEALER, bomb.coordinator_endpoint)
        try:
            sock.send_multipart(tiny_sequential_request(hidden, sink_endpoint))
            reply, seen = _await_kind(sock, (RunFailed.KIND, "run_ready"), 180.0)
        finally:
            sock.close(linger=0)
            sink.close(linger=0)
        time.sleep(1.0)
        peak = sampler.stop()
        alive = {name: proc.poll() is None for name, proc in bomb.processes.items()}
        figures.update(
            {
                "replies": seen,
                "refused": isinstance(reply, RunFailed),
                "error": reply.error[:200] if isinstance(reply, RunFailed) else "",
                "stage_rss_idle_mib": mib(idle.get("bomb0")),
                "stage_rss_peak_mib": mib(peak.get("bomb0")),
                "target_crashes": sum(not up for up in alive.values()),
                "target_peak_over_idle_rss": _ratio(peak.get("bomb0"), idle.get("bomb0")),
                "target_log_bytes": {n: len(bomb.logs(n).encode()) for n in bomb.processes},
            }
        )
    return 1, figures


# ------------------------------------------------------------------------ finding 4


class FlTarget:
    """An fl-server (FedAsync, one real fl-client) for the registration attacks."""

    def __init__(self, folder: Path, seconds: float) -> None:
        self.folder = folder
        zpipe = [sys.executable, "-m", "zpipe"]
        server_args = [
            # port 0: a port picked here could be taken before the server bound it
            *("fl-server", "--bind", "tcp://127.0.0.1:0", "--clients", "1"),
            *("--method", "fedasync", "--updates", "1000000", "--eval-every", "1"),
            *("--task-timeout", "5", "--register-timeout", "180"),
            *("--duration", str(seconds), "--seed", "0"),
        ]
        self.out = folder / "fl-server.out"
        self.log = folder / "fl-server.log"
        with open(self.out, "w") as out, open(self.log, "w") as err:
            self.server = subprocess.Popen(
                [*zpipe, *server_args], stdout=out, stderr=err, stdin=subprocess.DEVNULL
            )
        self.endpoint = self._listening_endpoint(timeout_s=180)
        self.client = subprocess.Popen(
            [
                *zpipe,
                *("fl-client", "--server", self.endpoint, "--id", "0", "--seed", "0"),
                *("--connect-timeout", "180", "--idle-timeout", "60"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
        )

    def _listening_endpoint(self, timeout_s: float) -> str:
        """Where the server listens, from its first event; "" if it exited first or
        said nothing within ``timeout_s`` (the client then has nowhere to go, and
        :meth:`wait_running` says the server did not start)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            listening = [e for e in self.events() if e.get("event") == "listening"]
            if listening:
                return str(listening[0]["endpoint"])
            if self.server.poll() is not None:
                break
            time.sleep(0.1)
        return ""

    def events(self) -> list[dict[str, Any]]:
        lines = self.out.read_text(errors="replace").splitlines()
        out = []
        for line in lines:
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
        return out

    def updates(self) -> int:
        """Global updates so far (the server evaluates after each)."""
        evals = [e for e in self.events() if e.get("event") == "eval"]
        return int(evals[-1]["global_updates"]) if evals else 0

    def wait_running(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.updates() > 0:
                return True
            if self.server.poll() is not None:
                return False
            time.sleep(0.5)
        return False

    def stop(self) -> None:
        for process in (self.client, self.server):
            if process.poll() is None:
                process.terminate()
        for process in (self.client, self.server):
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)


def fl_identities(
    attacker: Attacker, *, identities: int, window_s: float, big_frames: int, big_mb: int
) -> tuple[int, dict[str, Any]]:
    """Finding 4 against an fl-server with one real client: absurd registrations
    (each must get ``fl_error``), then ``identities`` silent client ids from one peer
    (global updates in ``window_s`` before and while they are registered), then one
    message of ``big_frames`` frames of ``big_mb`` MB (the server's memory)."""
    folder = Path(tempfile.mkdtemp(prefix="zpipe-hostile-fl-"))
    target = FlTarget(folder, seconds=3 * window_s + 240)
    figures: dict[str, Any] = {}
    sent = 0
    try:
        if not target.wait_running(180):
            figures["error"] = "fl-server did not start training: " + target.log.read_text()[-300:]
            figures["target_crashes"] = int(target.server.poll() is not None)
            return 0, figures
        pid = target.server.pid
        idle = rss_kib(pid)
        start = target.updates()
        time.sleep(window_s)
        figures["updates_before"] = target.updates() - start
        replies = attacker.requests(target.endpoint, absurd_fl_registrations(5000), 10.0)
        sent += 4
        errors = [FlError.from_message(r).reason for r in replies if r.kind == FlError.KIND]
        figures["absurd_registrations"] = 4
        figures["absurd_refused"] = len(errors)
        figures["absurd_errors"] = [e[:80] for e in errors]
        welcomes = 0
        kinds: dict[str, int] = {}
        reasons: list[str] = []
        # one connection per id (a peer's one connection is one client): the ids are
        # registered and then never answer their tasks
        socks = [
            attacker.socket(zmq.DEALER, target.endpoint, sndtimeo_ms=5000)
            for _ in range(identities)
        ]
        try:
            poller = zmq.Poller()
            for i, sock in enumerate(socks):
                sock.send_multipart(fl_registration(1000 + i, 0.05, [10] * 10))
                poller.register(sock, zmq.POLLIN)
                sent += 1
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                ready = dict(poller.poll(2000))
                if not ready:
                    break
                for sock in ready:
                    reply = decode(sock.recv_multipart(copy=False))
                    if reply.kind == FlWelcome.KIND:
                        welcomes += 1
                    else:  # an fl_error (why), or work for a welcomed id
                        kinds[reply.kind] = kinds.get(reply.kind, 0) + 1
                        if reply.kind == FlError.KIND and len(reasons) < 2:
                            reasons.append(FlError.from_message(reply).reason[:100])
            start = target.updates()
            time.sleep(window_s)
            figures["updates_during"] = target.updates() - start
        finally:
            for sock in socks:
                sock.close(linger=0)
        figures["identities_sent"] = identities
        figures["identities_welcomed"] = welcomes
        figures["identities_other_replies"] = kinds
        figures["identities_refusals"] = reasons
        sampler = RssSampler({"fl-server": pid}).start()
        big = attacker.socket(zmq.DEALER, target.endpoint, sndtimeo_ms=60_000)
        try:
            big.send_multipart(many_frames(big_frames, bytes(big_mb << 20)), copy=False)
            sent += 1
            time.sleep(5.0)
        finally:
            big.close(linger=0)
        peak = sampler.stop()
        time.sleep(3.0)
        figures.update(
            {
                "window_s": window_s,
                "server_rss_idle_mib": mib(idle),
                "server_rss_peak_mib": mib(peak.get("fl-server")),
                "server_rss_after_leave_mib": mib(rss_kib(pid)),
                "target_crashes": int(target.server.poll() is not None),
                "target_peak_over_idle_rss": _ratio(peak.get("fl-server"), idle),
                "real_client_alive": target.client.poll() is None,
            }
        )
        figures["refused"] = figures["absurd_refused"] == 4
        # the federated run stalled behind the silent ids: its hang (finding 4: 11 updates
        # in 60 s instead of 294); an open fl-server does not bound ids per peer
        before, during = figures["updates_before"], figures["updates_during"]
        figures["target_hangs"] = int(during < 0.1 * before)
    finally:
        target.stop()
        # its log (stderr); its stdout is the run's events, one per update here
        figures["target_log_bytes"] = {"fl-server": target.log.stat().st_size}
    return sent, figures
