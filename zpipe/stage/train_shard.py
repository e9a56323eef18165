"""A stage's shard for training: forward with autograd, backward, optimizer step.

Runs in the stage's compute thread, never on the event loop. Each forward
keeps its autograd graph (the activation) until that micro-batch's backward,
so the number of live activations is what a schedule's warm-up bounds.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from zpipe._errors import ConfigError, PipelineError
from zpipe.models import ModelSpec, load_layer_sequence, run_units
from zpipe.models.weights import unit_key
from zpipe.training.objectives import check_loss, make_optimizer, microbatch_loss
from zpipe.transport.emulation import compute_cpu_s, emulate_slowdown
from zpipe.transport.slowdown import Slowdown, slowdown_factor

# Separates a parameter's key from the name of one of its optimizer state tensors.
OPTIMIZER_KEY = "#opt."


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
    ) -> None:
        self.units = [u.train() for u in units]
        self.start = start
        self.first = first
        self.last = last
        self.loss = check_loss(loss)
        self.slowdown = slowdown
        params = [p for u in self.units for p in u.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(optimizer, params) if params else None
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
    ) -> TrainShard:
        """Units ``[start, end)`` of ``spec``; ``state`` (from :meth:`training_state`)
        replaces their initial weights and optimizer state."""
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
        )
        if state is not None:
            shard.load_training_state(state)
        return shard

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
            t.detach().requires_grad_(not self.first and t.is_floating_point()) for t in inputs
        )
        storages: dict[int, int] = {}

        def remember(t: torch.Tensor) -> torch.Tensor:
            # One count per storage: views of one tensor share it.
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(remember, lambda t: t):
            outputs = run_units(self.units, leaves)
        loss_value: float | None = None
        if self.last:
            if target is None:
                raise PipelineError(f"micro-batch {mb} reached the last stage without labels")
            loss = microbatch_loss(self.loss, outputs[0], target, minibatch_samples)
            loss_value = float(loss.detach())
            self._saved[mb] = (leaves, (loss,))
            sent: tuple[torch.Tensor, ...] = ()
        else:
            self._saved[mb] = (leaves, outputs)
            sent = tuple(t.detach() for t in outputs)
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
            pairs = [(r, g) for r, g in zip(roots, grad_outputs, strict=True) if r.requires_grad]
            if pairs:
                torch.autograd.backward([r for r, _ in pairs], [g for _, g in pairs])
        grads: tuple[torch.Tensor, ...] = ()
        if not self.first:
            grads = tuple(t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves)
        return grads, self._timed(started, cpu_started)

    def step(self) -> float:
        """Apply the accumulated gradients and clear them; seconds taken."""
        if self._saved:
            raise PipelineError(
                f"optimizer step with {len(self._saved)} micro-batches still awaiting backward"
            )
        started, cpu_started = time.perf_counter(), time.thread_time()
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return self._timed(started, cpu_started)

    def all_gradients(self) -> list[torch.Tensor]:
        """Every trainable parameter's gradient, zeros where none accumulated (a device
        that computed no rows), so every member of a group reduces the same list."""
        grads = []
        for unit in self.units:
            for p in unit.parameters():
                if not p.requires_grad:
                    continue
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
        return grads

    def float_buffers(self) -> list[torch.Tensor]:
        """Floating-point buffers (BatchNorm's running statistics): what replicas of a
        data-parallel group update from different rows and must average."""
        return [b for u in self.units for b in u.buffers() if b.is_floating_point()]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's weights under the full model's keys ("units.<index>.<name>")."""
        return {
            unit_key(self.start + offset, name): tensor.detach().clone()
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
                    state[f"{key}{OPTIMIZER_KEY}{name}"] = value.detach().clone()
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
            entry[name] = value.clone() if value.dim() > 0 or name == "step" else float(value)
