"""A generation run on a cluster with --keys: every hop (the client's sequences to
the first stage, steps stage to stage, the ring's tokens back to the first stage,
the stream to the client's sink) is a CURVE connection between allowed keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._support.causal_lm import zpipe_greedy
from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.generation.params import SamplingParams
from zpipe.models import ModelSpec
from zpipe.models.causal_lm import CausalLmStage
from zpipe.transport.roles import generate_keys_with_roles

pytestmark = pytest.mark.timeout(600)

PROMPTS = [[5, 17, 3], [9, 1, 44, 60, 2, 8, 30, 71, 11]]


def test_generation_runs_over_curve_connections(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    generate_keys_with_roles(keys, ["coordinator", "client", "g0", "g1", "g2"])
    spec = ModelSpec.preset("gpt2-tiny")
    whole = [CausalLmStage.build(spec, 0, 4)]  # the preset's 4 units, in one process
    expected = zpipe_greedy(whole, PROMPTS, 5, prefill_chunk=64)
    devices = [DeviceSpec("g0"), DeviceSpec("g1"), DeviceSpec("g2")]
    with LocalCluster(devices, keys_dir=keys, heartbeat_interval_s=0.5) as cluster:
        got = cluster.generate(
            spec, PROMPTS, SamplingParams(max_tokens=5, stop_at_eos=False),
            chunk_tokens=4, token_timeout_s=120.0,
        )  # fmt: skip
    assert got == expected
