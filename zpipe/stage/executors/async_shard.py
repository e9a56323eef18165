"""A stage's shard for asynchronous 1F1B: weight versions, stashing, aggregation.

A :class:`~zpipe.stage.executors.training_shard.TrainShard` whose forwards take a weight version
and whose backwards are each followed by their own update; the arithmetic is
:class:`~zpipe.training.async_stage.AsyncStageCompute`'s, the same the
single-process reference runs. Weights, optimizer state and replicas are the
live units', as for synchronous training. Runs in the stage's compute thread.

As a synchronous shard: a learning-rate schedule (read at this stage's own update
count, see :mod:`zpipe.training.async_stage`), a loss or optimizer of user code under
the stage's allow-list (``--allow-factory``), and a device (``--device``): weights,
versions and optimizer state stay on it, activations, labels and gradients cross
the shard's edges as host tensors, and what leaves the process (copies, replicas,
checkpoints) is a host copy.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from zpipe._errors import ConfigError, PipelineError, ProtocolError
from zpipe.devices import resolve_device
from zpipe.models import ModelSpec, load_layer_sequence
from zpipe.models.trust import FactoryPolicy
from zpipe.models.weights import STEPS_KEY, read_matching, split_unit_key
from zpipe.stage.executors.training_shard import TrainShard
from zpipe.training.async_regroup import (
    is_versioned_state,
    needed_versions,
    unit_state_from_tensors,
    unit_state_tensors,
)
from zpipe.training.async_stage import (
    AsyncStageCompute,
    UnitState,
    common_versions,
    has_trainable,
)
from zpipe.transport.slowdown import Slowdown


def _check_available(device: torch.device | str) -> None:
    """DeviceUnavailableError (a ConfigError) naming an accelerator this machine does not
    offer, with what torch sees: the stage's --device check, for a shard built another
    way (the CPU, and the meta device tests play an accelerator with, pass)."""
    kind = torch.device(device).type
    if kind in ("cuda", "mps"):
        resolve_device(str(torch.device(device)))


class AsyncShard(TrainShard):
    def __init__(
        self,
        units: Sequence[torch.nn.Module],
        *,
        start: int,
        first: bool,
        last: bool,
        loss: str,
        optimizer: Mapping[str, Any],
        slowdown: Slowdown = 1.0,
        lr_schedule: Mapping[str, Any] | None = None,
        start_step: int = 0,
        policy: FactoryPolicy | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        # a device this machine does not offer is named, never a torch assertion
        _check_available(device)
        super().__init__(
            units,
            start=start,
            first=first,
            last=last,
            loss=loss,
            optimizer=optimizer,
            slowdown=slowdown,
            lr_schedule=lr_schedule,
            start_step=start_step,
            policy=policy,
            device=device,
        )
        self.policy = policy
        self.compute = AsyncStageCompute(
            self.units,
            first=first,
            last=last,
            loss=self.loss,
            optimizer=dict(optimizer),
            lr_schedule=self.lr_schedule,
            policy=policy,
        )
        # One optimizer: its state is what replicas and checkpoints read.
        self.optimizer = self.compute.optimizer

    @classmethod
    def build(
        cls,
        spec: ModelSpec,
        start: int,
        end: int,
        *,
        first: bool,
        last: bool,
        loss: str,
        optimizer: Mapping[str, Any],
        slowdown: Slowdown = 1.0,
        state: Mapping[str, torch.Tensor] | None = None,
        lr_schedule: Mapping[str, Any] | None = None,
        start_step: int = 0,
        resume_optimizer: bool = False,
        device: torch.device | str = "cpu",
    ) -> AsyncShard:
        """As :meth:`TrainShard.build`; ``resume_optimizer`` reads these units' whole
        asynchronous state from the spec's weights file (a checkpoint of an
        asynchronous run: weights, optimizer state and the weight versions the next
        forwards read), which must end at ``start_step`` updates."""
        shard = super().build(
            spec,
            start,
            end,
            first=first,
            last=last,
            loss=loss,
            optimizer=optimizer,
            slowdown=slowdown,
            state=state,
            lr_schedule=lr_schedule,
            start_step=start_step,
            device=device,
        )
        assert isinstance(shard, AsyncShard)
        if state is None and resume_optimizer:
            shard.resume_checkpoint(start_step)
        return shard

    def resume_checkpoint(self, start_step: int) -> None:
        """Go on from the checkpoint the spec names (see :meth:`build`): the same
        weights, optimizer state, versions and update count as the run that saved it,
        so the resumed run equals one that never stopped (the batches it saves after
        flushed first, which changes no arithmetic: versions are named)."""
        spec = self.spec
        if spec is None or spec.weights is None:
            raise ConfigError("resuming the optimizer needs a weights file in the spec")

        def ours(key: str) -> bool:
            unit = split_unit_key(key)
            return key == STEPS_KEY or (unit is not None and self.start <= unit[0] < self.end)

        saved = read_matching(spec.weights, ours)
        steps = saved.pop(STEPS_KEY, None)
        if steps is None or not is_versioned_state(saved):
            raise ConfigError(
                f"{spec.weights} is not a checkpoint of an asynchronous run (no "
                f"{'step count' if steps is None else 'weight versions'}): save one with "
                "fit(..., schedule='async-1f1b', optimizer_state=True) and TrainReport.save, "
                "or train from its weights without resume_optimizer"
            )
        self.load_training_state(saved)
        if int(steps) != start_step or self.updates != start_step:
            raise ConfigError(
                f"{spec.weights} was saved after {int(steps)} mini-batches, its versions "
                f"end at update {self.updates}: resume it with start_step={int(steps)}, "
                f"not {start_step}"
            )

    def check_versions(self, needed: Sequence[int], *, stages: int) -> None:
        """ConfigError unless this shard keeps every weight version in ``needed`` (what
        the next forwards read: :func:`~zpipe.planner.async_schedule.
        versions_read_after`): a checkpoint or replica saved by a shallower pipeline
        (fewer stages) lacks the older ones a deeper one's first forwards read."""
        kept = self.compute.versions_kept
        missing = [v for v in needed if v not in kept]
        if missing:
            raise ConfigError(
                f"units [{self.start}, {self.end}) resume at update {self.updates} with weight "
                f"versions {kept}, but a pipeline of {stages} stages reads {list(needed)} "
                f"next (missing {missing}): the state was saved by a pipeline of fewer "
                "stages (or, without vertical sync, by a later stage); resume on at most "
                "as many, with the same cuts without vertical sync"
            )

    @property
    def live_activations(self) -> int:
        return self.compute.in_flight

    def load_training_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore weights and optimizer state; with weight versions (a replica of an
        asynchronous run, :meth:`repartition_snapshot`'s entries) the versions too, and
        the update count they end at: the run goes on exactly where it was kept."""
        if not is_versioned_state(state):
            super().load_training_state(state)
            self.compute.restart_versions()
            return
        # "units.3.weight#v5" and "units.3.weight#opt.momentum_buffer" are unit 3's
        foreign = sorted(
            k
            for k in state
            if (unit := split_unit_key(k)) is None or not self.start <= unit[0] < self.end
        )
        if foreign:
            raise ConfigError(
                f"the replica does not match units [{self.start}, {self.end}): "
                f"foreign {foreign[:3]}"
            )
        try:
            states = [
                unit_state_from_tensors(self.start + i, unit, state)
                for i, unit in enumerate(self.units)
            ]
        except ProtocolError as exc:
            raise ConfigError(
                f"the replica does not fit units [{self.start}, {self.end}): {exc}"
            ) from None
        if not any(has_trainable(s.module) for s in states):
            # the update count travels with the versions of trainable parameters
            raise ConfigError(
                f"units [{self.start}, {self.end}) have no trainable parameters: an "
                "asynchronous replica cannot say how many updates they are at"
            )
        versions = common_versions(states)
        if not versions:
            raise ConfigError("the replica's units share no weight version")
        self.compute = AsyncStageCompute.adopt(
            states,
            updates=max(versions),
            first=self.first,
            last=self.last,
            loss=self.loss,
            optimizer=self.optimizer_config,
            lr_schedule=self.lr_schedule,
            policy=self.policy,
            device=self.device,
        )
        self.units = self.compute.units
        self.optimizer = self.compute.optimizer

    @property
    def end(self) -> int:
        return self.start + len(self.units)

    @property
    def updates(self) -> int:
        """The updates the run made before this stage's next one (its newest version)."""
        return self.compute.updates

    def forward_at(
        self,
        batch: int,
        version: int,
        inputs: Sequence[torch.Tensor],
        target: torch.Tensor | None,
        samples: int,
        keep_newest: int,
    ) -> tuple[tuple[torch.Tensor, ...], float | None, float]:
        """Forward ``batch`` with weight ``version``: (outputs, loss on the last stage,
        seconds); versions no longer needed are let go."""
        started, cpu_started = time.perf_counter(), time.thread_time()
        on_device = self.mover.to_device(inputs)
        label = self.mover.to_device((target,))[0] if target is not None else None
        outputs, loss = self.compute.forward(batch, version, on_device, label, samples)
        outputs = self.mover.to_host(outputs)
        self.compute.forget_versions_before(version, keep_newest=keep_newest)
        self.peak_live = max(self.peak_live, self.compute.in_flight)
        return outputs, loss, self._timed(started, cpu_started)

    def forward(
        self,
        mb: int,
        inputs: Sequence[torch.Tensor],
        target: torch.Tensor | None = None,
        minibatch_samples: int = 0,
    ) -> tuple[tuple[torch.Tensor, ...], float | None, float]:
        raise PipelineError("an asynchronous stage forwards with a weight version (forward_at)")

    def backward(
        self, mb: int, grad_outputs: Sequence[torch.Tensor] = ()
    ) -> tuple[tuple[torch.Tensor, ...], float]:
        started, cpu_started = time.perf_counter(), time.thread_time()
        grads = self.mover.to_host(self.compute.backward(mb, self.mover.to_device(grad_outputs)))
        return grads, self._timed(started, cpu_started)

    def step(self) -> float:
        raise PipelineError("an asynchronous stage updates after each backward (step_batch)")

    def step_batch(self, batch: int) -> float:
        """Apply ``batch``'s gradients to the live weights; seconds taken."""
        started, cpu_started = time.perf_counter(), time.thread_time()
        self.compute.step(batch)
        return self._timed(started, cpu_started)

    def aggregate(self, count: int) -> float:
        """FTPipeHD's weight aggregation of the newest ``count`` versions; seconds."""
        started, cpu_started = time.perf_counter(), time.thread_time()
        self.compute.aggregate(count)
        return self._timed(started, cpu_started)

    # ------------------------------------------------------------ a live re-partition

    def repartition_snapshot(self, num_stages: int) -> dict[str, torch.Tensor]:
        """Every unit's state at a flush, under the full model's keys, with the weight
        versions the next forwards and aggregations read (what peers fetch, and what a
        replica keeps); ``num_stages``: the run's depth."""
        return self.saved_state(needed_versions(self.compute.updates, num_stages))

    def saved_state(self, versions: Sequence[int]) -> dict[str, torch.Tensor]:
        """Every unit's state at a flush with weight ``versions`` (a checkpoint's: see
        :func:`~zpipe.planner.async_schedule.versions_read_after`), host copies."""
        return self._cloned_state(self.compute.export_units(), versions)

    def live_copy(self, num_stages: int) -> dict[str, torch.Tensor]:
        """The same state as :meth:`repartition_snapshot`, taken while batches are in
        flight (FTPipeHD's replication without draining): right after an update, the
        live weights are version ``updates``; every tensor is cloned, so the updates
        that follow cannot tear the copy. Compute thread, between two actions."""
        versions = needed_versions(self.compute.updates, num_stages)
        return self._cloned_state(self.compute.unit_states(), versions)

    def _cloned_state(
        self, units: Sequence[UnitState], versions: Sequence[int]
    ) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for offset, state in enumerate(units):
            for key, tensor in unit_state_tensors(self.start + offset, state, versions).items():
                # a host copy: what crosses the wire (a clone on the CPU)
                out[key] = tensor.detach().to("cpu", copy=True)
        return out

    def regrouped(self, start: int, end: int, state: Mapping[str, torch.Tensor]) -> AsyncShard:
        """This stage's shard over units ``[start, end)`` instead, each unit's state
        (:meth:`unit_snapshot`'s entries, its own or a peer's) taken from ``state``;
        same settings, same number of updates."""
        if self.spec is None:
            raise PipelineError("this shard was not built from a model spec: it cannot regroup")
        units = load_layer_sequence(self.spec).build_units(start, end)
        states = [unit_state_from_tensors(start + i, u, state) for i, u in enumerate(units)]
        shard = AsyncShard(
            [s.module for s in states],
            start=start,
            first=self.first,
            last=self.last,
            loss=self.loss,
            optimizer=self.optimizer_config,
            slowdown=self.slowdown,
            lr_schedule=self.lr_schedule,
            policy=self.policy,
            device=self.device,
        )
        shard.compute = AsyncStageCompute.adopt(
            states,
            updates=self.compute.updates,
            first=self.first,
            last=self.last,
            loss=self.loss,
            optimizer=self.optimizer_config,
            lr_schedule=self.lr_schedule,
            policy=self.policy,
            device=self.device,
        )
        shard.units = shard.compute.units
        shard.optimizer = shard.compute.optimizer
        shard.peak_live = self.peak_live
        shard.spec = self.spec
        return shard
