"""One stage's asynchronous-training arithmetic: weight versions, stashing, aggregation.

No I/O and no threads: the stage's shard (:mod:`zpipe.stage.executors.async_shard`) runs it in
its compute thread, and the single-process reference
(:mod:`zpipe.training.async_reference`) runs one per stage in a global order.

The live parameters are the newest weights; the optimizer updates them in place.
Version ``t`` (the weights right after the ``t``-th update, see
:mod:`zpipe.planner.async_schedule`) is kept as a copy for as long as a forward may
still use it, a forwarded batch's backward still needs it (weight stashing), or an
aggregation will average it. A forward runs the units with the version's tensors
in place of the parameters (:mod:`zpipe.training.versioned_call`), so its graph holds
that version; the backward's parameter gradients are then applied to the live
weights: ``W(t+1) = W(t) - lr * grad(W(stashed))``, PipeDream's update.

Buffers (BatchNorm's running statistics) are not versioned: every forward updates
the live ones.

A learning-rate schedule (:mod:`zpipe.training.lr_schedules`) is read at the stage's
own update count: the update that makes version ``u + 1`` uses ``lr(u)``. Every
stage makes exactly one update per mini-batch, applying mini-batch ``u``'s gradient
at its ``u``-th update (counted over the whole training, a resumed run's included),
so this is the factor a synchronous run uses for mini-batch ``u``, no stage needs to
know the others' progress, and a resumed or re-partitioned stage goes on with its
versions' count. (The gradient was taken at an older version, weight stashing's
staleness; the schedule does not follow it: the rate belongs to the update.)

A loss or optimizer named as user code ("package.module:function") loads under a
:class:`~zpipe.models.trust.FactoryPolicy` (the stage's allow-list; None: this
process's own choice, as the single-process reference's), exactly as a synchronous
stage's does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from zpipe._errors import PipelineError
from zpipe.models.trust import FactoryPolicy
from zpipe.training.lr_schedules import check_lr_schedule, lr_factor
from zpipe.training.objectives import make_loss, make_optimizer
from zpipe.training.optimizer_step import apply_gradients
from zpipe.training.versioned_call import VersionedCall


@dataclass
class UnitState:
    """One unit's whole training state at a flush, as it moves to another stage: the
    module (live parameters and buffers), the optimizer's state of each parameter,
    and the weight versions later forwards and aggregations still use."""

    module: torch.nn.Module
    optimizer: dict[str, dict[str, torch.Tensor]]  # parameter -> its optimizer state
    versions: dict[int, dict[str, torch.Tensor]]  # version -> the unit's parameters


@dataclass
class _Stashed:
    version: int
    leaves: tuple[torch.Tensor, ...]  # the inputs that need a gradient
    params: list[dict[str, torch.Tensor]]  # per unit: the version's tensors, as graph leaves
    roots: tuple[torch.Tensor, ...]  # outputs, or the loss on the last stage


class AsyncStageCompute:
    def __init__(
        self,
        units: Sequence[torch.nn.Module],
        *,
        first: bool,
        last: bool,
        loss: str,
        optimizer: dict[str, Any],
        lr_schedule: Mapping[str, Any] | None = None,
        policy: FactoryPolicy | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        # ``device``: where the units compute (None: where they are); the caller moves
        # inputs, labels and gradients across (zpipe.devices.BoundaryMover)
        self.units = [(u if device is None else u.to(device)).train() for u in units]
        self.first = first
        self.last = last
        self.loss = loss
        self.optimizer_config = dict(optimizer)
        self.policy = policy
        self._loss_fn = make_loss(loss, policy=policy)
        self._params = [
            {n: p for n, p in u.named_parameters() if p.requires_grad} for u in self.units
        ]
        # each unit called with a version's tensors in its parameters' place
        self._calls = [VersionedCall(u) for u in self.units]
        flat = [p for unit in self._params for p in unit.values()]
        self.optimizer = make_optimizer(optimizer, flat, policy=policy) if flat else None
        self.lr_schedule = check_lr_schedule(lr_schedule)
        self._initial_lrs = (
            [float(group.get("lr", 0.0)) for group in self.optimizer.param_groups]
            if self.optimizer is not None
            else []
        )
        # the learning rates the last update used (what tests and logs read)
        self.last_lrs: list[float] = list(self._initial_lrs)
        self.updates = 0  # the newest version
        self._versions: dict[int, list[dict[str, torch.Tensor]]] = {0: self._copy_live()}
        self._stashed: dict[int, _Stashed] = {}
        self._pending: dict[int, _Stashed] = {}  # backwarded, its update not yet applied
        self.forward_versions: dict[int, int] = {}  # batch -> version (what tests check)
        self.backward_versions: dict[int, int] = {}

    # ------------------------------------------------------------- versions

    def _copy_live(self) -> list[dict[str, torch.Tensor]]:
        return [{n: p.detach().clone() for n, p in unit.items()} for unit in self._params]

    def restart_versions(self) -> None:
        """The live weights were replaced (a resumed state): they are the only version."""
        self._versions = {self.updates: self._copy_live()}

    @property
    def versions_kept(self) -> list[int]:
        return sorted(self._versions)

    @property
    def in_flight(self) -> int:
        return len(self._stashed)

    def forget_versions_before(self, oldest: int, *, keep_newest: int = 1) -> None:
        """Drop versions older than ``oldest`` that no stashed batch uses, keeping the
        newest ``keep_newest`` (what an aggregation averages)."""
        used = {s.version for s in self._stashed.values()}
        for version in list(self._versions):
            if version < oldest and version not in used and version <= self.updates - keep_newest:
                del self._versions[version]

    # ------------------------------------------------------------- compute

    def forward(
        self,
        batch: int,
        version: int,
        inputs: Sequence[torch.Tensor],
        target: torch.Tensor | None = None,
        samples: int = 0,
    ) -> tuple[tuple[torch.Tensor, ...], float | None]:
        """Forward ``batch`` with weight ``version``: the outputs to send on (detached),
        and the loss on the last stage."""
        if batch in self._stashed:
            raise PipelineError(f"batch {batch} was forwarded twice")
        weights = self._versions.get(version)
        if weights is None:
            raise PipelineError(
                f"batch {batch} needs weight version {version}; kept: {self.versions_kept}"
            )
        leaves = tuple(
            t.detach().requires_grad_(not self.first and t.is_floating_point()) for t in inputs
        )
        params = [{n: t.detach().requires_grad_(True) for n, t in unit.items()} for unit in weights]
        values: tuple[torch.Tensor, ...] = leaves
        for call, unit_params in zip(self._calls, params, strict=True):
            out = call(unit_params, values)
            values = _as_tuple(out)
        loss_value: float | None = None
        if self.last:
            if target is None:
                raise PipelineError(f"batch {batch} reached the last stage without labels")
            loss = self._loss_fn(values[0], target, samples or len(target))
            loss_value = float(loss.detach())
            roots: tuple[torch.Tensor, ...] = (loss,)
            sent: tuple[torch.Tensor, ...] = ()
        else:
            roots = values
            sent = tuple(t.detach() for t in values)
        self._stashed[batch] = _Stashed(version, leaves, params, roots)
        self.forward_versions[batch] = version
        return sent, loss_value

    def backward(
        self, batch: int, grad_outputs: Sequence[torch.Tensor] = ()
    ) -> tuple[torch.Tensor, ...]:
        """Backward ``batch`` through the version it was forwarded with (weight
        stashing); the gradients of its inputs (empty on the first stage). The
        update follows with :meth:`step`."""
        stashed = self._stashed.pop(batch, None)
        if stashed is None:
            raise PipelineError(f"backward of batch {batch}, which has no stashed forward")
        if self.last:
            torch.autograd.backward(stashed.roots[0])
        else:
            pairs = [
                (r, g) for r, g in zip(stashed.roots, grad_outputs, strict=True) if r.requires_grad
            ]
            if pairs:
                torch.autograd.backward([r for r, _ in pairs], [g for _, g in pairs])
        self.backward_versions[batch] = stashed.version
        self._pending[batch] = stashed
        if self.first:
            return ()
        return tuple(t.grad if t.grad is not None else torch.zeros_like(t) for t in stashed.leaves)

    def step(self, batch: int) -> None:
        """Apply ``batch``'s gradients (taken at its stashed version) to the live
        weights: the next version."""
        stashed = self._pending.pop(batch, None)
        if stashed is None:
            raise PipelineError(f"optimizer step for batch {batch}, which was not backwarded")
        if self.optimizer is not None:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            for live, used in zip(self._params, stashed.params, strict=True):
                for name, param in live.items():
                    grad = used[name].grad
                    params.append(param)
                    grads.append(grad if grad is not None else torch.zeros_like(param))
            if self.lr_schedule is not None:
                # update ``updates`` (counted over the whole training): its own rate
                factor = lr_factor(self.lr_schedule, self.updates)
                for group, initial in zip(
                    self.optimizer.param_groups, self._initial_lrs, strict=True
                ):
                    group["lr"] = initial * factor
                self.last_lrs = [float(g["lr"]) for g in self.optimizer.param_groups]
            # torch's fused Adam kernel without its Python wrapping where that is exact
            apply_gradients(self.optimizer, params, grads)
        self.updates += 1
        self._versions[self.updates] = self._copy_live()

    # ------------------------------------------------------------- moving units

    def export_units(self) -> list[UnitState]:
        """Every unit's state, to move them at a flush (nothing in flight: a stashed
        forward's graph cannot move). The units stay usable here until dropped."""
        if self._stashed or self._pending:
            raise PipelineError(
                f"units move only when nothing is in flight; batches "
                f"{sorted({*self._stashed, *self._pending})} are"
            )
        return self.unit_states()

    def unit_states(self) -> list[UnitState]:
        """Every unit's state as it is now, batches in flight or not (their forwards
        hold their own version's tensors, which this does not touch): what a copy made
        without draining reads between two actions, and clones before the next update
        (:meth:`export_units` is this at a flush). The tensors are the live ones."""
        opt_state = self.optimizer.state if self.optimizer is not None else {}
        out = []
        for index, (unit, params) in enumerate(zip(self.units, self._params, strict=True)):
            optimizer: dict[str, dict[str, torch.Tensor]] = {}
            for name, param in params.items():
                state = opt_state.get(param)
                if state:
                    optimizer[name] = dict(state)
            versions = {v: kept[index] for v, kept in self._versions.items()}
            out.append(UnitState(unit, optimizer, versions))
        return out

    @classmethod
    def adopt(
        cls,
        states: Sequence[UnitState],
        *,
        updates: int,
        first: bool,
        last: bool,
        loss: str,
        optimizer: dict[str, Any],
        lr_schedule: Mapping[str, Any] | None = None,
        policy: FactoryPolicy | None = None,
        device: torch.device | str | None = None,
    ) -> AsyncStageCompute:
        """A stage's compute over moved units (:meth:`export_units`), at ``updates``:
        the versions every unit kept, the optimizer's state of every parameter (the
        schedule goes on at ``updates``)."""
        compute = cls(
            [s.module for s in states],
            first=first,
            last=last,
            loss=loss,
            optimizer=optimizer,
            lr_schedule=lr_schedule,
            policy=policy,
            device=device,
        )
        compute.updates = updates
        common = common_versions(states, default=updates)
        if updates not in common:
            raise PipelineError(f"the moved units do not all have version {updates}")
        # a unit without trainable parameters has every version (of nothing)
        place = _placer(device)
        compute._versions = {
            v: [{n: place(t) for n, t in s.versions.get(v, {}).items()} for s in states]
            for v in sorted(common)
        }
        if compute.optimizer is not None:
            for params, state in zip(compute._params, states, strict=True):
                for name, param in params.items():
                    if name in state.optimizer:
                        compute.optimizer.state[param] = {
                            # a scalar (Adam's step) stays on the host, as torch keeps it
                            k: place(v) if isinstance(v, torch.Tensor) and v.dim() > 0 else v
                            for k, v in state.optimizer[name].items()
                        }
        return compute

    def aggregate(self, count: int) -> None:
        """Replace the live weights by the mean of the newest ``count`` versions
        (FTPipeHD's weight aggregation). The aggregate gets no version of its own: the
        next update applies to it and makes the next version (FTPipeHD's Fig. 2: no
        forward uses the aggregate itself), so a version names one set of weights."""
        wanted = list(range(self.updates - count + 1, self.updates + 1))
        missing = [v for v in wanted if v not in self._versions]
        if count < 1 or missing:
            raise PipelineError(f"cannot aggregate versions {wanted}: missing {missing}")
        with torch.no_grad():
            for index, unit in enumerate(self._params):
                for name, param in unit.items():
                    stacked = torch.stack([self._versions[v][index][name] for v in wanted])
                    param.copy_(stacked.mean(dim=0))


def _placer(device: torch.device | str | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """What puts a moved tensor where the units compute (the identity on the CPU)."""
    if device is None or torch.device(device).type == "cpu":
        return lambda t: t
    target = torch.device(device)
    return lambda t: t.to(target)


def _as_tuple(value: object) -> tuple[torch.Tensor, ...]:
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in value):
        return tuple(value)
    raise PipelineError(f"a unit returned {type(value).__name__}, not tensors")


def has_trainable(module: torch.nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def common_versions(states: Sequence[UnitState], *, default: int | None = None) -> set[int]:
    """The weight versions every unit with trainable parameters keeps (a unit without
    any, an activation or a frozen layer, carries none and constrains nothing);
    ``{default}`` when no unit has any (empty without a default)."""
    kept = [set(s.versions) for s in states if has_trainable(s.module)]
    if kept:
        return set.intersection(*kept)
    return set() if default is None else {default}
