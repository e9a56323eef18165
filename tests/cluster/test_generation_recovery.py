"""Pipelined generation on four real stage processes: greedy tokens equal
transformers' generate on four stages, and still do after a stage is SIGKILLed
mid-generation (a middle one, then the first one, which streams to the client):
the coordinator re-plans the run over the survivors, the client sends each
unfinished sequence again with the tokens it received, the new stages prefill
prompt + generated tokens, and each stream goes on with no token twice or missing.

One cluster of four stages serves the module (its tests run in file order: the
four-stage run before the kills; each later test names only stages still alive).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests._support.causal_lm import hf_greedy, hf_model, write_checkpoint
from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.generation.params import SamplingParams, TokenEvent
from zpipe.models.causal_lm import causal_lm_spec

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(600)

# different lengths: prefill in chunks of 4 while other sequences decode
PROMPTS = [[5, 17, 3], [9, 1, 44, 60, 2, 8, 30, 71, 11], [4] * 2 + list(range(20, 32))]
NEW_TOKENS = 20  # 14 + 20 tokens within the models' 64 positions
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, stop_at_eos=False)
KILL_AFTER = 2  # tokens of every sequence streamed before the kill: all mid-generation


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    """Four stages with quick failure detection (as tests/cluster/test_failures.py)."""
    with LocalCluster(
        [DeviceSpec(name) for name in ("a", "b", "c", "d")],
        heartbeat_interval_s=0.5,
        suspect_after=6,
        probe_intervals=4,
    ) as running:
        yield running


@pytest.fixture(scope="module")
def checkpoints(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, tuple[Path, list[list[int]]]]:
    """Each kind's checkpoint directory and transformers' greedy tokens of every prompt."""
    out = {}
    for kind in ("gpt2", "llama"):  # llama: grouped-query attention (6 heads, 2 kv heads)
        model = hf_model(kind)
        directory = write_checkpoint(model, tmp_path_factory.mktemp(f"genrec-{kind}"))
        out[kind] = (directory, [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS])
    return out


def _stream(
    cluster: LocalCluster, directory: Path, names: list[str], kill: str | None
) -> list[TokenEvent]:
    """Every event of a greedy run over ``names``; ``kill`` is SIGKILLed once every
    sequence has streamed KILL_AFTER tokens."""

    async def run() -> list[TokenEvent]:
        events: list[TokenEvent] = []
        counts = [0] * len(PROMPTS)
        killed = False
        async with cluster.client() as client:
            stream = client.generate(
                causal_lm_spec(directory),
                PROMPTS,
                GREEDY,
                stage_names=names,
                chunk_tokens=4,
                token_timeout_s=120.0,
                wait_for_stages_s=120.0,
            )
            async for event in stream:
                events.append(event)
                counts[event.sequence] += 1
                if kill is not None and not killed and min(counts) >= KILL_AFTER:
                    cluster.kill(kill)
                    killed = True
        return events

    return asyncio.run(run())


def _check_streams(events: list[TokenEvent], expected: list[list[int]]) -> None:
    """Each sequence's events: every index once, in order, the tokens transformers'."""
    for sequence, tokens in enumerate(expected):
        mine = [e for e in events if e.sequence == sequence]
        assert [e.index for e in mine] == list(range(NEW_TOKENS)), sequence
        assert [e.token for e in mine] == tokens, sequence
        assert [e.finish_reason for e in mine] == [None] * (NEW_TOKENS - 1) + ["length"]


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_greedy_tokens_equal_transformers_generate_on_four_stages(
    cluster: LocalCluster, checkpoints: dict[str, tuple[Path, list[list[int]]]], kind: str
) -> None:
    directory, expected = checkpoints[kind]
    _check_streams(_stream(cluster, directory, ["a", "b", "c", "d"], kill=None), expected)


def test_a_middle_stage_killed_mid_generation_changes_no_token(
    cluster: LocalCluster, checkpoints: dict[str, tuple[Path, list[list[int]]]]
) -> None:
    directory, expected = checkpoints["llama"]
    events = _stream(cluster, directory, ["a", "b", "c", "d"], kill="b")
    _check_streams(events, expected)
    logs = cluster.logs("coordinator")
    assert '"run_recovered"' in logs and '"dead": "b"' in logs
    # the survivors a, c, d took the five units between them, a first, split by the
    # generation planner within their rooms (each reports its free memory: ample), as
    # a run started on them is; the even cut would be [[0, 2], [2, 4], [4, 5]]
    assert '"bounds": [[0, 2], [2, 3], [3, 5]]' in logs
    # a, still first, prefilled the tokens each sequence had streamed before the kill
    assert logs_of(cluster, "a").count('"generation_sequence_taken_over"') == len(PROMPTS)


def test_the_first_stage_killed_mid_generation_streams_on_from_the_next(
    cluster: LocalCluster, checkpoints: dict[str, tuple[Path, list[list[int]]]]
) -> None:
    directory, expected = checkpoints["gpt2"]
    # a takes the client's sequences and streams every token until it dies
    events = _stream(cluster, directory, ["a", "c", "d"], kill="a")
    _check_streams(events, expected)
    logs = cluster.logs("coordinator")
    assert '"dead": "a"' in logs
    # c first now, then d; planned as a run started on them (the even cut: [[0, 3], [3, 5]])
    assert '"bounds": [[0, 2], [2, 5]]' in logs
    assert logs_of(cluster, "c").count('"generation_sequence_taken_over"') == len(PROMPTS)


def logs_of(cluster: LocalCluster, name: str) -> str:
    return cluster.logs(name)
