"""Capacity on real processes: a causal LM whose weights exceed what each stage's
``--memory-mb`` leaves for a model runs split over two stages (tokens equal
transformers'), and the same request on one stage is refused by the coordinator
before that stage loads anything.

A budget is the whole stage process's, as for every run kind: the margin and the
process's base (about 310 MiB, measured by each stage as it registers) come off it
first, so the model is big enough (about 113 MB) that a few MiB of difference
between the stages' bases and the default this test assumes change nothing.
Two stages of their own (the shared cluster's have no memory limit); one cluster
start serves both checks.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests._support.causal_lm import hf_greedy, hf_model, write_checkpoint
from zpipe._errors import PipelineError
from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.coordinator.generation_plan import MIB, generation_units, generation_workload
from zpipe.generation.params import SamplingParams
from zpipe.models.causal_lm import causal_lm_spec, read_causal_lm_config
from zpipe.planner.generation_cost import stage_memory
from zpipe.planner.memory import DEFAULT_MEMORY_MARGIN, DEFAULT_STAGE_BASE_BYTES, runtime_bytes

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(600)

PROMPTS = [[5, 17, 3], [9, 1, 44, 60, 2, 8, 30]]
NEW_TOKENS = 5
LIMITS = {"max_context": 16, "max_sequences": 2, "steps_in_flight": 2, "chunk_tokens": 4}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float, list[list[int]]]:
    """A checkpoint, the --memory-mb that leaves about three quarters of its weights
    for a model, and transformers' greedy tokens."""
    hf = hf_model("gpt2", n_embd=768, n_layer=4, n_head=8)
    directory = write_checkpoint(hf, tmp_path_factory.mktemp("gen-capacity"))
    config = read_causal_lm_config(causal_lm_spec(directory).config)
    units = generation_units(config, element_bytes=4, max_context=LIMITS["max_context"])
    weights = sum(u.weight_bytes for u in units)
    room = 0.75 * weights
    fixed = DEFAULT_STAGE_BASE_BYTES + runtime_bytes(False)
    memory_mb = round((room + fixed) * (1 + DEFAULT_MEMORY_MARGIN) / MIB, 2)
    workload = generation_workload(**LIMITS, kv_budget_bytes=None)
    # what the test stands on: the weights alone exceed a stage's room, and some split
    # into two fits both with 20 MiB to spare (a stage's base may differ a little)
    n = len(units)
    assert weights > room + 20 * MIB
    assert any(
        max(stage_memory(units, 0, k, workload).total, stage_memory(units, k, n, workload).total)
        <= room - 20 * MIB
        for k in range(1, n)
    )
    return directory, memory_mb, [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]


@pytest.fixture(scope="module")
def small_stages(model: tuple[Path, float, list[list[int]]]) -> Iterator[LocalCluster]:
    memory_mb = model[1]
    devices = [DeviceSpec("m0", memory_mb=memory_mb), DeviceSpec("m1", memory_mb=memory_mb)]
    # spawned: a process forked from the zygote starts with its libraries' pages not yet
    # resident, so the base it reports is lower than a device's would be
    with LocalCluster(devices, heartbeat_interval_s=0.5, log_level="info", zygote=False) as running:
        yield running


def test_refused_on_one_stage_before_loading_and_run_split_over_two(
    small_stages: LocalCluster, model: tuple[Path, float, list[list[int]]]
) -> None:
    directory, memory_mb, expected = model
    spec = causal_lm_spec(directory)
    greedy = SamplingParams(max_tokens=NEW_TOKENS, stop_at_eos=False)
    with pytest.raises(
        PipelineError, match=r"stage 'm0' needs [0-9.]+ MiB .* for its model"
    ) as info:
        small_stages.generate(spec, PROMPTS, greedy, stage_names=["m0"], **LIMITS)
    assert f"{memory_mb:.2f} MiB, less the 10% margin" in str(info.value)
    # the coordinator never sent m0 a set-up: m0 built nothing and refused nothing
    assert "generation_setup" not in small_stages.logs("m0")
    assert "generation_setup" not in small_stages.logs("coordinator")

    got = small_stages.generate(
        spec, PROMPTS, greedy, stage_names=["m0", "m1"], token_timeout_s=120.0, **LIMITS
    )
    assert got == expected
    # the same logs show a set-up when there is one: their silence above meant something
    for name in ("m0", "m1", "coordinator"):
        assert "generation_setup" in small_stages.logs(name)
