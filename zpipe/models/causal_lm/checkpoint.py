"""A Hugging Face checkpoint directory, read one stage's units at a time.

A directory as transformers writes it: ``config.json`` and either
``model.safetensors`` or shards listed in ``model.safetensors.index.json``.
A stage maps its units' parameter names onto the checkpoint's keys and reads
only those tensors (``safe_open(...).get_tensor(key)``), opening only the
shards that hold them; the index (or a file's header) says where each key is
without reading any tensor. A tied LM head reads the token embedding's tensor,
so a stage holding the head but not the embedding gets its own copy.
Nothing is ever downloaded.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import safetensors
import torch
from torch import nn

from zpipe._errors import ModelSpecError
from zpipe.models.causal_lm.config import GPT2, CausalLmConfig

CONFIG_NAME = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def read_config_json(directory: str | os.PathLike[str]) -> dict[str, Any]:
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise ModelSpecError(f"{directory} has no {CONFIG_NAME}: is it a Hugging Face checkpoint?")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelSpecError(f"cannot read {path} as JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ModelSpecError(f"{path} must hold a JSON object")
    return config


class HfCheckpoint:
    """Where each tensor of a checkpoint directory lives, and reads of single tensors."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        index, single = self.directory / INDEX_FILE, self.directory / SINGLE_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise ModelSpecError(f"cannot read the weight map of {index}: {exc}") from exc
            if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
            ):
                raise ModelSpecError(f"{index}: weight_map must map keys to file names")
            self.files: dict[str, str] = dict(weight_map)
        elif single.is_file():
            with self._open(SINGLE_FILE) as handle:
                self.files = dict.fromkeys(handle.keys(), SINGLE_FILE)
        else:
            raise ModelSpecError(
                f"{self.directory} has neither {SINGLE_FILE} nor {INDEX_FILE}; zpipe reads "
                "safetensors checkpoints (save_pretrained writes them)"
            )

    def _open(self, name: str) -> Any:
        path = self.directory / name
        if not path.is_file() or path.resolve().parent != self.directory.resolve():
            raise ModelSpecError(f"checkpoint file {path} is missing or outside {self.directory}")
        try:
            return safetensors.safe_open(str(path), framework="pt", device="cpu")
        except Exception as exc:  # safetensors raises its own error types
            raise ModelSpecError(f"cannot read safetensors file {path}: {exc}") from exc

    def keys(self) -> set[str]:
        return set(self.files)

    def read(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        """The tensors of `keys`, each shard opened once, no other tensor read."""
        by_file: dict[str, list[str]] = {}
        for key in keys:
            if key not in self.files:
                raise ModelSpecError(f"the checkpoint in {self.directory} has no tensor {key!r}")
            by_file.setdefault(self.files[key], []).append(key)
        out: dict[str, torch.Tensor] = {}
        for name, wanted in by_file.items():
            with self._open(name) as handle:
                for key in wanted:
                    out[key] = handle.get_tensor(key)
        return out


def _prefix(keys: set[str], config: CausalLmConfig) -> str:
    """``transformer.`` / ``model.`` for a ...ForCausalLM checkpoint, "" for a base model's."""
    wrapper, marker = (
        ("transformer.", "wte.weight")
        if config.arch == GPT2
        else (
            "model.",
            "embed_tokens.weight",
        )
    )
    if any(key.startswith(wrapper) for key in keys):
        return wrapper
    if marker in keys or any(key.startswith(("h.", "layers.")) for key in keys):
        return ""
    return wrapper


def checkpoint_keys(
    config: CausalLmConfig, index: int, names: Iterable[str], available: set[str]
) -> dict[str, str]:
    """For unit `index`: its parameter name -> the checkpoint key holding it."""
    prefix = _prefix(available, config)
    last = config.num_units - 1
    embedding = f"{prefix}{'wte' if config.arch == GPT2 else 'embed_tokens'}.weight"
    out = {}
    for name in names:
        if index == 0:
            key = f"{prefix}{name}"
        elif index == last and name == "lm_head.weight":
            # Tied: the head is the token embedding, whatever the file says of lm_head.
            key = embedding if config.tie_word_embeddings else "lm_head.weight"
        elif index == last:
            key = f"{prefix}{name}"
        else:
            layers = "h" if config.arch == GPT2 else "layers"
            key = f"{prefix}{layers}.{index - 1}.{name}"
        out[name] = key
    return out


def load_checkpoint_units(
    units: Sequence[nn.Module],
    *,
    start: int,
    config: CausalLmConfig,
    checkpoint: HfCheckpoint | str | os.PathLike[str],
) -> None:
    """Fill units ``start ..`` from a checkpoint directory, reading only their tensors."""
    source = checkpoint if isinstance(checkpoint, HfCheckpoint) else HfCheckpoint(checkpoint)
    available = source.keys()
    wanted: dict[int, dict[str, str]] = {}
    for offset, unit in enumerate(units):
        names = list(unit.state_dict())
        mapping = checkpoint_keys(config, start + offset, names, available)
        missing = [key for key in mapping.values() if key not in available]
        if missing:
            raise ModelSpecError(
                f"the checkpoint in {source.directory} has no {missing[0]!r} for unit "
                f"{start + offset}; does config.json describe these weights?"
            )
        wanted[offset] = mapping
    # One unit's tensors at a time: the units already hold their (random) weights, so
    # reading every unit's tensors first would double the stage's memory at load
    # (measured: a peak of +98.5 MiB for 45 MiB of weights), past what the capacity
    # check planned; this way the load costs one unit beyond the weights.
    for offset, unit in enumerate(units):
        tensors = source.read(sorted(set(wanted[offset].values())))
        state = {name: tensors[key] for name, key in wanted[offset].items()}
        _check_shapes(unit.state_dict(), state, source.directory)
        unit.load_state_dict(state, strict=True)
        del tensors, state


def _check_shapes(
    expected: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor], where: Path
) -> None:
    for name, reference in expected.items():
        if state[name].shape != reference.shape:
            raise ModelSpecError(
                f"checkpoint {where}: {name!r} has shape {tuple(state[name].shape)}, the "
                f"model expects {tuple(reference.shape)}; does config.json match the weights?"
            )
