"""Lossy training across real device processes on this machine.

:class:`DevicePool` starts ``n`` processes of ``python -m zpipe.lossy.device``
(:mod:`zpipe.lossy.device`), each told this launcher's control endpoint; they
answer with their data endpoints. A pool serves many runs (process start-up
and ``import torch`` cost seconds on two cores), and always ends its
children: ``close`` asks them to exit, then kills whatever is still alive.

:meth:`DevicePool.train` sends each device its setup for one
:class:`~zpipe.lossy.simulate.PreparedRun` (the run spec, its peers, its
weight slices and, for input and output owners, every mini-batch's inputs or
labels; the launcher reads the data set, so devices need neither scikit-learn
nor the files), starts every device at once, collects each one's result and
stitches them into the same :class:`~zpipe.lossy.trace.TrainingTrace` that
:func:`zpipe.lossy.trace.train_in_process` builds. With the same seed the two
drop the same messages and end with the same weights.

:meth:`DevicePool.measure_links` has every device send 50 probes over each of
its links, as EdgePipe measures reception ratios, and returns the measured
matrix, which :func:`zpipe.lossy.mapping.map_devices` can map on.

Control messages travel launcher -> device PUSH -> the device's PULL, and
device -> launcher PUSH -> the launcher's PULL; every await has a deadline,
and a wait also watches the children, so a device that dies fails the call
at once with its exit code.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import zmq
import zmq.asyncio

from zpipe._errors import ConfigError, PipelineError, ProtocolError, TransportTimeout
from zpipe.log import get_logger
from zpipe.lossy.data import Dataset
from zpipe.lossy.engine import shard_params
from zpipe.lossy.linkmodes import WAIT_MODES, WaitMode, check_link_transport
from zpipe.lossy.partial import FloatArray
from zpipe.lossy.schedule import total_timeslots
from zpipe.lossy.shard import Topology
from zpipe.lossy.simulate import PreparedRun, RunConfig, prepare_run
from zpipe.lossy.trace import TrainingTrace, trace_from_results
from zpipe.lossy.wire import RunSpec, peers_body, to_tensor
from zpipe.protocol import Message
from zpipe.protocol.lossy import (
    LossyGo,
    LossyHello,
    LossyProbeReport,
    LossyProbeRequest,
    LossyReady,
    LossyResult,
    LossySetup,
)
from zpipe.protocol.stage_control import Shutdown
from zpipe.transport.sockets import (
    SocketOptions,
    bind_endpoint,
    decode_frames,
    new_context,
    open_socket,
    recv_frames,
    send,
)

log = get_logger("zpipe.lossy.multiprocess")

# What a device answers the launcher with; each names its device.
_Reply = TypeVar("_Reply", LossyHello, LossyReady, LossyResult, LossyProbeReport)

SOCKET_OPTIONS = SocketOptions(send_hwm=1024, recv_hwm=1024)
PROBES_PER_LINK = 50  # EdgePipe measures each link with 50 packets
_REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class MultiprocessResult:
    """A multi-process run: its trace plus what only real processes have."""

    trace: TrainingTrace
    #: per device: passes that ran with partials missing,
    #: ``[data, kind, key_layer, missing, deadline, proceeded]`` (deadline mode:
    #: wall-clock seconds; emulated mode: the device's monotonic clock)
    waits: dict[int, list[list[Any]]]
    #: partials that arrived after their pass had run (discarded), all devices
    late: int
    #: malformed messages each device has dropped since it started
    protocol_errors: dict[int, int]
    wall_s: float
    measured_prr: FloatArray | None = None
    device_wall_s: dict[int, float] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        return {
            **self.trace.summary(),
            "late": self.late,
            "wall_s": self.wall_s,
            "protocol_errors": sum(self.protocol_errors.values()),
        }


class DevicePool:
    """``n_devices`` device processes and the control sockets to reach them."""

    def __init__(
        self,
        n_devices: int,
        *,
        host: str = "127.0.0.1",
        start_timeout_s: float = 60.0,
        control_timeout_s: float = 30.0,
        idle_timeout_s: float = 600.0,
        log_level: str = "warning",
    ) -> None:
        if n_devices < 1:
            raise ConfigError(f"a device pool needs at least one device, got {n_devices}")
        self.n_devices = n_devices
        self.host = host
        self.start_timeout_s = start_timeout_s
        self.control_timeout_s = control_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.log_level = log_level
        self.processes: list[subprocess.Popen[bytes]] = []
        self.endpoints: dict[int, str] = {}
        self.pids: dict[int, int] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._pull: zmq.asyncio.Socket | None = None
        self._push: dict[int, zmq.asyncio.Socket] = {}
        self._run = 0

    # -- lifetime ---------------------------------------------------------------

    def __enter__(self) -> DevicePool:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Start the processes and wait (bounded) until every one has said hello."""
        # The pool owns its event loop, so its sync methods can be called from
        # ordinary code, test after test, while the sockets stay on one loop.
        self._loop = asyncio.new_event_loop()
        self._ctx = new_context()
        self._pull = open_socket(self._ctx, zmq.PULL, SOCKET_OPTIONS)
        control = bind_endpoint(self._pull, f"tcp://{self.host}:0")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(_REPO_ROOT), env.get("PYTHONPATH", "")) if p
        )
        # The matrices are tiny: BLAS threads would only fight the other devices.
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            env[var] = "1"
        try:
            for k in range(self.n_devices):
                cmd = [
                    sys.executable,
                    "-m",
                    "zpipe.lossy.device",
                    "--index",
                    str(k),
                    "--control",
                    control,
                    "--host",
                    self.host,
                    "--parent-pid",
                    str(os.getpid()),
                    "--idle-timeout-s",
                    str(self.idle_timeout_s),
                    "--log-level",
                    self.log_level,
                ]
                self.processes.append(
                    subprocess.Popen(
                        cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL
                    )
                )
            hellos = self._call(
                self._gather(LossyHello, None, set(range(self.n_devices)), self.start_timeout_s)
            )
            for k, msg in hellos.items():
                self.endpoints[k] = msg.endpoint
                self.pids[k] = msg.pid
                sock = open_socket(self._ctx, zmq.PUSH, SOCKET_OPTIONS)
                sock.connect(msg.endpoint)
                self._push[k] = sock
        except BaseException:
            self.close()
            raise

    def close(self, *, timeout_s: float = 5.0) -> None:
        """Ask every device to exit, wait a bounded time, kill the rest."""
        if self._loop is not None and not self._loop.is_closed():
            for k in list(self._push):
                try:
                    self._call(
                        self._send(k, Shutdown(reason="pool closed").to_message(), timeout_s=1.0)
                    )
                except (TransportTimeout, zmq.ZMQError):
                    pass  # it is killed below
        deadline = time.monotonic() + timeout_s
        for proc in self.processes:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("lossy_device_killed", pid=proc.pid)
                proc.kill()
                proc.wait(timeout=timeout_s)
        self.processes = []
        for sock in [*self._push.values(), *([self._pull] if self._pull is not None else [])]:
            sock.close(linger=0)
        self._push = {}
        self._pull = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self._loop is not None and not self._loop.is_closed():
            self._loop.close()
        self._loop = None

    # -- runs -------------------------------------------------------------------

    def train(
        self,
        prepared: PreparedRun,
        data: Dataset,
        *,
        mode: WaitMode = "emulated",
        slot_s: float = 0.1,
        wait_s: float = 30.0,
        timeout_s: float = 120.0,
    ) -> MultiprocessResult:
        """Train one prepared run across the pool's devices."""
        if mode not in WAIT_MODES:
            raise ConfigError(f"wait mode must be one of {WAIT_MODES}, got {mode!r}")
        if not slot_s > 0 or not wait_s > 0:
            raise ConfigError("slot_s and wait_s must be positive")
        alloc = prepared.alloc
        devices = sorted(set(alloc.device_of))
        if devices[-1] >= self.n_devices:
            raise ConfigError(
                f"the allocation uses device {devices[-1]}; the pool has {self.n_devices}"
            )
        cfg = prepared.config
        spec = RunSpec(
            alloc=alloc,
            prr=prepared.topology.prr,
            seed=cfg.seed,
            recovery=cfg.recovery,
            lossless=prepared.lossless,
            lr=cfg.lr,
            n_data=prepared.n_data,
            batch=cfg.batch_size,
            mode=mode,
            slot_s=slot_s,
            wait_s=wait_s,
        )
        budget = timeout_s
        if mode == "deadline":
            budget += total_timeslots(alloc, prepared.n_data) * slot_s
        return self._call(self._train(prepared, data, spec, devices, budget))

    def measure_links(
        self,
        prr: FloatArray,
        *,
        seed: int,
        probes: int = PROBES_PER_LINK,
        timeout_s: float = 30.0,
    ) -> FloatArray:
        """Reception ratios measured with ``probes`` probes per directed link.

        ``prr`` is the emulated links' true ratios (``[src, dst]``); the result
        is ``received / sent`` per link, 1 on the diagonal.
        """
        n = self.n_devices
        prr = np.asarray(prr, dtype=np.float64)
        if prr.shape != (n, n):
            raise ConfigError(f"reception ratios of shape {prr.shape} for {n} devices")
        if probes < 1:
            raise ConfigError(f"need at least one probe per link, got {probes}")
        return self._call(self._measure(prr, seed, probes, timeout_s))

    # -- internals --------------------------------------------------------------

    @property
    def last_run(self) -> int:
        """The id of the latest run or measurement (0 before the first)."""
        return self._run

    def _call(self, coro: Any) -> Any:
        if self._loop is None:
            raise PipelineError("the device pool is not started (use it as a context manager)")
        return self._loop.run_until_complete(coro)

    def _next_run(self) -> int:
        self._run += 1
        return self._run

    async def _train(
        self,
        prepared: PreparedRun,
        data: Dataset,
        spec: RunSpec,
        devices: list[int],
        budget_s: float,
    ) -> MultiprocessResult:
        started = time.perf_counter()
        self._check_alive()  # a send to a dead device would only time out
        run = self._next_run()
        topo = Topology(spec.alloc)
        batches = [prepared.batch(data, i) for i in range(1, prepared.n_data + 1)]
        inputs = np.stack([x for x, _ in batches])
        labels = np.stack([y for _, y in batches]).astype(np.int64)
        peers = peers_body({d: self.endpoints[d] for d in devices})
        for d in devices:
            weights = shard_params(topo, prepared.params, d)
            layers = sorted(weights)
            tensors = [to_tensor(a) for layer in layers for a in weights[layer]]
            owns_input = topo.slice_of(0, d) is not None
            owns_output = topo.slice_of(topo.last, d) is not None
            if owns_input:
                tensors.append(to_tensor(inputs))
            if owns_output:
                tensors.append(to_tensor(labels))
            setup = LossySetup(
                run=run,
                device=d,
                spec=spec.to_body(),
                peers=peers,
                layers=layers,
                inputs=owns_input,
                labels=owns_output,
                tensors=tuple(tensors),
            )
            await self._send(d, setup.to_message(), timeout_s=self.control_timeout_s)
        ready = await self._gather(LossyReady, run, set(devices), self.control_timeout_s)
        failed = {d: m.error for d, m in ready.items() if m.error}
        if failed:
            raise PipelineError(f"devices refused the run: {failed}")
        # Room for every device to get "go" before the first timeslot begins.
        start_at = time.time() + 0.05 + 0.01 * len(devices)
        for d in devices:
            go = LossyGo(run=run, start_at=start_at).to_message()
            await self._send(d, go, timeout_s=self.control_timeout_s)
        results = await self._gather(LossyResult, run, set(devices), budget_s)
        failed = {d: m.error for d, m in results.items() if m.error}
        if failed:
            raise PipelineError(f"devices failed the run: {failed}")
        return self._assemble(topo, results, time.perf_counter() - started)

    def _assemble(
        self, topo: Topology, results: dict[int, LossyResult], wall_s: float
    ) -> MultiprocessResult:
        return MultiprocessResult(
            trace=trace_from_results(topo, results),
            waits={d: list(m.waits) for d, m in results.items()},
            late=sum(m.late for m in results.values()),
            protocol_errors={d: m.protocol_errors for d, m in results.items()},
            wall_s=wall_s,
            device_wall_s={d: float(m.wall_s) for d, m in results.items()},
        )

    async def _measure(
        self, prr: FloatArray, seed: int, probes: int, timeout_s: float
    ) -> FloatArray:
        self._check_alive()
        run = self._next_run()
        devices = set(range(self.n_devices))
        request = LossyProbeRequest(
            run=run,
            seed=seed,
            count=probes,
            prr=prr.tolist(),
            peers=peers_body(self.endpoints),
            timeout_s=timeout_s,
        ).to_message()
        for d in sorted(devices):
            await self._send(d, request, timeout_s=self.control_timeout_s)
        reports = await self._gather(LossyProbeReport, run, devices, timeout_s * 2)
        measured = np.eye(self.n_devices)
        for dst, msg in reports.items():
            if msg.error:
                raise PipelineError(f"device {dst} could not measure its links: {msg.error}")
            for src_key, received in msg.received.items():
                src = int(src_key)
                measured[src, dst] = int(received) / int(msg.sent[src_key])
        return measured

    async def _send(self, device: int, msg: Message, *, timeout_s: float) -> None:
        await send(self._push[device], msg, timeout_s=timeout_s, peer=f"device {device}")

    async def _gather(
        self, reply: type[_Reply], run: int | None, devices: set[int], timeout_s: float
    ) -> dict[int, _Reply]:
        """One ``reply`` message (of ``run``) from each of ``devices``, by a deadline."""
        assert self._pull is not None
        kind = reply.KIND
        got: dict[int, _Reply] = {}
        deadline = time.monotonic() + timeout_s
        while devices - got.keys():
            self._check_alive()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(devices - got.keys())
                raise TransportTimeout(f"devices {missing}", kind, timeout_s)
            try:
                # Short waits, so a child that died is noticed at once.
                frames = await recv_frames(
                    self._pull, timeout_s=min(0.5, remaining), peer="devices", awaited=kind
                )
            except TransportTimeout:
                continue
            try:
                raw = decode_frames(frames, SOCKET_OPTIONS.max_message_bytes)
                if raw.kind != kind:
                    log.info("lossy_unexpected_message", kind=raw.kind, expected=kind)
                    continue
                msg = reply.from_message(raw)
            except ProtocolError as exc:
                log.warning("lossy_bad_message", error=str(exc))
                continue
            if run is not None and getattr(msg, "run", None) != run:
                log.info("lossy_unexpected_message", kind=kind, run=getattr(msg, "run", None))
                continue
            if msg.device in devices:
                got[msg.device] = msg
        return got

    def _check_alive(self) -> None:
        for k, proc in enumerate(self.processes):
            code = proc.poll()
            if code is not None:
                raise PipelineError(f"device process {k} (pid {proc.pid}) exited with {code}")


def run_multiprocess(
    cfg: RunConfig,
    data: Dataset,
    *,
    pool: DevicePool | None = None,
    mode: WaitMode = "emulated",
    slot_s: float = 0.1,
    wait_s: float = 30.0,
    measure_links: bool = False,
    link_transport: str = "tcp",
    timeout_s: float = 120.0,
) -> MultiprocessResult:
    """Train ``cfg`` across device processes (a pool of its own unless given).

    With ``measure_links`` the devices first measure their links with 50
    probes each and the allocation is mapped on the measured ratios (compare
    with ``prepare_run(cfg, data, measured=result.measured_prr)``).
    """
    check_link_transport(link_transport)
    if pool is None:
        # naive runs use device 0 only; every other allocation uses all of them
        with DevicePool(cfg.n_devices) as own:
            return run_multiprocess(
                cfg,
                data,
                pool=own,
                mode=mode,
                slot_s=slot_s,
                wait_s=wait_s,
                measure_links=measure_links,
                timeout_s=timeout_s,
            )
    measured = None
    if measure_links:
        topology = prepare_run(cfg, data).topology
        measured = pool.measure_links(topology.prr, seed=cfg.seed)
    prepared = prepare_run(cfg, data, measured=measured)
    result: MultiprocessResult = pool.train(
        prepared, data, mode=mode, slot_s=slot_s, wait_s=wait_s, timeout_s=timeout_s
    )
    result.measured_prr = measured
    return result
