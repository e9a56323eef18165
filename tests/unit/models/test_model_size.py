"""A peer's built-in model is sized from its config before anything is built."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from zpipe._errors import ModelSpecError
from zpipe.models import ModelSpec, count_units, load_layer_sequence
from zpipe.models.presets import PRESETS
from zpipe.models.size import (
    DEFAULT_PEER_MODEL_BYTES,
    MIB,
    count_in_phase,
    default_build_limit,
    parameter_bytes,
    peer_build_limit,
    set_peer_build_limit,
)
from zpipe.stage.shard import Shard


@pytest.fixture
def build_limit() -> Iterator[None]:
    previous = peer_build_limit()
    yield
    set_peer_build_limit(previous)


def _built_elements(spec: ModelSpec, index: int) -> int:
    sequence = load_layer_sequence(spec)
    with torch.device("meta"):  # allocates nothing, counts the real modules
        unit = sequence.make_unit(index)  # type: ignore[attr-defined]
    return sum(t.numel() for t in [*unit.parameters(), *unit.buffers()])


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_the_count_from_the_config_is_what_building_makes(name: str) -> None:
    family, config = PRESETS[name]
    spec = ModelSpec(family, config)
    sequence = load_layer_sequence(spec)
    per_unit = [_built_elements(spec, i) for i in range(sequence.num_units)]
    for start in range(sequence.num_units):
        for end in (start + 1, start + 5, sequence.num_units):
            end = min(end, sequence.num_units)
            assert sequence.parameter_elements(start, end) == sum(per_unit[start:end])  # type: ignore[attr-defined]


def test_units_of_one_phase_are_counted_without_a_loop() -> None:
    for start in range(0, 12):
        for end in range(start, 14):
            expected = sum(1 for i in range(start, end) if i >= 1 and (i - 1) % 4 == 2)
            assert count_in_phase(start, end, offset=1, period=4, phase=2) == expected


def test_a_peers_huge_mlp_is_refused_before_anything_is_allocated(build_limit: None) -> None:
    set_peer_build_limit(64 * MIB)
    bomb = ModelSpec.from_dict({"family": "mlp", "config": {"dims": [10**9, 10**9]}})
    with pytest.raises(ModelSpecError, match="more than this device builds"):
        Shard.build(bomb, 0, 1)
    with pytest.raises(ModelSpecError, match="more than any device"):
        count_units(bomb)


def test_a_peers_transformer_of_a_trillion_layers_is_refused_by_its_unit_count() -> None:
    config = {**PRESETS["vit-tiny"][1], "num_layers": 10**12}
    bomb = ModelSpec.from_dict({"family": "transformer", "config": config})
    # counted in constant time, though the model has 4e12 units
    assert parameter_bytes(load_layer_sequence(bomb)) > DEFAULT_PEER_MODEL_BYTES
    with pytest.raises(ModelSpecError, match="units, more than"):
        count_units(bomb)


def test_the_limit_is_the_devices_and_only_binds_peers_specs(build_limit: None) -> None:
    family, config = PRESETS["mlp-small"]
    set_peer_build_limit(1 << 20)  # mlp-small's first unit is 1.5 MiB
    peer = ModelSpec.from_dict({"family": family, "config": config})
    with pytest.raises(ModelSpecError, match="--max-model-mb"):
        Shard.build(peer, 0, 1)
    Shard.build(peer, 1, 4)  # the smaller units fit
    Shard.build(ModelSpec(family, config), 0, 1)  # this process's own spec: its choice
    assert count_units(peer) == 4  # counting builds nothing, under the whole-model bound


def test_a_devices_default_limit_is_its_declared_memory() -> None:
    assert default_build_limit(512.0) == 512 * MIB
    assert default_build_limit(None) > 0
    with pytest.raises(ModelSpecError):
        set_peer_build_limit(0)


def test_the_stage_takes_max_model_mb() -> None:
    from zpipe.cli.stage import build_parser

    args = build_parser().parse_args(
        ["--coordinator", "tcp://127.0.0.1:1", "--name", "s", "--max-model-mb", "256"]
    )
    assert args.max_model_mb == 256.0
    with pytest.raises(SystemExit):
        build_parser().parse_args(
            ["--coordinator", "tcp://127.0.0.1:1", "--name", "s", "--max-model-mb", "0"]
        )


@pytest.mark.parametrize("family", ["sequential", "traced"])
def test_a_peers_factory_kwargs_cannot_build_past_the_limit(
    family: str, build_limit: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 33 finding 2: the always-allowed example factory with a hidden width of
    16,384 (about 1 GiB in float32) reached run_ready and grew the stage by 2 GB."""
    from zpipe.models.adapters import FactoryConfig

    real_builds: list[dict[str, object]] = []
    build = FactoryConfig.build

    def recording_build(self: FactoryConfig, seed: int, *, meta: bool = False) -> torch.nn.Module:
        if not meta:
            real_builds.append(dict(self.kwargs))
        return build(self, seed, meta=meta)

    monkeypatch.setattr(FactoryConfig, "build", recording_build)
    set_peer_build_limit(64 * MIB)
    config = {
        "factory": "zpipe.models.examples:tiny_sequential",
        "kwargs": {"in_features": 8, "hidden": 16_384, "out_features": 4},
        "input_shape": [8],
        **({"microbatch_size": 2} if family == "traced" else {}),
    }
    bomb = ModelSpec.from_dict({"family": family, "config": config})
    with pytest.raises(ModelSpecError, match="more than this device builds for a peer"):
        Shard.build(bomb, 0, 1)
    assert real_builds == []  # refused from the meta twin: nothing was allocated
    small = ModelSpec.from_dict({"family": family, "config": {**config, "kwargs": {"hidden": 64}}})
    assert Shard.build(small, 0, 1) is not None and real_builds  # within the limit it builds
    set_peer_build_limit(1)  # the same small spec over a 1-byte limit: refused, unbuilt
    real_builds.clear()
    with pytest.raises(ModelSpecError):
        Shard.build(small, 0, 1)
    assert real_builds == []
