"""A batch larger than the first stage's data port accepts is a clear error at the
client, before it is sent (libzmq would drop the connection without a word, and the
client would stall until its result deadline)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from zpipe._errors import ConfigError
from zpipe.client.batches import check_fits_first_stage
from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.models import ModelSpec, build_full_model, load_layer_sequence

# 1024 float32 inputs: 4 KiB a sample; --max-batch-rows 64 gives 256 KiB, under the
# port's floor of 1 MiB (the header allowance): 256 rows fit, 512 do not.
SPEC = ModelSpec("mlp", {"dims": [1024, 16, 4]}, seed=3)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    """One cluster for the module: each test's batch is refused before it is sent."""
    with LocalCluster([DeviceSpec("a", max_batch_rows=64), DeviceSpec("b")]) as running:
        yield running


def test_the_check_names_the_rows_the_limit_and_the_flag() -> None:
    check_fits_first_stage((torch.zeros(256, 1024),), 1 << 20, "a")
    check_fits_first_stage((torch.zeros(512, 1024),), None, "a")  # not known: not checked
    with pytest.raises(ConfigError) as info:
        check_fits_first_stage((torch.zeros(3), torch.zeros(512, 1024)), 1 << 20, "a")
    text = str(info.value)
    assert "512 rows" in text and str(1 << 20) in text and "--max-batch-rows" in text
    assert "'a'" in text


def test_a_batch_too_big_for_the_first_stage_fails_at_once_and_the_stage_serves_on(
    cluster: LocalCluster,
) -> None:
    sequence = load_layer_sequence(SPEC)
    big = sequence.example_input(512, seed=1)
    small = [sequence.example_input(8, seed=i) for i in range(2)]
    with pytest.raises(ConfigError, match="--max-batch-rows") as info:
        cluster.infer(SPEC, [big], partition=[[0, 1], [1, 2]], stage_names=["a", "b"])
    assert "512 rows" in str(info.value) and "'a'" in str(info.value)
    outputs, _ = cluster.infer(SPEC, small, partition=[[0, 1], [1, 2]], stage_names=["a", "b"])
    log = cluster.logs("a")
    assert '"max_message_bytes": 1048576' in log  # the stage's data_limits line
    with torch.inference_mode():
        model = build_full_model(SPEC)
        for got, inputs in zip(outputs, small, strict=True):
            torch.testing.assert_close(got[0], model(*inputs)[0])


def test_training_inputs_too_big_for_the_first_stage_fail_at_once(cluster: LocalCluster) -> None:
    inputs = load_layer_sequence(SPEC).example_input(1024, seed=2)[0]
    batch = (inputs, torch.randint(0, 4, (1024,)))
    with pytest.raises(ConfigError, match="--max-batch-rows") as info:
        cluster.fit(
            SPEC,
            [batch],
            optimizer={"name": "sgd", "lr": 0.1},
            num_microbatches=2,
            partition=[[0, 1], [1, 2]],
            stage_names=["a", "b"],
            progress=False,
        )
    assert "512 rows" in str(info.value) and "'a'" in str(info.value)
