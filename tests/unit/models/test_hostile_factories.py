"""A peer's model spec never selects code to import or run (issue 19, item 1)."""

from __future__ import annotations

import argparse
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from zpipe._errors import ConfigError, ModelSpecError, UntrustedCodeError
from zpipe.models import (
    FactoryAllowList,
    ModelSpec,
    build_full_model,
    count_units,
    load_layer_sequence,
    peer_factories_allowed,
)
from zpipe.models.trust import add_allow_factory_arguments, allow_list_from_args

MODULE_SOURCE = """
from pathlib import Path
from os import system  # an imported name: a wildcard must not reach it
from torch import nn

Path({marker!r}).write_text("imported")


def make(*, width: int = 4) -> nn.Sequential:
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 2))
"""


@pytest.fixture
def user_module(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A module on sys.path whose import writes a marker file: (module name, marker)."""
    name = f"zpipe_user_factory_{uuid.uuid4().hex[:8]}"
    marker = tmp_path / "imported.txt"
    (tmp_path / f"{name}.py").write_text(MODULE_SOURCE.format(marker=str(marker)))
    sys.path.insert(0, str(tmp_path))
    try:
        yield name, marker
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(name, None)


def peer_spec(factory: str, family: str = "sequential", **extra: Any) -> ModelSpec:
    """A spec as a coordinator or stage reads it off the wire."""
    config = {"factory": factory, "input_shape": [4], **extra}
    return ModelSpec.from_dict({"family": family, "config": config})


def test_os_system_from_a_peer_is_refused_and_nothing_runs(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    spec = peer_spec("os:system", kwargs={"command": f"touch {marker}"})
    with pytest.raises(UntrustedCodeError, match="--allow-factory os:system"):
        build_full_model(spec)
    with pytest.raises(UntrustedCodeError, match="nothing was imported"):
        load_layer_sequence(spec)
    assert not marker.exists()


@pytest.mark.parametrize("family", ["sequential", "traced"])
def test_a_refused_factory_module_is_never_imported(
    user_module: tuple[str, Path], family: str
) -> None:
    name, marker = user_module
    extra = {"microbatch_size": 2} if family == "traced" else {}
    spec = peer_spec(f"{name}:make", family, **extra)
    with pytest.raises(UntrustedCodeError, match=f"{name}:make"):
        load_layer_sequence(spec)
    # An allow-list that names something else does not allow it either.
    with pytest.raises(UntrustedCodeError):
        load_layer_sequence(spec, factories=FactoryAllowList.of("other.module:*"))
    assert not marker.exists()
    assert name not in sys.modules


@pytest.mark.parametrize("entry", ["{name}:make", "{name}:*"])
def test_an_allowed_factory_builds(user_module: tuple[str, Path], entry: str) -> None:
    name, marker = user_module
    allow = FactoryAllowList.of(entry.format(name=name))
    spec = peer_spec(f"{name}:make", kwargs={"width": 3}, input_shape=[3])
    model = build_full_model(spec, factories=allow)
    assert model(torch.ones(1, 3))[0].shape == (1, 2)
    assert marker.exists()


def test_the_process_allow_list_applies_to_peer_specs(user_module: tuple[str, Path]) -> None:
    name, _ = user_module
    spec = peer_spec(f"{name}:make")
    with peer_factories_allowed(FactoryAllowList.of(f"{name}:make")):
        assert load_layer_sequence(spec).num_units == 3
    with pytest.raises(UntrustedCodeError):  # the previous allow-list is back
        load_layer_sequence(spec)


def test_a_wildcard_reaches_only_the_modules_own_callables(
    user_module: tuple[str, Path], tmp_path: Path
) -> None:
    name, _ = user_module
    allow = FactoryAllowList.of(f"{name}:*")
    out = tmp_path / "system-ran"
    # A dotted path through the module is refused before any import ...
    assert not allow.allows(f"{name}:Path.write_text")
    assert not allow.allows(f"{name}:_private")
    # ... and a name the module imported is not the module's own.
    spec = peer_spec(f"{name}:system", kwargs={"command": f"touch {out}"})
    with pytest.raises(UntrustedCodeError, match="not defined in"):
        load_layer_sequence(spec, factories=allow)
    assert not out.exists()
    # The operator may still name it exactly.
    assert FactoryAllowList.of(f"{name}:system").allows(f"{name}:system")


def test_the_callers_own_spec_is_trusted(user_module: tuple[str, Path]) -> None:
    name, marker = user_module
    spec = ModelSpec("sequential", {"factory": f"{name}:make", "input_shape": [4]})
    assert load_layer_sequence(spec).num_units == 3
    assert marker.exists()
    # The same spec after a trip over the wire is a peer's.
    with pytest.raises(UntrustedCodeError):
        load_layer_sequence(ModelSpec.from_dict(spec.to_dict()))
    assert ModelSpec.from_dict(spec.to_dict()) == spec


def test_zpipes_own_examples_need_no_allow_list() -> None:
    spec = peer_spec("zpipe.models.examples:tiny_sequential", input_shape=[8])
    assert load_layer_sequence(spec).num_units == 5


def test_built_in_families_need_no_allow_list() -> None:
    spec = ModelSpec.from_dict(ModelSpec.preset("vit-tiny").to_dict())
    assert load_layer_sequence(spec).num_units == 10


def test_count_units_never_runs_user_code(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    spec = peer_spec("os:system", kwargs={"command": f"touch {marker}"})
    with pytest.raises(ModelSpecError, match="num_units"):
        count_units(spec)
    assert count_units(spec, declared=7) == 7
    assert not marker.exists()
    vit = ModelSpec.preset("vit-tiny")
    assert count_units(vit) == 10
    assert count_units(vit, declared=10) == 10
    with pytest.raises(ModelSpecError, match="declares 9 units"):
        count_units(vit, declared=9)
    for bad in (0, -1, True, "5", 10**9):
        with pytest.raises(ModelSpecError, match="declared unit count"):
            count_units(spec, declared=bad)


def test_allow_list_files_and_flags(tmp_path: Path) -> None:
    good = tmp_path / "factories.txt"
    good.write_text("# operator's list\nmypkg.models:make  # exact\n\nother.mod:*\n")
    allow = FactoryAllowList.from_cli(["third.mod:build"], [good])
    assert allow.allows("mypkg.models:make")
    assert not allow.allows("mypkg.models:other")
    assert allow.allows("other.mod:anything")
    assert allow.allows("third.mod:build")
    assert not allow.allows("os:system")
    assert not allow.allows("not a path")
    bad = tmp_path / "bad.txt"
    bad.write_text("mypkg.models:make\nos system\n")
    with pytest.raises(ConfigError, match=r"bad.txt:2"):
        FactoryAllowList.from_file(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        FactoryAllowList.from_file(tmp_path / "missing.txt")
    for entry in ("os", "os:", ":system", "os:sys tem", "a..b:c"):
        with pytest.raises(ConfigError, match=r"package\.module"):
            FactoryAllowList.of(entry)
    # The refusal names the file that would allow it.
    with pytest.raises(UntrustedCodeError, match="--allow-factories"):
        allow.check("os:system", family="sequential")


def test_command_line_flags_build_the_allow_list(tmp_path: Path) -> None:
    listed = tmp_path / "allowed.txt"
    listed.write_text("filed.module:make\n")
    parser = argparse.ArgumentParser()
    add_allow_factory_arguments(parser)
    args = parser.parse_args(
        [
            "--allow-factory",
            "a.b:make",
            "--allow-factory",
            "c.d:*",
            "--allow-factories",
            str(listed),
        ]
    )
    allow = allow_list_from_args(args)
    assert (
        allow.allows("a.b:make") and allow.allows("c.d:other") and allow.allows("filed.module:make")
    )
    assert not allow.allows("a.b:other")
    assert allow_list_from_args(parser.parse_args([])) == FactoryAllowList()
