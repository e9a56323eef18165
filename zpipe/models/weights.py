"""Weights files: write a full model's state dict, read back only one stage's units.

Keys are "units.<index>.<name inside the unit>", as in
`build_full_model(spec).state_dict()`. A stage reads only its own units' keys:
safetensors lets us fetch single tensors, and .pt files are memory-mapped so
the other units' tensors are never read from disk.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from zpipe._errors import ModelSpecError

UNITS_PREFIX = "units"
SAFETENSORS_SUFFIXES = (".safetensors",)
TORCH_SUFFIXES = (".pt", ".pth", ".bin")


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
    model: nn.Module | Sequence[nn.Module], path: str | os.PathLike[str], *, start: int = 0
) -> None:
    """Write weights; .safetensors by suffix, else a torch state-dict file.

    `model` is a full model (e.g. `build_full_model(spec)`), whose state dict is
    written as is, or a list of units whose first one is unit `start`.
    """
    if isinstance(model, nn.Module) and not isinstance(model, nn.ModuleList):
        state = dict(model.state_dict())
    else:
        state = {
            unit_key(start + offset, name): tensor
            for offset, unit in enumerate(model)
            for name, tensor in unit.state_dict().items()
        }
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


def load_unit_weights(
    units: Sequence[nn.Module], *, start: int, path: str | os.PathLike[str]
) -> None:
    """Fill units start.. from `path`, reading only their keys; strict about names/shapes."""
    file = Path(path)
    with _open_weights(file) as reader:
        by_unit: dict[int, set[str]] = {}
        for key in reader.keys():
            parsed = split_unit_key(key)
            if parsed is not None:
                by_unit.setdefault(parsed[0], set()).add(parsed[1])
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
            loaded = {}
            for name, reference in expected.items():
                tensor = reader.get(unit_key(index, name))
                if tensor.shape != reference.shape:
                    raise ModelSpecError(
                        f"weights file {file}: {unit_key(index, name)!r} has shape "
                        f"{tuple(tensor.shape)} but the model expects {tuple(reference.shape)}; "
                        "check the spec's config against the one the file was saved from"
                    )
                loaded[name] = tensor
            unit.load_state_dict(loaded, strict=True)
