"""A data-parallel first stage: every device's share of a micro-batch is checked
against that device's own data-port limit, not the first device's."""

from __future__ import annotations

import pytest
import torch

from zpipe._errors import ConfigError
from zpipe.client.batches import check_fits_first_stage, first_stage_limits
from zpipe.training.routing import split_rows


def _check_shares(inputs: torch.Tensor, shares: list[int], limits: dict[str, int | None]) -> None:
    """What the training client does with each micro-batch's inputs."""
    for name, (lo, hi) in zip(limits, split_rows(int(inputs.shape[0]), shares), strict=True):
        check_fits_first_stage((inputs[lo:hi],), limits[name], name)


def test_each_devices_share_is_checked_against_its_own_limit() -> None:
    inputs = torch.zeros(300, 256)  # 1 KiB a row: a's share 200 KiB, b's 100 KiB
    described = {"first_limits": {"a": 1 << 20, "b": 50 << 10}}
    limits = first_stage_limits(("a", "b"), described, fallback=50 << 10)
    assert limits == {"a": 1 << 20, "b": 50 << 10}
    # a's share fits a's port; b's smaller share does not fit b's smaller one
    with pytest.raises(ConfigError) as refused:
        _check_shares(inputs, [2, 1], limits)
    message = str(refused.value)
    assert "first stage 'b' accepts at most 51200 bytes" in message
    assert "a micro-batch of 100 rows" in message
    assert "--max-batch-rows" in message  # what to do
    _check_shares(inputs[:120], [2, 1], limits)  # b's 40 rows fit


def test_a_plan_without_per_device_limits_falls_back_to_the_one_limit() -> None:
    """An older coordinator sends one limit (first_max_message_bytes) and no map;
    a device the map leaves out (its stage said nothing) gets the one limit too."""
    assert first_stage_limits(("a", "b"), {}, fallback=1 << 20) == {"a": 1 << 20, "b": 1 << 20}
    assert first_stage_limits(("a", "b"), {"first_limits": {"a": 7}}, fallback=None) == {
        "a": 7,
        "b": None,
    }
