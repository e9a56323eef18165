"""Without keys, a data port admits the hosts its assignment names: the pure parts
(which addresses an assignment admits, and the ZAP handler's decision)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import structlog

from zpipe.coordinator.membership import Member
from zpipe.coordinator.runs.generation import GenerationLimits, generation_setups
from zpipe.models import ModelSpec
from zpipe.protocol.stage_control import Assign
from zpipe.stage.assignment import generation_sender_endpoints, sender_endpoints
from zpipe.stage.executors.lossy_peers import LossyPeers
from zpipe.transport import address_auth
from zpipe.transport.address_auth import (
    AddressAllowList,
    AddressAuthenticator,
    peer_addresses,
    zap_reply,
)


def request(address: str, *, domain: str = "zpipe-data-addr", mechanism: bytes = b"NULL") -> list:
    return [b"1.0", b"id-7", domain.encode(), address.encode(), b"", mechanism]


def test_peer_addresses_are_the_hosts_of_the_senders_endpoints() -> None:
    got = peer_addresses(["tcp://10.0.0.2:5000", None, "", "tcp://10.0.0.3:5001", "ipc:///x"])
    assert got == {"10.0.0.2", "10.0.0.3"}
    assert peer_addresses([]) == set()  # nobody named: nobody admitted
    assert peer_addresses(["tcp://[::1]:5000"]) == {"::1"}


def test_a_loopback_peer_also_admits_this_ports_own_address() -> None:
    # a peer on this host reaches this port at the address this port advertises
    got = peer_addresses(["tcp://127.0.0.1:5000"], "tcp://10.0.0.9:6000")
    assert got == {"127.0.0.1", "10.0.0.9"}
    assert peer_addresses(["tcp://10.0.0.2:5000"], "tcp://10.0.0.9:6000") == {"10.0.0.2"}


def test_a_host_name_is_resolved_and_an_unknown_one_admits_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def fake_getaddrinfo(host: str, *args: Any, **kwargs: Any) -> list[Any]:
        if host == "edge-7":
            return [(2, 1, 6, "", ("10.1.2.3", 0))]
        raise OSError("Name or service not known")

    monkeypatch.setattr(address_auth.pysocket, "getaddrinfo", fake_getaddrinfo)
    assert peer_addresses(["tcp://edge-7:5000", "tcp://nowhere:5000"]) == {"10.1.2.3"}


def test_the_allow_list_admits_exactly_what_it_was_given() -> None:
    allow = AddressAllowList()
    assert "127.0.0.1" not in allow  # empty: nobody
    allow.replace(["10.0.0.2"])
    assert "10.0.0.2" in allow and "10.0.0.3" not in allow
    assert "::ffff:10.0.0.2" in allow  # an IPv4 peer on a dual-stack listener
    allow.admit_any()
    assert "10.0.0.3" in allow and allow.admits_any
    allow.replace([])
    assert "10.0.0.3" not in allow and not allow.admits_any
    with pytest.raises(ValueError):
        allow.replace(["not-an-address"])


def test_the_zap_reply_admits_an_allowed_address_and_refuses_others() -> None:
    allow = AddressAllowList(["10.0.0.2"])
    reply, address, ok = zap_reply(request("10.0.0.2"), allow)
    assert ok and address == "10.0.0.2" and reply[:3] == [b"1.0", b"id-7", b"200"]
    reply, address, ok = zap_reply(request("10.0.0.66"), allow)
    assert not ok and address == "10.0.0.66" and reply[2] == b"400" and reply[4] == b""
    # only NULL connections are judged by address; CURVE ones need their key checked
    assert not zap_reply(request("10.0.0.2", mechanism=b"CURVE"), allow)[2]
    assert zap_reply([b"1.0"], allow)[0][2] == b"400"  # malformed: refused, not raised
    assert zap_reply([b"9.9", b"id", b"d", b"10.0.0.2", b"", b"NULL"], allow)[0][2] == b"400"


def test_the_handler_counts_and_logs_refusals_by_address() -> None:
    allow = AddressAllowList(["10.0.0.2"])
    auth = AddressAuthenticator(object(), allow)  # type: ignore[arg-type]  # never started
    with structlog.testing.capture_logs() as logs:
        assert auth.decide(request("10.0.0.2"))[2]
        for _ in range(3):
            assert not auth.decide(request("10.0.0.66"))[2]
        assert not auth.decide(request("10.0.0.2", domain="another"))[2]  # not its domain
    assert auth.refused == {"10.0.0.66": 3, "10.0.0.2": 1}
    refused = [e for e in logs if e["event"] == "peer_refused"]
    # peer= is what the flood limit counts lines by (zpipe.log_limits)
    assert [e["peer"] for e in refused] == ["10.0.0.66"] * 3 + ["10.0.0.2"]
    assert refused[-1]["refused"] == 1


def test_an_inference_assignment_admits_its_upstream() -> None:
    assign = Assign(
        run=1, model={}, start=0, end=1, index=1, num_stages=2, upstream="s0",
        downstream="client", downstream_endpoint="tcp://10.0.0.9:1", dtype="float32",
        upstream_endpoint="tcp://10.0.0.2:5000", epoch=1,
    )  # fmt: skip
    assert sender_endpoints(assign) == ["tcp://10.0.0.2:5000"]


def test_a_training_assignment_admits_both_neighbours() -> None:
    train = {
        "upstream": {"names": ["a", "b"], "endpoints": ["tcp://10.0.0.2:1", "tcp://10.0.0.3:1"]},
        "downstream": {"names": ["client"], "endpoints": ["tcp://10.0.0.9:2"]},
    }
    assign = Assign(
        run=1, model={}, start=0, end=1, index=1, num_stages=2, upstream="a",
        downstream="client", downstream_endpoint="tcp://10.0.0.9:2", dtype="float32",
        mode="train", train=train, epoch=1,
    )  # fmt: skip
    assert sender_endpoints(assign) == ["tcp://10.0.0.2:1", "tcp://10.0.0.3:1", "tcp://10.0.0.9:2"]
    assert peer_addresses(sender_endpoints(assign)) == {"10.0.0.2", "10.0.0.3", "10.0.0.9"}


def test_a_lossy_setup_admits_its_other_devices() -> None:
    allow = AddressAllowList()

    def connector(endpoint: str, key: str | None, peer: str) -> Any:
        raise AssertionError("nothing connects at set-up")

    peers = LossyPeers(connector, None, allow)
    endpoints = {0: "tcp://10.0.0.1:1", 1: "tcp://10.0.0.2:1", 2: "tcp://10.0.0.3:1"}
    peers.allow({"0": "a", "1": "b", "2": "c"}, {}, 1, endpoints)
    assert "10.0.0.1" in allow and "10.0.0.3" in allow
    assert "10.0.0.2" not in allow  # itself (a non-loopback address): not a sender
    assert "10.0.0.4" not in allow


def _members(hosts: list[str]) -> list[Member]:
    return [
        Member(
            name=f"g{i}",
            routing_id=b"r",
            data_endpoint=f"tcp://{h}:5000",
            info={},
            public_key=None,
            joined_at=0.0,
            last_seen=0.0,
        )
        for i, h in enumerate(hosts)
    ]


def test_a_generation_setup_admits_its_upstream_and_the_first_stage_the_client() -> None:
    # a ring: the first stage's steps come back from the last one, and the client
    # submits to the first; every other stage hears only the one before it
    limits = GenerationLimits(max_context=64, max_sequences=2, steps_in_flight=1,
                              chunk_tokens=16, kv_budget_bytes=None, dtype=None)  # fmt: skip
    spec = ModelSpec("mlp", {"dims": [2, 2]})
    setups = generation_setups(
        1, 1, spec, _members(["10.0.0.1", "10.0.0.2", "10.0.0.3"]), [(0, 1), (1, 2), (2, 3)],
        limits, sink_endpoint="tcp://10.0.0.9:7000", keys={}, budget_tokens=None,
    )  # fmt: skip
    admitted = [peer_addresses(generation_sender_endpoints(s)) for s in setups]
    assert admitted == [{"10.0.0.3", "10.0.0.9"}, {"10.0.0.1"}, {"10.0.0.2"}]
    (alone,) = generation_setups(
        1, 1, spec, _members(["10.0.0.1"]), [(0, 3)], limits,
        sink_endpoint="tcp://10.0.0.9:7000", keys={}, budget_tokens=None,
    )  # fmt: skip
    assert generation_sender_endpoints(alone) == ["tcp://10.0.0.9:7000"]  # the client only
    # a coordinator from before upstream_endpoint names nobody: the stage opens the port
    older = replace(setups[1], upstream_endpoint=None)
    assert generation_sender_endpoints(older) == []
