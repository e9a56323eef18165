"""Link emulation: serialisation paid by the sender, latency in flight, seeded loss."""

from __future__ import annotations

import asyncio
import time

import pytest

from zpipe._errors import ConfigError
from zpipe.transport.emulation import EmulatedLink, LinkModel, LinkSpec


def test_bandwidth_serialises_messages_back_to_back() -> None:
    model = LinkModel(LinkSpec(bandwidth_mbps=8.0, latency_ms=100.0))  # 1 MB/s
    free1, arrive1, _ = model.schedule(500_000, now=0.0)
    free2, arrive2, _ = model.schedule(500_000, now=0.0)  # queued behind the first
    assert free1 == pytest.approx(0.5) and arrive1 == pytest.approx(0.6)
    assert free2 == pytest.approx(1.0) and arrive2 == pytest.approx(1.1)
    free3, _, _ = model.schedule(0, now=5.0)  # an idle link starts fresh
    assert free3 == pytest.approx(5.0)


def test_traffic_of_another_socket_occupies_the_link_without_drawing_losses() -> None:
    spec = LinkSpec(bandwidth_mbps=8.0, loss=0.5, seed=3)  # 1 MB/s
    plain, shared = LinkModel(spec), LinkModel(spec)
    assert shared.occupy(250_000, now=0.0) == pytest.approx(0.25)
    free, _, _ = shared.schedule(500_000, now=0.0)  # queued behind the other socket's bytes
    assert free == pytest.approx(0.75)
    plain.schedule(500_000, now=0.0)
    losses = [[m.schedule(10, 1.0)[2] for _ in range(50)] for m in (plain, shared)]
    assert losses[0] == losses[1]


async def test_pacing_waits_for_the_serialisation_time() -> None:
    async def deliver(item: object) -> None:
        raise AssertionError("pacing delivers nothing")

    link = EmulatedLink(LinkSpec(bandwidth_mbps=80.0), deliver)  # 10 MB/s
    started = time.monotonic()
    await link.pace(1_000_000)
    await link.pace(1_000_000)
    assert time.monotonic() - started >= 0.19
    await link.close()


def test_loss_is_seeded_and_near_its_rate() -> None:
    def draws(seed: int) -> list[bool]:
        model = LinkModel(LinkSpec(loss=0.3, seed=seed))
        return [model.schedule(10, 0.0)[2] for _ in range(2000)]

    assert draws(1) == draws(1)
    assert draws(1) != draws(2)
    assert 0.25 < sum(draws(1)) / 2000 < 0.35


@pytest.mark.parametrize("kwargs", [{"bandwidth_mbps": 0}, {"latency_ms": -1}, {"loss": 1.0}])
def test_bad_link_specs_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        LinkSpec(**kwargs)  # type: ignore[arg-type]


async def test_latency_is_paid_in_flight_and_order_is_kept() -> None:
    delivered: list[tuple[int, float]] = []

    async def deliver(item: object) -> None:
        delivered.append((int(item), time.monotonic()))  # type: ignore[call-overload]

    link = EmulatedLink(LinkSpec(latency_ms=200.0), deliver)
    started = time.monotonic()
    for i in range(5):
        assert await link.submit(i, 10)
    submit_s = time.monotonic() - started
    await asyncio.sleep(0.4)
    await link.close()
    assert [i for i, _ in delivered] == [0, 1, 2, 3, 4]
    # Five messages in flight at once: the sender did not wait for the latency
    # (waiting would take 5 x 0.2 s; the margin absorbs a loaded machine).
    assert submit_s < 0.5
    assert all(at - started >= 0.19 for _, at in delivered)


async def test_lost_messages_are_not_delivered() -> None:
    delivered: list[object] = []

    async def deliver(item: object) -> None:
        delivered.append(item)

    link = EmulatedLink(LinkSpec(loss=0.5, seed=3), deliver)
    results = [await link.submit(i, 10) for i in range(100)]
    await asyncio.sleep(0.05)
    await link.close()
    assert link.lost == results.count(False) > 0
    assert delivered == [i for i, ok in enumerate(results) if ok]


def test_slowdown_adds_the_slower_devices_extra_work_not_a_multiple_of_the_wait_for_a_core(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from zpipe.transport.emulation import emulate_slowdown

    sleeps: list[float] = []
    monkeypatch.setattr("zpipe.transport.emulation.time.sleep", sleeps.append)
    # 1 s of CPU work that took 1.5 s of wall time because another process had the core:
    # a 4x slower device does 3 s more work
    assert emulate_slowdown(4.0, 1.5, 1.0) == pytest.approx(4.5)
    assert sleeps == [pytest.approx(3.0)]
    # contention beyond the emulated device's time still leaves the device slower
    assert emulate_slowdown(2.0, 3.0, 1.0) == pytest.approx(4.0)
    # without a CPU time, the wall time is the work
    assert emulate_slowdown(2.0, 1.0) == pytest.approx(2.0)
    # a full-speed device is never slowed
    assert emulate_slowdown(1.0, 1.5, 1.0) == pytest.approx(1.5)
    assert len(sleeps) == 3
