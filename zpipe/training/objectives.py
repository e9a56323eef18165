"""Losses and optimizers by name: what a training run asks the stages to build.

Nothing crosses the wire as code: a run names its loss ("cross_entropy", "mse")
and describes its optimizer as plain data, e.g.
``{"name": "sgd", "lr": 0.1, "momentum": 0.9}``,
``{"name": "adam", "lr": 1e-3, "betas": [0.9, 0.999]}`` or
``{"name": "adamw", "lr": 1e-3, "weight_decay": 0.01}``; each stage builds its
own optimizer over its own parameters. SGD, Adam and AdamW update every
parameter elementwise, so per-stage optimizers give exactly the weights one
optimizer over the whole model would.

User code, by name: a loss may be ``"package.module:function"``, called as
``function(output, target)`` and returning the *mean* loss over the samples it
is given (as ``reduction="mean"``); an optimizer's name may be
``"package.module:function"``, called as ``function(params, **fields)`` and
returning a ``torch.optim.Optimizer``. The name crosses the wire, never the
code: each stage imports it only if its operator allowed it
(``--allow-factory``, as for model factories; see zpipe.models.trust), because
naming it runs that code there. A per-sample loss gives the same gradients
split over micro-batches; an optimizer that is not elementwise (one that
normalises across all parameters, say) sees one stage's parameters only.

Losses are computed per micro-batch but scaled to the whole mini-batch
(:func:`microbatch_loss`), so the gradients accumulated over a mini-batch's
micro-batches equal those of one pass over the mini-batch with the loss's
usual ``reduction="mean"``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from zpipe._errors import ConfigError
from zpipe.planner.async_schedule import ASYNC_SCHEDULE, AsyncSettings, async_warmup
from zpipe.planner.schedules import SCHEDULES
from zpipe.training.lr_schedules import check_lr_schedule
from zpipe.training.warmup import check_warmup_policy, resolve_warmup_policy, warmup_counts

if TYPE_CHECKING:
    from zpipe.models.trust import FactoryPolicy

LOSSES = ("cross_entropy", "mse")
OPTIMIZERS = ("sgd", "adam", "adamw")
# (output, target, samples in the whole mini-batch) -> this micro-batch's share of the loss
LossFunction = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
_PLAIN_VALUES = (int, float, str, bool, list, tuple, type(None))

_OPTIMIZER_FIELDS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "sgd": {
        "lr": (int, float),
        "momentum": (int, float),
        "dampening": (int, float),
        "weight_decay": (int, float),
        "nesterov": bool,
    },
    "adam": {
        "lr": (int, float),
        "betas": (list, tuple),
        "eps": (int, float),
        "weight_decay": (int, float),
        "amsgrad": bool,
    },
}
_OPTIMIZER_FIELDS["adamw"] = dict(_OPTIMIZER_FIELDS["adam"])


def is_factory_name(name: object) -> bool:
    """Whether a loss or optimizer name is user code ("package.module:function")."""
    return isinstance(name, str) and ":" in name


def _check_factory_name(name: str, what: str) -> None:
    from zpipe.models.trust import split_factory_path

    try:
        split_factory_path(name)
    except ConfigError:
        raise ConfigError(
            f"{what} {name!r}: user code is named 'package.module:function'"
        ) from None


def check_loss(name: str) -> str:
    if is_factory_name(name):
        _check_factory_name(name, "loss")
        return name
    if name not in LOSSES:
        raise ConfigError(
            f"unknown loss {name!r}; known: {', '.join(LOSSES)}, or 'package.module:function'"
        )
    return name


def microbatch_loss(
    name: str, output: torch.Tensor, target: torch.Tensor, minibatch_samples: int
) -> torch.Tensor:
    """This micro-batch's share of the mini-batch's mean loss.

    Summed over the mini-batch's micro-batches it equals the loss of the whole
    mini-batch with ``reduction="mean"``, whatever the micro-batch sizes.
    """
    if minibatch_samples < 1:
        raise ConfigError(f"a mini-batch needs at least one sample, got {minibatch_samples}")
    if name == "cross_entropy":
        return F.cross_entropy(output, target, reduction="sum") / minibatch_samples
    if name == "mse":
        per_sample = output[0].numel() if output.dim() > 0 and output.shape[0] > 0 else 1
        return F.mse_loss(output, target, reduction="sum") / (minibatch_samples * per_sample)
    raise ConfigError(f"unknown loss {name!r}; known: {', '.join(LOSSES)}")


def check_optimizer(config: Mapping[str, Any]) -> dict[str, Any]:
    """A validated copy of an optimizer description; errors name the bad field."""
    if not isinstance(config, Mapping):
        raise ConfigError(f"an optimizer is described by a mapping, got {config!r}")
    name = config.get("name")
    if is_factory_name(name):
        return _check_factory_optimizer(str(name), config)
    if name not in _OPTIMIZER_FIELDS:
        raise ConfigError(
            f"unknown optimizer {name!r}; known: {', '.join(sorted(_OPTIMIZER_FIELDS))}, "
            "or 'package.module:function'"
        )
    fields = _OPTIMIZER_FIELDS[str(name)]
    checked: dict[str, Any] = {"name": name}
    for key, value in config.items():
        if key == "name":
            continue
        if key not in fields:
            raise ConfigError(
                f"optimizer {name}: unknown field {key!r}; known: {', '.join(sorted(fields))}"
            )
        expected = fields[key]
        if isinstance(value, bool) and expected is not bool:
            raise ConfigError(f"optimizer {name}: {key} must be a number, got {value!r}")
        if not isinstance(value, expected):
            raise ConfigError(f"optimizer {name}: {key} has the wrong type: {value!r}")
        checked[key] = list(value) if isinstance(value, tuple) else value
    if "lr" not in checked:
        raise ConfigError(f"optimizer {name}: lr is required")
    if not checked["lr"] > 0:
        raise ConfigError(f"optimizer {name}: lr must be > 0, got {checked['lr']}")
    betas = checked.get("betas")
    if betas is not None and (len(betas) != 2 or not all(0 <= b < 1 for b in betas)):
        raise ConfigError(f"optimizer {name}: betas must be two numbers in [0, 1), got {betas}")
    return checked


def _check_factory_optimizer(name: str, config: Mapping[str, Any]) -> dict[str, Any]:
    """A user optimizer's fields are its keyword arguments: plain data only."""
    _check_factory_name(name, "optimizer")
    checked: dict[str, Any] = {"name": name}
    for key, value in config.items():
        if key == "name":
            continue
        if not isinstance(key, str) or not isinstance(value, _PLAIN_VALUES):
            raise ConfigError(
                f"optimizer {name}: field {key!r} must be a number, string, bool or list"
            )
        checked[key] = list(value) if isinstance(value, tuple) else value
    return checked


def _resolve(name: str, policy: FactoryPolicy | None, what: str) -> Callable[..., Any]:
    """The callable a loss or optimizer names, if ``policy`` allows it (the stage's
    allow-list for a peer's run; None: this process's own choice)."""
    from zpipe.models.adapters import resolve_factory
    from zpipe.models.trust import TRUST_CALLER

    return resolve_factory(name, policy=policy or TRUST_CALLER, family=what)


def make_loss(name: str, *, policy: FactoryPolicy | None = None) -> LossFunction:
    """The function that computes a micro-batch's share of the mini-batch's loss."""
    check_loss(name)
    if not is_factory_name(name):
        return lambda output, target, samples: microbatch_loss(name, output, target, samples)
    function = _resolve(name, policy, "loss")

    def user_loss(output: torch.Tensor, target: torch.Tensor, samples: int) -> torch.Tensor:
        if samples < 1:
            raise ConfigError(f"a mini-batch needs at least one sample, got {samples}")
        value = function(output, target)
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            raise ConfigError(f"loss {name!r} must return a scalar Tensor, got {value!r}")
        # the mean over this micro-batch, weighed by its share of the mini-batch
        rows = output.shape[0] if output.dim() > 0 else 1
        return value.reshape(()) * (rows / samples)

    return user_loss


def make_optimizer(
    config: Mapping[str, Any],
    params: Iterable[torch.nn.Parameter],
    *,
    policy: FactoryPolicy | None = None,
) -> torch.optim.Optimizer:
    checked = check_optimizer(config)
    kwargs = {k: v for k, v in checked.items() if k != "name"}
    params = list(params)
    name = str(checked["name"])
    if is_factory_name(name):
        function = _resolve(name, policy, "optimizer")
        try:
            optimizer = function(params, **kwargs)
        except Exception as exc:  # user code fails with whatever it raises
            raise ConfigError(f"optimizer {name!r} raised {type(exc).__name__}: {exc}") from exc
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(
                f"optimizer {name!r} returned {type(optimizer).__name__}, "
                "not a torch.optim.Optimizer"
            )
        return optimizer
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    if name == "sgd":
        return torch.optim.SGD(params, **kwargs)
    adam = torch.optim.AdamW if name == "adamw" else torch.optim.Adam
    try:
        # torch's fused kernel updates each tensor in one pass instead of about ten:
        # a stage's Adam step on CPU took half the time (24-unit residual MLP, hidden
        # 256: 0.77 -> 0.38 ms per unit). Every stage and every reference builds its
        # optimizer here, so they stay equal to each other.
        return adam(params, fused=True, **kwargs)
    except RuntimeError:
        # a device or dtype torch has no fused kernel for: its per-tensor loop
        return adam(params, **kwargs)


TRAIN_SETTINGS = (
    "schedule",
    "num_microbatches",
    "loss",
    "optimizer",
    "warmups",
    "plan",
    "lr_schedule",
    "start_step",
    "resume_optimizer",
    "warmup",
    "async",
    # live re-partitioning (zpipe.training.repartition.RepartitionSettings' map): the
    # coordinator reads it; stages need none of it
    "repartition",
)


def check_train_settings(settings: Mapping[str, Any], num_stages: int) -> dict[str, Any]:
    """A run's training settings, checked, with each stage's warm-up filled in.

    ``warmups`` (optional) gives K_p per stage; without it GPipe uses M and 1F1B
    the ``warmup`` policy's counts (:mod:`zpipe.training.warmup`): ``"asteroid"``
    K_p = min(2(P - p) - 1, M), ``"torch"`` min(P - p, M), ``"auto"`` (the default)
    Asteroid's.
    """
    if not isinstance(settings, Mapping):
        raise ConfigError(f"training settings must be a mapping, got {settings!r}")
    unknown = sorted(set(settings) - set(TRAIN_SETTINGS))
    if unknown:
        raise ConfigError(f"unknown training settings {unknown}; known: {list(TRAIN_SETTINGS)}")
    schedule = str(settings.get("schedule", "1f1b")).lower()
    if schedule == ASYNC_SCHEDULE:
        return _check_async_settings(settings, num_stages)
    if schedule not in SCHEDULES:
        known = ", ".join((*SCHEDULES, ASYNC_SCHEDULE))
        raise ConfigError(f"unknown schedule {schedule!r}; known: {known}")
    m = settings.get("num_microbatches")
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ConfigError(f"num_microbatches must be an integer >= 1, got {m!r}")
    policy = check_warmup_policy(settings.get("warmup") or "auto")
    warmups = settings.get("warmups")
    if warmups is None:
        if schedule == "gpipe":
            warmups = [m] * num_stages
        else:
            resolved = resolve_warmup_policy(policy)
            warmups = warmup_counts(resolved, num_stages, m)
    else:
        warmups = [int(w) for w in warmups]
        if len(warmups) != num_stages:
            raise ConfigError(f"warmups has {len(warmups)} entries for {num_stages} stages")
        if any(not 1 <= w <= m for w in warmups):
            raise ConfigError(f"every warm-up must be in 1..{m}, got {warmups}")
        if any(a < b for a, b in itertools.pairwise(warmups)):
            raise ConfigError(
                f"warm-ups must not grow from one stage to the next (neighbours would wait "
                f"for each other forever), got {warmups}"
            )
        if schedule == "gpipe" and any(w != m for w in warmups):
            raise ConfigError("gpipe runs every forward first: leave warmups out or use M")
    start_step = settings.get("start_step", 0)
    if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
        raise ConfigError(f"start_step must be an integer >= 0, got {start_step!r}")
    return {
        "schedule": schedule,
        "num_microbatches": m,
        "loss": check_loss(str(settings.get("loss", "cross_entropy"))),
        "optimizer": check_optimizer(settings.get("optimizer") or {}),
        "warmups": warmups,
        "lr_schedule": check_lr_schedule(settings.get("lr_schedule")),
        "start_step": start_step,
        "resume_optimizer": bool(settings.get("resume_optimizer", False)),
    }


def _check_async_settings(settings: Mapping[str, Any], num_stages: int) -> dict[str, Any]:
    """Asynchronous 1F1B: one micro-batch per mini-batch, warm-ups ``n - i``, and its
    own settings under ``async`` (:class:`~zpipe.planner.async_schedule.AsyncSettings`)."""
    m = settings.get("num_microbatches")
    if m != 1 or isinstance(m, bool):
        raise ConfigError(
            f"{ASYNC_SCHEDULE} trains every mini-batch whole (num_microbatches=1), got {m!r}"
        )
    start_step = settings.get("start_step", 0)
    if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
        raise ConfigError(f"start_step must be an integer >= 0, got {start_step!r}")
    resume = bool(settings.get("resume_optimizer", False))
    if start_step and not resume:
        raise ConfigError(async_start_step_refusal(start_step))
    if resume and AsyncSettings.from_dict(settings.get("async")).live_copies:
        raise ConfigError(ASYNC_RESUME_LIVE_COPIES)
    warmups = [async_warmup(p, num_stages) for p in range(num_stages)]
    given = settings.get("warmups")
    if given is not None and [int(w) for w in given] != warmups:
        raise ConfigError(f"{ASYNC_SCHEDULE}'s warm-ups are n - i ({warmups}), got {given}")
    return {
        "schedule": ASYNC_SCHEDULE,
        "num_microbatches": 1,
        "loss": check_loss(str(settings.get("loss", "cross_entropy"))),
        "optimizer": check_optimizer(settings.get("optimizer") or {}),
        "warmups": warmups,
        # read at each stage's own update count (zpipe.training.async_stage)
        "lr_schedule": check_lr_schedule(settings.get("lr_schedule")),
        "start_step": start_step,
        "resume_optimizer": resume,
        "async": AsyncSettings.from_dict(settings.get("async")).to_dict(),
    }


# Live copies and a fast recovery count mini-batches from the fit's start; a resumed
# asynchronous run's versions count from the checkpoint's (zpipe.training.async_fast_state
# restarts every unit at the acknowledged count): not reconciled yet.
ASYNC_RESUME_LIVE_COPIES = (
    f"{ASYNC_SCHEDULE} does not resume from a checkpoint with live_copies yet: the copies "
    "and a fast recovery count mini-batches from this run's start, the resumed weight "
    "versions from the checkpoint's; resume without live_copies (recovery from flush "
    "replicas works)"
)


def async_start_step_refusal(start_step: int) -> str:
    """Why an asynchronous run takes ``start_step`` only with ``resume_optimizer``."""
    return (
        f"{ASYNC_SCHEDULE} takes start_step ({start_step}) only with resume_optimizer: "
        "its update count and the weight versions the next forwards read come from the "
        "checkpoint of an asynchronous run"
    )
