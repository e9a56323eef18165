"""``python -m zpipe end-run``: a run ended from a shell, whatever client started it.

A ROUTER on loopback TCP stands in for the coordinator: the command sends
``run_end`` for the run named, prints the stages' counters of the report, and
exits 0; its flags are checked before anything is sent.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import zmq
import zmq.asyncio

from tests._support.stand_in_coordinator import WAIT_S, answer, endpoint_of, received
from zpipe.cli import main as zpipe_main
from zpipe.protocol.client_control import PRESENCE, Progress, RunEnd, RunReport


async def test_end_run_sends_run_end_and_prints_the_counters(
    router: zmq.asyncio.Socket, capsys: pytest.CaptureFixture[str]
) -> None:
    endpoint = endpoint_of(router)
    command = asyncio.ensure_future(
        asyncio.to_thread(zpipe_main, ["end-run", "--coordinator", endpoint, "7"])
    )
    identity, end = await received(router)
    assert isinstance(end, RunEnd) and end.run == 7
    # a coordinator looking whether this client is there: dropped, not taken for the answer
    await answer(router, identity, Progress(run=7, awaited=PRESENCE))
    await answer(router, identity, RunReport(run=7, stages={"a": {"microbatches": 2}}))
    assert await asyncio.wait_for(command, WAIT_S) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed == {"run": 7, "stages": {"a": {"microbatches": 2}}}


def test_end_run_needs_a_coordinator_and_a_run(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        zpipe_main(["end-run", "7"])
    assert exited.value.code == 2 and "--coordinator" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        zpipe_main(["end-run", "--coordinator", "tcp://127.0.0.1:9", "-1"])
    assert exited.value.code == 2
