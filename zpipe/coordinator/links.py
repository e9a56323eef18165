"""Measured links between stages: asking the stages, caching what they measured.

Before it plans from profiles, the coordinator asks stages to measure the
links it may use (every ordered pair of the run's stages): first every stage
learns which peers may probe it (``link_peers``; with CurveZMQ a refused
handshake is never retried, so peers are allowed before anyone connects),
then one stage at a time measures one link (``link_probe_request``), so that
no two probes share a link or a core. Results are cached per pair until
either stage registers again.

A link that cannot be measured (the stage failed or timed out) is planned from
what the sender declared (``--bandwidth-mbps``/``--latency-ms``) and logged;
a run never fails because a measurement did.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from zpipe._errors import ZpipeError
from zpipe.coordinator.membership import Member
from zpipe.log import get_logger
from zpipe.planner import ClusterLink
from zpipe.protocol import WireMessage
from zpipe.protocol.stage_control import LinkPeers, LinkPeersOk, LinkProbeReply, LinkProbeRequest

log = get_logger("zpipe.coordinator")

# request(member, message, reply class, timeout_s) -> the member's reply (of that class)
Request = Callable[[Member, WireMessage, type[Any], float], Awaitable[Any]]


@dataclass(frozen=True)
class MeasuredLink:
    bandwidth_bps: float
    rtt_s: float

    def as_cluster_link(self) -> ClusterLink:
        # One-way latency taken as half the round trip: the two directions of a
        # pair are not told apart by a ping, and latency does not set the period.
        return ClusterLink(bandwidth_mbps=self.bandwidth_bps / 1e6, latency_ms=self.rtt_s * 500.0)


_PairKey = tuple[str, float, str, float]


class LinkMeasurer:
    def __init__(
        self, request: Request, public_keys: Mapping[str, bytes], *, timeout_s: float
    ) -> None:
        self._request = request
        self._public_keys = public_keys
        self._timeout_s = timeout_s
        self._cache: dict[_PairKey, MeasuredLink] = {}

    async def measure(self, members: Sequence[Member]) -> dict[tuple[str, str], MeasuredLink]:
        """The measured link of every ordered pair of ``members`` that could be measured."""
        todo = [
            (a, b)
            for a in members
            for b in members
            if a is not b and _key(a, b) not in self._cache and b.info.get("probe_endpoint")
        ]
        if todo:
            await self.allow_peers(members)
        for a, b in todo:
            measured = await self._measure_pair(a, b)
            if measured is not None:
                self._cache[_key(a, b)] = measured
        return self.known(members)

    async def remeasure(self, chain: Sequence[Member]) -> dict[tuple[str, str], MeasuredLink]:
        """Probe again the links between consecutive members of ``chain`` (a pipeline's
        stages in order), both ways: a live re-partition renews the links its cuts
        cross while the run goes on. Only pairs measured before are probed (one never
        measured, say after a coordinator restart, stays costed as declared); a pair
        that cannot be measured now keeps what was measured before. Returns what was
        measured now."""
        # only pairs measured before (at planning): their peers know each other's keys
        # already, and telling them again would race the run's own peer grants (one
        # request per stage and reply kind at a time)
        pairs = [
            pair
            for a, b in pairwise(chain)
            for pair in ((a, b), (b, a))
            if _key(*pair) in self._cache and pair[1].info.get("probe_endpoint")
        ]
        out: dict[tuple[str, str], MeasuredLink] = {}
        for a, b in pairs:
            measured = await self._measure_pair(a, b)
            if measured is not None:
                self._cache[_key(a, b)] = out[(a.name, b.name)] = measured
        return out

    def known(self, members: Sequence[Member]) -> dict[tuple[str, str], MeasuredLink]:
        """What is measured already between ``members``, measuring nothing: a re-planner
        after a death costs links from these and has no time to probe."""
        return {
            (a.name, b.name): self._cache[_key(a, b)]
            for a in members
            for b in members
            if a is not b and _key(a, b) in self._cache
        }

    def known_cluster_links(self, members: Sequence[Member]) -> dict[tuple[str, str], ClusterLink]:
        return {pair: link.as_cluster_link() for pair, link in self.known(members).items()}

    async def allow_peers(
        self, members: Sequence[Member], fetches: Mapping[str, Sequence[Any]] | None = None
    ) -> None:
        """Tell every member which peers may reach its probe socket (their keys) and,
        with ``fetches``, which unit fetches it answers (see :func:`fetch_grants`)."""
        keys = {
            m.name: self._public_keys[m.name].decode()
            for m in members
            if m.name in self._public_keys
        }
        for member in members:
            try:
                granted = None if fetches is None else list(fetches.get(member.name, ()))
                allowed = LinkPeers(keys=keys, fetches=granted)
                await self._request(member, allowed, LinkPeersOk, self._timeout_s)
            except ZpipeError as exc:  # timed out, malformed, or the stage died
                log.warning("link_peers_failed", stage=member.name, error=str(exc))

    async def _measure_pair(self, a: Member, b: Member) -> MeasuredLink | None:
        key = self._public_keys.get(b.name)
        request = LinkProbeRequest(
            target=b.name,
            endpoint=str(b.info["probe_endpoint"]),
            key=key.decode() if key is not None else None,
        )
        try:
            reply: LinkProbeReply = await self._request(a, request, LinkProbeReply, self._timeout_s)
        except ZpipeError as exc:  # timed out, malformed, or the stage died
            log.warning("link_unmeasured", sender=a.name, receiver=b.name, error=str(exc))
            return None
        bandwidth, rtt = reply.bandwidth_bps, reply.rtt_s
        if reply.error or bandwidth is None or rtt is None or not bandwidth > 0 or rtt < 0:
            log.warning(
                "link_unmeasured", sender=a.name, receiver=b.name, error=reply.error or "empty"
            )
            return None
        measured = MeasuredLink(bandwidth_bps=float(bandwidth), rtt_s=float(rtt))
        log.info(
            "link_measured",
            sender=a.name,
            receiver=b.name,
            bandwidth_mbps=round(measured.bandwidth_bps / 1e6, 1),
            rtt_ms=round(measured.rtt_s * 1e3, 3),
        )
        return measured


def _key(a: Member, b: Member) -> _PairKey:
    return (a.name, a.joined_at, b.name, b.joined_at)
