"""The coordinator's links probed again for a live re-partition
(:meth:`zpipe.coordinator.links.LinkMeasurer.remeasure`), against stand-in stages."""

from __future__ import annotations

import asyncio
from typing import Any

from zpipe.coordinator.links import LinkMeasurer, MeasuredLink
from zpipe.coordinator.membership import Member
from zpipe.protocol.stage_control import LinkPeers, LinkPeersOk, LinkProbeReply


def member(name: str, joined_at: float = 0.0) -> Member:
    return Member(
        name=name,
        routing_id=name.encode(),
        data_endpoint="tcp://h:1",
        info={"probe_endpoint": f"tcp://{name}:2"},
        public_key=None,
        joined_at=joined_at,
        last_seen=0.0,
    )


class Stages:
    """Stand-in stages: each probe answers ``bandwidth[(sender, receiver)]`` bit/s (None:
    a failed probe); every request is recorded."""

    def __init__(self) -> None:
        self.bandwidth: dict[tuple[str, str], float | None] = {}
        self.asked: list[tuple[str, str]] = []
        self.peers_told = 0

    async def request(self, m: Member, message: Any, reply: type[Any], timeout_s: float) -> Any:
        if isinstance(message, LinkPeers):
            self.peers_told += 1
            return LinkPeersOk(name=m.name)
        pair = (m.name, str(message.target))
        self.asked.append(pair)
        bps = self.bandwidth.get(pair, 1e9)
        error = "" if bps is not None else "TransportTimeout: no answer"
        return LinkProbeReply(
            name=m.name, target=pair[1], bandwidth_bps=bps, rtt_s=0.001 if bps else None,
            error=error,
        )  # fmt: skip


def test_the_links_between_consecutive_stages_are_probed_again_both_ways() -> None:
    stages = Stages()
    measurer = LinkMeasurer(stages.request, {}, timeout_s=1.0)
    a, b, c = member("a"), member("b"), member("c")
    asyncio.run(measurer.measure([a, b, c]))  # when the run was planned: every pair
    told, stages.asked = stages.peers_told, []
    stages.bandwidth = {("a", "b"): 1e7, ("b", "a"): 2e7, ("b", "c"): None}
    renewed = asyncio.run(measurer.remeasure([a, b, c]))
    # consecutive pairs only (not a-c), both directions, one at a time
    assert stages.asked == [("a", "b"), ("b", "a"), ("b", "c"), ("c", "b")]
    assert stages.peers_told == told  # the peers know each other already
    assert renewed == {
        ("a", "b"): MeasuredLink(1e7, 0.001),
        ("b", "a"): MeasuredLink(2e7, 0.001),
        ("c", "b"): MeasuredLink(1e9, 0.001),
    }
    known = measurer.known([a, b, c])
    assert known[("a", "b")].bandwidth_bps == 1e7  # the latest replace the cached
    assert known[("b", "c")].bandwidth_bps == 1e9  # a failed probe keeps the last


def test_a_pair_never_measured_is_not_probed_mid_run() -> None:
    stages = Stages()
    measurer = LinkMeasurer(stages.request, {}, timeout_s=1.0)
    a, b = member("a"), member("b")
    asyncio.run(measurer.measure([a, b]))
    told, stages.asked = stages.peers_told, []
    # b registered again (its cached links are gone); c was never measured
    again, c = member("b", joined_at=5.0), member("c")
    assert asyncio.run(measurer.remeasure([a, again, c])) == {}
    assert stages.asked == [] and stages.peers_told == told
