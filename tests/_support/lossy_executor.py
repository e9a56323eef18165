"""Helpers shared by tests (moved from test_lossy_executor.py)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from zpipe.lossy.engine import shard_params
from zpipe.lossy.evaluation import EvalSpec
from zpipe.lossy.links import Recovery
from zpipe.lossy.mapping import partition_and_map
from zpipe.lossy.partial import init_mlp
from zpipe.lossy.shard import Topology
from zpipe.lossy.wire import RunSpec, partial_message, to_tensor
from zpipe.protocol.lossy import LossySetup
from zpipe.stage.executors.lossy import LossyExecutor
from zpipe.stage.supervision import TaskSupervisor
from zpipe.transport.codec import Message

SIZES = [6, 4, 4, 3]
EPOCH = 7


class _UnlimitedPort:
    """The data socket's limit is all the executor reads of it outside a receive loop."""

    def getsockopt(self, option: int) -> int:
        return -1


def _executor(sent: list[Message], *, data_in: Any = None) -> LossyExecutor:
    async def send_control(message: Message) -> None:
        sent.append(message)

    async def stop_data() -> None:
        return None

    def connect(endpoint: str, key: str | None, peer: str) -> Any:
        raise AssertionError("set-up connects to nobody: peers connect at lossy_go")

    async def apply_limits(limits: Any) -> None:
        return None

    port = data_in if data_in is not None else _UnlimitedPort()
    return LossyExecutor(
        name="s0",
        # no receive loop reads _UnlimitedPort: it only answers the limit the port has
        data_in=lambda: port,
        data_allow=None,
        connector=connect,
        compute=ThreadPoolExecutor(max_workers=1),
        supervisor=TaskSupervisor("s0", lambda name, error: None),
        send_control=send_control,
        stop_data=stop_data,
        apply_limits=apply_limits,
        max_message_bytes=1 << 20,
        send_timeout_s=1.0,
    )


def _setup(device: int, test: EvalSpec | None = None) -> Message:
    alloc = partition_and_map(SIZES, "vertical", 3, np.ones((3, 3)), mapping="identity", seed=0)
    topo = Topology(alloc)
    spec = RunSpec(alloc=alloc, prr=np.ones((3, 3)), seed=0, recovery=Recovery(), lossless=True,
                   lr=0.1, n_data=2, batch=2, mode="emulated", slot_s=0.1, wait_s=1.0,
                   test=test)  # fmt: skip
    weights = shard_params(topo, init_mlp(SIZES, seed=0), device)
    tensors = [to_tensor(a) for layer in sorted(weights) for a in weights[layer]]
    owns_input = topo.slice_of(0, device) is not None
    owns_output = topo.slice_of(topo.last, device) is not None
    if owns_input:
        tensors.append(to_tensor(np.zeros((2, 2, SIZES[0]))))
        if test is not None:
            tensors.append(to_tensor(np.zeros((test.n_test, SIZES[0]))))
    if owns_output:
        tensors.append(to_tensor(np.zeros((2, 2), dtype=np.int64)))
    setup = LossySetup(run=5, device=device, spec=spec.to_body(),
                       peers={str(d): f"tcp://127.0.0.1:{9000 + d}" for d in range(3)},
                       layers=sorted(weights), inputs=owns_input, labels=owns_output,
                       tensors=tuple(tensors), epoch=EPOCH)  # fmt: skip
    return setup.to_message()


def _partial(data: int, kind: str, layer: int, src: int, shape: tuple[int, int]) -> Message:
    m = partial_message(5, data, kind, layer, src, np.ones(shape))
    return Message(m.kind, m.body, epoch=EPOCH, tensors=m.tensors)


async def _setup_only(executor: LossyExecutor, setup: Message) -> None:
    await executor.on_control(setup)
    await executor._supervisor.stop()  # no socket to receive on in this test
