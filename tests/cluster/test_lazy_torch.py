"""A stage imports what torch would otherwise import lazily on its compute thread.

The first optimizer step or profiled forward makes torch import ``torch._dynamo``
(hundreds of modules, seconds of GIL-holding work that starved a loaded stage's
heartbeats). Each check runs in a fresh interpreter, the only place where what a
first step imports can be seen.
"""

from __future__ import annotations

import json
import subprocess
import sys

_FIRST_STEP = r"""
import json, sys
import torch
import zpipe.cli.stage  # what a stage process has imported when it starts
from zpipe.lazy_torch import import_lazy_torch_modules
from zpipe.models import ModelSpec
from zpipe.stage.profiling import profile_model
if sys.argv[1] == "preload":
    import_lazy_torch_modules()
before = set(sys.modules)
spec = ModelSpec("mlp", {"dims": [6, 8, 3]}, seed=0)
profile_model(spec, batch_sizes=(1, 2), warmup=1, repeats=1, train=True)
model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
params = list(model.parameters())
for optimizer in (torch.optim.SGD(params, lr=0.1), torch.optim.Adam(params)):
    model(torch.randn(4, 6)).sum().backward()
    optimizer.step()
print(json.dumps(sorted(set(sys.modules) - before)))
"""


def _imported_by_first_steps(mode: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", _FIRST_STEP, mode],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return list(json.loads(done.stdout.strip().splitlines()[-1]))


def test_after_the_preload_a_first_profile_and_optimizer_step_import_almost_nothing() -> None:
    imported = _imported_by_first_steps("preload")
    assert len(imported) < 10, imported
    assert not [m for m in imported if m.startswith(("torch._dynamo", "sympy"))]


def test_without_the_preload_the_first_steps_import_torch_dynamo_on_the_spot() -> None:
    # what the preload is for: if torch stops importing this lazily, the list can shrink
    imported = _imported_by_first_steps("none")
    assert "torch._dynamo" in imported
    assert len(imported) > 100
