"""A stage's part of measuring a lossy run's links before it is mapped (EdgePipe: 50
probes per link).

The coordinator sends every stage of the run a ``lossy_probe_request`` (its device
index, the peers' data endpoints, the probe count, the seed and the links' true
reception ratios); the stage takes probes on its data port, answers
``lossy_ready``, and at ``lossy_go`` sends ``count`` ``lossy_probe`` messages to
each peer and one ``lossy_probe_end`` saying how many it tried. A probe's fate
is decided by the stage's emulated links, given the seeded decision the partials'
links use (:func:`zpipe.lossy.links.seeded_link_loss`, keyed by
:attr:`~zpipe.lossy.links.Direction.PROBE` and the probe's number): a probe the
link lost never reaches the wire. Once every peer's end has come (a
link keeps its order: then all its probes have), or the request's timeout
passed, the stage answers ``lossy_probe_report``: what it received from whom.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import zmq.asyncio

from zpipe._errors import ProtocolError
from zpipe.lossy.links import Direction, seeded_link_loss
from zpipe.lossy.wire import peers_from_body
from zpipe.protocol.lossy import (
    LossyProbe,
    LossyProbeEnd,
    LossyProbeReport,
    LossyProbeRequest,
)
from zpipe.transport.emulation import KeyedLinks, LossKey
from zpipe.transport.sockets import send

# Far above EdgePipe's 50, far below what would flood a peer's queue.
MAX_PROBES = 10_000


@dataclass
class LinkProbes:
    """One measurement on this stage: what it sends, and what has reached it."""

    run: int
    device: int
    seed: int
    count: int
    prr: np.ndarray
    peers: dict[int, str]
    timeout_s: float
    received: dict[int, int] = field(default_factory=dict)
    ends: dict[int, int] = field(default_factory=dict)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    @classmethod
    def from_request(cls, req: LossyProbeRequest) -> LinkProbes:
        """:class:`ProtocolError` if the request does not fit itself."""
        peers = peers_from_body(req.peers, "lossy_probe_request")
        try:
            prr = np.asarray(req.prr, dtype=np.float64)
        except (TypeError, ValueError):  # ragged or not numbers
            raise ProtocolError("lossy_probe_request: bad reception ratios") from None
        n = len(prr)
        if prr.shape != (n, n) or not np.all((prr >= 0) & (prr <= 1)):
            raise ProtocolError("lossy_probe_request: reception ratios must be n x n in [0, 1]")
        if req.device is None or not 0 <= req.device < n or req.device not in peers:
            raise ProtocolError(f"lossy_probe_request: device {req.device} is not a peer")
        if any(not 0 <= d < n for d in peers):
            raise ProtocolError("lossy_probe_request: a peer without reception ratios")
        if not 1 <= req.count <= MAX_PROBES or not 0 < req.timeout_s <= 3600:
            raise ProtocolError("lossy_probe_request: count in 1..10000, timeout in (0, 3600]")
        return cls(req.run, req.device, req.seed, req.count, prr, peers, float(req.timeout_s))

    @property
    def others(self) -> list[int]:
        return sorted(d for d in self.peers if d != self.device)

    def on_probe(self, probe: LossyProbe) -> None:
        self._check_peer(probe.src)
        self.received[probe.src] = self.received.get(probe.src, 0) + 1

    def on_end(self, end: LossyProbeEnd) -> None:
        self._check_peer(end.src)
        self.ends[end.src] = end.sent
        self.arrived.set()

    def _check_peer(self, src: int) -> None:
        if src == self.device or src not in self.peers:
            raise ProtocolError(f"a probe from device {src}, not a peer of this measurement")

    def report(self) -> LossyProbeReport:
        missing = sorted(set(self.others) - self.ends.keys())
        return LossyProbeReport(
            run=self.run,
            device=self.device,
            received={str(src): self.received.get(src, 0) for src in self.others},
            sent={str(src): self.ends[src] for src in self.others if src in self.ends},
            error=f"no probes finished from devices {missing}" if missing else "",
        )


async def probe_links(
    probes: LinkProbes, peers: Mapping[int, zmq.asyncio.Socket], *, epoch: int, timeout_s: float
) -> LossyProbeReport:
    """Send this stage's probes and ends, then wait (at most the request's timeout) for
    every peer's end; ``timeout_s``: each send's deadline."""
    me = probes.device
    links = KeyedLinks(seeded_link_loss(probes.seed, probes.prr))
    for dst in probes.others:
        sock, peer = peers[dst], f"device {dst}"
        for seq in range(probes.count):
            if links.transmit(LossKey(me, dst, 0, seq, Direction.PROBE)):
                probe = LossyProbe(run=probes.run, src=me, seq=seq, epoch=epoch)
                await send(sock, probe.to_message(), timeout_s=timeout_s, peer=peer)
        end = LossyProbeEnd(run=probes.run, src=me, sent=probes.count, epoch=epoch)
        await send(sock, end.to_message(), timeout_s=timeout_s, peer=peer)
    deadline = time.monotonic() + probes.timeout_s
    while not set(probes.others) <= probes.ends.keys():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        probes.arrived.clear()  # no await since the check above: no wake-up is lost
        try:
            await asyncio.wait_for(probes.arrived.wait(), remaining)
        except asyncio.TimeoutError:
            break
    return probes.report()
