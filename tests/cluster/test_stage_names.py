"""A second stage under a name a live stage holds is refused; a restarted one takes over.

The coordinator asks the holder with a probe: an answer refuses the newcomer, a
connection that is gone or a probe left unanswered lets it take the name over.
"""

from __future__ import annotations

import subprocess
import time

import pytest

from tests._support.coordinator_harness import Harness
from zpipe._errors import ConfigError, PeerGoneError
from zpipe.client import PipelineClient
from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.coordinator.events import RegisterAsked, RequestFailed
from zpipe.protocol.stage_control import Register
from zpipe.transport.codec import Message


def _register(h: Harness, name: str, routing_id: bytes, endpoint: str) -> None:
    register = Register(name=name, data_endpoint=endpoint, info={"probe_endpoint": endpoint})
    h.feed(RegisterAsked(routing_id, None, register))


def _to(h: Harness, routing_id: bytes, kind: str) -> list[Message]:
    return [s.wire for s in h.sent if s.to == routing_id and s.wire.kind == kind]


def _claimed() -> Harness:
    """Stage "a" registered as a#1; then a#2 registers under the same name."""
    h = Harness()
    _register(h, "a", b"a#1", "tcp://h:1")
    assert _to(h, b"a#1", "registered")
    h.now = 0.5
    _register(h, "a", b"a#2", "tcp://h:2")
    return h


def test_a_live_holder_that_answers_keeps_its_name_and_the_newcomer_is_refused() -> None:
    h = _claimed()
    (probe,) = _to(h, b"a#1", "probe")
    assert not _to(h, b"a#2", "registered") and not _to(h, b"a#2", "refused")
    h.feed_message("a#1", Message("probe_ack", {"nonce": probe.body["nonce"]}))  # type: ignore[attr-defined]
    (refused,) = _to(h, b"a#2", "refused")
    reason = refused.body["reason"]
    assert "the name 'a' is taken" in reason and "tcp://h:1" in reason
    assert h.events("registration_refused")[0]["stage"] == "a"
    member = h.state.membership.get("a")
    assert member is not None and member.routing_id == b"a#1"
    assert not h.events("stage_dead")
    h.advance(3.0, alive=("a",))  # the settled claim expires no more
    assert h.state.membership.get("a").routing_id == b"a#1"  # type: ignore[union-attr]


def test_a_newcomer_that_repeats_its_registration_opens_no_second_probe() -> None:
    h = _claimed()
    _register(h, "a", b"a#2", "tcp://h:2")
    assert len(_to(h, b"a#1", "probe")) == 1


def test_a_holder_whose_connection_is_gone_is_taken_over_at_once() -> None:
    h = _claimed()
    h.feed(RequestFailed("a", PeerGoneError("a", "probe")))
    assert _to(h, b"a#2", "registered") and not _to(h, b"a#2", "refused")
    member = h.state.membership.get("a")
    assert member is not None and member.routing_id == b"a#2"
    assert member.data_endpoint == "tcp://h:2"
    assert "connection is gone" in h.events("stage_dead")[0]["reason"]


def test_a_frozen_holder_that_does_not_answer_is_taken_over_when_it_would_be_dead() -> None:
    h = _claimed()
    membership = h.state.membership
    h.advance(membership.suspect_after_s + membership.probe_timeout_s - 0.3)
    assert not _to(h, b"a#2", "registered")
    h.advance(0.6)
    assert _to(h, b"a#2", "registered")
    assert h.state.membership.get("a").routing_id == b"a#2"  # type: ignore[union-attr]
    # the old process, should it wake, is a stranger: it is told to register again
    h.feed_message("a#1", Message("heartbeat", {"name": "a", "metrics": {}}))  # type: ignore[attr-defined]
    assert _to(h, b"a#1", "register_again")


def test_a_holder_silent_past_its_suspect_time_is_taken_over_without_a_probe() -> None:
    h = Harness()
    _register(h, "a", b"a#1", "tcp://h:1")
    h.now = h.state.membership.suspect_after_s + 0.1
    _register(h, "a", b"a#2", "tcp://h:2")
    assert not _to(h, b"a#1", "probe")
    assert _to(h, b"a#2", "registered")


def test_a_claim_settled_by_the_holders_death_meanwhile_admits_the_newcomer_once() -> None:
    h = _claimed()
    h.state.membership.declare_dead("a", "no heartbeat", h.now)
    _register(h, "a", b"a#2", "tcp://h:2")  # the newcomer's next registration is admitted
    assert len(_to(h, b"a#2", "registered")) == 1
    h.advance(3.0)  # the old claim does not fire later on the new holder
    member = h.state.membership.get("a")
    assert member is not None and member.routing_id == b"a#2" and member.state.value != "dead"
    assert not h.events("stage_name_taken_over")


def test_the_same_process_registering_again_is_no_claim() -> None:
    h = Harness()
    _register(h, "a", b"a#1", "tcp://h:1")
    h.now = 0.5
    _register(h, "a", b"a#1", "tcp://h:1")
    assert len(_to(h, b"a#1", "registered")) == 2 and not _to(h, b"a#1", "probe")


def test_a_run_whose_stage_is_taken_over_loses_that_stage() -> None:
    h = Harness()
    run = h.start_stream(["a", "b"], recover=False)
    h.now = 0.5
    _register(h, "b", b"b#new", "tcp://b:9")
    h.feed(RequestFailed("b", PeerGoneError("b", "probe")))
    (failed,) = h.to_client("stage_failed")
    assert failed.body["stage"] == "b" and failed.body["run"] == run
    assert _to(h, b"b#new", "registered")


# -- the processes -------------------------------------------------------------------------


def test_client_refuses_a_coordinator_host_that_does_not_resolve() -> None:
    import asyncio

    async def open_client() -> None:
        async with PipelineClient("tcp://no-such-host.invalid:5550"):
            pass

    with pytest.raises(ConfigError, match=r"'no-such-host\.invalid' .* cannot be resolved"):
        asyncio.run(open_client())


def _wait_for_log(cluster: LocalCluster, name: str, text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in cluster.logs(name):
        if time.monotonic() > deadline:
            raise AssertionError(f"{text!r} not in {name}'s log:\n{cluster.logs(name)}")
        time.sleep(0.2)


def test_a_duplicate_stage_exits_saying_the_name_is_taken_and_a_restart_takes_it_over() -> None:
    # a long suspect time: the restarted stage registers before the killed one's
    # heartbeats lapse, so the name is claimed while its holder still counts as alive
    with LocalCluster(
        [DeviceSpec("d0")], heartbeat_interval_s=0.5, suspect_after=120, log_level="info"
    ) as cluster:
        first = cluster.processes["d0"]
        duplicate = cluster.start_stage(DeviceSpec("d0"))
        cluster.processes["d0"] = first  # the duplicate is ours to watch, not the cluster's
        try:
            returncode = duplicate.wait(timeout=120)
        except subprocess.TimeoutExpired:
            duplicate.kill()
            raise
        assert returncode == 1
        _wait_for_log(cluster, "coordinator", "registration_refused", 30)
        assert "is taken" in cluster.logs("d0")  # the duplicate wrote to d0's log file too
        # the first one is still the member, alive
        (member,) = cluster.wait_for_stages(1, timeout_s=30)
        assert member["name"] == "d0" and member["state"] == "alive"
        # a crash, then a restart under the same name: it takes the name over
        cluster.kill("d0")
        cluster.start_stage(DeviceSpec("d0"))
        _wait_for_log(cluster, "coordinator", "stage_name_taken_over", 120)
        assert "connection is gone" in cluster.logs("coordinator")
        (member,) = cluster.wait_for_stages(1, timeout_s=120)
        assert member["state"] == "alive"
        assert cluster.processes["d0"].poll() is None
