"""PyTorch's own pipeline training (``torch.distributed.pipelining``): the baseline.

One process per stage, spawned with ``torch.multiprocessing`` and joined in a
``gloo`` process group on loopback TCP. Each stage wraps zpipe's units
``load_layer_sequence(spec).build_units(start, end)`` (the same weights, seeded
per unit) in one module, builds a :class:`~torch.distributed.pipelining.PipelineStage`
(shapes inferred at run time, on the first step) and runs
:class:`~torch.distributed.pipelining.Schedule1F1B` (warm-up ``P - p`` forwards
on stage ``p``) or :class:`~torch.distributed.pipelining.ScheduleGPipe`, one
optimizer step per mini-batch, with the same optimizer description zpipe's stages
use (:func:`zpipe.training.objectives.make_optimizer`).

The workers live across runs: :meth:`TorchPipeline.train` resets every stage's
weights to their initial values and builds a fresh optimizer, then times the
steps between two barriers (stage 0's clock), so that process start-up, the
process group's rendezvous and the schedule's shape inference (done by a warm-up
run) stay out of the timing, as zpipe's stage start-up and shard building stay
out of its ``elapsed_s``.

Losses: ``loss_fn`` is the micro-batch's mean cross-entropy and the schedule
scales gradients by ``1 / M`` (``scale_grads=True``), so with equal micro-batches
the gradients are those of the mini-batch's mean loss, as in zpipe; a mini-batch's
loss is the mean of its micro-batches' losses.

The batches are built in every process from the same recipe (:func:`make_batches`),
so no tensor crosses a process boundary outside the pipeline itself.

The worker is a module-level function, so that the spawned processes find it by
name: ``bench`` must be importable there, as it is here (the spawned processes get
this process's ``sys.path``; ``bench/training.py`` puts the repository on it).
"""

from __future__ import annotations

import contextlib
import queue
import shutil
import tempfile
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from zpipe.models import ModelSpec, load_layer_sequence, run_units
from zpipe.training.objectives import make_optimizer

Batch = tuple[torch.Tensor, torch.Tensor]


def make_batches(spec: ModelSpec, count: int, batch_size: int, seed: int) -> list[Batch]:
    """``count`` mini-batches ``(inputs, labels)`` of ``batch_size``, the same for any caller."""
    sequence = load_layer_sequence(spec)
    num_classes = int(spec.config["num_classes"])
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        input_seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
        (inputs,) = sequence.example_input(batch_size, seed=input_seed)
        labels = torch.randint(0, num_classes, (batch_size,), generator=generator)
        batches.append((inputs, labels))
    return batches


class StageModule(nn.Module):
    """zpipe's units ``[start, end)`` as one module; one output is returned bare."""

    def __init__(self, units: Sequence[nn.Module]) -> None:
        super().__init__()
        self.units = nn.ModuleList(units)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        outputs = run_units(list(self.units), inputs)
        return outputs[0] if len(outputs) == 1 else outputs


def _mean_cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target)


@dataclass(frozen=True)
class _Job:
    schedule: str
    num_microbatches: int
    optimizer: dict[str, Any]
    batches: int
    batch_size: int
    seed: int


@dataclass
class TorchRun:
    """One timed run: stage 0's wall time between the barriers, and each mini-batch's loss."""

    elapsed_s: float
    samples: int
    losses: list[float]
    step_ends_s: list[float]  # stage 0's clock after each optimizer step (its origin: any)
    busy_s: list[float]  # per stage: time inside schedule.step (waits included)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.elapsed_s if self.elapsed_s > 0 else 0.0


def _worker(
    rank: int,
    world: int,
    init_method: str,
    spec_dict: dict[str, Any],
    ranges: list[tuple[int, int]],
    threads: int,
    jobs: Any,
    results: Any,
) -> None:
    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):  # only settable before any inter-op work
        torch.set_num_interop_threads(1)
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    try:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
        spec = ModelSpec.from_dict(spec_dict)
        start, end = ranges[rank]
        module = StageModule(load_layer_sequence(spec).build_units(start, end)).train()
        initial = {k: v.clone() for k, v in module.state_dict().items()}
        stage = PipelineStage(module, rank, world, torch.device("cpu"))
        schedules: dict[tuple[str, int], Any] = {}
        first, last = rank == 0, rank == world - 1
        results.put(("ready", rank, None))
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))
        return
    while True:
        job: _Job | None = jobs.get()
        if job is None:
            break
        try:
            key = (job.schedule, job.num_microbatches)
            if key not in schedules:
                kind = Schedule1F1B if job.schedule == "1f1b" else ScheduleGPipe
                schedules[key] = kind(stage, job.num_microbatches, loss_fn=_mean_cross_entropy)
            schedule = schedules[key]
            module.load_state_dict(initial)
            optimizer = make_optimizer(job.optimizer, module.parameters())
            batches = make_batches(spec, job.batches, job.batch_size, job.seed)
            losses: list[float] = []
            step_ends: list[float] = []
            busy = 0.0
            dist.barrier()
            started = time.perf_counter()
            for inputs, labels in batches:
                optimizer.zero_grad(set_to_none=True)
                args = (inputs,) if first else ()
                step_started = time.perf_counter()
                if last:
                    mb_losses: list[torch.Tensor] = []
                    schedule.step(*args, target=labels, losses=mb_losses)
                    losses.append(float(torch.stack([x.detach() for x in mb_losses]).mean()))
                else:
                    schedule.step(*args)
                busy += time.perf_counter() - step_started
                optimizer.step()
                step_ends.append(time.perf_counter())
            dist.barrier()
            elapsed = time.perf_counter() - started
            done = {"elapsed_s": elapsed, "losses": losses, "busy_s": busy, "ends": step_ends}
            results.put(("done", rank, done))
        except BaseException:
            results.put(("error", rank, traceback.format_exc()))
            break
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


class TorchPipeline:
    """``with TorchPipeline(spec, ranges, threads=1) as pipe: run = pipe.train(...)``."""

    def __init__(
        self,
        spec: ModelSpec,
        ranges: Sequence[tuple[int, int]],
        *,
        threads: int,
        timeout_s: float = 300.0,
    ) -> None:
        self.spec = spec
        self.ranges = [(int(a), int(b)) for a, b in ranges]
        self.threads = threads
        self.timeout_s = timeout_s
        self._context = mp.get_context("spawn")
        self._jobs: list[Any] = []
        self._results: Any = None
        self._processes: list[Any] = []
        self._rendezvous: str | None = None  # the rendezvous file's folder, while started

    @property
    def world(self) -> int:
        return len(self.ranges)

    @property
    def pids(self) -> list[int]:
        return [int(p.pid) for p in self._processes if p.pid is not None]

    def __enter__(self) -> TorchPipeline:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        # a file rendezvous: a TCP port picked here could be taken before rank 0 binds it
        self._rendezvous = tempfile.mkdtemp(prefix="zpipe-torch-rendezvous-")
        init_method = f"file://{self._rendezvous}/store"
        self._results = self._context.Queue()
        self._jobs = [self._context.Queue() for _ in range(self.world)]
        for rank in range(self.world):
            process = self._context.Process(
                target=_worker,
                args=(
                    rank,
                    self.world,
                    init_method,
                    self.spec.to_dict(),
                    self.ranges,
                    self.threads,
                    self._jobs[rank],
                    self._results,
                ),
                daemon=True,
            )
            process.start()
            self._processes.append(process)
        try:
            self._collect("ready")
        except BaseException:
            self.stop()
            raise

    def _collect(self, kind: str) -> dict[int, Any]:
        replies: dict[int, Any] = {}
        deadline = time.monotonic() + self.timeout_s
        while len(replies) < self.world:
            try:
                got, rank, payload = self._results.get(timeout=1.0)
            except queue.Empty:
                dead = [i for i, p in enumerate(self._processes) if not p.is_alive()]
                if dead:
                    raise RuntimeError(f"torch pipeline ranks {dead} exited") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"torch pipeline: no {kind!r} from ranks "
                        f"{sorted(set(range(self.world)) - set(replies))} "
                        f"after {self.timeout_s:.0f} s"
                    ) from None
                continue
            if got == "error":
                raise RuntimeError(f"torch pipeline rank {rank} failed:\n{payload}")
            replies[rank] = payload
        return replies

    def train(
        self,
        *,
        schedule: str,
        num_microbatches: int,
        optimizer: dict[str, Any],
        batches: int,
        batch_size: int,
        seed: int,
    ) -> TorchRun:
        """Train from the initial weights on ``make_batches(spec, batches, batch_size, seed)``."""
        if batch_size % num_microbatches:
            raise ValueError("the baseline needs micro-batches of equal size")
        job = _Job(schedule, num_microbatches, dict(optimizer), batches, batch_size, seed)
        for q in self._jobs:
            q.put(job)
        replies = self._collect("done")
        return TorchRun(
            elapsed_s=float(replies[0]["elapsed_s"]),
            samples=batches * batch_size,
            losses=list(replies[self.world - 1]["losses"]),
            step_ends_s=list(replies[0]["ends"]),
            busy_s=[float(replies[r]["busy_s"]) for r in range(self.world)],
        )

    def stop(self, timeout_s: float = 10.0) -> None:
        for q in self._jobs:
            with contextlib.suppress(Exception):
                q.put(None)
        deadline = time.monotonic() + timeout_s
        for process in self._processes:
            process.join(timeout=max(0.1, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
        self._processes = []
        for q in [*self._jobs, self._results]:
            if q is not None:
                with contextlib.suppress(Exception):
                    q.close()
                    q.join_thread()
        self._jobs, self._results = [], None
        if self._rendezvous is not None:
            shutil.rmtree(self._rendezvous, ignore_errors=True)
            self._rendezvous = None
