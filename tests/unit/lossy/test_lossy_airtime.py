"""The timeslot clock charges recovery airtime: r-TX copies and ACK rounds cost time."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from zpipe._errors import ConfigError
from zpipe.lossy.airtime import ACK_AIRTIME_MS, LinkCosts, data_within_budget, plan_clock
from zpipe.lossy.data import load_dataset
from zpipe.lossy.links import Recovery
from zpipe.lossy.partition import partition
from zpipe.lossy.radio import uniform_topology
from zpipe.lossy.schedule import PI2_MS_PER_MAC, sequential_period, timeslot_ms
from zpipe.lossy.simulate import RunConfig, prepare_run, run_training

# Vertical over 3 devices: layer 0 on device 0, layer 1 on 1, the output on 2.
# Mini-batch 1 runs F1 (0 -> 1), F2 (1 -> 2), F3 (shares with itself: no link),
# B3 (2 -> 1), B2 (sends nothing) in slots 0..4.
SIZES = [4, 4, 2]
COMPUTE_MS = 4 * 4 * PI2_MS_PER_MAC  # the worst forward pass: 4 inputs x 4 neurons
MARGIN_MS = 100.0
MESSAGE_MS = 4 * 32 / 250_000 * 1000  # 4 values of 32 bits at 250 kb/s (eq. 4)


def _links(prr: float, scheme: str = "none", devices: int = 3, **kw: int) -> LinkCosts:
    recovery = Recovery(scheme, **kw)  # type: ignore[arg-type]
    return LinkCosts(prr=uniform_topology(devices, prr), seed=7, recovery=recovery)


def test_one_transmission_is_the_papers_fixed_timeslot() -> None:
    alloc = partition("vertical", SIZES, 3)
    clock = plan_clock(alloc, _links(0.5), 1)
    assert clock.n_slots == 5
    slot_ms = COMPUTE_MS + MESSAGE_MS + MARGIN_MS
    assert slot_ms == pytest.approx(timeslot_ms(alloc))
    np.testing.assert_allclose(clock.durations_s, slot_ms / 1000.0)


def test_rtx_charges_every_copy_in_the_slots_that_cross_a_link() -> None:
    alloc = partition("vertical", SIZES, 3)
    clock = plan_clock(alloc, _links(0.5, "rtx", copies=3), 1)
    # slots 0, 1 and 3 send (3 copies each); slots 2 and 4 keep one message's time
    expected_ms = 5 * (COMPUTE_MS + MARGIN_MS) + 3 * 3 * MESSAGE_MS + 2 * MESSAGE_MS
    assert clock.total_s * 1000.0 == pytest.approx(expected_ms)
    assert clock.airtime_s * 1000.0 == pytest.approx(11 * MESSAGE_MS)


def test_ack_charges_rounds_and_acknowledgements() -> None:
    alloc = partition("vertical", SIZES, 3)
    # perfect links: one round and one acknowledgement per message
    clock = plan_clock(alloc, _links(1.0, "ack", max_attempts=4), 1)
    expected_ms = 5 * (COMPUTE_MS + MARGIN_MS + MESSAGE_MS) + 3 * ACK_AIRTIME_MS
    assert clock.total_s * 1000.0 == pytest.approx(expected_ms)
    # dead links: every attempt spent, nothing acknowledged
    clock = plan_clock(alloc, _links(0.0, "ack", max_attempts=4), 1)
    expected_ms = 5 * (COMPUTE_MS + MARGIN_MS) + 3 * 4 * MESSAGE_MS + 2 * MESSAGE_MS
    assert clock.total_s * 1000.0 == pytest.approx(expected_ms)


def test_a_slot_lasts_until_its_busiest_sender_is_done() -> None:
    # horizontal over 3 devices: each sender broadcasts to 2 others, acknowledged one by one
    alloc = partition("horizontal", [6, 6, 3], 3)
    clock = plan_clock(alloc, _links(1.0, "ack"), 1)
    message_ms = 2 * 32 / 250_000 * 1000
    air_ms = (clock.durations_s - clock.base_s) * 1000.0
    # F1, F2, F3 (logits shared), B3: one round + 2 acks each; B2 sends nothing
    np.testing.assert_allclose(air_ms[:4], message_ms + 2 * ACK_AIRTIME_MS)
    assert air_ms[-1] == pytest.approx(message_ms)


@pytest.mark.parametrize("scheme", ["none", "rtx", "ack"])
@pytest.mark.parametrize("kind", ["vertical", "hybrid", "horizontal"])
def test_a_budget_of_exactly_n_mini_batches_gives_n(kind: str, scheme: str) -> None:
    alloc = partition(kind, [16, 12, 12, 12, 12, 10], 6)
    links = _links(0.7, scheme, devices=6)
    for n in (1, 2, 5, 17):
        budget = plan_clock(alloc, links, n).total_s
        assert data_within_budget(alloc, links, budget, max_data=1000) == n
        assert data_within_budget(alloc, links, budget * (1 - 1e-6), max_data=1000) == max(n - 1, 1)


def test_a_budget_beyond_the_cap_is_refused_not_allocated() -> None:
    alloc = partition("hybrid", [16, 12, 12, 10], 4)
    for scheme in ("none", "ack"):
        links = _links(0.7, scheme, devices=4)
        with pytest.raises(ConfigError, match="more than 50 mini-batches"):
            data_within_budget(alloc, links, 1e6, max_data=50)
    with pytest.raises(ConfigError, match="positive"):
        data_within_budget(alloc, links, float("inf"), max_data=50)


def test_without_pipelining_each_mini_batch_waits_for_the_last() -> None:
    alloc = partition("hybrid", [16, 12, 12, 12, 12, 10], 6)
    links = _links(1.0, devices=6)
    piped = plan_clock(alloc, links, 10)
    sequential = plan_clock(alloc, links, 10, period=sequential_period(alloc))
    assert sequential.n_slots == 10 * 11
    assert piped.n_slots == 9 * 4 + 11  # Theorem 1 with M = 2


def test_at_equal_budget_retransmitting_trains_on_fewer_mini_batches() -> None:
    data = load_dataset("digits")
    base = RunConfig(allocation="hybrid", budget_s=300.0, seed=2)
    steps = {
        scheme: prepare_run(replace(base, recovery=Recovery(scheme)), data).n_data
        for scheme in ("none", "rtx", "ack")
    }
    assert steps["rtx"] < steps["none"]
    assert steps["ack"] < steps["none"]
    # lossless runs send once, whatever the scheme
    lossless = replace(base, lossless=True)
    assert (
        prepare_run(replace(lossless, recovery=Recovery("rtx")), data).n_data
        == prepare_run(lossless, data).n_data
    )


def test_the_same_seed_charges_the_same_time_and_counts_the_transmissions() -> None:
    data = load_dataset("digits").limit(n_train=400, n_test=100)
    cfg = RunConfig(
        allocation="hybrid",
        n_data=12,
        seed=4,
        recovery=Recovery("ack"),
        eval_points=1,
        test_repeats=1,
    )
    a, b = run_training(cfg, data), run_training(cfg, data)
    assert a["train_time_s"] == b["train_time_s"] and a["traffic"] == b["traffic"]
    assert a["airtime_s"] > prepare_run(replace(cfg, recovery=Recovery()), data).clock.airtime_s  # type: ignore[union-attr]
    assert 1.0 < a["tx_factor"] <= 2 * 4
    rtx = run_training(replace(cfg, recovery=Recovery("rtx")), data)
    assert rtx["tx_factor"] == 2.0
