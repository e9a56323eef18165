"""A stage's data port limits from its plan's model: the largest frame it can carry."""

from __future__ import annotations

import pytest
import torch

from zpipe.models import ModelSpec, build_full_model, load_layer_sequence
from zpipe.models.presets import PRESETS
from zpipe.models.sequence import as_tuple
from zpipe.models.size import largest_tensor_bytes_per_sample
from zpipe.stage.ports import data_port_limits
from zpipe.transport.sockets import (
    CURVE_FRAME_OVERHEAD,
    DEFAULT_QUEUED_BYTES_PER_PEER,
    HEADER_FRAME_ALLOWANCE,
    ReceiveLimits,
)

FALLBACK = ReceiveLimits(1 << 31, 16)


def _largest_real(spec: ModelSpec) -> int:
    sequence = load_layer_sequence(spec)
    values = sequence.example_input(1)
    most = max(t.numel() * t.element_size() for t in values)
    with torch.no_grad():
        for unit in build_full_model(spec).units:
            values = as_tuple(unit(*values))
            most = max(most, *(t.numel() * t.element_size() for t in values))
    return most


@pytest.mark.parametrize("name", ["vit-tiny", "bert-tiny", "mlp-small", "cnn-small"])
def test_the_config_gives_the_largest_tensor_a_real_run_sends(name: str) -> None:
    spec = ModelSpec.preset(name)
    assert largest_tensor_bytes_per_sample(load_layer_sequence(spec)) == _largest_real(spec)


def test_limits_are_the_largest_tensor_times_the_rows_and_bound_the_queue() -> None:
    spec = ModelSpec.preset("vit-tiny")  # the input image is its largest tensor: 12 KiB
    limits, source = data_port_limits(spec, max_rows=4096, fallback=FALLBACK)
    assert source == "model"
    assert limits.max_message_bytes == 3 * 32 * 32 * 4 * 4096 + CURVE_FRAME_OVERHEAD
    assert limits.queued_bytes_per_peer <= DEFAULT_QUEUED_BYTES_PER_PEER
    small, _ = data_port_limits(spec, max_rows=2, fallback=FALLBACK)
    assert small.max_message_bytes == HEADER_FRAME_ALLOWANCE  # the floor: room for a header
    huge, _ = data_port_limits(ModelSpec.preset("vit-base"), max_rows=10**6, fallback=FALLBACK)
    assert huge.max_message_bytes == FALLBACK.max_message_bytes  # never above the socket's


def test_a_user_code_model_keeps_the_sockets_limits() -> None:
    spec = ModelSpec("sequential", {"factory": "zpipe.models.examples:tiny_sequential"})
    assert data_port_limits(spec, max_rows=8, fallback=FALLBACK) == (FALLBACK, "fallback")


def test_big_presets_are_sized_without_building_weights() -> None:
    family, config = PRESETS["vit-huge"]  # 2.5 GB of weights were it built for real
    found = largest_tensor_bytes_per_sample(load_layer_sequence(ModelSpec(family, config)))
    assert found == 257 * 5120 * 4  # fc1's output, per sample
    family, config = PRESETS["bert-base"]  # a sequence of up to max_positions tokens
    found = largest_tensor_bytes_per_sample(load_layer_sequence(ModelSpec(family, config)))
    assert found == 512 * 3072 * 4


@pytest.mark.parametrize(
    ("family", "config"),
    [
        ("mlp", {"dims": [3, 50, 7]}),
        ("cnn", {"channels": [4, 9], "image_size": 12, "pool": [False, True], "num_classes": 3}),
        ("cnn", {"channels": [2], "image_size": 4, "in_channels": 1, "num_classes": 40}),
        ("transformer", {"kind": "vit", "num_layers": 1, "hidden": 8, "heads": 2, "mlp": 4,
                         "image_size": 8, "patch": 4, "num_classes": 3}),
    ],
)  # fmt: skip
def test_other_configs_match_a_real_run_too(family: str, config: dict[str, object]) -> None:
    spec = ModelSpec(family, config)
    assert largest_tensor_bytes_per_sample(load_layer_sequence(spec)) == _largest_real(spec)


def test_the_probe_port_takes_no_frame_larger_than_the_device_builds() -> None:
    from zpipe.models.size import peer_build_limit, set_peer_build_limit
    from zpipe.stage.ports import PROBE_MIN_FRAME_BYTES, probe_port_limits
    from zpipe.transport.sockets import SocketOptions

    options = SocketOptions()
    previous = set_peer_build_limit(64 << 20)  # --max-model-mb 64
    try:
        assert probe_port_limits(options).max_message_bytes == 64 << 20
        set_peer_build_limit(1 << 10)  # link bursts still fit
        assert probe_port_limits(options).max_message_bytes == PROBE_MIN_FRAME_BYTES
        set_peer_build_limit(1 << 40)  # never above the socket's own limit
        assert probe_port_limits(options).max_message_bytes == options.max_message_bytes
    finally:
        set_peer_build_limit(previous)
    assert peer_build_limit() == previous
