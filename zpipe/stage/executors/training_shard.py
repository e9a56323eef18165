"""A stage's shard for training: forward with autograd, backward, optimizer step.

Runs in the stage's compute thread, never on the event loop. Each forward
keeps its autograd graph (the activation) until that micro-batch's backward,
so the number of live activations is what a schedule's warm-up bounds.

On an accelerator (``--device``) activations, labels and gradients cross the
shard's edges as CPU tensors (:class:`zpipe.devices.BoundaryMover`); weights,
optimizer state and saved activations stay on the device. What leaves the
process (all-reduce, snapshots, replicas) is a host copy, written back after
an all-reduce (:meth:`TrainShard.keep_reduced`).

A learning-rate schedule scales the optimizer's initial rates by the factor of
the mini-batch about to step (``start_step`` counts those trained before this
shard was built: a resumed run goes on where it stopped).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from zpipe._errors import ConfigError, PipelineError
from zpipe.devices import BoundaryMover
from zpipe.models import ModelSpec, load_layer_sequence, run_units
from zpipe.models.trust import FactoryPolicy, factory_policy
from zpipe.models.weights import (
    OPTIMIZER_KEY,
    STEPS_KEY,
    read_matching,
    split_unit_key,
    unit_key,
)
from zpipe.training.lr_schedules import check_lr_schedule, lr_factor
from zpipe.training.objectives import check_loss, make_loss, make_optimizer
from zpipe.transport.emulation import compute_cpu_s, emulate_slowdown
from zpipe.transport.slowdown import Slowdown, slowdown_factor

__all__ = ["OPTIMIZER_KEY", "TrainShard"]


class TrainShard:
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
        """``policy``: which loss and optimizer callables may load (None: any, the
        caller's own choice; a stage passes its peer allow-list)."""
        self.device = torch.device(device)
        self.mover = BoundaryMover(self.device)
        self.units = [u.to(self.device).train() for u in units]
        self.start = start
        self.first = first
        self.last = last
        self.loss = check_loss(loss)
        self._loss_fn = make_loss(loss, policy=policy)
        self.slowdown = slowdown
        params = [p for u in self.units for p in u.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(optimizer, params, policy=policy) if params else None
        # what a live re-partition builds other units with (build() sets the spec)
        self.optimizer_config = dict(optimizer)
        self.spec: ModelSpec | None = None
        self.lr_schedule = check_lr_schedule(lr_schedule)
        self._initial_lrs = (
            [float(group.get("lr", 0.0)) for group in self.optimizer.param_groups]
            if self.optimizer is not None
            else []
        )
        # the mini-batch the next step() applies, counted over the whole training
        self.next_step = start_step
        # micro-batch -> (inputs that need a gradient, outputs or the loss)
        self._saved: dict[int, tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]] = {}
        self._saved_bytes: dict[int, int] = {}
        self.peak_live = 0
        # Bytes autograd keeps for the backwards still to come (what 1F1B's warm-up bounds).
        self.live_activation_bytes = 0
        self.peak_activation_bytes = 0

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
    ) -> TrainShard:
        """Units ``[start, end)`` of ``spec``; ``state`` (from :meth:`training_state`)
        replaces their initial weights and optimizer state. Without it,
        ``resume_optimizer`` reads these units' optimizer state from the spec's
        weights file (a checkpoint saved with it), and only theirs."""
        sequence = load_layer_sequence(spec)
        if not 0 <= start < end <= sequence.num_units:
            raise ConfigError(
                f"unit range [{start}, {end}) is outside the model's {sequence.num_units} units"
            )
        # build_units loads the spec's weights file, if it names one
        shard = cls(
            sequence.build_units(start, end),
            start=start,
            first=first,
            last=last,
            loss=loss,
            optimizer=optimizer,
            slowdown=slowdown,
            lr_schedule=lr_schedule,
            start_step=start_step,
            policy=factory_policy(from_peer=spec.from_peer),
            device=device,
        )
        shard.spec = spec
        if state is not None:
            shard.load_training_state(state)
        elif resume_optimizer:
            if spec.weights is None:
                raise ConfigError("resuming the optimizer needs a weights file in the spec")
            owners = set(shard._named_parameters())
            saved = read_matching(
                spec.weights,
                lambda key: (
                    key == STEPS_KEY
                    or (OPTIMIZER_KEY in key and key.partition(OPTIMIZER_KEY)[0] in owners)
                ),
            )
            # a checkpoint always has its step count; an optimizer may keep no state
            if STEPS_KEY not in saved:
                raise ConfigError(
                    f"{spec.weights} is not a checkpoint with optimizer state (no step "
                    "count): save one with fit(..., optimizer_state=True) and "
                    "TrainReport.save, or train from its weights without resume_optimizer"
                )
            del saved[STEPS_KEY]
            shard.load_optimizer_state(saved)
        return shard

    def repartition_snapshot(self, num_stages: int) -> dict[str, torch.Tensor]:
        """This stage's state between two rounds, for peers to fetch units of at a live
        re-partition (:mod:`zpipe.stage.executors.async_repartition`)."""
        return self.training_state()

    def regrouped(self, start: int, end: int, state: Mapping[str, torch.Tensor]) -> TrainShard:
        """This stage's shard over units ``[start, end)`` instead, their state taken
        from ``state`` (:meth:`repartition_snapshot`'s entries, its own or a peer's)."""
        if self.spec is None:
            raise PipelineError("this shard was not built from a model spec: it cannot regroup")
        return TrainShard.build(
            self.spec,
            start,
            end,
            first=self.first,
            last=self.last,
            loss=self.loss,
            optimizer=self.optimizer_config,
            slowdown=self.slowdown,
            state={k: v for k, v in state.items() if _unit_in(k, start, end)},
            lr_schedule=self.lr_schedule,
            start_step=self.next_step,
            device=self.device,
        )

    def _weight_storages(self) -> set[int]:
        return {
            t.untyped_storage().data_ptr()
            for unit in self.units
            for t in (*unit.parameters(), *unit.buffers())
        }

    @property
    def live_activations(self) -> int:
        return len(self._saved)

    def _timed(self, started: float, cpu_started: float) -> float:
        elapsed = time.perf_counter() - started
        return emulate_slowdown(
            slowdown_factor(self.slowdown), elapsed, compute_cpu_s(time.thread_time() - cpu_started)
        )

    def forward(
        self,
        mb: int,
        inputs: Sequence[torch.Tensor],
        target: torch.Tensor | None = None,
        minibatch_samples: int = 0,
    ) -> tuple[tuple[torch.Tensor, ...], float | None, float]:
        """(outputs to send on, this micro-batch's loss on the last stage, seconds taken).

        The first stage's inputs are data and need no gradient; later stages'
        inputs are activations whose gradient goes back upstream.
        """
        if mb in self._saved:
            raise PipelineError(f"micro-batch {mb} was forwarded twice")
        started, cpu_started = time.perf_counter(), time.thread_time()
        leaves = tuple(
            t.detach().requires_grad_(not self.first and t.is_floating_point())
            for t in self.mover.to_device(inputs)
        )
        storages: dict[int, int] = {}
        weights = self._weight_storages()

        def remember(t: torch.Tensor) -> torch.Tensor:
            # One count per storage: views of one tensor share it. Weights a layer saves
            # (a Linear its weight) are not activations: they stay whatever is in flight.
            storage = t.untyped_storage()
            if storage.data_ptr() not in weights:
                storages[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(remember, lambda t: t):
            outputs = run_units(self.units, leaves)
        loss_value: float | None = None
        if self.last:
            if target is None:
                raise PipelineError(f"micro-batch {mb} reached the last stage without labels")
            (on_device,) = self.mover.to_device((target,))
            loss = self._loss_fn(outputs[0], on_device, minibatch_samples)
            loss_value = float(loss.detach())
            self._saved[mb] = (leaves, (loss,))
            sent: tuple[torch.Tensor, ...] = ()
        else:
            self._saved[mb] = (leaves, outputs)
            sent = self.mover.to_host(tuple(t.detach() for t in outputs))
        self._saved_bytes[mb] = sum(storages.values())
        self.live_activation_bytes += self._saved_bytes[mb]
        self.peak_live = max(self.peak_live, len(self._saved))
        self.peak_activation_bytes = max(self.peak_activation_bytes, self.live_activation_bytes)
        return sent, loss_value, self._timed(started, cpu_started)

    def backward(
        self, mb: int, grad_outputs: Sequence[torch.Tensor] = ()
    ) -> tuple[tuple[torch.Tensor, ...], float]:
        """Gradients of this micro-batch's inputs (empty on the first stage), and seconds."""
        saved = self._saved.pop(mb, None)
        if saved is None:
            raise PipelineError(f"backward of micro-batch {mb}, which has no saved forward")
        started, cpu_started = time.perf_counter(), time.thread_time()
        self.live_activation_bytes -= self._saved_bytes.pop(mb, 0)
        leaves, roots = saved
        if self.last:
            torch.autograd.backward(roots[0])
        else:
            grads_in = self.mover.to_device(grad_outputs)
            pairs = [(r, g) for r, g in zip(roots, grads_in, strict=True) if r.requires_grad]
            if pairs:
                torch.autograd.backward([r for r, _ in pairs], [g for _, g in pairs])
        grads: tuple[torch.Tensor, ...] = ()
        if not self.first:
            grads = self.mover.to_host(
                tuple(t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves)
            )
        return grads, self._timed(started, cpu_started)

    def step(self) -> float:
        """Apply the accumulated gradients and clear them; seconds taken."""
        if self._saved:
            raise PipelineError(
                f"optimizer step with {len(self._saved)} micro-batches still awaiting backward"
            )
        started, cpu_started = time.perf_counter(), time.thread_time()
        if self.optimizer is not None:
            if self.lr_schedule is not None:
                factor = lr_factor(self.lr_schedule, self.next_step)
                for group, initial in zip(
                    self.optimizer.param_groups, self._initial_lrs, strict=True
                ):
                    group["lr"] = initial * factor
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.next_step += 1
        return self._timed(started, cpu_started)

    def all_gradients(self) -> list[torch.Tensor]:
        """Every trainable parameter's gradient, zeros where none accumulated (a device
        that computed no rows), so every member of a group reduces the same list.

        On the CPU the gradients themselves (reduced in place); on an accelerator host
        copies, which :meth:`keep_reduced` writes back."""
        grads = []
        for unit in self.units:
            for p in unit.parameters():
                if not p.requires_grad:
                    continue
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
        return list(self.mover.to_host(grads))

    def _device_float_buffers(self) -> list[torch.Tensor]:
        return [b for u in self.units for b in u.buffers() if b.is_floating_point()]

    def float_buffers(self) -> list[torch.Tensor]:
        """Floating-point buffers (BatchNorm's running statistics): what replicas of a
        data-parallel group update from different rows and must average (host copies
        on an accelerator, as :meth:`all_gradients`)."""
        return list(self.mover.to_host(self._device_float_buffers()))

    def keep_reduced(self, grads: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor]) -> None:
        """Write the all-reduced host copies back onto the device (nothing to do on the
        CPU, where they were reduced in place)."""
        if self.mover.is_host:
            return
        targets = [p.grad for u in self.units for p in u.parameters() if p.requires_grad]
        with torch.no_grad():
            for target, value in zip(
                [*targets, *self._device_float_buffers()], [*grads, *buffers], strict=True
            ):
                assert target is not None  # all_gradients made every gradient
                target.copy_(value)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's weights under the full model's keys ("units.<index>.<name>"), on
        the host."""
        return {
            unit_key(self.start + offset, name): tensor.detach().to("cpu", copy=True)
            for offset, unit in enumerate(self.units)
            for name, tensor in unit.state_dict().items()
        }

    def _named_parameters(self) -> dict[str, torch.nn.Parameter]:
        return {
            unit_key(self.start + offset, name): param
            for offset, unit in enumerate(self.units)
            for name, param in unit.named_parameters()
        }

    def training_state(self) -> dict[str, torch.Tensor]:
        """Weights and optimizer state: what a replica needs to resume this stage exactly.

        The optimizer's per-parameter state (SGD's momentum buffer, Adam's moments and
        step) is keyed ``"<parameter key>#opt.<name>"``, so a stage that takes over
        these units under another partition finds it by the same keys.
        """
        state = self.state_dict()
        if self.optimizer is None:
            return state
        for key, param in self._named_parameters().items():
            for name, value in self.optimizer.state.get(param, {}).items():
                if isinstance(value, torch.Tensor):
                    state[f"{key}{OPTIMIZER_KEY}{name}"] = value.detach().to("cpu", copy=True)
                elif isinstance(value, (int, float)):
                    state[f"{key}{OPTIMIZER_KEY}{name}"] = torch.tensor(
                        float(value), dtype=torch.float64
                    )
        return state

    def load_training_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore what :meth:`training_state` gave, for this shard's units.

        Every weight of the shard must be there (a replica that misses one would
        silently train from the initial weights); optimizer state is optional per
        parameter (none before its first step). Keys of other units are refused.
        """
        weights = {k: v for k, v in state.items() if OPTIMIZER_KEY not in k}
        own = self.state_dict()
        missing = sorted(set(own) - set(weights))
        foreign = sorted(set(weights) - set(own))
        if missing or foreign:
            raise ConfigError(
                f"the replica does not match units [{self.start}, {self.start + len(self.units)})"
                f": missing {missing[:3]}, foreign {foreign[:3]}"
            )
        with torch.no_grad():
            for offset, unit in enumerate(self.units):
                prefix = unit_key(self.start + offset, "")
                unit.load_state_dict(
                    {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}
                )
        self.load_optimizer_state(state)

    def load_optimizer_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore the ``"<parameter key>#opt.<name>"`` entries of ``state``."""
        params = self._named_parameters()
        for key, value in state.items():
            if OPTIMIZER_KEY not in key:
                continue
            owner, _, name = key.partition(OPTIMIZER_KEY)
            param = params.get(owner)
            if param is None or self.optimizer is None:
                raise ConfigError(f"optimizer state {key!r} belongs to no parameter here")
            entry = self.optimizer.state[param]
            # Adam keeps its step as a float tensor; a number stays a number.
            # Adam's step stays on the host, as torch keeps it; moments go to the device.
            if value.dim() > 0:
                entry[name] = value.to(param.device, copy=True)
            else:
                entry[name] = value.clone() if name == "step" else float(value)


def _unit_in(key: str, start: int, end: int) -> bool:
    unit = split_unit_key(key.partition(OPTIMIZER_KEY)[0])
    return unit is not None and start <= unit[0] < end
