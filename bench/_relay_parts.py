"""What bench/stage_relay.py's relay paths share: the running lifecycle, the
feeder's requests and the relay's CPU and context switches by thread (``usage``),
and ``--steps``' per-step CPU clock (``timed``)."""

from __future__ import annotations

import asyncio
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from zpipe.protocol.stage_control import Assign, Connect, Registered
from zpipe.stage.lifecycle import DataRoute, StageLifecycle
from zpipe.transport.sockets import SocketOptions

LOOPBACK = "tcp://127.0.0.1:*"
EPOCH = 1
RUN = 1
OPTIONS = SocketOptions()


def running_lifecycle() -> StageLifecycle:
    """A stage lifecycle in the RUNNING phase of inference run RUN, upstream 'client'."""
    lifecycle = StageLifecycle(
        name="relay", coordinator="c", registration={}, connect_s=1.0, silence_limit_s=1.0, now=0.0
    )
    lifecycle.registration_reply(Registered(name="relay", heartbeat_interval=1.0), 0.0)
    assign = Assign(
        run=RUN, model={}, start=0, end=1, index=0, num_stages=1, upstream="client",
        downstream="client", downstream_endpoint="", dtype="float32", epoch=EPOCH,
    )  # fmt: skip
    lifecycle.control_message(assign, 0.0)
    lifecycle.assignment_ready(RUN, EPOCH, build_s=0.0)
    lifecycle.control_message(Connect(run=RUN, epoch=EPOCH), 0.0)
    lifecycle.connected(RUN, DataRoute.inference(EPOCH, "client"))
    return lifecycle


def thread_role(name: str) -> str:
    """Which part of the relay a thread is, by its name."""
    if name == "MainThread":
        return "loop"
    if name.startswith("compute"):
        return "compute"
    if name.startswith("zpipe-link"):
        return "link_meter"
    if name.startswith("ZMQbg"):
        return "libzmq"
    return "other"  # pyzmq's garbage collector of zero-copy frames is an unnamed Thread-N


def usage() -> tuple[float, dict[str, int], dict[str, float], dict[str, float]]:
    """This process's CPU seconds, how often each of its threads has blocked so far
    (voluntary context switches: each is a sleep that some other thread's hand-off,
    the network or a wait for the GIL had to end) and each thread's CPU seconds
    (``schedstat``, nanoseconds), both by thread role."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    switches: dict[str, int] = {}
    cpu: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            status = (task / "status").read_text()
            ran_ns = int((task / "schedstat").read_text().split()[0])
            name = names.get(int(task.name)) or (task / "comm").read_text().strip()
        except (OSError, ValueError, IndexError):  # a thread that just ended
            continue
        role = thread_role(name)
        cpu[role] = cpu.get(role, 0.0) + ran_ns / 1e9
        for line in status.splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                switches[role] = switches.get(role, 0) + int(line.split()[1])
    return time.process_time(), switches, cpu, dict(STEPS)


# --steps: the loop thread's CPU seconds per step, each without the steps it calls
STEPS: dict[str, float] = {}
_STEP_STACK: list[float] = []


def timed(name: str, fn: Any) -> Any:
    """``fn`` charging its loop-thread CPU (less its timed callees') to step ``name``."""
    loop_thread = threading.get_ident()

    def timed(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() != loop_thread:
            return fn(*args, **kwargs)
        started = time.thread_time()
        _STEP_STACK.append(0.0)
        try:
            return fn(*args, **kwargs)
        finally:
            spent = time.thread_time() - started
            STEPS[name] = STEPS.get(name, 0.0) + spent - _STEP_STACK.pop()
            if _STEP_STACK:
                _STEP_STACK[-1] += spent

    return timed


async def readable(conn: Connection) -> None:
    """Until the feeder's next request is there (the run's own deadline bounds it)."""
    loop = asyncio.get_running_loop()
    ready = asyncio.Event()
    loop.add_reader(conn.fileno(), ready.set)
    try:
        await ready.wait()
    finally:
        loop.remove_reader(conn.fileno())
