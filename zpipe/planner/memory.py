"""The one memory model: what a stage's process holds at its peak, from a profile.

Every planner (PipeEdge, the even and greedy baselines, HPP, straight, FTPipeHD,
the lossy runs' planner, generation's weights-and-working-set part) and every
memory limit (``--memory-mb``, a cluster file's ``memory_mb``) is checked against
what this module predicts. A stage running units ``[i, j)`` on micro-batches of
``b`` samples needs:

- **weights**: the units' ``param_bytes`` (parameters and buffers, exact);
- **forward**, the tight rule: ``max(peak[i], input(i) + max(peak[i+1 .. j-1]))``,
  where ``peak[u]`` is the profile's ``memory_bytes`` of unit ``u`` (its input
  plus the peak its forward allocates) and ``input(i)`` the stage's input (the
  model's input or unit ``i-1``'s output), which its sender keeps alive while the
  later units run. One unit's intermediates are freed before the next one runs,
  so peaks never add up; summing them (PipeEdge's additive ``M(i..j)``) errs high
  by about the number of units (``bench/memory.py`` measured 2.6-5.2x);
- for training, in addition: the **gradients** (one copy of the weights), the
  **optimizer state** (:data:`OPTIMIZER_STATE_COPIES` more copies: plain SGD 0,
  momentum 1, Adam 2) and the **saved-for-backward** bytes (the profile's
  ``activation_bytes``) of every micro-batch in flight (the stage's warm-up ``K``);
  the forward's transient above is counted once, for the one micro-batch that runs,
  or the optimizer step's temporaries instead where they are larger
  (:data:`OPTIMIZER_STEP_COPIES` copies of the weights: torch's fused Adam makes
  none, plain SGD none, SGD with momentum one), as the step runs after the
  backward; and what torch's
  training machinery costs a process the first time it runs, whatever the model
  (:data:`TRAINING_RUNTIME_BYTES`: the optimizer's first step),
  which like the base is taken off a device's room, not added to a stage's model;
- the **runtime**: what running any model costs the process the first time
  (:data:`COMPUTE_RUNTIME_BYTES`: the CPU kernels' workspaces, which no unit's
  profiled peak counts; like the base it is taken off a device's room);
- the **process base**: what the stage process holds before its model arrives
  (the interpreter, torch, zpipe, the sockets). A stage measures its resident
  memory when it registers and reports it (``Register.base_bytes``); a stage that
  reports none is planned with :data:`DEFAULT_STAGE_BASE_BYTES`.

A **safety margin** (:data:`DEFAULT_MEMORY_MARGIN`, the coordinator's
``--memory-margin``) is a fraction of the prediction: a stage fits a budget
``M`` when ``(base + model) x (1 + margin) <= M``. The planners see each device's
room for the model, ``M / (1 + margin) - base`` (:func:`model_room_bytes`,
applied where a registered stage becomes a planner device); a cluster file's
``memory_mb`` is already that room (what the device gives the model).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from zpipe._errors import ConfigError
from zpipe.planner.profile import ModelProfile

MIB = 2**20
# A CPU stage process before its model arrives: Python, torch 2.x with torch._dynamo
# (which a stage imports before it registers: zpipe.lazy_torch), zpipe's stage modules
# and sockets, measured resident (VmRSS) on x86-64 Linux at 310 MiB.
DEFAULT_STAGE_BASE_BYTES = 320 * MIB
# The fraction added to every prediction before it is compared with a budget: what
# the prediction does not see (allocator fragmentation, message buffers in flight).
DEFAULT_MEMORY_MARGIN = 0.1
MAX_MEMORY_MARGIN = 10.0
# Copies of the weights an optimizer keeps beside them (momentum: 1, Adam's moments: 2).
OPTIMIZER_STATE_COPIES: dict[str, int] = {"sgd": 0, "sgd-momentum": 1, "adam": 2, "adamw": 2}
# Copies of the weights an optimizer's step allocates for a moment. Adam and AdamW
# run torch's fused kernel (zpipe.training.objectives.make_optimizer), which updates
# each tensor in place: none (bench/memory.py, 2026-11-30: the MLP stage of 96 MiB
# of weights peaked 11 MiB above its weights, gradients and state). Its per-tensor
# and multi-tensor loops, which a device without the fused kernel falls back to,
# make about two (the square root of the second moment and a quotient; measured
# 2.0-2.1x the weights); the safety margin is what covers that case. SGD with
# momentum's 1 is on the safe side, not measured.
OPTIMIZER_STEP_COPIES: dict[str, int] = {"sgd": 0, "sgd-momentum": 1, "adam": 0, "adamw": 0}
# What a stage process's first forward adds, whatever the model: the CPU kernels'
# workspaces and caches (oneDNN, the BLAS, the thread pool), which no unit's profiled
# peak counts; measured 6 MiB (an MLP) to 29 MiB (ViT-Base's attention) at one sample.
COMPUTE_RUNTIME_BYTES = 24 * MIB
# What training adds to a stage process the first time it runs, whatever the model:
# the optimizer's first step (measured 7-8 MiB resident, torch 2.x, x86-64, with
# torch._dynamo already imported, as a stage imports it before it registers).
TRAINING_RUNTIME_BYTES = 10 * MIB


def optimizer_state_copies(optimizer: str) -> int:
    """Copies of the weights the optimizer keeps (momentum: 1, Adam's two moments: 2)."""
    try:
        return OPTIMIZER_STATE_COPIES[optimizer]
    except KeyError:
        raise ConfigError(
            f"unknown optimizer {optimizer!r}; known: {', '.join(OPTIMIZER_STATE_COPIES)}"
        ) from None


def check_margin(margin: float) -> float:
    """A safety margin: a finite fraction within 0 .. :data:`MAX_MEMORY_MARGIN`."""
    if isinstance(margin, bool) or not isinstance(margin, int | float):
        raise ConfigError(f"a memory margin must be a number, got {margin!r}")
    if not (math.isfinite(margin) and 0 <= margin <= MAX_MEMORY_MARGIN):
        raise ConfigError(
            f"a memory margin must be a fraction within 0 .. {MAX_MEMORY_MARGIN:g}, got {margin!r}"
        )
    return float(margin)


@dataclass(frozen=True)
class StageMemory:
    """A stage's predicted peak, by part (bytes)."""

    weights: int
    forward: int
    gradients: int = 0
    optimizer: int = 0
    saved: int = 0
    base: int = 0
    step: int = 0  # the optimizer step's temporaries (the step runs apart from a forward)
    runtime: int = 0  # what training's machinery costs a process (TRAINING_RUNTIME_BYTES)

    @property
    def model(self) -> int:
        """Everything but the process base: what a planner fits into a device's room."""
        transient = max(self.forward, self.step)
        return self.weights + transient + self.gradients + self.optimizer + self.saved

    @property
    def total(self) -> int:
        """The process's predicted peak resident memory: the model's part, the process's
        base and, for training, what training's machinery costs it."""
        return self.model + self.base + self.runtime

    def with_margin(self, margin: float) -> int:
        """What a budget must hold for this stage: the total plus the safety margin."""
        # rounded first: 6050 x 1.1 is 6655.000000000001 in binary floating point
        return math.ceil(round(self.total * (1 + check_margin(margin)), 6))


def tight_forward_bytes(unit_peaks: Sequence[int], stage_input: int) -> int:
    """The forward's peak of a stage: its first unit's peak (which counts the stage's
    input), or a later unit's peak plus the stage's input, whichever is largest."""
    if not unit_peaks:
        raise ConfigError("a stage runs at least one unit")
    later = [stage_input + int(p) for p in unit_peaks[1:]]
    return max([int(unit_peaks[0]), *later])


def predict_stage(
    *,
    weights: int,
    unit_peaks: Sequence[int],
    stage_input: int,
    training: bool = False,
    optimizer: str = "sgd",
    saved: int = 0,
    in_flight: int = 1,
    base: int = 0,
) -> StageMemory:
    """THE prediction: a stage's peak from its units' figures (see the module docstring).

    ``saved`` is the stage's saved-for-backward bytes of one micro-batch, held
    ``in_flight`` times (the warm-up K); both are ignored for inference.
    """
    forward = tight_forward_bytes(unit_peaks, stage_input)
    if not training:
        return StageMemory(
            weights=int(weights), forward=forward, base=int(base), runtime=runtime_bytes(False)
        )
    copies = optimizer_state_copies(optimizer)
    return StageMemory(
        weights=int(weights),
        forward=forward,
        gradients=int(weights),
        optimizer=copies * int(weights),
        saved=max(0, int(in_flight)) * int(saved),
        base=int(base),
        step=OPTIMIZER_STEP_COPIES[optimizer] * int(weights),
        runtime=runtime_bytes(True),
    )


def runtime_bytes(training: bool) -> int:
    """What running a model costs a stage process whatever the model: the first
    forward's kernel workspaces, and to train the optimizer's first step."""
    return COMPUTE_RUNTIME_BYTES + (TRAINING_RUNTIME_BYTES if training else 0)


def model_room_bytes(
    budget_bytes: int, *, base_bytes: int, margin: float, training: bool = False
) -> int:
    """What a stage process with ``budget_bytes`` gives its model: the budget less the
    margin, less the process base and :func:`runtime_bytes`; at
    least 1 (a device too small for its own base holds nothing a planner can place)."""
    fixed = int(base_bytes) + runtime_bytes(training)
    room = math.floor(budget_bytes / (1 + check_margin(margin))) - fixed
    return max(1, room)


# --------------------------------------------------------------------------- from a profile


def unit_inputs(input_bytes: int, output_bytes: Sequence[int]) -> list[int]:
    """Each unit's input: the model's input for unit 0, the previous unit's output after."""
    return [int(input_bytes), *(int(o) for o in output_bytes[:-1])]


def tight_forward_matrix(unit_peaks: Sequence[float], inputs: Sequence[float]) -> np.ndarray:
    """:func:`tight_forward_bytes` of every stage ``[i, k)`` at once: ``out[i, k]``
    (``L x (L + 1)``; 0 where ``k <= i``). Never decreasing in ``k``."""
    peaks = np.asarray(unit_peaks, dtype=np.float64)
    ins = np.asarray(inputs, dtype=np.float64)
    n = len(peaks)
    u = np.arange(n)
    # later[i, u]: unit u's peak plus stage i's input, for the units after i
    later = np.where(u[None, :] > u[:, None], peaks[None, :] + ins[:, None], 0.0)
    running = np.maximum.accumulate(later, axis=1)  # max over units i+1 .. u
    out = np.zeros((n, n + 1))
    out[:, 1:] = np.maximum(running, peaks[:, None])
    out[np.arange(n + 1)[None, :] <= u[:, None]] = 0.0
    return out


def inference_need_matrix(
    param_bytes: Sequence[int],
    unit_peaks: Sequence[int],
    input_bytes: int,
    output_bytes: Sequence[int],
) -> np.ndarray:
    """The model part of :func:`predict_stage` (inference) of every stage ``[i, k)``:
    weights plus the tight forward, ``L x (L + 1)`` (0 where ``k <= i``), for the
    planners that search over every stage at once. Never decreasing in ``k``."""
    weights = np.zeros(len(param_bytes) + 1)
    weights[1:] = np.cumsum(np.asarray(param_bytes, dtype=np.float64))
    forward = tight_forward_matrix(unit_peaks, unit_inputs(input_bytes, output_bytes))
    need = weights[None, :] - weights[:-1, None] + forward
    n = len(param_bytes)
    need[np.arange(n + 1)[None, :] <= np.arange(n)[:, None]] = 0.0
    return need


def profile_stage_memory(
    profile: ModelProfile,
    start: int,
    end: int,
    batch_size: int,
    *,
    training: bool = False,
    optimizer: str = "sgd",
    in_flight: int = 1,
    base: int = 0,
) -> StageMemory:
    """:func:`predict_stage` of units ``[start, end)`` at a profiled ``batch_size``."""
    if not 0 <= start < end <= profile.num_units:
        raise ConfigError(f"units [{start}, {end}) are not a stage of {profile.num_units} units")
    k = profile.batch_sizes.index(batch_size) if batch_size in profile.batch_sizes else None
    if k is None:
        raise ConfigError(
            f"batch size {batch_size} was not profiled; profiled: {list(profile.batch_sizes)}"
        )
    units = profile.units[start:end]
    stage_input = profile.input_bytes[k] if start == 0 else profile.units[start - 1].output_bytes[k]
    saved = sum((u.activation_bytes or ())[k] for u in units) if training else 0
    return predict_stage(
        weights=sum(u.param_bytes for u in units),
        unit_peaks=[u.memory_bytes[k] for u in units],
        stage_input=stage_input,
        training=training,
        optimizer=optimizer,
        saved=saved,
        in_flight=in_flight,
        base=base,
    )


def profile_need_matrix(profile: ModelProfile, batch_size: int) -> np.ndarray:
    """:func:`inference_need_matrix` of ``profile`` at a profiled ``batch_size``."""
    return inference_need_matrix(
        profile.param_bytes(),
        profile.peak_bytes(batch_size),
        profile.input_bytes_at(batch_size),
        profile.output_bytes(batch_size),
    )
