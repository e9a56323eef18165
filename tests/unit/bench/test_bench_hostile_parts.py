"""bench/hostile.py's pure pieces: the hostile messages its finding classes send (each
is what the finding describes, and the real receiver's checks see it so) and how a
class's window is judged (crashes, hangs, false deaths, exactness, memory, log bytes).
The attacks themselves run only in the bench."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from bench._hostile_judge import (
    Snapshot,
    class_goals_met,
    log_events,
    merge,
    rss_ratios,
    stage_deaths,
    stream_marks,
    window_figures,
)
from bench._hostile_wire import (
    FL_CLASSES,
    absurd_fl_registrations,
    bulk_chunks,
    fl_registration,
    many_frames,
    registration,
    tiny_sequential_bytes,
    tiny_sequential_request,
    zmtp_greeting,
    zmtp_long_frame_header,
    zmtp_ready,
)
from zpipe._errors import ProtocolError
from zpipe.federated.net_admission import profile_from_register
from zpipe.models.examples import tiny_sequential
from zpipe.protocol import REGISTRY
from zpipe.protocol.bulk import BulkChunk
from zpipe.protocol.client_control import RunRequest
from zpipe.protocol.federated import FlRegister
from zpipe.protocol.stage_control import Register
from zpipe.transport.bulk import ChunkHeader, Inbox
from zpipe.transport.codec import decode

# ------------------------------------------------------------------ the messages


def _parse(frames: list[bytes]) -> object:
    return REGISTRY.parse(decode([memoryview(f) for f in frames]))


def test_a_zmtp_greeting_is_rfc_23s_64_bytes_for_null() -> None:
    greeting = zmtp_greeting()
    assert len(greeting) == 64
    assert greeting[0] == 0xFF and greeting[9] == 0x7F  # signature
    assert greeting[10:12] == bytes([3, 0])  # version 3.0
    assert greeting[12:32] == b"NULL" + b"\0" * 16  # mechanism, padded
    assert greeting[32] == 0  # as-server: a client


def test_a_ready_command_names_its_socket_type() -> None:
    ready = zmtp_ready("DEALER")
    assert ready[0] == 0x04 and ready[1] == len(ready) - 2  # short command, its size
    body = ready[2:]
    assert body[:6] == b"\x05READY"
    name_len = body[6]
    assert body[7 : 7 + name_len] == b"Socket-Type"
    (value_len,) = struct.unpack(">I", body[7 + name_len : 11 + name_len])
    assert body[11 + name_len :] == b"DEALER" and value_len == 6


def test_a_long_frame_header_carries_the_size_big_endian() -> None:
    assert zmtp_long_frame_header(2**31 - 1) == b"\x02" + (2**31 - 1).to_bytes(8, "big")
    assert zmtp_long_frame_header(5, more=True)[0] == 0x03
    with pytest.raises(ValueError):
        zmtp_long_frame_header(-1)


def test_many_frames_shares_one_frame_object() -> None:
    frame = b"x"
    message = many_frames(1000, frame)
    assert len(message) == 1000 and all(f is frame for f in message)
    with pytest.raises(ValueError):
        many_frames(0, frame)


def test_the_fake_stage_registers_as_a_stage_that_takes_no_work() -> None:
    message = _parse(registration("mallory"))
    assert isinstance(message, Register)
    assert message.name == "mallory" and message.data_endpoint == "tcp://127.0.0.1:9"


def test_half_a_bulk_transfer_is_valid_chunks_that_never_complete() -> None:
    """Finding 5's transfer: the coordinator's reassembly takes every chunk sent (so
    the bench measures memory held, not a refusal) and is left waiting for the rest."""
    announced, sent = 64 << 20, 40 << 20  # scaled down from 1 GiB and 192 MB
    inbox = Inbox(cap_bytes=1 << 31)
    chunks = list(bulk_chunks("mallory", "tok", 3, announced, sent))
    received = 0
    for frames in chunks:
        chunk = _parse(frames)
        assert isinstance(chunk, BulkChunk) and chunk.name == "mallory" and chunk.token == "tok"
        payload = chunk.tensors[0]
        assert inbox.add(ChunkHeader.from_body(chunk.body()), payload.numpy().data) is None
        received += payload.numel()
    assert received == sent and inbox.open_transfers == 1
    with pytest.raises(ValueError):
        next(bulk_chunks("m", "t", 0, 10, 11))


def test_the_bypass_request_asks_for_the_example_factory_at_that_width() -> None:
    request = _parse(tiny_sequential_request(16_384, "tcp://127.0.0.1:5"))
    assert isinstance(request, RunRequest)
    config = request.model["config"]
    assert config["factory"] == "zpipe.models.examples:tiny_sequential"
    assert config["kwargs"]["hidden"] == 16_384 and request.num_units == 5
    assert request.sink_endpoint == "tcp://127.0.0.1:5"
    # the figure the bench reports is the real model's size (hidden 16,384: about 1 GiB)
    real = sum(p.numel() for p in tiny_sequential(hidden=64).parameters()) * 4
    assert tiny_sequential_bytes(64) == real
    assert 1.0 < tiny_sequential_bytes(16_384) / 2**30 < 1.01


def test_the_absurd_fl_registrations_are_the_ones_the_server_must_refuse() -> None:
    registrations = [_parse(f) for f in absurd_fl_registrations(5000)]
    assert [r.latency_s for r in registrations if isinstance(r, FlRegister)][:3] == [
        1e308,
        5e-324,
        0.0,
    ]
    for message in registrations:
        assert isinstance(message, FlRegister)
        with pytest.raises(ProtocolError):
            profile_from_register(message, FL_CLASSES)
    silent = _parse(fl_registration(1000, 0.05, [10] * FL_CLASSES))
    assert isinstance(silent, FlRegister)
    assert profile_from_register(silent, FL_CLASSES).client_id == 1000  # a valid id


# ------------------------------------------------------------------ the judging


def _snap(
    outputs: int, mismatches: int = 0, deaths: tuple[str, ...] = (), **kw: object
) -> Snapshot:
    alive = kw.get("alive", {"coordinator": True, "s0": True})
    logs = kw.get("log_bytes", {"coordinator": 100})
    return Snapshot(outputs, mismatches, deaths, alive, logs)  # type: ignore[arg-type]


def test_a_quiet_window_meets_every_goal() -> None:
    figures = window_figures(
        _snap(10),
        _snap(20, log_bytes={"coordinator": 150}),
        peak_kib={"coordinator": 150},
        idle_kib={"coordinator": 100},
        resumed_s=0.02,
    )
    assert figures["crashes"] == 0 and figures["hangs"] == 0 and figures["false_deaths"] == 0
    assert figures["stream_exact"] and figures["stream_outputs"] == 10
    assert (
        figures["peak_over_idle_rss"] == 1.5 and figures["peak_over_idle_process"] == "coordinator"
    )
    assert figures["log_bytes"] == {"coordinator": 50} and figures["log_bytes_total"] == 50
    assert class_goals_met(figures)


def test_each_failure_of_a_window_is_counted_and_fails_the_class() -> None:
    before = _snap(10, deaths=("old",))
    crashed = window_figures(
        before,
        _snap(12, alive={"coordinator": False, "s0": True}),
        peak_kib={},
        idle_kib={},
        resumed_s=0.1,
    )
    assert crashed["crashes"] == 1 and crashed["crashed"] == ["coordinator"]
    assert not class_goals_met(crashed)
    stalled = window_figures(before, _snap(10), peak_kib={}, idle_kib={}, resumed_s=None)
    assert stalled["hangs"] == 1 and not stalled["stream_exact"] and not class_goals_met(stalled)
    wrong = window_figures(before, _snap(15, mismatches=1), peak_kib={}, idle_kib={}, resumed_s=0.1)
    assert not wrong["stream_exact"] and not class_goals_met(wrong)
    grown = window_figures(
        before, _snap(15), peak_kib={"s0": 250}, idle_kib={"s0": 100}, resumed_s=0.1
    )
    assert grown["peak_over_idle_rss"] == 2.5 and not class_goals_met(grown)
    assert not class_goals_met(
        {
            **window_figures(before, _snap(15), peak_kib={}, idle_kib={}, resumed_s=0.1),
            "refused": False,
        }
    )


def test_only_a_death_the_class_did_not_cause_is_false() -> None:
    before = _snap(10, deaths=("old",))
    after = _snap(15, deaths=("old", "mallory", "s0"))
    figures = window_figures(
        before, after, peak_kib={}, idle_kib={}, resumed_s=0.1, expected_deaths=["mallory"]
    )
    assert figures["false_deaths"] == 1 and figures["false_dead"] == ["s0"]
    own = window_figures(
        before,
        _snap(15, deaths=("old", "mallory")),
        peak_kib={},
        idle_kib={},
        resumed_s=0.1,
        expected_deaths=["mallory"],
    )
    assert own["false_deaths"] == 0 and own["expected_deaths"] == ["mallory"]
    assert class_goals_met(own)


def test_targets_of_one_class_add_up() -> None:
    entry: dict[str, object] = {}
    one = window_figures(
        _snap(0),
        _snap(5, log_bytes={"coordinator": 130}),
        peak_kib={"s0": 120},
        idle_kib={"s0": 100},
        resumed_s=0.5,
    )
    two = window_figures(
        _snap(5, log_bytes={"coordinator": 130}),
        _snap(5, log_bytes={"coordinator": 200}),
        peak_kib={"s0": 300},
        idle_kib={"s0": 100},
        resumed_s=None,
    )
    merge(entry, one)
    merge(entry, two)
    assert entry["hangs"] == 1 and entry["stream_exact"] is False
    assert entry["peak_over_idle_rss"] == 3.0 and entry["log_bytes"] == {"coordinator": 100}
    assert entry["log_bytes_total"] == 100 and entry["stream_outputs"] == 5


def test_the_logs_and_marks_are_read_as_written() -> None:
    log = "\n".join(
        [
            json.dumps({"stage": "s1", "event": "stage_dead"}),
            "not json",
            json.dumps({"event": "dropped_message", "peer": "x" * 200}),
            json.dumps({"stage": "s2", "event": "stage_dead"}),
            '{"stage": "s3", "event": "stage_dead"',  # cut by a crash
        ]
    )
    assert stage_deaths(log) == ("s1", "s2")
    events = log_events(log, top=2)
    assert list(events) == ["dropped_message", "stage_dead"]
    assert stream_marks(b"1101") == (4, 1) and stream_marks(b"") == (0, 0)
    assert rss_ratios({"a": 200, "b": 10, "c": 5}, {"a": 100, "b": None}) == {"a": 2.0}


def test_tensors_of_the_bench_are_never_pickled() -> None:
    # the chunks carry a raw uint8 tensor frame, as a stage's own would
    frames = next(bulk_chunks("m", "t", 0, 1 << 20, 1 << 20))
    assert len(frames) == 2 and len(frames[1]) == 1 << 20
    assert torch.frombuffer(bytearray(frames[1]), dtype=torch.uint8).sum() == 0


# ------------------------------------------------------------------ the plan


def _members() -> list[dict[str, object]]:
    return [
        {
            "name": name,
            "data_endpoint": f"tcp://127.0.0.1:{port}",
            "info": {"probe_endpoint": f"tcp://127.0.0.1:{port + 1}"},
        }
        for name, port in (("h0", 5000), ("h1", 5010), ("idle0", 5020))
    ]


def test_the_plan_has_every_finding_and_runs_the_frame_storms_last() -> None:
    """Building the plan opens nothing (each step's attack is a closure); ``--only``
    picks classes by these names."""
    from bench._hostile_plan import FAKE_STAGE, attack_plan, peer_request_steps
    from bench.hostile import _parse

    args = _parse([])
    members = _members()
    plan = [
        *peer_request_steps(members, "tcp://127.0.0.1:4000", 4, "/nonexistent/marker"),
        *attack_plan(
            members,
            "tcp://127.0.0.1:4000",
            "tcp://127.0.0.1:4100",
            args,
            control="",
            idle_data="tcp://127.0.0.1:5020",
            first_data="tcp://127.0.0.1:5000",
            on_sent=lambda: None,
        ),
    ]
    classes = [step.klass for step in plan]
    findings = {
        "frame_amplification",
        "max_model_bypass",
        "data_port_frames",
        "fl_identities",
        "half_bulk",
        "probe_flood",
        "slowloris",
    }
    assert findings <= set(classes)
    assert classes[-1] == "frame_amplification"  # it can stop the cluster: last
    half = next(step for step in plan if step.klass == "half_bulk")
    assert half.expected_deaths == (FAKE_STAGE,) and half.target == "coordinator"
    storms = [step for step in plan if step.klass == "data_port_frames"]
    assert [(s.endpoint, s.target) for s in storms] == [
        ("tcp://127.0.0.1:5020", "idle0"),
        ("tcp://127.0.0.1:5000", "h0"),
    ]
    probes = [step for step in plan if step.klass == "probe_flood"]
    assert {s.target for s in probes} == {"h0", "h1", "idle0"} and all(s.cpu for s in probes)
    assert not any(step.expected_deaths for step in plan if step.klass != "half_bulk")
