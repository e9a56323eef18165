"""Per-message drop decisions and the r-TX / ACK recovery schemes."""

from __future__ import annotations

import numpy as np
import pytest

from zpipe._errors import ConfigError
from zpipe.lossy.links import Direction, Recovery, Traffic, deliver, drop_uniform


def test_drop_key_is_a_pure_function() -> None:
    key = (42, 1, 3, 2, 17, Direction.BACKWARD)
    first = drop_uniform(*key)
    # however many other decisions happen in between, in whatever order
    for step in range(100, 0, -1):
        drop_uniform(42, 3, 1, 2, step, Direction.FORWARD)
    assert drop_uniform(*key) == first
    assert 0.0 <= first < 1.0
    # every field matters
    assert len({drop_uniform(42, 1, 3, 2, 17, d) for d in Direction}) == len(Direction)
    assert drop_uniform(42, 1, 3, 2, 17, 0) != drop_uniform(42, 3, 1, 2, 17, 0)
    assert drop_uniform(42, 1, 3, 2, 17, 0) != drop_uniform(43, 1, 3, 2, 17, 0)
    assert drop_uniform(42, 1, 3, 2, 17, 0, 0) != drop_uniform(42, 1, 3, 2, 17, 0, 1)
    with pytest.raises(ConfigError, match="non-negative"):
        drop_uniform(1, -1, 0, 0, 0, 0)


def test_drop_uniform_is_uniform() -> None:
    u = np.array([drop_uniform(5, 0, 1, 1, step, 0) for step in range(20000)])
    assert u.mean() == pytest.approx(0.5, abs=0.01)
    hist, _ = np.histogram(u, bins=10, range=(0, 1))
    assert hist.min() > 1800 and hist.max() < 2200


@pytest.mark.parametrize("prr", [0.0, 0.3, 0.8, 1.0])
def test_delivery_rate_follows_the_reception_ratio(prr: float) -> None:
    traffic = Traffic()
    for step in range(5000):
        traffic.add(deliver(9, 2, 4, 1, step, Direction.FORWARD, prr=prr))
    assert traffic.delivery_rate == pytest.approx(prr, abs=0.02)
    assert traffic.tx_factor == 1.0


def test_rtx_sends_twice_and_helps() -> None:
    prr = 0.6
    plain, rtx = Traffic(), Traffic()
    for step in range(5000):
        p = deliver(1, 0, 1, 3, step, 0, prr=prr)
        r = deliver(1, 0, 1, 3, step, 0, prr=prr, recovery=Recovery("rtx"))
        # the first copy is the plain message: r-TX only ever adds deliveries
        assert r.delivered or not p.delivered
        plain.add(p)
        rtx.add(r)
    assert rtx.tx_factor == 2.0
    assert rtx.delivery_rate == pytest.approx(1 - (1 - prr) ** 2, abs=0.02)
    assert rtx.delivery_rate > plain.delivery_rate


def test_ack_retransmits_until_acknowledged_or_deadline() -> None:
    prr = 0.6
    traffic = Traffic()
    for step in range(5000):
        d = deliver(1, 0, 1, 3, step, 0, prr=prr, recovery=Recovery("ack", max_attempts=4))
        assert 1 <= d.data_tx <= 4 and d.ack_tx <= d.data_tx
        if not d.delivered:
            assert d.data_tx == 4 and d.ack_tx == 0
        traffic.add(d)
    assert traffic.delivery_rate == pytest.approx(1 - (1 - prr) ** 4, abs=0.02)
    assert traffic.tx_factor > 2.0  # retransmissions and acknowledgements both cost
    # a perfect link costs one message and one acknowledgement
    assert deliver(1, 0, 1, 0, 0, 0, prr=1.0, recovery=Recovery("ack")) == deliver(
        2, 5, 4, 0, 0, 0, prr=1.0, prr_back=1.0, recovery=Recovery("ack")
    )
    # a lost acknowledgement makes the sender try again, to the deadline
    lost_acks = deliver(1, 0, 1, 0, 0, 0, prr=1.0, prr_back=0.0, recovery=Recovery("ack"))
    assert lost_acks.delivered and lost_acks.data_tx == 4 and lost_acks.ack_tx == 4


def test_self_messages_never_touch_a_link() -> None:
    d = deliver(0, 3, 3, 0, 0, 0, prr=0.0)
    assert d.delivered and d.data_tx == 0


def test_bad_recovery() -> None:
    with pytest.raises(ConfigError, match="unknown recovery"):
        Recovery("fec")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        Recovery("rtx", copies=0)
    with pytest.raises(ConfigError):
        Recovery("ack", max_attempts=0)
