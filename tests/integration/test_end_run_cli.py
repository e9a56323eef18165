"""``python -m zpipe end-run``: a run ended from a shell, whatever client started it.

A ROUTER on loopback TCP stands in for the coordinator: the command sends
``run_end`` for the run named, prints the stages' counters of the report, and
exits 0; its flags are checked before anything is sent.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator

import pytest
import zmq
import zmq.asyncio

from zpipe.cli import main as zpipe_main
from zpipe.protocol import REGISTRY
from zpipe.protocol.client_control import PRESENCE, Progress, RunEnd, RunReport
from zpipe.transport.codec import decode, encode

WAIT_S = 60.0


@pytest.fixture
async def context() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.term()


@pytest.fixture
def router(context: zmq.asyncio.Context) -> Iterator[zmq.asyncio.Socket]:
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:*")
    yield router
    router.close(linger=0)


async def test_end_run_sends_run_end_and_prints_the_counters(
    router: zmq.asyncio.Socket, capsys: pytest.CaptureFixture[str]
) -> None:
    endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
    command = asyncio.ensure_future(
        asyncio.to_thread(zpipe_main, ["end-run", "--coordinator", endpoint, "7"])
    )
    identity, *frames = await asyncio.wait_for(router.recv_multipart(), WAIT_S)
    end = REGISTRY.parse(decode(frames))
    assert isinstance(end, RunEnd) and end.run == 7
    # a coordinator looking whether this client is there: dropped, not taken for the answer
    presence = Progress(run=7, awaited=PRESENCE)
    await router.send_multipart([identity, *encode(presence.to_message())])
    report = RunReport(run=7, stages={"a": {"microbatches": 2}})
    await router.send_multipart([identity, *encode(report.to_message())])
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
