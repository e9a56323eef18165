"""A local cluster: a coordinator and stage processes spawned on loopback.

For experiments and tests on one machine: each stage is a real
``python -m zpipe.stage`` process that can emulate a slower device and a
slower link, exactly as it would run on a device of its own.

For clusters of many stages, ``emulate_compute`` (a profile file) makes every
stage emulate its compute from the profile (``--emulate-compute``) and
``fork_stages`` forks the stages from this process instead of starting fresh
interpreters (:mod:`zpipe.cluster.forked`): 64 stages start in seconds
and share the imported torch.

``zygote`` (or ``ZPIPE_CLUSTER_ZYGOTE=1`` in the environment, as the test suite
sets it) starts the coordinator and stages by forking a warm interpreter of its
own (:mod:`zpipe.cluster.zygote`) rather than starting fresh ones: each process
is still a separate ``python -m`` command of its own, without three seconds of
importing torch each (Linux; elsewhere they are spawned).

:class:`LocalCluster` is for synchronous code (``with``; each call runs its own
event loop); :class:`AsyncLocalCluster` is the same cluster for code that already
runs in an event loop, such as a Jupyter notebook (``async with``, ``await``).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from zpipe._errors import PipelineError
from zpipe.client import (
    Batch,
    GenerateOptions,
    InferOptions,
    Outputs,
    PipelineClient,
    RunReport,
    TrainBatch,
    TrainOptions,
    TrainReport,
)
from zpipe.cluster.coordinator_process import (
    ENDPOINT_FILE,
    CoordinatorStart,
    PortHold,
    StageProcess,
    coordinator_argv,
    registered_now,
    stop_processes,
    unless_coordinator_exits,
)
from zpipe.cluster.device_spec import DeviceSpec, local_devices
from zpipe.config import Timeouts
from zpipe.generation.params import SamplingParams, TokenEvent
from zpipe.models import ModelSpec, load_layer_sequence
from zpipe.progress import TerminalProgress

# set (to anything but 0) to launch the processes of every cluster from a zygote
ZYGOTE_ENV = "ZPIPE_CLUSTER_ZYGOTE"


class LocalCluster:
    """``with LocalCluster(3) as cluster: outputs = cluster.infer(spec, batches)``.

    ``devices``: how many plain devices, or each device as a :class:`DeviceSpec` or
    a name (``LocalCluster(["a", "b"])``)."""

    def __init__(
        self,
        devices: Sequence[DeviceSpec | str] | int = 3,
        *,
        keys_dir: Path | None = None,
        heartbeat_interval_s: float = 0.5,
        suspect_after: int = 3,
        probe_intervals: int = 2,
        log_level: str = "info",
        log_dir: Path | None = None,
        python: str = sys.executable,
        # a stage imports torch and torch._dynamo before it registers: 25-40 s each
        # when a dozen processes start at once on two loaded cores
        start_timeout_s: float = 120.0,
        measure_links: bool = True,
        state_dir: Path | None = None,
        emulate_compute: Path | None = None,
        fork_stages: bool = False,
        zygote: bool | None = None,
        allow_factories: Sequence[str] = (),
        progress: bool | None = None,
    ) -> None:
        """``allow_factories``: user code (model factories, loss and optimizer
        callables, "package.module:function" or "package.module:*") that the
        processes may import and run for a run's request (``--allow-factory``)."""
        self.devices, self.stage_threads = local_devices(devices, os.cpu_count() or 1)
        self.keys_dir = keys_dir
        self.heartbeat_interval_s = heartbeat_interval_s
        self.suspect_after = suspect_after
        self.probe_intervals = probe_intervals
        self.log_level = log_level
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.log_dir = log_dir
        self.python = python
        self.start_timeout_s = start_timeout_s
        self.measure_links = measure_links
        self.state_dir = state_dir
        self.emulate_compute = emulate_compute
        self.fork_stages = fork_stages
        if zygote is None:
            zygote = os.environ.get(ZYGOTE_ENV, "") not in ("", "0")
        self.zygote = zygote
        self.allow_factories = tuple(allow_factories)
        self._coordinator_args: list[str] = []
        self.coordinator_endpoint = ""
        self._port_hold: PortHold | None = None  # a killed coordinator's port, until restarted
        self.processes: dict[str, StageProcess] = {}
        # "starting N stages: k registered" on stderr (None: when it is a terminal)
        self.progress = TerminalProgress(progress)

    @property
    def timeouts(self) -> Timeouts:
        return Timeouts(
            heartbeat_interval_s=self.heartbeat_interval_s,
            suspect_after_intervals=self.suspect_after,
            probe_intervals=self.probe_intervals,
        )

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _spawn(self, name: str, args: list[str]) -> StageProcess:
        assert self.log_dir is not None
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if self._zygote_runs(args):
            # imported only here: the zygote module imports the stage (and torch)
            from zpipe.cluster.zygote import shared_zygote

            launched = shared_zygote().launch(
                args[1], args[2:], self.log_dir / f"{name}.log", env=env
            )
            self.processes[name] = launched
            return launched
        log_file = open(self.log_dir / f"{name}.log", "ab")
        process = subprocess.Popen(
            [self.python, *args],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
            stdin=subprocess.DEVNULL,
        )
        log_file.close()
        self.processes[name] = process
        return process

    def _zygote_runs(self, args: list[str]) -> bool:
        """Whether ``python ARGS`` is launched by the zygote: a zpipe command, with this
        interpreter, on a system with child subreapers."""
        if not self.zygote or self.python != sys.executable or args[:1] != ["-m"]:
            return False
        from zpipe.cluster.zygote import COMMANDS, zygote_available

        return args[1] in COMMANDS and zygote_available()

    def _common_flags(self) -> list[str]:
        flags = [
            "--heartbeat-interval",
            str(self.heartbeat_interval_s),
            "--log-format",
            "json",
            "--log-level",
            self.log_level,
            # so that a killed owner does not leave its processes running (a forked
            # stage's parent is this process too)
            "--parent-pid",
            str(os.getpid()),
        ]
        if self.keys_dir is not None:
            flags += ["--keys", str(self.keys_dir)]
        for pattern in self.allow_factories:
            flags += ["--allow-factory", pattern]
        return flags

    def start(self) -> None:
        _no_running_loop("start")
        try:
            self._spawn_all()
            self.wait_for_stages(len(self.devices), timeout_s=self.start_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _spawn_all(self) -> None:
        self._stages_for(self._spawn_coordinator().wait())

    async def _spawn_all_async(self) -> None:
        """:meth:`_spawn_all` without blocking the running loop while the coordinator starts."""
        self._stages_for(await self._spawn_coordinator().wait_async())

    def _stages_for(self, endpoint: str) -> None:
        """The coordinator listens at ``endpoint``: start every device's stage."""
        self.coordinator_endpoint = endpoint
        # a restarted coordinator binds the same port: stages and clients know this one
        self._coordinator_args[self._coordinator_args.index("--bind") + 1] = endpoint
        for device in self.devices:
            self.start_stage(device)

    def _spawn_coordinator(self, *, restart: bool = False) -> CoordinatorStart:
        """Start the coordinator on a port it picks itself (see
        :mod:`zpipe.cluster.coordinator_process`: a port picked here can be taken
        before the coordinator binds it), or ``restart`` it on the port it had."""
        if self.log_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="zpipe-cluster-")
            self.log_dir = Path(self._tmp.name)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        path = self.log_dir / ENDPOINT_FILE
        path.unlink(missing_ok=True)  # an earlier coordinator's (or cluster's)
        if not restart:  # a restart keeps the arguments, with the bound endpoint
            self._coordinator_args = coordinator_argv(
                endpoint_file=path,
                suspect_after=self.suspect_after,
                probe_intervals=self.probe_intervals,
                measure_links=self.measure_links,
                state_dir=self.state_dir,
                common=self._common_flags(),
            )
        process = self._spawn("coordinator", self._coordinator_args)
        return CoordinatorStart(
            process, path, lambda: self.logs("coordinator"), self.start_timeout_s
        )

    def restart_coordinator(self) -> StageProcess:
        """Start the coordinator again, on the same endpoint and state directory
        (after :meth:`kill` of ``"coordinator"``, say); its log file grows on. The port
        is held from the kill until the new coordinator listens (:class:`PortHold`); a
        :class:`PipelineError` if another socket took it before."""
        old = self.processes.get("coordinator")
        if old is not None and old.poll() is None:
            raise PipelineError("the coordinator is still running; kill it first")
        hold, self._port_hold = self._port_hold or PortHold(self.coordinator_endpoint), None
        hold.check()
        start = self._spawn_coordinator(restart=True)
        hold.release_once_listening(start)
        return start.process

    def start_stage(self, device: DeviceSpec, *extra: str) -> StageProcess:
        """Start a stage process for ``device`` (a stage started again after a kill, or
        one more); without its own ``threads`` it gets the cluster's share of the cores,
        as the stages it started with did: with torch's default, several threads per
        stage fight over the shared cores, and its emulated slowdown, which multiplies
        the compute thread's CPU time only when one thread does all the work, would
        multiply the wall time, waits for a core included."""
        if device.threads is None:
            device = replace(device, threads=self.stage_threads)
        args = [
            "--coordinator",
            self.coordinator_endpoint,
            "--bind",
            "tcp://127.0.0.1:0",
            *device.stage_flags(),
            *self._common_flags(),
            *(
                ["--emulate-compute", str(self.emulate_compute)]
                if self.emulate_compute is not None
                else []
            ),
            *extra,
        ]
        if not self.fork_stages:
            return self._spawn(device.name, ["-m", "zpipe.stage", *args])
        # imported only here: it imports the stage (and torch) into this process
        from zpipe.cluster.forked import fork_stage

        assert self.log_dir is not None
        process = fork_stage(args, self.log_dir / f"{device.name}.log")
        self.processes[device.name] = process
        return process

    def wait_for_stages(self, count: int, *, timeout_s: float) -> list[dict[str, Any]]:
        _no_running_loop("wait_for_stages")
        return asyncio.run(self._wait_for_stages(count, timeout_s=timeout_s))

    async def _wait_for_stages(self, count: int, *, timeout_s: float) -> list[dict[str, Any]]:
        for name, process in self.processes.items():
            if process.poll() is not None:
                raise PipelineError(f"{name} exited with {process.returncode}:\n{self.logs(name)}")
        desc = f"starting {count} stage{'s' if count != 1 else ''} (import torch, register)"
        bar = self.progress.bar(total=count, unit="stage", desc=desc)

        def registered(alive: int) -> None:
            bar.update(min(alive, count) - bar.n)

        try:
            async with self.client() as client:
                waiting = asyncio.ensure_future(
                    client.wait_for_stages(
                        count,
                        timeout_s=timeout_s,
                        on_alive=registered,
                        accept=lambda members: registered_now(self.processes, members),
                    )
                )
                what = f"{count} stages were awaited"
                return await unless_coordinator_exits(
                    waiting, self.processes, what, lambda: self.logs("coordinator")
                )
        finally:
            bar.close()

    def client(self, **kwargs: Any) -> PipelineClient:
        kwargs.setdefault("keys_dir", self.keys_dir)
        kwargs.setdefault("timeouts", self.timeouts)
        kwargs.setdefault("sink_bind", "tcp://127.0.0.1:0")
        return PipelineClient(self.coordinator_endpoint, **kwargs)

    def infer(
        self,
        model: ModelSpec,
        batches: Iterable[Batch] | AsyncIterable[Batch],
        *,
        options: InferOptions | None = None,
        **keywords: Any,
    ) -> tuple[list[Outputs], RunReport]:
        """Run a whole inference stream from synchronous code: outputs in order, and the report.

        The settings are ``options`` or :class:`~zpipe.client.InferOptions`' keywords.
        Without ``stage_names`` or ``stages`` the pipeline runs through the devices in the
        order they were given (the first ``len(partition)`` of them with a partition).
        """
        _no_running_loop("infer")
        return asyncio.run(self._infer(model, batches, options, keywords))

    async def _infer(
        self,
        model: ModelSpec,
        batches: Iterable[Batch] | AsyncIterable[Batch],
        options: InferOptions | None,
        keywords: dict[str, Any],
    ) -> tuple[list[Outputs], RunReport]:
        settings = InferOptions.from_keywords(options, keywords, caller="infer")
        if settings.stage_names is None and settings.stages is None:
            settings = replace(settings, stage_names=self._default_stages(model, settings))
        async with self.client() as client:
            outputs = await client.infer(model, batches, options=settings)
            assert client.last_report is not None
            return outputs, client.last_report

    def generate(
        self,
        model: ModelSpec,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        options: GenerateOptions | None = None,
        **keywords: Any,
    ) -> list[list[int]]:
        """Generate from every prompt from synchronous code: each sequence's tokens, in
        prompt order. The settings are ``options`` or :class:`GenerateOptions`'
        keywords; without ``stage_names``, ``stages`` or ``partition`` the pipeline
        runs through every device in the order they were given (the units split by
        the planner within each stage's memory). :meth:`PipelineClient.generate`
        streams the events instead."""
        _no_running_loop("generate")
        return asyncio.run(self._generate_tokens(model, prompts, params, options, keywords))

    def _generate_settings(
        self, options: GenerateOptions | None, keywords: dict[str, Any]
    ) -> GenerateOptions:
        if options is None and not {"stages", "stage_names", "partition"} & set(keywords):
            keywords = {**keywords, "stage_names": [d.name for d in self.devices]}
        return GenerateOptions.from_keywords(options, keywords)

    async def _generate_tokens(
        self,
        model: ModelSpec,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None,
        options: GenerateOptions | None,
        keywords: dict[str, Any],
    ) -> list[list[int]]:
        tokens: list[list[int]] = [[] for _ in prompts]
        async for event in self._generate(model, prompts, params, options, keywords):
            tokens[event.sequence].append(event.token)
        return tokens

    async def _generate(
        self,
        model: ModelSpec,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None,
        options: GenerateOptions | None,
        keywords: dict[str, Any],
    ) -> AsyncIterator[TokenEvent]:
        settings = self._generate_settings(options, keywords)
        async with self.client() as client:
            async for event in client.generate(model, prompts, params, options=settings):
                yield event

    def _default_stages(self, model: ModelSpec, settings: InferOptions | TrainOptions) -> list[str]:
        """The devices in the order they were given: as many as the partition has
        stages, or as the model has units."""
        count = (
            len(settings.partition)
            if settings.partition is not None
            else load_layer_sequence(model).num_units
        )
        return [d.name for d in self.devices][:count]

    def fit(
        self,
        model: ModelSpec,
        batches: Iterable[TrainBatch] | AsyncIterable[TrainBatch],
        *,
        options: TrainOptions | None = None,
        **keywords: Any,
    ) -> TrainReport:
        """Train from synchronous code (see :func:`zpipe.client.fit`; the settings are
        ``options`` or :class:`~zpipe.client.TrainOptions`' keywords); the stages default
        to the devices in the order they were given."""
        _no_running_loop("fit")
        return asyncio.run(self._fit(model, batches, options, keywords))

    async def _fit(
        self,
        model: ModelSpec,
        batches: Iterable[TrainBatch] | AsyncIterable[TrainBatch],
        options: TrainOptions | None,
        keywords: dict[str, Any],
    ) -> TrainReport:
        settings = TrainOptions.from_keywords(options, keywords, caller="fit")
        if settings.stage_names is None and settings.stages is None:
            settings = replace(settings, stage_names=self._default_stages(model, settings))
        async with self.client() as client:
            return await client.fit(model, batches, options=settings)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        process = self.processes[name]
        process.send_signal(sig)
        if sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):
            process.wait(timeout=30)
            if name == "coordinator" and self.coordinator_endpoint and not self._port_hold:
                self._port_hold = PortHold(self.coordinator_endpoint)  # for a restart

    def logs(self, name: str) -> str:
        assert self.log_dir is not None
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM every process (stages first), then SIGKILL what is left after the timeout."""
        stop_processes(self.processes, timeout_s)
        if self._port_hold is not None:
            self._port_hold.close()
            self._port_hold = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
            self.log_dir = None


class AsyncLocalCluster(LocalCluster):
    """:class:`LocalCluster` for code inside a running event loop (a Jupyter cell)::

        async with AsyncLocalCluster(3) as cluster:
            outputs, report = await cluster.infer(spec, batches)
            report = await cluster.fit(spec, train_batches, optimizer=..., num_microbatches=2)

    The same processes and settings; the calls are awaited instead of running an
    event loop of their own, and stopping the processes waits in a thread.
    """

    def __enter__(self) -> LocalCluster:
        raise TypeError("use 'async with AsyncLocalCluster(...)' (or 'with LocalCluster(...)')")

    async def __aenter__(self) -> AsyncLocalCluster:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.stop)

    async def start(self) -> None:  # type: ignore[override]
        try:
            await self._spawn_all_async()
            await self._wait_for_stages(len(self.devices), timeout_s=self.start_timeout_s)
        except BaseException:
            await asyncio.to_thread(self.stop)
            raise

    async def wait_for_stages(  # type: ignore[override]
        self, count: int, *, timeout_s: float
    ) -> list[dict[str, Any]]:
        return await self._wait_for_stages(count, timeout_s=timeout_s)

    async def infer(  # type: ignore[override]
        self,
        model: ModelSpec,
        batches: Iterable[Batch] | AsyncIterable[Batch],
        *,
        options: InferOptions | None = None,
        **keywords: Any,
    ) -> tuple[list[Outputs], RunReport]:
        """See :meth:`LocalCluster.infer`."""
        return await self._infer(model, batches, options, keywords)

    def generate(  # type: ignore[override]
        self,
        model: ModelSpec,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        options: GenerateOptions | None = None,
        **keywords: Any,
    ) -> AsyncIterator[TokenEvent]:
        """Every token event of the run as it streams (see :meth:`PipelineClient.generate`;
        stages default as in :meth:`LocalCluster.generate`)."""
        return self._generate(model, prompts, params, options, keywords)

    async def fit(  # type: ignore[override]
        self,
        model: ModelSpec,
        batches: Iterable[TrainBatch] | AsyncIterable[TrainBatch],
        *,
        options: TrainOptions | None = None,
        **keywords: Any,
    ) -> TrainReport:
        """See :meth:`LocalCluster.fit`."""
        return await self._fit(model, batches, options, keywords)


def _no_running_loop(call: str) -> None:
    """asyncio.run refuses to run inside a running loop with a message that does not
    say what to do instead; this one does."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise PipelineError(
        f"LocalCluster.{call}() runs its own event loop and cannot be called from a "
        "running one (a Jupyter cell, an async function); use "
        "'async with AsyncLocalCluster(...) as cluster:' and 'await cluster."
        f"{call}(...)' there"
    )
