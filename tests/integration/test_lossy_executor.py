"""The stage's lossy executor judges every partial before it files it (no sockets:
its checks are fed messages directly)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
import zmq
import zmq.asyncio

from tests._support.lossy_executor import (
    EPOCH,
    SIZES,
    _executor,
    _partial,
    _setup,
    _setup_only,
)
from zpipe._errors import PipelineError, ProtocolError
from zpipe.coordinator.runs.lossy_probe import measured_matrix
from zpipe.lossy.evaluation import EvalSpec
from zpipe.lossy.links import Recovery
from zpipe.lossy.mapping import partition_and_map
from zpipe.lossy.pass_control import PassControl, PassStarted
from zpipe.lossy.wire import RunSpec
from zpipe.protocol import REGISTRY
from zpipe.protocol.lossy import LossyProbeReport
from zpipe.stage.executors.lossy import LossyExecutor
from zpipe.transport.codec import Message, encode


def test_partials_a_stage_does_not_own_are_refused_and_stale_ones_dropped() -> None:
    sent: list[Message] = []
    executor = _executor(sent)
    setup = _setup(1)  # vertical on 3 devices: device 1 owns layer 1 only

    async def scenario() -> None:
        await executor.on_control(setup)
        await executor.close()

    asyncio.run(scenario())
    assert [m.kind for m in sent] == ["lossy_ready"] and sent[0].body["error"] == ""
    assert sent[0].epoch == EPOCH
    assert executor.state is None  # closed; set it up again without a receive loop
    asyncio.run(_setup_only(executor, setup))
    st, control = executor.state, _control(executor)
    filed = control.partials
    assert st is not None
    # device 0 (the input owner) sends layer 0's slice: filed for the forward of layer 1
    executor._on_data(REGISTRY.parse(_partial(1, "F", 0, 0, (2, 6))))
    assert set(filed[(1, "F", 0)]) == {0}
    with pytest.raises(ProtocolError, match="owns no part"):  # a layer it does not own
        executor._on_data(REGISTRY.parse(_partial(1, "F", 1, 0, (2, 4))))
    with pytest.raises(ProtocolError, match="shape"):
        executor._on_data(REGISTRY.parse(_partial(2, "F", 0, 0, (2, 5))))
    with pytest.raises(ProtocolError, match="outside"):  # a mini-batch beyond the run
        executor._on_data(REGISTRY.parse(_partial(9, "F", 0, 0, (2, 6))))
    with pytest.raises(ProtocolError, match="not a peer"):
        executor._on_data(REGISTRY.parse(_partial(1, "F", 0, 7, (2, 6))))
    # another plan epoch: ignored, nothing filed
    old = _partial(2, "F", 0, 0, (2, 6))
    executor._on_data(
        REGISTRY.parse(Message(old.kind, old.body, epoch=EPOCH - 1, tensors=old.tensors))
    )
    assert (2, "F", 0) not in filed and executor.stale == 1  # dropped, counted
    # after its pass ran (null-filled), a partial is late: counted, not filed
    control.consumed.add((2, "F", 0))
    executor._on_data(REGISTRY.parse(_partial(2, "F", 0, 0, (2, 6))))
    assert st.late == 1 and (2, "F", 0) not in filed
    assert torch.equal(torch.from_numpy(filed[(1, "F", 0)][0]), torch.ones(2, 6).double())


def test_a_test_pass_partial_is_filed_apart_and_one_for_no_test_step_refused() -> None:
    # Three test rows in mini-batches of two: test steps 0 (2 rows) and 1 (1 row).
    test = EvalSpec(n_test=3, batch=2)
    sent: list[Message] = []
    executor = _executor(sent)
    asyncio.run(_setup_only(executor, _setup(0, test)))  # the input owner takes the rows
    assert sent[-1].body["error"] == ""
    assert executor.state is not None and executor.state.x_test is not None
    asyncio.run(_setup_only(executor, _setup(1, test)))
    st, control = executor.state, _control(executor)
    filed = control.partials
    assert st is not None and sorted(st.tests) == [0, 1]
    executor._on_data(REGISTRY.parse(_partial(1, "TF", 0, 0, (1, 6))))
    # training's mini-batch 1: apart
    executor._on_data(REGISTRY.parse(_partial(1, "F", 0, 0, (2, 6))))
    assert set(filed[(1, "TF", 0)]) == {0} and filed[(1, "TF", 0)][0].shape == (1, 6)
    assert set(filed[(1, "F", 0)]) == {0}
    with pytest.raises(ProtocolError, match="not a test step"):
        executor._on_data(REGISTRY.parse(_partial(2, "TF", 0, 0, (1, 6))))
    with pytest.raises(ProtocolError, match="shape"):  # step 0 has two rows
        executor._on_data(REGISTRY.parse(_partial(0, "TF", 0, 0, (1, 6))))
    with pytest.raises(ProtocolError, match="sharing"):  # sharing is of the output layer
        executor._on_data(REGISTRY.parse(_partial(0, "TS", 0, 0, (2, 6))))
    # a setup whose test rows are missing is refused
    setup = _setup(0, test)
    short = Message(setup.kind, setup.body, epoch=EPOCH, tensors=setup.tensors[:-1])
    asyncio.run(_setup_only(executor, short))
    assert "tensors" in sent[-1].body["error"] and executor.state is None


def _control(executor: LossyExecutor) -> PassControl:
    """The pass schedule's controller of the run set up on ``executor``."""
    assert executor._inbox is not None
    return executor._inbox.control


def test_a_setup_that_does_not_fit_is_refused_in_lossy_ready() -> None:
    sent: list[Message] = []
    executor = _executor(sent)
    setup = _setup(1)
    wrong_device = Message(setup.kind, {**setup.body, "device": 0}, epoch=EPOCH,
                           tensors=setup.tensors)  # fmt: skip
    asyncio.run(_setup_only(executor, wrong_device))
    assert sent[-1].kind == "lossy_ready" and "weights for layers" in sent[-1].body["error"]
    assert executor.state is None and executor.protocol_errors == 1
    with pytest.raises(ProtocolError, match="not set up"):
        asyncio.run(executor.on_control(Message("lossy_go", {"run": 5, "start_at": 0.0})))


def test_run_spec_round_trips_and_rejects_garbage() -> None:
    alloc = partition_and_map(SIZES, "hybrid", 3, np.ones((3, 3)), mapping="identity", seed=0)
    spec = RunSpec(alloc=alloc, prr=np.full((3, 3), 0.75), seed=3,
                   recovery=Recovery("ack", max_attempts=3), lossless=False, lr=0.1, n_data=4,
                   batch=20, mode="emulated", slot_s=0.1, wait_s=5.0)  # fmt: skip
    body = msgpack.unpackb(msgpack.packb(spec.to_body()))
    again = RunSpec.from_body(body)
    assert again.alloc == spec.alloc and np.array_equal(again.prr, spec.prr)
    assert again.recovery == spec.recovery and again.test is None
    test = EvalSpec(n_test=7, batch=3, repeats=2, eval_index=4)
    tested = RunSpec.from_body(msgpack.unpackb(msgpack.packb(replace(spec, test=test).to_body())))
    assert tested.test == test
    for broken in (
        {**body, "test": {"n_test": 0, "batch": 3, "repeats": 1, "eval_index": 0}},
        {**body, "test": {"n_test": 7, "batch": 3, "repeats": 1}},
        {**body, "test": [7, 3]},
        {**body, "prr": [[1.0]]},
        {**body, "mode": "psychic"},
        {**body, "n_data": "4"},
        {**body, "recovery": {"scheme": "pray", "copies": 1, "max_attempts": 1}},
        {k: v for k, v in body.items() if k != "alloc"},
    ):
        with pytest.raises(ProtocolError):
            RunSpec.from_body(broken)


def test_bad_partials_reaching_the_data_port_are_dropped_and_counted() -> None:
    # Through the executor's real receive loop: each bad message is dropped and counted,
    # and the loop goes on to file the good one sent after them.
    async def scenario() -> tuple[LossyExecutor, list[Message]]:
        ctx = zmq.asyncio.Context()
        pull = ctx.socket(zmq.PULL)
        pull.bind("inproc://lossy-data")
        push = ctx.socket(zmq.PUSH)
        push.connect("inproc://lossy-data")
        sent: list[Message] = []
        executor = _executor(sent, data_in=pull)
        await executor.on_control(_setup(1))  # vertical on 3 devices: device 1 owns layer 1
        st = executor.state
        assert st is not None
        good = _partial(2, "F", 0, 0, (2, 6))
        other_run = Message(good.kind, {**good.body, "run": 4}, epoch=EPOCH, tensors=good.tensors)
        other_epoch = Message(good.kind, good.body, epoch=EPOCH + 1, tensors=good.tensors)
        for frames in (
            [b"\xc1 not msgpack"],
            encode(_partial(1, "F", 1, 0, (2, 4))),  # a layer device 1 does not own
            encode(_partial(7, "F", 0, 0, (2, 6))),  # a mini-batch beyond the run's 2
            encode(other_run),
            encode(other_epoch),
            encode(good),  # last: once it is filed, every earlier one was handled
        ):
            await push.send_multipart(frames)
        assert executor._inbox is not None
        # the pass loop's own wait: until device 0's partial is filed under the key
        wait = PassStarted((2, "F", 0), 2, (0,), frozenset({0}), time.monotonic() + 30)
        _, got, _ = await asyncio.to_thread(executor._inbox.collect, wait, time.monotonic)
        await executor.close()
        for sock in (push, pull):
            sock.close(linger=0)
        ctx.term()
        assert set(got) == {0}
        return executor, sent

    executor, _ = asyncio.run(scenario())
    assert executor.protocol_errors == 3 and executor.stale == 2


def test_a_probe_report_that_does_not_fit_is_refused() -> None:
    def report(received: dict[str, Any], sent: dict[str, Any], error: str = "") -> LossyProbeReport:
        return LossyProbeReport(run=1, device=0, received=received, sent=sent, error=error)

    good = [report({"1": 40}, {"1": 50}), report({"0": 50}, {"0": 50})]
    # device 0 heard 40 of device 1's 50: the link [src 1][dst 0]
    np.testing.assert_array_equal(measured_matrix(good), [[1.0, 1.0], [0.8, 1.0]])
    for bad in (
        report({"1": 60}, {"1": 50}),  # more received than sent
        report({"1": 40}, {"1": 0}),
        report({"1": "40"}, {"1": 50}),
        report({"2": 40}, {"2": 50}),  # not a peer
        report({}, {}),
    ):
        with pytest.raises(ProtocolError):
            measured_matrix([bad, good[1]])
    with pytest.raises(PipelineError, match="could not measure"):
        measured_matrix([report({"1": 0}, {}, error="no probes finished"), good[1]])
