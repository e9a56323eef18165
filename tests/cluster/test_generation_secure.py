"""A generation run on a cluster with --keys: every hop (the client's sequences to
the first stage, steps stage to stage, the ring's tokens back to the first stage,
the stream to the client's sink) is a CURVE connection between allowed keys; after
the first stage is SIGKILLed the survivors' new hops are too."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from tests._support.causal_lm import zpipe_greedy
from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.generation.params import SamplingParams, TokenEvent
from zpipe.models import ModelSpec
from zpipe.models.causal_lm import CausalLmStage
from zpipe.transport.roles import generate_keys_with_roles

pytestmark = pytest.mark.timeout(600)

PROMPTS = [[5, 17, 3], [9, 1, 44, 60, 2, 8, 30, 71, 11]]
SPEC = ModelSpec.preset("gpt2-tiny")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    keys = tmp_path_factory.mktemp("gen-keys")
    generate_keys_with_roles(keys, ["coordinator", "client", "g0", "g1", "g2"])
    devices = [DeviceSpec("g0"), DeviceSpec("g1"), DeviceSpec("g2")]
    with LocalCluster(
        devices, keys_dir=keys, heartbeat_interval_s=0.5, suspect_after=6, probe_intervals=4
    ) as running:
        yield running


def _expected(new_tokens: int) -> list[list[int]]:
    whole = [CausalLmStage.build(SPEC, 0, 4)]  # the preset's 4 units, in one process
    return zpipe_greedy(whole, PROMPTS, new_tokens, prefill_chunk=64)


def test_generation_runs_over_curve_connections(cluster: LocalCluster) -> None:
    got = cluster.generate(
        SPEC, PROMPTS, SamplingParams(max_tokens=5, stop_at_eos=False),
        chunk_tokens=4, token_timeout_s=120.0,
    )  # fmt: skip
    assert got == _expected(5)


def test_the_survivors_stream_on_over_curve_after_the_first_stage_is_killed(
    cluster: LocalCluster,
) -> None:
    new_tokens = 12

    async def run() -> list[TokenEvent]:
        events: list[TokenEvent] = []
        async with cluster.client() as client:
            stream = client.generate(
                SPEC,
                PROMPTS,
                SamplingParams(max_tokens=new_tokens, stop_at_eos=False),
                stage_names=["g0", "g1", "g2"],
                chunk_tokens=4,
                token_timeout_s=120.0,
            )
            killed = False
            async for event in stream:
                events.append(event)
                streamed = [sum(e.sequence == i for e in events) for i in range(len(PROMPTS))]
                if not killed and min(streamed) >= 2:
                    cluster.kill("g0")  # the stage that streams to this client
                    killed = True
        return events

    events = asyncio.run(run())
    for sequence, tokens in enumerate(_expected(new_tokens)):
        mine = [e for e in events if e.sequence == sequence]
        assert [e.index for e in mine] == list(range(new_tokens))
        assert [e.token for e in mine] == tokens
    # g1 took the client's sequences, over a CURVE connection from the client
    assert cluster.logs("g1").count('"generation_sequence_taken_over"') == len(PROMPTS)
