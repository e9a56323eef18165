"""Weights files: write a full model's state dict, read back only one stage's units.

zpipe's own keys are "units.<index>.<name inside the unit>", as in
`build_full_model(spec).state_dict()`. A file without any such key is read in
the model's *plain* layout instead, which each family names (`PlainKey`): the
state dict of an `nn.Sequential` of the units ("<index>.<name>"), of the user's
own `nn.Sequential` ("<child name>.<name>") or of the module a traced model was
traced from (its own parameter names). A stage reads only its own units' keys:
safetensors lets us fetch single tensors, and .pt files are memory-mapped so
the other units' tensors are never read from disk.

A checkpoint may also hold optimizer state, "<unit key>#opt.<name>" (see
`zpipe.stage.executors.training_shard`), the mini-batches trained so far (`STEPS_KEY`)
and, from an asynchronous run, weight versions (`ASYNC_VERSION_MARKS`); loading weights
skips them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from zpipe._errors import ModelSpecError

UNITS_PREFIX = "units"
SAFETENSORS_SUFFIXES = (".safetensors",)
TORCH_SUFFIXES = (".pt", ".pth", ".bin")
# Separates a parameter's key from the name of one of its optimizer state tensors.
OPTIMIZER_KEY = "#opt."
# A checkpoint's count of mini-batches trained (an int64 scalar): where a resumed
# run's learning-rate schedule goes on from.
STEPS_KEY = "#steps"
# An asynchronous run's checkpoint also keeps each unit's weight versions, the ones
# the next forwards read ("<parameter key>#v<t>", "units.<i>.#live_versions": see
# zpipe.training.async_regroup, whose names these are); loading weights skips them.
ASYNC_VERSION_MARKS = ("#v", "#live_versions")

# (unit index, name inside the unit) -> the key in the model's plain layout
PlainKey = Callable[[int, str], str]


def sequential_of_units_key(index: int, name: str) -> str:
    """The plain layout of a built-in model: ``nn.Sequential(*units).state_dict()``."""
    return f"{index}.{name}"


def unit_key(index: int, name: str) -> str:
    return f"{UNITS_PREFIX}.{index}.{name}"


def split_unit_key(key: str) -> tuple[int, str] | None:
    """(index, name) of a "units.<index>.<name>" key, or None for any other key."""
    head, _, rest = key.partition(".")
    index, _, name = rest.partition(".")
    if head != UNITS_PREFIX or not index.isdigit() or not name:
        return None
    return int(index), name


def save_weights(
    model: nn.Module | Sequence[nn.Module] | Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    *,
    start: int = 0,
) -> None:
    """Write weights; .safetensors by suffix, else a torch state-dict file.

    `model` is a full model (e.g. `build_full_model(spec)`), whose state dict is
    written as is, a state dict itself, or a list of units whose first one is
    unit `start`.
    """
    if isinstance(model, Mapping):
        state = dict(model)
    elif isinstance(model, nn.Module) and not isinstance(model, nn.ModuleList):
        state = dict(model.state_dict())
    else:
        state = {
            unit_key(start + offset, name): tensor
            for offset, unit in enumerate(model)
            for name, tensor in unit.state_dict().items()
        }
    write_state(state, path)


def write_state(state: Mapping[str, torch.Tensor], path: str | os.PathLike[str]) -> None:
    """Write a flat name -> tensor dict; .safetensors by suffix, else torch.save."""
    target = Path(path)
    if target.suffix in SAFETENSORS_SUFFIXES:
        from safetensors.torch import save_file

        save_file(_unshared(state), str(target))
    elif target.suffix in TORCH_SUFFIXES:
        torch.save(state, target)
    else:
        raise ModelSpecError(_suffix_problem(target))


def _unshared(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous tensors, one storage each: safetensors refuses shared memory."""
    seen: set[tuple[int, int]] = set()
    out = {}
    for name, tensor in state.items():
        tensor = tensor.detach().contiguous()
        where = (tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
        if tensor.numel() and where in seen:
            tensor = tensor.clone()
        seen.add(where)
        out[name] = tensor
    return out


def _suffix_problem(path: Path) -> str:
    return (
        f"weights file {path} has an unknown suffix {path.suffix!r}; "
        f"use {SAFETENSORS_SUFFIXES[0]} or one of {TORCH_SUFFIXES}"
    )


class _WeightsReader(Protocol):
    def keys(self) -> list[str]: ...

    def get(self, key: str) -> torch.Tensor: ...


class _SafetensorsReader:
    def __init__(self, handle: object) -> None:
        self._handle = handle

    def keys(self) -> list[str]:
        return list(self._handle.keys())  # type: ignore[attr-defined]

    def get(self, key: str) -> torch.Tensor:
        tensor: torch.Tensor = self._handle.get_tensor(key)  # type: ignore[attr-defined]
        return tensor


class _StateDictReader:
    def __init__(self, state: Mapping[str, torch.Tensor]) -> None:
        self._state = state

    def keys(self) -> list[str]:
        return list(self._state)

    def get(self, key: str) -> torch.Tensor:
        return self._state[key]


@contextmanager
def _open_weights(path: Path) -> Iterator[_WeightsReader]:
    if not path.is_file():
        raise ModelSpecError(f"weights file {path} does not exist (or is not a file)")
    if path.suffix in SAFETENSORS_SUFFIXES:
        from safetensors import safe_open

        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
        except Exception as exc:  # safetensors raises its own error types
            raise ModelSpecError(f"cannot read safetensors file {path}: {exc}") from exc
        with handle:
            yield _SafetensorsReader(handle)
    elif path.suffix in TORCH_SUFFIXES:
        try:
            # weights_only: never unpickle arbitrary objects; mmap: read lazily.
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:
            raise ModelSpecError(
                f"cannot read weights file {path} as a state dict of tensors: {exc}"
            ) from exc
        if not isinstance(state, Mapping) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
        ):
            raise ModelSpecError(
                f"weights file {path} must hold a flat dict of name -> Tensor; "
                "write it with zpipe.models.save_weights"
            )
        yield _StateDictReader(state)
    else:
        raise ModelSpecError(_suffix_problem(path))


def is_weight_key(key: str) -> bool:
    """A model weight's key, not optimizer state, the step count of a checkpoint nor an
    asynchronous run's weight versions."""
    return (
        OPTIMIZER_KEY not in key
        and key != STEPS_KEY
        and not any(mark in key for mark in ASYNC_VERSION_MARKS)
    )


def load_unit_weights(
    units: Sequence[nn.Module],
    *,
    start: int,
    path: str | os.PathLike[str],
    plain_key: PlainKey = sequential_of_units_key,
) -> None:
    """Fill units start.. from `path`, reading only their keys; strict about names/shapes.

    A file with "units.<i>." keys is zpipe's own layout; a file without any is read
    in the model's plain layout, `plain_key`.
    """
    file = Path(path)
    with _open_weights(file) as reader:
        keys = [key for key in reader.keys() if is_weight_key(key)]
        by_unit: dict[int, set[str]] = {}
        for key in keys:
            parsed = split_unit_key(key)
            if parsed is not None:
                by_unit.setdefault(parsed[0], set()).add(parsed[1])
        if not by_unit:
            _load_plain(units, start=start, file=file, reader=reader, plain_key=plain_key)
            return
        for offset, unit in enumerate(units):
            index = start + offset
            expected = unit.state_dict()
            present = by_unit.get(index, set())
            missing = [name for name in expected if name not in present]
            if missing:
                raise ModelSpecError(
                    f"weights file {file} has no key {unit_key(index, missing[0])!r}"
                    f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; "
                    "was it saved from a different model config? Write it with "
                    "save_weights(build_full_model(spec), path)"
                )
            unexpected = sorted(present - set(expected))
            if unexpected:
                raise ModelSpecError(
                    f"weights file {file} has key {unit_key(index, unexpected[0])!r} that "
                    f"unit {index} does not have; was it saved from a different model config?"
                )
            loaded = {
                name: _checked(reader, unit_key(index, name), reference, file)
                for name, reference in expected.items()
            }
            unit.load_state_dict(loaded, strict=True)


def _checked(reader: _WeightsReader, key: str, reference: torch.Tensor, file: Path) -> torch.Tensor:
    tensor = reader.get(key)
    if tensor.shape != reference.shape:
        raise ModelSpecError(
            f"weights file {file}: {key!r} has shape {tuple(tensor.shape)} but the model "
            f"expects {tuple(reference.shape)}; check the spec's config against the one the "
            "file was saved from"
        )
    return tensor


def _load_plain(
    units: Sequence[nn.Module],
    *,
    start: int,
    file: Path,
    reader: _WeightsReader,
    plain_key: PlainKey,
) -> None:
    """Units from a file in the model's plain layout: every key a unit needs must be
    there; keys of other units are left unread."""
    present = set(reader.keys())
    for offset, unit in enumerate(units):
        index = start + offset
        expected = unit.state_dict()
        wanted = {name: plain_key(index, name) for name in expected}
        missing = [key for key in wanted.values() if key not in present]
        if missing:
            example = next(iter(sorted(present)), "(none)")
            raise ModelSpecError(
                f"weights file {file} has no 'units.<i>.' keys (zpipe's layout) and lacks "
                f"{missing[0]!r} of unit {index} in the model's plain layout"
                f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; its keys "
                f"look like {example!r}. Convert a foreign checkpoint with python -m zpipe "
                "import, or save the model's own state dict"
            )
        loaded = {name: _checked(reader, key, expected[name], file) for name, key in wanted.items()}
        unit.load_state_dict(loaded, strict=True)


def read_matching(
    path: str | os.PathLike[str], wanted: Callable[[str], bool]
) -> dict[str, torch.Tensor]:
    """Only the tensors of `path` whose keys `wanted` accepts (e.g. one stage's
    optimizer state), each read alone."""
    with _open_weights(Path(path)) as reader:
        return {key: reader.get(key) for key in reader.keys() if wanted(key)}
