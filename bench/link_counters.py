"""Do a stage's link counters show a real slow link? Kernel links, not emulation.

Two network namespaces joined by a veth pair, the sender's side capped with
``tc tbf`` (``--mbps``, default 20); the sender pushes ``--messages`` ViT-sized
activations (``--message-bytes``, default 4.84 MB) with zpipe's ``send``, once
as before the link meter (a plain send: it only queues) and once as a stage
sends now (``LinkMeter``: a window of messages on their way, tracked until libzmq
wrote them out; one under 512 KiB with another behind it may go copied while the
link keeps up and counts with the tracked one behind it: ``copied`` says how many).
The receiver stamps the moment it holds every message (one machine, one
monotonic clock). JSON lines, one per mode, then a summary:

    link_s_over_delivery     the meter's link_s / the real delivery time (goal: near 1)
    send_s_plain_over_delivery   what send_s showed before (near 0: the problem)
    delivery_windowed_over_plain the delivery time with the window / without (goal: 1,
                                 the window costs no throughput)

Needs root, ``ip`` and ``tc``; otherwise it prints one line saying why and exits 0.
Run from the repository root: ``.venv/bin/python -m bench.link_counters``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import emit, loadavg, summary

PORT = 5999


async def _receive(endpoint: str, messages: int) -> None:
    import zmq

    from zpipe.transport.sockets import (
        SocketOptions,
        bind_endpoint,
        new_context,
        open_socket,
        recv_frames,
    )

    sock = open_socket(new_context(), zmq.PULL, SocketOptions())
    bind_endpoint(sock, endpoint)
    for _ in range(messages):
        await recv_frames(sock, timeout_s=600, peer="sender", awaited="data")
    print(json.dumps({"received_all_at": time.monotonic()}), flush=True)


async def _send(endpoint: str, messages: int, message_bytes: int, windowed: bool) -> None:
    import torch
    import zmq

    from zpipe.stage.metrics import LinkMeter, StageCounters
    from zpipe.transport.codec import Message
    from zpipe.transport.sockets import SocketOptions, new_context, open_socket, send

    sock = open_socket(new_context(), zmq.PUSH, SocketOptions())
    sock.connect(endpoint)
    await asyncio.sleep(1.0)  # connected before the clock starts
    counters = StageCounters()
    meter = LinkMeter(counters)
    tensor = torch.zeros(message_bytes // 4)
    message = Message("data", {"run": 1, "mb": 0, "src": "sender"}, tensors=(tensor,))
    started, send_s, copied = time.monotonic(), 0.0, 0
    for i in range(messages):
        began = time.perf_counter()
        if windowed:
            # as a stage's inference loop sends: a message with another behind it may
            # go copied, riding on the next tracked one, while the link keeps up
            meter.has_room()
            copy = meter.may_copy(message_bytes, more_behind=i < messages - 1)
            await meter.room(timeout_s=600)
            if copy:
                meter.copied(await send(sock, message, timeout_s=600, peer="receiver"))
            else:
                await send(sock, message, timeout_s=600, peer="receiver", on_queued=meter.track)
            copied += copy
        else:
            await send(sock, message, timeout_s=600, peer="receiver")
        send_s += time.perf_counter() - began
    await meter.drained(timeout_s=600, peer="receiver")
    print(json.dumps({"started_at": started, "send_s": send_s, "link_s": counters.link_s,
                      "link_mbps": counters.to_dict()["link_mbps"],
                      "copied": copied}), flush=True)  # fmt: skip
    await asyncio.sleep(600)  # the parent ends this process once the receiver is done


def _run(cmd: list[str]) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


def _one_mode(ns: tuple[str, str], args: argparse.Namespace, windowed: bool) -> dict[str, float]:
    python, endpoint = sys.executable, f"tcp://10.77.9.2:{PORT}"
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    common = [str(args.messages), str(args.message_bytes)]
    receiver = subprocess.Popen(
        ["ip", "netns", "exec", ns[1], python, "-m", "bench.link_counters", "--role", "receive",
         "--endpoint", endpoint, "--messages", common[0]],
        stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    time.sleep(3.0)  # bound before the sender connects
    sender = subprocess.Popen(
        ["ip", "netns", "exec", ns[0], python, "-m", "bench.link_counters", "--role", "send",
         "--endpoint", endpoint, "--messages", common[0], "--message-bytes", common[1],
         *(["--windowed"] if windowed else [])],
        stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        received = json.loads(
            receiver.communicate(timeout=args.timeout)[0].strip().splitlines()[-1]
        )
        assert sender.stdout is not None
        sent = json.loads(sender.stdout.readline())
    finally:
        sender.kill()
        sender.wait()
        receiver.kill()
    delivery_s = received["received_all_at"] - sent["started_at"]
    return {"send_s": sent["send_s"], "link_s": sent["link_s"], "link_mbps": sent["link_mbps"],
            "delivery_s": delivery_s, "copied": sent.get("copied", 0)}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="bench/link_counters.py", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--mbps", type=float, default=20.0, help="tbf cap of the uplink (20)")
    parser.add_argument("--messages", type=int, default=8, help="messages sent (8)")
    parser.add_argument("--message-bytes", type=int, default=4_840_000, help="(4840000)")
    parser.add_argument("--timeout", type=float, default=600.0, help="per mode, seconds")
    parser.add_argument("--role", choices=("bench", "send", "receive"), default="bench",
                        help=argparse.SUPPRESS)  # fmt: skip
    parser.add_argument("--endpoint", default="", help=argparse.SUPPRESS)
    parser.add_argument("--windowed", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "receive":
        asyncio.run(_receive(args.endpoint, args.messages))
        return 0
    if args.role == "send":
        asyncio.run(_send(args.endpoint, args.messages, args.message_bytes, args.windowed))
        return 0
    if os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")):
        emit({"bench": "link_counters", "skipped": "needs root, ip and tc"})
        return 0
    tag = uuid.uuid4().hex[:6]
    ns, veth = (f"zlc{tag}a", f"zlc{tag}b"), (f"zlc{tag}va", f"zlc{tag}vb")
    try:
        for name in ns:
            _run(["ip", "netns", "add", name])
        _run(["ip", "link", "add", veth[0], "type", "veth", "peer", "name", veth[1]])
        for name, dev, addr in zip(ns, veth, ("10.77.9.1/24", "10.77.9.2/24"), strict=True):
            _run(["ip", "link", "set", dev, "netns", name])
            _run(["ip", "-n", name, "addr", "add", addr, "dev", dev])
            _run(["ip", "-n", name, "link", "set", dev, "up"])
            _run(["ip", "-n", name, "link", "set", "lo", "up"])
        _run(["tc", "-n", ns[0], "qdisc", "add", "dev", veth[0], "root", "tbf", "rate",
              f"{args.mbps}mbit", "burst", "32kbit", "latency", "400ms"])  # fmt: skip
        results = {}
        for windowed in (False, True):
            mode = "windowed" if windowed else "plain"
            results[mode] = _one_mode(ns, args, windowed)
            emit({"bench": "link_counters", "mode": mode, "mbps_cap": args.mbps,
                  "bytes": args.messages * args.message_bytes, **results[mode]})  # fmt: skip
    finally:
        for name in ns:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
    plain, windowed_ = results["plain"], results["windowed"]
    summary(
        "link_counters",
        link_s_over_delivery=round(windowed_["link_s"] / windowed_["delivery_s"], 4),
        send_s_plain_over_delivery=round(plain["send_s"] / plain["delivery_s"], 4),
        delivery_windowed_over_plain=round(windowed_["delivery_s"] / plain["delivery_s"], 4),
        loadavg=loadavg(),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
