"""Measure a model's units on this device: the numbers the planners plan from.

For each profiled batch size every unit's forward is timed (after warm-up, the
median of repeats), and its output size, weight size and activation memory are
recorded. Times of a larger batch are never reported below those of a smaller
one (a running maximum over batch sizes), so noise cannot make a planner
believe that more work is cheaper.

Activation memory (``memory_bytes``) is measured: the bytes of a unit's
inputs (alive while it runs) plus the peak memory its forward allocates, its
outputs included (:mod:`zpipe.peak_memory`: torch's allocator statistics on
CUDA; on the CPU the larger of every operator's output storages followed from
creation to release and, on Linux with glibc, the process's resident growth,
which also sees the scratch memory kernels allocate inside themselves). It is
never reported below the old estimate, inputs plus outputs.

``--device`` (``auto``, ``cpu``, ``cuda[:N]``, ``mps``) profiles on that
device: units and inputs are moved there, and each timed run waits for the
device to finish. The profile records the device kind, and the coordinator
plans each stage from its own profile on its own device.

With ``train=True`` (``--train``) each unit also gets the numbers training
planners need, measured in training mode (``module.train()``, autograd on):

- ``backward_time_s``: the median time of ``torch.autograd.backward`` from a
  gradient of the unit's outputs (ones) to the gradients of its parameters
  and of its input (the first unit's input is data and gets none), after the
  same warm-up; parameter gradients accumulate across repeats, as they do
  across the micro-batches of a mini-batch. The forward itself is not timed
  again: planners take forward times from ``time_s``.
- ``activation_bytes``: the bytes autograd saves for the backward, counted
  with ``torch.autograd.graph.saved_tensors_hooks``: every saved tensor's
  storage once (views share it), the unit's own parameters and buffers left
  out (they are weights). A saved input or output is counted by the unit that
  saves it, so two neighbouring units that both save the tensor between them
  (a ReLU its output, the next Linear its input) count it twice: summed over
  a stage, the number errs high by at most the tensors at unit boundaries.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from zpipe._errors import ConfigError
from zpipe.models import ModelSpec, load_layer_sequence
from zpipe.peak_memory import peak_bytes
from zpipe.planner.profile import ModelProfile, UnitProfile
from zpipe.transport.emulation import compute_cpu_s, emulate_slowdown

BUILT_IN_FAMILIES = ("transformer", "mlp", "cnn")


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _as_tuple(value: object) -> tuple[torch.Tensor, ...]:
    if isinstance(value, torch.Tensor):
        return (value,)
    return tuple(value)  # type: ignore[arg-type]


@contextlib.contextmanager
def _compute_dtype(dtype: str, device_type: str = "cpu") -> Iterator[None]:
    if dtype == "bfloat16":
        with torch.autocast(device_type, dtype=torch.bfloat16):
            yield
    elif dtype == "float32":
        yield
    else:
        raise ConfigError(f"dtype must be float32 or bfloat16, got {dtype!r}")


def _no_wait() -> None:
    pass


def _waiter(device: torch.device) -> Callable[[], None]:
    """What waits for ``device`` to finish queued work (a CUDA kernel returns at once)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    if device.type == "mps":
        return torch.mps.synchronize
    return _no_wait


@dataclass(frozen=True)
class _Timing:
    warmup: int
    repeats: int
    slowdown: float
    wait: Callable[[], None] = _no_wait

    def once(self, step: Callable[[], object]) -> float:
        """How long ``step`` takes, as a stage with this slowdown would see it."""
        self.wait()
        started, cpu_started = time.perf_counter(), time.thread_time()
        step()
        self.wait()
        elapsed = time.perf_counter() - started
        # as a stage runs it: stretched from the CPU time (see emulation)
        return emulate_slowdown(
            self.slowdown, elapsed, compute_cpu_s(time.thread_time() - cpu_started)
        )

    def median(
        self, step: Callable[[], object], prepare: Callable[[], object] | None = None
    ) -> float:
        """Median of :meth:`once` over the repeats after the warm-up; ``prepare`` is untimed."""
        samples = []
        for attempt in range(self.warmup + self.repeats):
            if prepare is not None:
                prepare()
            took = self.once(step)
            if attempt >= self.warmup:
                samples.append(took)
        return statistics.median(samples)


def _time_forward(
    unit: nn.Module, inputs: tuple[torch.Tensor, ...], timing: _Timing
) -> tuple[float, tuple[torch.Tensor, ...]]:
    """Median forward time of ``unit`` on ``inputs``, and its outputs."""
    results: list[tuple[torch.Tensor, ...]] = []

    def step() -> None:
        results[:] = [_as_tuple(unit(*inputs))]

    return timing.median(step), results[0]


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of the memory behind ``t``: views of one tensor share it."""
    try:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # tensor kinds without a plain storage
        return id(t), t.numel() * t.element_size()


def _training_inputs(inputs: tuple[torch.Tensor, ...], *, first: bool) -> list[torch.Tensor]:
    """Normal (not inference-mode) copies; later units' float inputs need gradients."""
    copies = []
    for t in inputs:
        copy = t.clone()  # a clone made outside inference mode is a normal tensor
        if not first and copy.is_floating_point():
            copy.requires_grad_(True)
        copies.append(copy)
    return copies


def _measure_training(
    unit: nn.Module,
    inputs: tuple[torch.Tensor, ...],
    timing: _Timing,
    *,
    dtype: str,
    first: bool,
    name: str,
    device_type: str = "cpu",
) -> tuple[float, int]:
    """(median backward seconds, bytes saved for the backward) of ``unit`` on ``inputs``."""
    weights = {_storage_key(t)[0] for t in (*unit.parameters(), *unit.buffers())}
    was_training = unit.training
    unit.train()
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        address, size = _storage_key(t)
        if address not in weights:
            saved[address] = size
        return t

    pending: list[list[torch.Tensor]] = []

    def prepare() -> None:
        saved.clear()
        args = _training_inputs(inputs, first=first)
        with (
            torch.autograd.graph.saved_tensors_hooks(pack, _unpack),
            _compute_dtype(dtype, device_type),
        ):
            result = _as_tuple(unit(*args))
        pending[:] = [[t for t in result if t.requires_grad]]

    def backward() -> None:
        outs = pending.pop()
        if outs:
            torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])

    try:
        with torch.enable_grad():
            took = timing.median(backward, prepare)
    except (RuntimeError, ValueError) as exc:
        batch = inputs[0].shape[0] if inputs and inputs[0].dim() else "?"
        raise ConfigError(
            f"unit {name!r} cannot run a training step on a batch of {batch}: {exc}"
        ) from None
    finally:
        unit.train(was_training)
        unit.zero_grad(set_to_none=True)
    return took, sum(saved.values())


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def _never_cheaper_when_larger(rows: list[list[float]]) -> None:
    """A running maximum over batch sizes, so noise never makes more work look cheaper."""
    for row in rows:
        for i in range(1, len(row)):
            row[i] = max(row[i], row[i - 1])


def profile_model(
    spec: ModelSpec,
    *,
    batch_sizes: Sequence[int] = (1, 2, 4, 8),
    dtype: str = "float32",
    warmup: int = 2,
    repeats: int = 5,
    slowdown: float = 1.0,
    device_name: str = "local",
    train: bool = False,
    device: torch.device | str = "cpu",
    on_unit: Callable[[int, int], None] | None = None,
) -> ModelProfile:
    """Profile every unit of ``spec`` at each batch size on this device.

    With ``train`` the profile also holds each unit's backward time and the
    bytes it saves for its backward (see the module docstring). ``device`` is
    the torch device the units run on. ``on_unit(done, total)`` hears of each unit
    profiled (a progress bar).
    """
    device = torch.device(device)
    sizes = sorted(set(batch_sizes))
    if not sizes or sizes[0] < 1:
        raise ConfigError(f"batch sizes must be >= 1, got {list(batch_sizes)}")
    if repeats < 1 or warmup < 0:
        raise ConfigError("repeats must be >= 1 and warmup >= 0")
    sequence = load_layer_sequence(spec)
    names = sequence.unit_names()
    count = sequence.num_units
    # Built-in families build one unit at a time, so a device with little memory
    # can profile a model it could never hold whole; adapters build the user's
    # module whole anyway, so they build it once.
    whole = None if spec.family in BUILT_IN_FAMILIES else sequence.build_units(0, count)
    param_bytes: list[int] = []
    times: list[list[float]] = [[] for _ in range(count)]
    outputs: list[list[int]] = [[] for _ in range(count)]
    memory: list[list[int]] = [[] for _ in range(count)]
    backward: list[list[float]] = [[] for _ in range(count)]
    saved: list[list[int]] = [[] for _ in range(count)]
    examples = {b: sequence.example_input(b, seed=b) for b in sizes}
    input_bytes = [_nbytes(examples[b]) for b in sizes]
    activations = {b: tuple(t.to(device) for t in examples[b]) for b in sizes}
    del examples
    timing = _Timing(warmup=warmup, repeats=repeats, slowdown=slowdown, wait=_waiter(device))
    for index in range(count):
        # Built outside inference mode: parameters made in it could never get gradients.
        unit = whole[index] if whole is not None else sequence.build_units(index, index + 1)[0]
        unit = unit.to(device)
        param_bytes.append(
            sum(p.numel() * p.element_size() for p in unit.parameters())
            + sum(b.numel() * b.element_size() for b in unit.buffers())
        )
        for batch_size in sizes:
            inputs = activations[batch_size]
            with torch.inference_mode(), _compute_dtype(dtype, device.type):
                took, result = _time_forward(unit, inputs, timing)
                # measured in a run of its own: following allocations slows the timed ones
                peak = peak_bytes(functools.partial(unit, *inputs), device)
            times[index].append(took)
            outputs[index].append(_nbytes(result))
            estimate = _nbytes(inputs) + _nbytes(result)
            memory[index].append(max(_nbytes(inputs) + peak, estimate))
            if train:
                took, kept = _measure_training(
                    unit,
                    inputs,
                    timing,
                    dtype=dtype,
                    first=index == 0,
                    name=names[index],
                    device_type=device.type,
                )
                backward[index].append(took)
                saved[index].append(kept)
            activations[batch_size] = result
        del unit
        if on_unit is not None:
            on_unit(index + 1, count)
    for rows in (times, backward):
        _never_cheaper_when_larger(rows)
    return ModelProfile(
        batch_sizes=tuple(sizes),
        units=tuple(
            UnitProfile(
                names[i],
                param_bytes[i],
                tuple(times[i]),
                tuple(outputs[i]),
                tuple(memory[i]),
                tuple(backward[i]) if train else None,
                tuple(saved[i]) if train else None,
            )
            for i in range(count)
        ),
        input_bytes=tuple(input_bytes),
        model=spec.to_dict(),
        device={
            "name": device_name,
            "threads": torch.get_num_threads(),
            "dtype": dtype,
            "torch": torch.__version__,
            "slowdown": slowdown,
            "kind": device.type,
            "device": str(device),
        },
    )


def speed_score(*, size: int = 256, repeats: int = 5, slowdown: float = 1.0) -> float:
    """Matrix-multiply GFLOP/s of this device (median), for comparing devices' speeds.

    Cheap enough to run at every stage start; a slowdown factor is applied as the
    stage applies it to real compute.
    """
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    flops = 2.0 * size**3 * 4
    samples = []
    with torch.inference_mode():
        torch.mm(a, b)
        for _ in range(repeats):
            started = time.perf_counter()
            for _ in range(4):
                torch.mm(a, b)
            samples.append(emulate_slowdown(slowdown, time.perf_counter() - started))
    return flops / statistics.median(samples) / 1e9
