"""``--memory-mb`` against the one memory model (zpipe.planner.memory), with real stages:
a model whose split fits the stages' budgets is planned and runs within them (their
peak resident memory, read from /proc), and one that fits no split is refused at
planning, before any stage loads a unit of it.

Two stages (three processes) of their own: the shared clusters have no memory limits.
The runs carry their profile, so that no stage builds the model to profile it."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from zpipe import ZpipeError
from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.models import ModelSpec, load_layer_sequence
from zpipe.planner.memory import DEFAULT_MEMORY_MARGIN, model_room_bytes
from zpipe.stage.profiling import profile_model

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads the stages' /proc/PID/status"
)

MIB = 2**20
BUDGET_MB = 500  # a stage process: ~310 MiB of its own (torch), the rest for its model
BATCH = 4


@pytest.fixture(scope="module")
def limited() -> Iterator[LocalCluster]:
    devices = [DeviceSpec("m0", memory_mb=BUDGET_MB), DeviceSpec("m1", memory_mb=BUDGET_MB)]
    # spawned: a process forked from the zygote starts with its libraries' pages not yet
    # resident, so the base it reports is lower than a device's would be
    with LocalCluster(
        devices, heartbeat_interval_s=0.5, measure_links=False, zygote=False
    ) as running:
        yield running


def _peak_mib(cluster: LocalCluster, name: str) -> float:
    status = Path(f"/proc/{cluster.processes[name].pid}/status").read_text()
    line = next(x for x in status.splitlines() if x.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def _mlp(hidden: int) -> ModelSpec:
    return ModelSpec.preset("mlp-small", dims=[1024, hidden, hidden, 1024, 10])


def test_a_split_that_fits_runs_within_the_budget_and_one_that_does_not_is_refused(
    limited: LocalCluster,
) -> None:
    members = limited.wait_for_stages(2, timeout_s=120.0)
    bases = [int(m["info"]["base_bytes"]) for m in members]
    # each stage measured its own base when it registered, and the planner's room is
    # what its budget leaves of that and the margin
    assert all(200 * MIB < b < BUDGET_MB * MIB for b in bases), bases
    room = min(
        model_room_bytes(BUDGET_MB * MIB, base_bytes=b, margin=DEFAULT_MEMORY_MARGIN) for b in bases
    )

    fits = _mlp(4096)  # 96 MiB of weights, 64 of them in one unit
    profile = profile_model(fits, batch_sizes=[BATCH], warmup=0, repeats=1)
    assert sum(profile.param_bytes()) < room
    sequence = load_layer_sequence(fits)
    batches = [sequence.example_input(BATCH, seed=k) for k in range(3)]
    outputs, report = limited.infer(
        fits, batches, planner="pipeedge", profile=profile, microbatch_size=BATCH
    )
    assert len(outputs) == 3 and report.samples == 3 * BATCH
    peaks = {name: _peak_mib(limited, name) for name in ("m0", "m1")}
    assert all(peak <= BUDGET_MB for peak in peaks.values()), peaks

    too_big = _mlp(8192)  # one unit alone is 256 MiB of weights: no split fits
    big_profile = profile_model(too_big, batch_sizes=[BATCH], warmup=0, repeats=1)
    assert max(big_profile.param_bytes()) > room
    big_batches = [load_layer_sequence(too_big).example_input(BATCH, seed=0)]
    with pytest.raises(ZpipeError, match=r"needs .* devices? .*holds?"):
        limited.infer(
            too_big, big_batches, planner="pipeedge", profile=big_profile, microbatch_size=BATCH
        )
    # refused at planning: no stage built any of it (a unit alone would be 256 MiB)
    after = {name: _peak_mib(limited, name) for name in ("m0", "m1")}
    assert all(after[n] < peaks[n] + 32 for n in after), (peaks, after)
    assert all(p.poll() is None for p in limited.processes.values())
