"""What a generation stage sends and allows, built from its set-up (pure)."""

from __future__ import annotations

import pytest
import torch

from zpipe._errors import ProtocolError
from zpipe.protocol.generation import GenSetup, GenStep, GenStepFailed, GenTokens
from zpipe.stage.executors.generation_messages import (
    CLIENT,
    after_step,
    failed_step,
    first_stage_scheduler,
    refusals_for,
    sender_keys,
)
from zpipe.stage.executors.generation_steps import StepOut


def _setup(index: int, n: int = 3, **keys: str) -> GenSetup:
    return GenSetup(
        run=4,
        model={"family": "x", "config": {"eos_token_id": [7, 9]}},
        start=index,
        end=index + 1,
        index=index,
        num_stages=n,
        upstream=f"s{(index - 1) % n}",
        downstream=f"s{(index + 1) % n}",
        max_context=32,
        max_sequences=4,
        steps_in_flight=n,
        chunk_tokens=8,
        epoch=2,
        **keys,
    )


def _step() -> GenStep:
    return GenStep(
        run=4, step=11, src="s0", rows=[[3, 0, 2, -1], [5, 4, 1, 0]], sampling=[], epoch=2
    )


def test_the_first_stage_allows_its_upstream_and_the_client_and_the_others_their_upstream() -> None:
    first = sender_keys(_setup(0, upstream_key="U" * 40, client_key="C" * 40))
    assert first == {"s2": b"U" * 40, CLIENT: b"C" * 40}
    assert sender_keys(_setup(1, upstream_key="V" * 40)) == {"s0": b"V" * 40}


@pytest.mark.parametrize(
    ("index", "keys", "missing"),
    [(1, {}, "upstream 's0'"), (0, {"upstream_key": "U" * 40}, "the client")],
)
def test_a_set_up_without_a_senders_key_is_refused(
    index: int, keys: dict[str, str], missing: str
) -> None:
    with pytest.raises(ProtocolError, match=f"no key for {missing}"):
        sender_keys(_setup(index, **keys))


def test_the_scheduler_takes_the_set_ups_limits_and_the_models_end_ids() -> None:
    scheduler = first_stage_scheduler(_setup(0))
    assert scheduler.limits.max_sequences == 4 and scheduler.limits.chunk_tokens == 8
    assert scheduler._eos == frozenset({7, 9})


def test_a_middle_stage_passes_its_values_on_and_the_last_its_tokens_round_the_ring() -> None:
    values = torch.ones(2, 1, 3)
    middle = after_step(_setup(1), _step(), StepOut(values=values), "s1")
    assert isinstance(middle, GenStep) and middle.src == "s1" and middle.step == 11
    assert middle.tensors[0] is values and middle.rows == _step().rows and middle.epoch == 2
    last = after_step(_setup(2), _step(), StepOut(tokens=(42,)), "s2")
    assert isinstance(last, GenTokens) and last.tokens == [42] and last.src == "s2"


def test_a_failed_step_names_its_sequences_and_each_is_refused_to_the_client() -> None:
    failed = failed_step(_setup(1), _step(), "s1", "boom")
    assert isinstance(failed, GenStepFailed)
    assert failed.sequences == [3, 5] and failed.stage == "s1" and failed.error == "boom"
    refused = refusals_for(_setup(0), failed, [3, 5], "s0")
    assert [r.sequence for r in refused] == [3, 5]
    assert all("step 11 failed at stage s1: boom" in r.error for r in refused)
