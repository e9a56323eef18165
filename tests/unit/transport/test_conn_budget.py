"""The connection guard's pure decisions: wire sizes, what a connection holds, whom to cut."""

from __future__ import annotations

import pytest

from zpipe.transport.conn_budget import (
    CURVE_FRAME_WRAPPING,
    ConnectionHolding,
    GuardBudget,
    MemoryGrowth,
    connections_to_cut,
    control_port_budget,
    data_port_budget,
    discarded_wire_bytes,
    frame_wire_bytes,
    held_bytes,
    message_wire_bytes,
    probe_port_budget,
    quiet,
    sends_small_messages,
)

MIB = 1 << 20


def test_frame_wire_bytes_follow_zmtp_3_short_and_long_headers() -> None:
    assert frame_wire_bytes(1) == 3  # flags, size, the byte: a million of them are 3 MB
    assert frame_wire_bytes(255) == 257
    assert frame_wire_bytes(256) == 265
    # CURVE's MESSAGE command wraps the body before the frame header is chosen
    assert frame_wire_bytes(223, CURVE_FRAME_WRAPPING) == 265
    assert frame_wire_bytes(222, CURVE_FRAME_WRAPPING) == 257
    assert message_wire_bytes([1, 1000, 0]) == 3 + 1009 + 2


def test_a_discarded_message_s_wire_bytes_from_its_counts_are_exact_for_uniform_frames() -> None:
    assert discarded_wire_bytes(1_000_000, 1_000_000) == message_wire_bytes([1] * 1_000_000)
    assert discarded_wire_bytes(8000, 8000 * 60_000) == message_wire_bytes([60_000] * 8000)
    assert discarded_wire_bytes(0, 0) == 0


def test_held_bytes_leave_out_the_slack_for_handshakes_and_heartbeats() -> None:
    budget = GuardBudget(per_connection_bytes=MIB, slack_bytes=1000, slack_bytes_per_s=10.0)
    assert held_bytes(received=5000, taken=4000, age_s=0.0, budget=budget) == 0
    assert held_bytes(received=5000, taken=1000, age_s=100.0, budget=budget) == 2000
    assert held_bytes(received=5000, taken=1000, age_s=1e6, budget=budget) == 0


def test_a_connection_over_its_budget_is_cut_and_one_at_it_is_not() -> None:
    budget = GuardBudget(per_connection_bytes=MIB)
    cuts = connections_to_cut(
        [
            ConnectionHolding(5, "a", MIB),
            ConnectionHolding(6, "b", MIB + 1),
            ConnectionHolding(7, "c", 0),
        ],
        budget,
    )
    assert [(c.fd, c.reason) for c in cuts] == [(6, "connection")]


def test_unexplained_memory_growth_cuts_the_largest_holder_once() -> None:
    budget = GuardBudget(per_connection_bytes=None, rss_growth_bytes=100 * MIB)
    holdings = [
        ConnectionHolding(5, "legit", 2 * MIB),
        ConnectionHolding(6, "flood", 6 * MIB),
        ConnectionHolding(7, "x", 0),
    ]
    # 300 MB grown for 9 MB received: small frames (64 bytes of libzmq for 3 on the wire)
    cuts = connections_to_cut(holdings, budget, MemoryGrowth(300 * MIB, 9 * MIB))
    assert [(c.fd, c.reason) for c in cuts] == [(6, "memory")]


def test_growth_that_received_bytes_explain_cuts_nobody() -> None:
    """A coordinator that keeps a 300 MB replica grows by about what it received."""
    budget = GuardBudget(per_connection_bytes=None, rss_growth_bytes=100 * MIB)
    holdings = [ConnectionHolding(5, "replica sender", 16 * MIB)]
    assert connections_to_cut(holdings, budget, MemoryGrowth(300 * MIB, 310 * MIB)) == []
    # and growth under the budget never cuts, however little was received
    assert connections_to_cut(holdings, budget, MemoryGrowth(99 * MIB, 0)) == []


def test_under_memory_pressure_a_sender_of_refused_messages_goes_first() -> None:
    budget = GuardBudget(per_connection_bytes=None, rss_growth_bytes=MIB)
    holdings = [
        ConnectionHolding(5, "bulk", 16 * MIB),
        ConnectionHolding(6, "flood", 3 * MIB, refused_messages=2),
    ]
    cuts = connections_to_cut(holdings, budget, MemoryGrowth(400 * MIB, 20 * MIB))
    assert [c.peer for c in cuts] == ["flood"]


def test_a_connection_holding_little_is_never_cut_for_memory() -> None:
    """Memory that grew for another reason (a model built) is no small peer's fault."""
    budget = GuardBudget(per_connection_bytes=None, rss_growth_bytes=MIB, min_held_to_cut=MIB)
    holdings = [ConnectionHolding(5, "heartbeats", MIB - 1)]
    assert connections_to_cut(holdings, budget, MemoryGrowth(900 * MIB, 0)) == []
    assert quiet(holdings, budget)
    assert not quiet([*holdings, ConnectionHolding(6, "flood", MIB)], budget)


def test_both_rules_do_not_cut_one_connection_twice() -> None:
    budget = GuardBudget(per_connection_bytes=MIB, rss_growth_bytes=MIB)
    holdings = [ConnectionHolding(5, "a", 8 * MIB), ConnectionHolding(6, "b", 2 * MIB)]
    cuts = connections_to_cut(holdings, budget, MemoryGrowth(500 * MIB, 0))
    assert [(c.fd, c.reason) for c in cuts] == [(5, "connection"), (6, "connection")]


def test_port_budgets_admit_their_largest_legitimate_messages() -> None:
    control = control_port_budget(256 * MIB)
    assert control.per_connection_bytes is not None
    assert control.per_connection_bytes >= 2 * 256 * MIB
    assert control.rss_growth_bytes is not None
    # 16 activations of 4 MiB queued, and one message as large as the bounds allow
    data = data_port_budget(64 * MIB, 64 * MIB, message_max_frames=17, recv_hwm=16)
    # no receive mark at a data port: small-message floods are the process rule's
    assert data.rss_growth_bytes is not None
    assert data.per_connection_bytes is not None
    assert data.per_connection_bytes >= 17 * message_wire_bytes([4 * MIB])
    # finding 3's message (8,000 frames of 60 kB) passes an idle port's budget early
    idle = data_port_budget(256 << 10, 256 << 10, message_max_frames=17, recv_hwm=4)
    assert idle.per_connection_bytes is not None
    assert idle.per_connection_bytes < 10 * 60_000


@pytest.mark.parametrize(
    "bad",
    [
        {"per_connection_bytes": 0},
        {"per_connection_bytes": None, "rss_growth_bytes": 0},
        {"per_connection_bytes": 1, "slack_bytes": -1},
        {"per_connection_bytes": 1, "amplification": -1.0},
        {"per_connection_bytes": 1, "small_message_wire": 0},
        {"per_connection_bytes": 1, "small_message_wire": 1024, "small_message_held": 0},
    ],
)
def test_a_budget_refuses_nonsense(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        GuardBudget(**bad)  # type: ignore[arg-type]


# a probe port's budget as a stage opens it: 16 frames of 2 MiB queued, 2 frames a message
PROBE = probe_port_budget(16 * 2 * MIB, 2 * MIB, message_max_frames=2, recv_hwm=16)
FLOOD_PROBE = message_wire_bytes([40])  # bench/hostile.py probe_flood's messages


def test_a_sender_of_small_messages_is_cut_past_a_megabyte_held() -> None:
    """A probe flood's connection: 40-byte messages, a few thousand taken, 1 MiB more
    held (some 3 MiB inside libzmq), far under the byte budget that a link burst needs."""
    assert PROBE.per_connection_bytes is not None and PROBE.per_connection_bytes > 32 * MIB
    flood = ConnectionHolding(5, "flood", MIB + 1, taken_bytes=5000 * FLOOD_PROBE,
                              taken_messages=5000)  # fmt: skip
    at_limit = ConnectionHolding(6, "under", MIB, taken_bytes=5000 * FLOOD_PROBE,
                                 taken_messages=5000)  # fmt: skip
    cuts = connections_to_cut([flood, at_limit], PROBE)
    assert [(c.fd, c.reason) for c in cuts] == [(5, "small messages")]


def test_a_link_burst_and_a_backup_are_not_small_messages() -> None:
    # a prober: 6 pings, then a first burst of 4 chunks of 64 KiB taken; the next
    # burst (32 MiB) arriving faster than the stage reads it
    pings = 6 * message_wire_bytes([30])
    chunks = 4 * message_wire_bytes([40, 64 << 10])
    prober = ConnectionHolding(5, "prober", 32 * MIB, taken_bytes=pings + chunks,
                               taken_messages=10)  # fmt: skip
    assert not sends_small_messages(prober, PROBE)
    # a backup's first message, arriving whole before anything of it was read
    backup = ConnectionHolding(6, "backup", 30 * MIB)
    assert not sends_small_messages(backup, PROBE)
    assert connections_to_cut([prober, backup], PROBE) == []


def test_the_small_message_mean_is_by_count_so_large_messages_do_not_hide_a_flood() -> None:
    """One 1 MiB message among 25,000 probes: the mean is some 80 bytes."""
    mixed = ConnectionHolding(5, "mixed", 2 * MIB, taken_bytes=MIB + 25_000 * FLOOD_PROBE,
                              taken_messages=25_001)  # fmt: skip
    assert sends_small_messages(mixed, PROBE)
    assert [c.reason for c in connections_to_cut([mixed], PROBE)] == ["small messages"]


def test_ports_without_the_small_message_rule_keep_their_byte_budget() -> None:
    data = data_port_budget(64 * MIB, 64 * MIB, message_max_frames=17, recv_hwm=16)
    assert data.small_message_wire is None
    flood = ConnectionHolding(5, "flood", 8 * MIB, taken_bytes=5000 * FLOOD_PROBE,
                              taken_messages=5000)  # fmt: skip
    assert connections_to_cut([flood], data) == []
