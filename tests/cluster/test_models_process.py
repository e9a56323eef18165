"""Model units built in another process equal this process's: seeding depends on nothing
process-local (split from tests/unit/models/test_models.py, which starts no process)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from zpipe.models import (
    ModelSpec,
    load_layer_sequence,
)

TRACED_CONFIG: dict[str, Any] = {
    "factory": "zpipe.models.examples:tiny_residual",
    "input_shape": [8],
    "microbatch_size": 4,
}


def test_separate_process_builds_identical_units(tmp_path: Path) -> None:
    # Stages are separate processes: seeding must not depend on anything process-local.
    out = tmp_path / "units.safetensors"
    script = (
        "import sys\n"
        "from zpipe.models import ModelSpec, load_layer_sequence, save_weights\n"
        "spec = ModelSpec.from_dict({'family': 'traced', 'seed': 4, 'config': {"
        "'factory': 'zpipe.models.examples:tiny_residual', 'input_shape': [8],"
        " 'microbatch_size': 4}})\n"
        "units = load_layer_sequence(spec).build_units(1, 3)\n"
        "vit = load_layer_sequence(ModelSpec.preset('vit-tiny', seed=4)).build_units(2, 4)\n"
        "save_weights([*units, *vit], sys.argv[1])\n"
    )
    subprocess.run([sys.executable, "-c", script, str(out)], check=True, timeout=120)
    theirs = load_file(str(out))
    spec = ModelSpec("traced", TRACED_CONFIG, seed=4)
    ours = [
        *load_layer_sequence(spec).build_units(1, 3),
        *load_layer_sequence(ModelSpec.preset("vit-tiny", seed=4)).build_units(2, 4),
    ]
    expected = {
        f"units.{i}.{k}": v for i, unit in enumerate(ours) for k, v in unit.state_dict().items()
    }
    assert theirs.keys() == expected.keys()
    for key, tensor in expected.items():
        assert torch.equal(theirs[key], tensor), key
