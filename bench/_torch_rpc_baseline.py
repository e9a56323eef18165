"""A PipeEdge-style pipeline over ``torch.distributed.rpc`` (TensorPipe): the baseline.

It mirrors PipeEdge's RPC runtime (``pipeedge.comm.rpc.DistRpcPipelineStage``):

* one process per stage (spawned with ``torch.multiprocessing``), plus the driver
  (the calling process, rank 0);
* each stage is an object created on its worker with ``rpc.remote``; it holds
  its shard of the model and an RRef to the next stage;
* the driver asks stage 0 whether it is ready (``rpc_sync``), then sends it a
  micro-batch with ``rpc_async``; each stage computes (one micro-batch at a
  time), then asks the next stage whether it is ready (``rpc_sync``) and
  forwards its outputs with ``rpc_async``; the last stage hands its outputs to
  the driver with ``rpc_sync`` on a callback function;
* a stage admits at most three micro-batches (received, computing, sending),
  PipeEdge's ``_sem_fwd``; the driver keeps at most ``max_in_flight``
  micro-batches in the pipeline, like zpipe's client.

Emulation is zpipe's own: a stage computes with :class:`zpipe.stage.shard.Shard`
(the same units, dtype handling and ``emulate_slowdown`` call as a zpipe stage)
and pays its outgoing link with :class:`zpipe.transport.emulation.LinkModel`
(serialisation time at the sender, links used one message at a time, latency
in flight). Only the transport and the runtime around them differ.

Import this module as ``bench._torch_rpc_baseline`` (an entry run as a script
puts the repository on ``sys.path``, which the spawned workers inherit) so that
the functions and the class the RPC framework pickles resolve in every process.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.multiprocessing as mp
from torch.distributed import rpc

from zpipe.client import as_tensors, split_microbatches
from zpipe.models import ModelSpec
from zpipe.stage.shard import Shard
from zpipe.transport.emulation import LinkModel, LinkSpec

DRIVER = "driver"
# PipeEdge's _sem_fwd: micro-batches a stage admits at once (receiving, computing, sending).
STAGE_SLOTS = 3

Tensors = tuple[torch.Tensor, ...]


# ---------------------------------------------------------------- stage side


class RpcStage:
    """One pipeline stage, living on its worker process (created with ``rpc.remote``)."""

    def __init__(
        self,
        name: str,
        spec: dict[str, Any],
        start: int,
        end: int,
        dtype: str,
        slowdown: float,
        bandwidth_mbps: float | None,
        latency_ms: float,
        wait_s: float,
    ) -> None:
        self.name = name
        self.shard = Shard.build(
            ModelSpec.from_dict(spec), start, end, dtype=dtype, slowdown=slowdown
        )
        self.link = LinkModel(LinkSpec(bandwidth_mbps, latency_ms))
        self.link_ideal = bandwidth_mbps is None and latency_ms == 0
        self.wait_s = wait_s
        self._slots = threading.Semaphore(STAGE_SLOTS)  # PipeEdge's _sem_fwd
        self._compute = threading.Lock()  # PipeEdge's _sem_mod (one micro-batch at a time)
        self._link_lock = threading.Lock()  # the outgoing link carries one message at a time
        self._stats_lock = threading.Lock()
        self._next: rpc.RRef[RpcStage] | None = None
        self._results_to: str | None = None
        self.reset_stats()

    def set_next(self, stage: rpc.RRef[RpcStage]) -> None:
        self._next = stage

    def set_results(self, results_to: str) -> None:
        self._results_to = results_to

    def reset_stats(self) -> None:
        with getattr(self, "_stats_lock", threading.Lock()):
            self.stats_busy_s = 0.0
            self.stats_send_s = 0.0
            self.stats_bytes_out = 0
            self.stats_microbatches = 0

    def stats(self) -> dict[str, float | int]:
        with self._stats_lock:
            return {
                "busy_s": self.stats_busy_s,
                "send_blocked_s": self.stats_send_s,
                "bytes_out": self.stats_bytes_out,
                "microbatches": self.stats_microbatches,
                "threads": torch.get_num_threads(),
            }

    def wait_for_ready(self) -> None:
        """Called by the previous stage (or the driver) before it sends a micro-batch."""
        if not self._slots.acquire(timeout=self.wait_s):
            raise TimeoutError(f"{self.name} had no free slot for {self.wait_s:g} s")

    def _pay_link(self, nbytes: int) -> None:
        """Serialisation time here, in order; then the latency (in flight for zpipe)."""
        if self.link_ideal:
            return
        with self._link_lock:
            free_at, deliver_at, _ = self.link.schedule(nbytes, time.monotonic())
            time.sleep(max(0.0, free_at - time.monotonic()))
        # zpipe's EmulatedLink delivers from a task while the sender goes on;
        # here this RPC thread waits, but the link is already free for the next one.
        time.sleep(max(0.0, deliver_at - time.monotonic()))

    def forward(self, mb: int, inputs: Tensors) -> None:
        """Compute one micro-batch and pass it on (PipeEdge's ``__call__``)."""
        try:
            with self._compute:
                outputs, busy = self.shard.forward(inputs)
            sending = time.perf_counter()
            nbytes = sum(t.numel() * t.element_size() for t in outputs)
            self._pay_link(nbytes)
            if self._next is not None:
                # Do not send before the next stage has room (PipeEdge's wait_for_ready).
                self._next.rpc_sync().wait_for_ready()
                self._next.rpc_async().forward(mb, outputs)
            else:
                assert self._results_to is not None
                rpc.rpc_sync(self._results_to, _collect, args=(mb, outputs))
            with self._stats_lock:
                self.stats_busy_s += busy
                self.stats_send_s += time.perf_counter() - sending
                self.stats_bytes_out += nbytes
                self.stats_microbatches += 1
        except BaseException as exc:
            message = f"{self.name}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"
            with contextlib.suppress(Exception):  # if not, the driver times out on its own
                rpc.rpc_async(DRIVER, _fail, args=(mb, message))
        finally:
            self._slots.release()


_stop = threading.Event()


def _request_stop() -> None:
    """Runs on a worker: the driver is about to shut the RPC world down."""
    _stop.set()


def _worker_main(
    index: int,
    names: list[str],
    init_method: str,
    threads: int,
    rpc_timeout_s: float,
    transports: list[str] | None,
    channels: list[str] | None,
    parent: int,
) -> None:
    """Entry point of stage worker ``index`` (rank ``index + 1``)."""
    _quiet_warnings()
    torch.set_num_threads(threads)
    rpc.init_rpc(
        names[index],
        rank=index + 1,
        world_size=len(names) + 1,
        rpc_backend_options=_options(init_method, rpc_timeout_s, transports, channels),
    )
    # Serve RPCs until the driver says stop; exit at once if the driver is gone.
    while not _stop.wait(1.0):
        if os.getppid() != parent:
            os._exit(3)
    rpc.shutdown(graceful=True, timeout=rpc_timeout_s)


def _quiet_warnings() -> None:
    # rpc's start-up and shutdown barrier uses a gloo group in a way torch 2.x warns about.
    warnings.filterwarnings("ignore", message="You are using a Backend", category=UserWarning)


def _options(
    init_method: str,
    rpc_timeout_s: float,
    transports: list[str] | None,
    channels: list[str] | None,
) -> rpc.TensorPipeRpcBackendOptions:
    return rpc.TensorPipeRpcBackendOptions(
        init_method=init_method,
        rpc_timeout=rpc_timeout_s,
        num_worker_threads=16,
        _transports=transports,
        _channels=channels,
    )


# --------------------------------------------------------------- driver side


@dataclass
class _DriverState:
    results: dict[int, Tensors] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)
    window: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(1))


_state = _DriverState()


def _collect(mb: int, outputs: Tensors) -> None:
    """Runs on the driver: the last stage's outputs for micro-batch ``mb``."""
    with _state.cond:
        _state.results[mb] = outputs
        _state.cond.notify_all()
    _state.window.release()


def _fail(mb: int, message: str) -> None:
    """Runs on the driver: a stage failed on micro-batch ``mb``."""
    with _state.cond:
        _state.errors.append(f"micro-batch {mb}: {message}")
        _state.cond.notify_all()
    _state.window.release()


@dataclass(frozen=True)
class StageSetup:
    """What a stage worker needs: its name, unit range and emulated device."""

    name: str
    start: int
    end: int
    slowdown: float = 1.0
    bandwidth_mbps: float | None = None
    latency_ms: float = 0.0


@dataclass
class RpcRunResult:
    outputs: list[Tensors]
    samples: int
    microbatches: int
    elapsed_s: float
    stages: dict[str, dict[str, float | int]]

    @property
    def throughput(self) -> float:
        return self.samples / self.elapsed_s if self.elapsed_s > 0 else 0.0


class TorchRpcPipeline:
    """``with TorchRpcPipeline(spec, stages, ...) as pipe: result = pipe.run(batches, ...)``."""

    def __init__(
        self,
        spec: ModelSpec,
        stages: Sequence[StageSetup],
        *,
        dtype: str = "float32",
        threads: int = 1,
        rpc_timeout_s: float = 120.0,
        start_timeout_s: float = 120.0,
        transports: list[str] | None = None,
        channels: list[str] | None = None,
    ) -> None:
        self.spec = spec
        self.stages = list(stages)
        self.dtype = dtype
        self.threads = threads
        self.rpc_timeout_s = rpc_timeout_s
        self.start_timeout_s = start_timeout_s
        self.transports = transports
        self.channels = channels
        self._context: mp.ProcessContext | None = None
        self._rrefs: list[rpc.RRef[RpcStage]] = []
        self._initialised = False
        self._rendezvous: str | None = None  # the rendezvous file's folder, while started

    def __enter__(self) -> TorchRpcPipeline:
        try:
            self.start()
        except BaseException:
            self.stop(graceful=False)
            raise
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.stop(graceful=exc_type is None)

    def start(self) -> None:
        # a file rendezvous: a TCP port picked here could be taken before it is bound
        self._rendezvous = tempfile.mkdtemp(prefix="zpipe-rpc-rendezvous-")
        init_method = f"file://{self._rendezvous}/store"
        names = [s.name for s in self.stages]
        self._context = mp.start_processes(
            _worker_main,
            args=(
                names,
                init_method,
                self.threads,
                self.rpc_timeout_s,
                self.transports,
                self.channels,
                os.getpid(),
            ),
            nprocs=len(names),
            join=False,
            daemon=True,
            start_method="spawn",
        )
        # init_rpc waits for every worker to join the world.
        _quiet_warnings()
        options = _options(init_method, self.start_timeout_s, self.transports, self.channels)
        rpc.init_rpc(DRIVER, rank=0, world_size=len(names) + 1, rpc_backend_options=options)
        self._initialised = True
        spec = self.spec.to_dict()
        self._rrefs = [
            rpc.remote(
                s.name,
                RpcStage,
                args=(
                    s.name,
                    spec,
                    s.start,
                    s.end,
                    self.dtype,
                    s.slowdown,
                    s.bandwidth_mbps,
                    s.latency_ms,
                    self.rpc_timeout_s,
                ),
                timeout=self.start_timeout_s,
            )
            for s in self.stages
        ]
        # Built, or the build's error raised (to_here would pickle the stage itself).
        torch.futures.wait_all(
            [r.rpc_async(timeout=self.start_timeout_s).stats() for r in self._rrefs]
        )
        futures = [
            a.rpc_async(timeout=self.rpc_timeout_s).set_next(b)
            for a, b in zip(self._rrefs, self._rrefs[1:], strict=False)
        ]
        futures.append(self._rrefs[-1].rpc_async(timeout=self.rpc_timeout_s).set_results(DRIVER))
        torch.futures.wait_all(futures)

    @property
    def pids(self) -> dict[str, int]:
        """Each stage's worker process id, by stage name."""
        if self._context is None:
            return {}
        return {
            s.name: int(p.pid)
            for s, p in zip(self.stages, self._context.processes, strict=True)
            if p.pid is not None
        }

    def run(
        self,
        batches: Sequence[Sequence[torch.Tensor] | torch.Tensor],
        *,
        microbatch_size: int | None,
        max_in_flight: int,
    ) -> RpcRunResult:
        """Stream ``batches`` through the pipeline; outputs in input order, and timings."""
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        first = self._rrefs[0]
        torch.futures.wait_all(
            [r.rpc_async(timeout=self.rpc_timeout_s).reset_stats() for r in self._rrefs]
        )
        with _state.cond:
            _state.results.clear()
            _state.errors.clear()
        _state.window = threading.Semaphore(max_in_flight)
        started = time.perf_counter()
        owner: list[tuple[int, int]] = []
        samples = 0
        for index, batch in enumerate(batches):
            tensors = as_tensors(batch)
            samples += int(tensors[0].shape[0])
            for part, mb_tensors in enumerate(split_microbatches(tensors, microbatch_size)):
                self._acquire_window()
                mb = len(owner)
                owner.append((index, part))
                first.rpc_sync(timeout=self.rpc_timeout_s).wait_for_ready()
                first.rpc_async(timeout=self.rpc_timeout_s).forward(mb, mb_tensors)
        with _state.cond:
            # A deadline per result, as zpipe's client has.
            seen, deadline = -1, 0.0
            while len(_state.results) < len(owner) and not _state.errors:
                if len(_state.results) != seen:
                    seen, deadline = len(_state.results), time.monotonic() + self.rpc_timeout_s
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"torch.rpc pipeline: {seen} of {len(owner)} results, then none for "
                        f"{self.rpc_timeout_s:g} s"
                    )
                _state.cond.wait(left)
            if _state.errors:
                raise RuntimeError("torch.rpc pipeline failed: " + _state.errors[0])
            results = dict(_state.results)
        # Put micro-batches back together, as zpipe's client does.
        pieces: dict[int, dict[int, Tensors]] = {}
        for mb, (index, part) in enumerate(owner):
            pieces.setdefault(index, {})[part] = results[mb]
        outputs: list[Tensors] = []
        for index in range(len(pieces)):
            ordered = [pieces[index][p] for p in range(len(pieces[index]))]
            outputs.append(
                tuple(
                    torch.cat(group) if len(ordered) > 1 else group[0]
                    for group in zip(*ordered, strict=True)
                )
            )
        elapsed = time.perf_counter() - started
        stats = torch.futures.wait_all(
            [r.rpc_async(timeout=self.rpc_timeout_s).stats() for r in self._rrefs]
        )
        return RpcRunResult(
            outputs=outputs,
            samples=samples,
            microbatches=len(owner),
            elapsed_s=elapsed,
            stages={s.name: dict(st) for s, st in zip(self.stages, stats, strict=True)},
        )

    def _acquire_window(self) -> None:
        deadline = time.monotonic() + self.rpc_timeout_s
        while not _state.window.acquire(timeout=0.5):
            with _state.cond:
                if _state.errors:
                    raise RuntimeError("torch.rpc pipeline failed: " + _state.errors[0])
            if time.monotonic() > deadline:
                raise TimeoutError(f"torch.rpc pipeline: no result for {self.rpc_timeout_s:g} s")

    def stop(self, *, graceful: bool = True, timeout_s: float = 30.0) -> None:
        """Shut the RPC world down and make sure every worker process is gone."""
        self._rrefs = []
        if self._initialised:
            self._initialised = False
            if graceful:
                with contextlib.suppress(Exception):
                    torch.futures.wait_all(
                        [
                            rpc.rpc_async(s.name, _request_stop, timeout=timeout_s)
                            for s in self.stages
                        ]
                    )
            try:
                rpc.shutdown(graceful=graceful, timeout=timeout_s)
            except Exception:
                if graceful:
                    with contextlib.suppress(Exception):
                        rpc.shutdown(graceful=False)
        if self._context is not None:
            self._stop_processes(graceful=graceful, timeout_s=timeout_s)
        if self._rendezvous is not None:
            shutil.rmtree(self._rendezvous, ignore_errors=True)
            self._rendezvous = None

    def _stop_processes(self, *, graceful: bool, timeout_s: float) -> None:
        assert self._context is not None
        deadline = time.monotonic() + (timeout_s if graceful else 1.0)
        for process in self._context.processes:
            process.join(max(0.1, deadline - time.monotonic()))
        for process in self._context.processes:
            if process.is_alive():
                process.terminate()
                process.join(5.0)
            if process.is_alive():
                process.kill()
                process.join(5.0)
        self._context = None
