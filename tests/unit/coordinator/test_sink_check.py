"""A loopback sink advertised to a last stage on another host is refused at run start."""

from __future__ import annotations

from typing import Any

import pytest

from tests._support.coordinator_harness import SPEC, Harness
from zpipe._errors import ConfigError
from zpipe.coordinator.sink_check import check_sink_reachable, is_local_only

LOOPBACK_SINK = "tcp://127.0.0.1:5600"


@pytest.mark.parametrize(
    ("host", "local"),
    [
        ("127.0.0.1", True),
        ("127.3.2.1", True),
        ("::1", True),
        ("0.0.0.0", True),
        ("::", True),
        ("localhost", True),
        ("10.0.0.2", False),
        ("dev2.lan", False),
    ],
)
def test_which_hosts_mean_this_machine(host: str, local: bool) -> None:
    assert is_local_only(host) is local


def test_a_loopback_sink_for_a_remote_last_stage_is_refused_with_the_fix() -> None:
    with pytest.raises(ConfigError) as refused:
        check_sink_reachable(LOOPBACK_SINK, {"dev2": "tcp://10.0.0.2:5555"})
    text = str(refused.value)
    assert LOOPBACK_SINK in text and "'dev2'" in text and "10.0.0.2" in text
    assert "advertise_host" in text and "--advertise-host" in text


@pytest.mark.parametrize("sink", ["tcp://0.0.0.0:5600", "tcp://[::1]:5600", "ipc:///tmp/sink"])
def test_unspecified_ipv6_and_ipc_sinks_are_local_only_too(sink: str) -> None:
    with pytest.raises(ConfigError, match="another host"):
        check_sink_reachable(sink, {"dev2": "tcp://10.0.0.2:5555"})


@pytest.mark.parametrize(
    ("sink", "last", "local_hosts"),
    [
        (LOOPBACK_SINK, "tcp://127.0.0.1:5555", ()),  # everything on one machine
        (LOOPBACK_SINK, "tcp://192.168.1.5:5555", ("192.168.1.5",)),  # the same host's LAN IP
        (LOOPBACK_SINK, "tcp://vm:5555", ("vm", "127.0.0.1")),  # the same host's name
        ("tcp://192.168.1.9:5600", "tcp://10.0.0.2:5555", ()),  # a routable sink
        ("inproc://sink", "tcp://10.0.0.2:5555", ()),  # a test inside one process
    ],
)
def test_a_sink_the_last_stage_can_reach_passes(
    sink: str, last: str, local_hosts: tuple[str, ...]
) -> None:
    check_sink_reachable(sink, {"dev2": last}, local_hosts)


def _request(sink: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": SPEC.to_dict(),
        "dtype": "float32",
        "sink_endpoint": sink,
        "wait_for_stages_s": 0.0,
        "stage_names": ["a", "b"],
        **extra,
    }


@pytest.mark.parametrize(
    "mode",
    [
        {"planner": "even"},
        {
            "mode": "train",
            "partition": [[0, 3], [3, 6]],
            "train": {"num_microbatches": 2, "optimizer": {"name": "sgd", "lr": 0.1}},
        },
    ],
    ids=["infer", "train"],
)
def test_the_coordinator_refuses_the_run_before_assigning_anything(mode: dict[str, Any]) -> None:
    h = Harness()
    h.register("a", "tcp://10.0.0.1:5555")
    h.register("b", "tcp://10.0.0.2:5555")
    h.client("run_request", **_request(LOOPBACK_SINK, **mode))
    (failed,) = h.to_client("run_failed")
    assert "last stage 'b' runs at 10.0.0.2" in failed.body["error"]
    assert not h.to("a", "assign") and not h.to("b", "assign")
    assert h.core.run is None
    # the same run with a sink the stages can reach starts
    h.client("run_request", **_request("tcp://10.0.0.9:5600", **mode))
    assert h.to("b", "assign")


def test_a_recovery_that_would_make_a_remote_stage_last_fails_the_run_saying_why() -> None:
    """Issue 17: the sink was checked only at the start; a re-plan that moves the end of
    the pipeline to another host would leave the client waiting for lost results."""
    h = Harness()
    h.register("a", "tcp://10.0.0.1:5555")  # another host
    h.register("b", "tcp://127.0.0.1:5555")  # this one: the last stage at the start
    h.start_stream(["a", "b"], recover=True, sink_endpoint=LOOPBACK_SINK)
    h.advance(8.0, alive=("a",))  # b dies; a alone would be the last stage
    assert not h.to_client("run_replanned")
    (failed,) = h.to_client("stage_failed")
    assert failed.body["stage"] == "b"
    reason = failed.body["reason"]
    assert "recovery failed" in reason and "runs at 10.0.0.1" in reason
