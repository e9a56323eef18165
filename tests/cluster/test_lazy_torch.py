"""What torch imports lazily, and when the coordinator imports torch at all.

The first optimizer step or profiled forward makes torch import ``torch._dynamo``
(hundreds of modules, seconds of GIL-holding work that starved a loaded stage's
heartbeats). Each check runs in a fresh interpreter, the only place where what a
first step imports can be seen. The coordinator and the client never need it:
a training and an inference run leave it unimported there, so nothing stalls
their loops and nothing preloads it (a preload on a thread of the coordinator
stalled its loop for 5-20 s under load: every zmq send and receive gave the GIL
to the import, for a switch interval each).

The coordinator's contract (zpipe/coordinator/run_kinds.py): it listens, registers
stages and answers their heartbeats without torch; the first run request imports
torch and the run kinds, on its loop, at once; after that nothing more is imported
in a training or an inference run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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


# A training and an inference run from a fresh interpreter (the client) on a local
# cluster whose coordinator reports every import it makes (PYTHONPROFILEIMPORTTIME
# is inherited, and the coordinator's stderr goes to its log).
_CLIENT_AND_COORDINATOR = r"""
import json, sys
from pathlib import Path
import torch
from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.models import ModelSpec

spec = ModelSpec("mlp", {"dims": [12, 16, 4]}, seed=1)
generator = torch.Generator().manual_seed(0)
batches = [(torch.randn(6, 12, generator=generator), torch.randint(0, 4, (6,), generator=generator))
           for _ in range(2)]
# spawned, as a user's are: a coordinator forked from the test lane's zygote has torch
with LocalCluster([DeviceSpec("s0"), DeviceSpec("s1")], log_dir=Path(sys.argv[1]),
                  log_level="info", start_timeout_s=240.0, zygote=False) as cluster:
    report = cluster.fit(spec, batches, optimizer={"name": "adam", "lr": 0.01},
                         num_microbatches=2, progress=False)
    outputs, _ = cluster.infer(spec, [x for x, _ in batches])
print(json.dumps({"steps": report.steps, "outputs": len(outputs),
                  "client_imported": "torch._dynamo" in sys.modules}))
"""


def test_a_training_and_an_inference_run_never_import_it_in_the_client_or_coordinator(
    tmp_path: Path,
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _CLIENT_AND_COORDINATOR, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
        env={**os.environ, "PYTHONPROFILEIMPORTTIME": "1"},
    )
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {"steps": 2, "outputs": 2, "client_imported": False}
    log = (tmp_path / "coordinator.log").read_text().splitlines()
    imported = {line.rsplit("|", 1)[1].strip() for line in log if line.startswith("import time:")}
    assert "torch" in imported  # the report is there: torch's own import is listed
    assert "torch._dynamo" not in imported
    # Once it listens, the coordinator imports only at the first run request, between
    # the two events that frame it (torch among them), and nothing after: no lazy
    # import on its planning thread (numpy.ma, at the first PipeEdge plan, until it
    # was preloaded)
    listening = next(i for i, line in enumerate(log) if "coordinator_listening" in line)
    importing = next(i for i, line in enumerate(log) if "run_kinds_importing" in line)
    imported_at = next(i for i, line in enumerate(log) if "run_kinds_imported" in line)
    assert listening < importing < imported_at
    torch_line = next(i for i, line in enumerate(log) if line.rstrip().endswith("| torch"))
    assert importing < torch_line < imported_at
    late = [
        line
        for i, line in enumerate(log)
        if line.startswith("import time:") and i > listening and not importing < i < imported_at
    ]
    assert late == []


# A coordinator serving membership alone: 20 heartbeat-only peers register and have
# heartbeats acknowledged, in a fresh interpreter that runs the coordinator itself.
_MEMBERSHIP_ONLY = r"""
import asyncio, json, sys
from zpipe.config import Timeouts
from zpipe.coordinator.server import Coordinator, CoordinatorConfig
from zpipe.testing.fake_peers import FakePeers

async def main():
    timeouts = Timeouts(heartbeat_interval_s=0.2)
    coordinator = Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0", timeouts=timeouts))
    ready = asyncio.Event()
    serving = asyncio.create_task(coordinator.serve(ready=ready))
    await asyncio.wait_for(ready.wait(), 120)
    async with FakePeers(coordinator.endpoint, 20, register_timeout_s=120.0) as peers:
        deadline = asyncio.get_running_loop().time() + 120
        while peers.summary().acks < 60 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        summary = peers.summary()
    coordinator.stop()
    await asyncio.wait_for(serving, 60)
    return {"members": len(coordinator.membership.all()), "acks": summary.acks,
            "torch": "torch" in sys.modules, "models": "zpipe.models.registry" in sys.modules}

print(json.dumps(asyncio.run(main())))
"""


def test_the_coordinator_registers_and_answers_heartbeats_without_importing_torch() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _MEMBERSHIP_ONLY],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["members"] == 20
    assert seen["acks"] >= 60
    assert seen["torch"] is False
    assert seen["models"] is False


# The codec binds torch at the first tensor: a process that decodes one without having
# imported torch gets it whole, and one that never sees a tensor never imports it.
_DECODE_FIRST_TENSOR = r"""
import json, sys
from zpipe.transport.codec import decode, encode
before = "torch" in sys.modules
frames = [bytes.fromhex(h) for h in json.loads(sys.stdin.read())]
message = decode(frames)
again = decode(encode(message))  # and the encode side binds nothing twice
print(json.dumps({"torch_before": before, "dtype": str(message.tensors[0].dtype),
                  "values": message.tensors[0].tolist(), "again": again.tensors[0].tolist()}))
"""


def test_the_codec_imports_torch_at_the_first_tensor_it_decodes() -> None:
    import torch

    from zpipe.protocol.bulk import BulkChunk
    from zpipe.transport.codec import encode

    chunk = BulkChunk(name="s0", token="t", transfer=1, seq=0, chunks=1, nbytes=3,
                      tensors=(torch.tensor([7, 8, 9], dtype=torch.uint8),))  # fmt: skip
    frames = [bytes(memoryview(f)) for f in encode(chunk.to_message())]
    done = subprocess.run(
        [sys.executable, "-c", _DECODE_FIRST_TENSOR],
        input=json.dumps([f.hex() for f in frames]),
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {"torch_before": False, "dtype": "torch.uint8", "values": [7, 8, 9],
                    "again": [7, 8, 9]}  # fmt: skip
