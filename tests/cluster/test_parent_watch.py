"""A LocalCluster's processes shut down when the program that started them is killed."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

from zpipe.cli.parent_watch import parent_is_gone, watch_parent

OWNER = """
import sys
from zpipe.cluster import LocalCluster
cluster = LocalCluster(2, heartbeat_interval_s=0.5)
cluster.start()
print(" ".join(str(p.pid) for p in cluster.processes.values()), flush=True)
sys.stdin.read()  # until killed
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is gone too; its parent (init) reaps it
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_a_parent_that_is_not_ours_is_gone() -> None:
    assert not parent_is_gone(os.getppid())
    assert parent_is_gone(os.getpid())  # never our own parent


def test_the_watch_fires_once_for_a_gone_parent_and_never_for_a_live_one() -> None:
    async def watch(pid: int) -> list[str]:
        calls: list[str] = []
        task = asyncio.ensure_future(
            watch_parent(pid, lambda: calls.append("gone"), interval_s=0.01)
        )
        try:
            await asyncio.wait_for(asyncio.shield(task), 0.2)
        except asyncio.TimeoutError:
            task.cancel()
        return calls

    assert asyncio.run(watch(os.getpid())) == ["gone"]
    assert asyncio.run(watch(os.getppid())) == []  # twenty looks, no call


def test_the_cluster_goes_when_its_owner_is_killed() -> None:
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert owner.stdout is not None
        line = owner.stdout.readline()  # after the coordinator saw both stages
        children = [int(p) for p in line.split()]
        assert len(children) == 3 and all(_alive(p) for p in children)
        owner.send_signal(signal.SIGKILL)  # no chance to stop its cluster
        owner.wait(timeout=30)
        deadline = time.monotonic() + 120  # generous: a loaded machine shuts down slowly
        while any(_alive(p) for p in children) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [p for p in children if _alive(p)]
        assert not left, f"still running after their owner was killed: {left}"
    finally:
        if owner.poll() is None:
            owner.kill()
        for pid in locals().get("children", []):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
