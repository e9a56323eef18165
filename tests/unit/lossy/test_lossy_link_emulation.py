"""The one loss model: the transport's link emulation, given the simulation's keyed
decision, drops what the simulation drops, and a stage's sender no longer decides."""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest

from zpipe.lossy.engine import LinkChannel
from zpipe.lossy.links import (
    Direction,
    Recovery,
    copy_lost,
    deliver,
    deliver_over,
    drop_uniform,
    seeded_link_loss,
)
from zpipe.transport.emulation import EmulatedLink, KeyedLinks, LinkModel, LinkSpec, LossKey

PRR = np.array([[1.0, 0.7, 0.4], [0.55, 1.0, 0.9], [0.3, 0.8, 1.0]])
SCHEMES = [Recovery("none"), Recovery("rtx", copies=3), Recovery("ack", max_attempts=4)]


def test_the_keyed_decision_is_the_seeded_hash_against_the_links_ratio() -> None:
    lost = seeded_link_loss(11, PRR)
    keys = [
        LossKey(src, dst, layer, step, int(Direction.FORWARD), copy)
        for src, dst in [(0, 1), (1, 0), (2, 0)]
        for layer, step, copy in itertools.product(range(2), range(40), range(2))
    ]
    for key in keys:
        uniform = drop_uniform(11, key.src, key.dst, key.layer, key.step, key.kind, key.copy)
        assert lost(key) == (uniform >= PRR[key.src, key.dst])
        assert lost(key) == copy_lost(11, key, float(PRR[key.src, key.dst]))
    # it drops about the link's loss, and another seed drops other copies
    share = np.mean([lost(k) for k in keys if (k.src, k.dst) == (2, 0)])
    assert 0.55 < share < 0.85
    other = seeded_link_loss(12, PRR)
    assert [lost(k) for k in keys] != [other(k) for k in keys]


@pytest.mark.parametrize("recovery", SCHEMES, ids=lambda r: r.scheme)
def test_copies_through_emulated_links_fare_exactly_as_the_simulation_decides(
    recovery: Recovery,
) -> None:
    links = KeyedLinks(seeded_link_loss(5, PRR))
    data_tx = ack_tx = 0
    outcomes = set()
    for src, dst, layer, step in itertools.product(range(3), range(3), range(3), range(30)):
        direction = Direction.BACKWARD if layer else Direction.FORWARD
        simulated = deliver(5, src, dst, layer, step, direction, prr=PRR[src, dst],
                            prr_back=PRR[dst, src], recovery=recovery)  # fmt: skip
        emulated = deliver_over(links.transmit, src, dst, layer, step, direction, recovery=recovery)
        assert emulated == simulated
        data_tx, ack_tx = data_tx + emulated.data_tx, ack_tx + emulated.ack_tx
        outcomes.add(emulated.delivered)
    assert outcomes == {True, False}  # the setting loses some messages and not others
    # the links carried every copy (an acknowledgement is a copy on the reverse link)
    assert sum(links.sent.values()) == data_tx + ack_tx
    assert 0 < sum(links.lost.values()) < sum(links.sent.values())
    assert (0, 0) not in links.sent  # a message to oneself never touches a link


def test_a_stage_channel_counts_what_the_simulation_counts_but_its_links_decide() -> None:
    recovery = Recovery("rtx", copies=2)
    simulated = LinkChannel(prr=PRR, seed=3, recovery=recovery)
    staged = LinkChannel(prr=PRR, seed=3, recovery=recovery)
    links = KeyedLinks(staged.keyed_loss())
    for src, dst, step in itertools.product(range(3), range(3), range(25)):
        want = simulated.send(src, dst, 1, step, Direction.FORWARD)
        got = staged.send(src, dst, 1, step, Direction.FORWARD, transmit=links.transmit)
        assert got == want
    assert staged.traffic["forward"].as_dict() == simulated.traffic["forward"].as_dict()
    assert sum(links.sent.values()) == simulated.traffic["forward"].data_tx

    # the sender does not decide: a link that drops nothing delivers what the seed
    # would have dropped, and one that drops everything loses what it would have let by
    lost_by_seed = next(
        step for step in range(100) if not simulated.would_deliver(2, 0, 1, step, Direction.FORWARD)
    )
    kept_by_seed = next(
        step for step in range(100) if simulated.would_deliver(2, 0, 1, step, Direction.FORWARD)
    )
    sent: list[LossKey] = []

    def perfect(key: LossKey) -> bool:
        sent.append(key)
        return True

    assert staged.send(2, 0, 1, lost_by_seed, Direction.FORWARD, transmit=perfect)
    assert [k.copy for k in sent] == [0, 1]  # both r-TX copies went to the link
    assert not staged.send(2, 0, 1, kept_by_seed, Direction.FORWARD, transmit=lambda _: False)


def test_keyed_messages_leave_the_random_streams_draws_to_the_other_traffic() -> None:
    spec = LinkSpec(loss=0.4, seed=9)
    plain = LinkModel(spec)
    keyed = LinkModel(spec, keyed_loss=seeded_link_loss(9, PRR))
    plain_losses = [plain.schedule(10, 0.0)[2] for _ in range(200)]
    keyed_losses = []
    for i in range(200):
        key = LossKey(2, 0, 0, i, int(Direction.PROBE))
        assert keyed.schedule(10, 0.0, key)[2] == copy_lost(9, key, 0.3)
        keyed_losses.append(keyed.schedule(10, 0.0)[2])  # unkeyed: the seeded stream
    assert keyed_losses == plain_losses
    # a key on a link without a keyed decision draws from the stream as before
    again = LinkModel(spec)
    assert [again.schedule(10, 0.0, LossKey(0, 1, 0, i, 0))[2] for i in range(200)] == plain_losses


def test_an_emulated_link_with_a_keyed_decision_drops_the_keyed_messages() -> None:
    async def main() -> tuple[list[object], list[bool]]:
        delivered: list[object] = []

        async def deliver_item(item: object) -> None:
            delivered.append(item)

        link = EmulatedLink(LinkSpec(), deliver_item, keyed_loss=seeded_link_loss(4, PRR))
        keys = [LossKey(0, 2, 1, step, int(Direction.FORWARD)) for step in range(60)]
        results = [await link.submit(k.step, 10, key=k) for k in keys]
        await asyncio.sleep(0.05)
        await link.close()
        assert link.lost == results.count(False)
        assert results == [not copy_lost(4, k, 0.4) for k in keys]
        return delivered, results

    delivered, results = asyncio.run(main())
    assert 0 < results.count(False) < len(results)
    assert delivered == [step for step, ok in enumerate(results) if ok]


def test_a_stages_probes_go_through_its_emulated_links_which_drop_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from zpipe.protocol.lossy import LossyProbeRequest
    from zpipe.stage.executors import lossy_probes

    # a link decision that drops every odd probe to device 2, and nothing else
    def odd_to_two(seed: int, prr: object) -> object:
        return lambda key: key.dst == 2 and key.step % 2 == 1

    monkeypatch.setattr(lossy_probes, "seeded_link_loss", odd_to_two)
    wire: list[tuple[object, str, int | None]] = []

    async def fake_send(sock: object, message: object, *, timeout_s: float, peer: str) -> None:
        wire.append((sock, message.kind, message.body.get("seq")))  # type: ignore[attr-defined]

    monkeypatch.setattr(lossy_probes, "send", fake_send)
    peers = {d: f"tcp://127.0.0.1:{6000 + d}" for d in range(3)}
    request = LossyProbeRequest(run=1, seed=0, count=6, prr=PRR.tolist(),
                                peers={str(d): e for d, e in peers.items()},
                                timeout_s=0.05, device=0)  # fmt: skip
    probes = lossy_probes.LinkProbes.from_request(request)
    sockets = {1: "sock1", 2: "sock2"}
    asyncio.run(lossy_probes.probe_links(probes, sockets, epoch=0, timeout_s=1.0))  # type: ignore[arg-type]
    to_one = [seq for sock, kind, seq in wire if sock == "sock1" and kind == "lossy_probe"]
    to_two = [seq for sock, kind, seq in wire if sock == "sock2" and kind == "lossy_probe"]
    assert to_one == list(range(6)) and to_two == [0, 2, 4]
    # each link's end still says how many were tried
    ends = [(sock, kind) for sock, kind, _ in wire if kind == "lossy_probe_end"]
    assert ends == [("sock1", "lossy_probe_end"), ("sock2", "lossy_probe_end")]
