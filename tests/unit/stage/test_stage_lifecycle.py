"""The stage's lifecycle controller, fed events in-process (no sockets, no asyncio)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zpipe._errors import ConfigError, ProtocolError
from zpipe.protocol.data_plane import Data, Grad, Labels, MicroBatchError
from zpipe.protocol.stage_control import (
    Assign,
    BackupRequest,
    Connect,
    HeartbeatAck,
    LinkPeers,
    LinkProbeRequest,
    MetricsRequest,
    Probe,
    ProfileRequest,
    Refused,
    Register,
    RegisterAgain,
    Registered,
    Shutdown,
    WeightsRequest,
)
from zpipe.stage.commands import (
    AllowProbePeers,
    Command,
    ConnectAssignment,
    DropMessage,
    Exit,
    Note,
    RestartTask,
    SendToCoordinator,
    StageJob,
    StartJob,
)
from zpipe.stage.lifecycle import (
    LIVE_LINK_SILENCE_FACTOR,
    CoordinatorLost,
    DataRoute,
    DataVerdict,
    Phase,
    RestartPolicy,
    StageLifecycle,
    StageTaskFailed,
)
from zpipe.stage.peer_policy import FetchGrant

REGISTRATION = Register(name="s0", data_endpoint="tcp://127.0.0.1:5000", info={})


def new_stage(now: float = 0.0, **kwargs: Any) -> StageLifecycle:
    return StageLifecycle(
        name="s0",
        coordinator="tcp://127.0.0.1:4000",
        registration=REGISTRATION,
        connect_s=15.0,
        silence_limit_s=10.0,
        now=now,
        **kwargs,
    )


def registered(now: float = 0.0, interval: float = 1.0) -> StageLifecycle:
    stage = new_stage(now)
    reply = Registered(name="s0", heartbeat_interval=interval)
    assert stage.registration_reply(reply, now) == []
    return stage


def sends(commands: list[Command]) -> list[tuple[str, dict[str, Any], int]]:
    return [(c.kind, dict(c.body), c.epoch) for c in commands if isinstance(c, SendToCoordinator)]


def assign(run: int, epoch: int, upstream: str = "client") -> Assign:
    return Assign(
        run=run, model={}, start=0, end=1, index=0, num_stages=1, upstream=upstream,
        downstream="client", downstream_endpoint="", dtype="float32", epoch=epoch,
    )  # fmt: skip


def connect(run: int, epoch: int = 0, ring: dict[str, Any] | None = None) -> Connect:
    return Connect(run=run, ring=ring, epoch=epoch)


# the shell fills these in (SendToCoordinator.attach_metrics)
NO_METRICS = {"metrics": {}}


def running(run: int = 1, epoch: int = 3, now: float = 0.0) -> StageLifecycle:
    """A stage connected to an inference assignment from ``client``."""
    stage = registered(now)
    stage.control_message(assign(run, epoch), now)
    stage.assignment_ready(run, epoch, build_s=0.5)
    [connected] = stage.control_message(connect(run, epoch), now)
    assert isinstance(connected, ConnectAssignment)
    stage.connected(run, DataRoute.inference(epoch, "client"))
    return stage


# --------------------------------------------------------------- registration


def test_registration_is_sent_until_the_connect_timeout_then_the_coordinator_is_lost() -> None:
    stage = new_stage(now=100.0)
    assert sends(stage.registration_due(100.0)) == [("register", REGISTRATION.body(), 0)]
    assert stage.registration_time_left(110.0) == pytest.approx(5.0)
    [exit_] = stage.registration_due(115.0)
    assert isinstance(exit_, Exit) and isinstance(exit_.error, CoordinatorLost)
    assert "within 15 s" in exit_.reason
    assert stage.phase is Phase.STOPPING


def test_a_refused_registration_fails_with_a_config_error_and_other_replies_are_ignored() -> None:
    stage = new_stage()
    assert stage.registration_reply(HeartbeatAck(), 1.0) == []
    assert stage.phase is Phase.REGISTERING
    [exit_] = stage.registration_reply(Refused(reason="duplicate name"), 1.0)
    assert isinstance(exit_, Exit) and isinstance(exit_.error, ConfigError)
    assert "refused this stage: duplicate name" in exit_.reason


def test_registered_makes_the_stage_idle_with_the_coordinators_interval() -> None:
    stage = registered(interval=0.25)
    assert stage.phase is Phase.IDLE
    assert stage.heartbeat_interval_s == 0.25


# ----------------------------------------------------------------- liveness


def test_heartbeats_carry_metrics_and_wait_at_most_an_interval() -> None:
    stage = registered(interval=0.5)
    [beat] = stage.heartbeat_due(1.0)
    assert isinstance(beat, SendToCoordinator)
    assert (beat.kind, dict(beat.body), beat.attach_metrics) == (
        "heartbeat",
        {"name": "s0", **NO_METRICS},
        True,
    )
    assert beat.timeout_s == 0.5


def test_a_silent_coordinator_is_lost_and_any_message_counts_as_word() -> None:
    stage = registered(now=0.0)
    stage.heard_from_coordinator(8.0)  # frames that did not even decode
    assert sends(stage.heartbeat_due(18.0)) != []
    [exit_] = stage.heartbeat_due(18.5)
    assert isinstance(exit_, Exit) and isinstance(exit_.error, CoordinatorLost)
    assert "for 10.5 s (limit 10 s)" in exit_.reason


def test_a_silent_coordinator_whose_connection_is_up_is_served_on_until_it_seems_hung() -> None:
    """Issue 33: a flooded coordinator read no heartbeat of an idle stage for 60.6 s,
    and the stage exited while the coordinator lived. Its process answers ZMTP pings
    on the control connection: the stage waits on, says so once, and gives up only
    after LIVE_LINK_SILENCE_FACTOR limits (a hung coordinator)."""
    stage = new_stage(0.0, link_lag_s=6.0)
    stage.link_up(0.0)
    stage.registration_reply(Registered(name="s0", heartbeat_interval=1.0), 0.0)
    out = stage.heartbeat_due(10.5)  # past the limit of 10 s: no exit
    assert not [c for c in out if isinstance(c, Exit)]
    [note] = [
        c for c in out if isinstance(c, Note) and c.event == "coordinator_silent_but_connected"
    ]
    assert note.fields["hung_after_s"] == LIVE_LINK_SILENCE_FACTOR * 10.0
    later = [stage.heartbeat_due(float(t)) for t in range(11, 50)]
    assert not [c for out in later for c in out if isinstance(c, Exit)]
    said = [c for out in later for c in out if isinstance(c, Note) and c.fields.get("hung_after_s")]
    assert said == []  # said once per silence
    [exit_] = stage.heartbeat_due(50.5)
    assert isinstance(exit_, Exit) and isinstance(exit_.error, CoordinatorLost)
    assert "connection is up" in exit_.reason


def test_a_dropped_connection_counts_as_seen_a_ping_timeout_before_the_drop() -> None:
    stage = new_stage(0.0, link_lag_s=6.0)
    stage.link_up(0.0)
    stage.registration_reply(Registered(name="s0", heartbeat_interval=1.0), 0.0)
    stage.heartbeat_due(10.5)  # flooded: silent, connected
    stage.link_down(30.0)  # then it went: last known alive at 24 s
    assert not [c for c in stage.heartbeat_due(34.0) if isinstance(c, Exit)]
    [exit_] = stage.heartbeat_due(34.5)  # 10.5 s after 24 s
    assert isinstance(exit_, Exit) and "no sign of its process" in exit_.reason


def test_a_killed_coordinator_is_lost_within_the_limit_of_its_last_word() -> None:
    """Its process gone, the connection drops at once: the limit counts from its
    last word, as without the connection's signs (``link_lag_s`` covers the pings)."""
    stage = new_stage(0.0, link_lag_s=6.0)
    stage.link_up(0.0)
    stage.registration_reply(Registered(name="s0", heartbeat_interval=1.0), 0.0)
    stage.control_message(HeartbeatAck(), 8.0)
    stage.link_down(8.1)  # killed at 8 s
    assert not [c for c in stage.heartbeat_due(18.0) if isinstance(c, Exit)]
    [exit_] = stage.heartbeat_due(18.5)
    assert isinstance(exit_, Exit) and "for 10.5 s (limit 10 s)" in exit_.reason


def test_a_reconnection_during_a_silence_is_a_sign_of_life_and_a_later_drop_ends_it() -> None:
    stage = new_stage(0.0, link_lag_s=6.0)
    stage.registration_reply(Registered(name="s0", heartbeat_interval=1.0), 0.0)
    stage.link_up(9.0)  # a handshake: the coordinator's process answered at 9 s
    stage.link_down(9.5)  # and dropped again (its pings timed out before)
    assert not [c for c in stage.heartbeat_due(19.0) if isinstance(c, Exit)]
    [exit_] = stage.heartbeat_due(19.5)
    assert isinstance(exit_, Exit)


def test_a_coordinator_away_is_reported_once_and_the_run_is_served_on() -> None:
    stage = running(now=0.0)
    assert [type(c) for c in stage.heartbeat_due(1.0)] == [SendToCoordinator]
    assert [type(c) for c in stage.heartbeat_due(2.0)] == [SendToCoordinator]
    away, beat = stage.heartbeat_due(3.5)  # three intervals of silence
    assert isinstance(away, Note) and away.event == "coordinator_away"
    assert away.fields["limit_s"] == 10.0 and away.fields["phase"] == "running"
    assert sends([beat]) == [("heartbeat", {"name": "s0", **NO_METRICS}, 0)]
    assert stage.coordinator_away
    # the usual cadence for eight heartbeats without an answer (a coordinator that is
    # only slow hears it), then one every three intervals; the absence is said once
    beats = [t for t in range(4, 10) if sends(stage.heartbeat_due(float(t)))]
    assert beats == [4, 5, 6, 7, 8]
    assert stage.data_verdict(Data, "client", 3, has_tensors=True).verdict is DataVerdict.DELIVER
    assert stage.phase is Phase.RUNNING


def test_after_eight_unanswered_heartbeats_one_goes_every_three_intervals() -> None:
    stage = StageLifecycle(
        name="s0",
        coordinator="tcp://127.0.0.1:4000",
        registration=REGISTRATION,
        connect_s=15.0,
        silence_limit_s=60.0,
        now=0.0,
    )
    stage.registration_reply(Registered(name="s0", heartbeat_interval=1.0), 0.0)
    beats = [t for t in range(1, 30) if sends(stage.heartbeat_due(float(t)))]
    assert beats == [1, 2, 3, 4, 5, 6, 7, 8, 11, 14, 17, 20, 23, 26, 29]
    stage.control_message(HeartbeatAck(), 29.5)  # the usual cadence again
    assert [t for t in range(30, 34) if sends(stage.heartbeat_due(float(t)))] == [30, 31, 32, 33]


def test_the_first_word_after_an_absence_is_reported_and_answered_with_a_heartbeat() -> None:
    stage = running(now=0.0)
    stage.heartbeat_due(4.0)
    back, beat = stage.control_message(HeartbeatAck(), 9.0)
    assert isinstance(back, Note) and back.event == "coordinator_back"
    assert back.fields == {"away_s": 9.0, "phase": "running"}
    assert sends([beat]) == [("heartbeat", {"name": "s0", **NO_METRICS}, 0)]
    assert not stage.coordinator_away
    assert stage.control_message(HeartbeatAck(), 9.5) == []  # said once
    # a coordinator that forgot this stage has it register again; the run is untouched
    stage.heartbeat_due(14.0)
    back, beat, register = stage.control_message(RegisterAgain(reason="x"), 15.0)
    assert isinstance(back, Note)
    assert sends([register]) == [("register", REGISTRATION.body(), 0)]
    assert stage.phase is Phase.RUNNING and stage.route is not None


def test_a_frame_that_does_not_decode_also_ends_the_absence() -> None:
    stage = registered(now=0.0)
    stage.heartbeat_due(5.0)
    stage.heard_from_coordinator(6.0)  # the shell saw frames; the message was bad
    [back, _beat, drop] = stage.control_message(Data(run=1, mb=0, src="x"), 6.0)
    assert isinstance(back, Note) and back.fields["away_s"] == 6.0
    assert isinstance(drop, DropMessage)


def test_a_control_message_resets_the_silence_clock() -> None:
    stage = registered(now=0.0)
    stage.control_message(HeartbeatAck(), 9.0)
    assert not any(isinstance(c, Exit) for c in stage.heartbeat_due(15.0))


# ---------------------------------------------------------- control messages


def test_simple_requests_are_answered_at_once() -> None:
    stage = registered()
    assert sends(stage.control_message(Probe(nonce=7), 1.0)) == [("probe_ack", {"nonce": 7}, 0)]
    assert sends(stage.control_message(RegisterAgain(reason="x"), 1.0)) == [
        ("register", REGISTRATION.body(), 0)
    ]
    [metrics] = stage.control_message(MetricsRequest(run=4, epoch=9), 1.0)
    assert isinstance(metrics, SendToCoordinator) and metrics.attach_metrics
    assert (metrics.kind, dict(metrics.body), metrics.epoch) == (
        "metrics",
        {"run": 4, "name": "s0", **NO_METRICS},
        9,
    )
    allow, ok = stage.control_message(LinkPeers(keys={"s1": "KEY"}), 1.0)
    assert allow == AllowProbePeers({"s1": "KEY"})
    assert sends([ok]) == [("link_peers_ok", {"name": "s0"}, 0)]
    grant = {"peer": "s2", "owner": "s1", "run": 3, "step": 4, "start": 2, "end": 5}
    allow, _ = stage.control_message(LinkPeers(keys={}, fetches=[grant]), 1.0)
    assert allow == AllowProbePeers({}, (FetchGrant("s2", "s1", 3, 4, 2, 5),))
    # an empty list (the coordinator's revocation at the next backup) answers no fetch
    allow, _ = stage.control_message(LinkPeers(keys={}, fetches=[]), 1.0)
    assert allow == AllowProbePeers({}, ())
    with pytest.raises(ProtocolError, match="fetch grant"):
        stage.control_message(LinkPeers(keys={}, fetches=[{"peer": 1}]), 1.0)
    assert stage.control_message(HeartbeatAck(), 1.0) == []


def test_long_requests_become_jobs_with_their_concurrency_rule() -> None:
    stage = registered()
    cases = [
        (ProfileRequest(model={}, batch_size=1, dtype="f32", repeats=1), StageJob.PROFILE, False),
        (LinkProbeRequest(target="s1", endpoint="tcp://h:1"), StageJob.LINK_PROBE, False),
        (WeightsRequest(run=1, step=1), StageJob.WEIGHTS, True),  # the newest wins
        (BackupRequest(run=1, step=1, holder="s1"), StageJob.BACKUP, True),
        (assign(1, 0), StageJob.ASSIGN, True),
    ]  # one at a time where newest_wins is False
    for message, job, newest_wins in cases:
        assert stage.control_message(message, 1.0) == [StartJob(job, message, newest_wins)]


def test_shutdown_is_a_clean_exit_and_refused_loses_the_coordinator() -> None:
    stage = registered()
    [exit_] = stage.control_message(Shutdown(reason="bye"), 1.0)
    assert exit_ == Exit("bye") and stage.phase is Phase.STOPPING
    assert stage.control_message(Probe(nonce=1), 2.0) == []  # stopping

    other = registered()
    [lost] = other.control_message(Refused(reason="declared dead"), 1.0)
    assert isinstance(lost, Exit) and isinstance(lost.error, CoordinatorLost)


def test_an_unexpected_control_message_is_dropped() -> None:
    [drop] = registered().control_message(Data(run=1, mb=0, src="x"), 1.0)
    assert isinstance(drop, DropMessage) and "unexpected control message 'data'" in drop.reason


# --------------------------------------------------------------- assignment


def test_an_assignment_is_built_then_connected_then_running() -> None:
    stage = registered()
    stage.control_message(assign(2, 5), 1.0)
    assert stage.phase is Phase.ASSIGNING
    ready = stage.assignment_ready(
        2, 5, build_s=1.5, ring_endpoint="tcp://h:9", max_message_bytes=4096
    )
    body = {"run": 2, "name": "s0", "build_s": 1.5, "ring_endpoint": "tcp://h:9"}
    assert sends(ready) == [("ready", {**body, "max_message_bytes": 4096}, 5)]
    assert stage.phase is Phase.ASSIGNED
    [connected] = stage.control_message(connect(2, ring={"r": 1}), 2.0)
    assert connected == ConnectAssignment(2, 5, {"r": 1})
    assert sends(stage.connected(2, DataRoute.inference(5, "client"))) == [
        ("connected", {"run": 2, "name": "s0"}, 5)
    ]
    assert stage.phase is Phase.RUNNING
    stage.data_stopped()
    assert stage.phase is Phase.IDLE and stage.route is None


def test_a_connect_for_a_run_not_built_is_dropped() -> None:
    stage = registered()
    [drop] = stage.control_message(connect(3), 1.0)
    assert isinstance(drop, DropMessage) and "run 3" in drop.reason
    stage.control_message(assign(3, 1), 1.0)  # assigned but not built yet
    assert isinstance(stage.control_message(connect(3), 1.0)[0], DropMessage)


def test_a_replaced_assignment_that_finishes_late_is_not_announced() -> None:
    stage = registered()
    stage.control_message(assign(1, 1), 1.0)
    stage.control_message(assign(1, 2), 1.0)  # a re-plan before the first was built
    assert stage.assignment_ready(1, 1, build_s=1.0) == []
    assert sends(stage.assignment_ready(1, 2, build_s=1.0))[0][2] == 2


def test_build_and_connect_failures_are_reported_as_assign_failed() -> None:
    stage = registered()
    stage.control_message(assign(1, 4), 1.0)
    assert sends(stage.assignment_failed(1, 4, "ModelSpecError: no such family")) == [
        ("assign_failed", {"run": 1, "name": "s0", "error": "ModelSpecError: no such family"}, 4)
    ]
    assert stage.phase is Phase.IDLE
    stage.control_message(assign(1, 5), 1.0)
    stage.assignment_ready(1, 5, build_s=0.1)
    stage.control_message(connect(1), 1.0)
    assert sends(stage.connect_failed(1, 5, "ConfigError: no endpoint"))[0][0] == "assign_failed"
    assert stage.phase is Phase.IDLE


# ---------------------------------------------------------------------- data


def test_only_the_assigned_upstreams_data_of_the_running_epoch_is_delivered() -> None:
    stage = running(epoch=3)
    assert stage.data_verdict(Data, "client", 3, has_tensors=True).verdict is DataVerdict.DELIVER
    error = stage.data_verdict(MicroBatchError, "client", 3, has_tensors=False)
    assert error.verdict is DataVerdict.DELIVER
    assert stage.data_verdict(Data, "client", 2, has_tensors=True).verdict is DataVerdict.STALE
    assert stage.data_verdict(Data, "client", 4, has_tensors=True).verdict is DataVerdict.STALE
    impostor = stage.data_verdict(Data, "mallory", 3, has_tensors=True)
    assert impostor.verdict is DataVerdict.DROP and "must come from ['client']" in impostor.reason
    assert stage.data_verdict(Grad, "client", 3, has_tensors=True).verdict is DataVerdict.DROP
    assert stage.data_verdict(Data, "client", 3, has_tensors=False).verdict is DataVerdict.DROP


def test_training_routes_take_gradients_from_downstream_and_labels_on_the_last_stage() -> None:
    stage = registered()
    stage.control_message(assign(1, 2), 0.0)
    stage.assignment_ready(1, 2, build_s=0.0)
    stage.control_message(connect(1), 0.0)
    stage.connected(1, DataRoute.training(2, ("a", "b"), (CLIENT := "client",), last=True))
    assert stage.data_verdict(Data, "b", 2, has_tensors=False).verdict is DataVerdict.DELIVER
    assert stage.data_verdict(Grad, CLIENT, 2, has_tensors=True).verdict is DataVerdict.DELIVER
    assert stage.data_verdict(Labels, CLIENT, 2, has_tensors=True).verdict is DataVerdict.DELIVER
    assert stage.data_verdict(Labels, "a", 2, has_tensors=True).verdict is DataVerdict.DROP


def test_nothing_is_delivered_once_a_new_assignment_arrives() -> None:
    stage = running(epoch=3)
    stage.control_message(assign(1, 4), 1.0)
    assert stage.data_verdict(Data, "client", 3, has_tensors=True).verdict is DataVerdict.DROP
    assert stage.data_verdict(Data, "client", 4, has_tensors=True).verdict is DataVerdict.DROP


# Events of a random run: assignments (epochs only grow, as the coordinator's do),
# builds finishing (or failing), connects, data of any epoch, stops.
_event = st.one_of(
    st.tuples(st.just("assign"), st.integers(1, 3), st.integers(0, 3)),  # run, epoch step
    st.tuples(st.just("built"), st.booleans(), st.just(0)),  # finishes: ok or failed
    st.tuples(st.just("connect"), st.integers(1, 3), st.booleans()),  # run, connect ok
    st.tuples(st.just("data"), st.integers(0, 12), st.sampled_from(["client", "x"])),
    st.tuples(st.just("stop"), st.just(0), st.just(0)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_event, max_size=40))
def test_property_no_message_of_another_epoch_is_ever_delivered(events: list[Any]) -> None:
    stage = registered()
    epoch, building = 0, None
    newest_seen = stage.newest_epoch
    for kind, a, b in events:
        if kind == "assign":
            epoch += b
            stage.control_message(assign(a, epoch), 1.0)
            building = (a, epoch)
        elif kind == "built" and building is not None:
            if a:
                stage.assignment_ready(*building, build_s=0.0)
            else:
                stage.assignment_failed(*building, "failed")
            building = None
        elif kind == "connect":
            commands = stage.control_message(connect(a), 1.0)
            for command in commands:
                if isinstance(command, ConnectAssignment):
                    if b:
                        stage.connected(command.run, DataRoute.inference(command.epoch, "client"))
                    else:
                        stage.connect_failed(command.run, command.epoch, "failed")
        elif kind == "data":
            decision = stage.data_verdict(Data, b, a, has_tensors=True)
            if decision.verdict is DataVerdict.DELIVER:
                # delivered only from the assigned sender, of the running assignment's
                # epoch, which is the newest assignment's: nothing older reaches compute
                assert stage.phase is Phase.RUNNING and b == "client"
                assert a == stage.route.epoch == stage.newest_epoch == epoch  # type: ignore[union-attr]
        elif kind == "stop":
            stage.data_stopped()
        assert stage.newest_epoch >= newest_seen  # epochs only increase
        newest_seen = stage.newest_epoch


# --------------------------------------------------------------- supervision


def test_a_dying_task_is_restarted_until_it_dies_too_often_then_the_stage_fails() -> None:
    stage = new_stage(restart_policy=RestartPolicy(limit=2, window_s=10.0))
    assert stage.task_died("data-receive", "ZMQError: boom", 1.0) == [RestartTask("data-receive")]
    assert stage.task_died("control", "ZMQError: boom", 1.5) == [RestartTask("control")]
    assert stage.task_died("data-receive", "ZMQError: boom", 2.0) == [RestartTask("data-receive")]
    [exit_] = stage.task_died("data-receive", "ZMQError: boom", 3.0)
    assert isinstance(exit_, Exit) and isinstance(exit_.error, StageTaskFailed)
    assert "data-receive task died 3 times within 10 s; last: ZMQError: boom" in exit_.reason
    assert stage.task_died("control", "late", 4.0) == []  # already stopping


def test_deaths_far_apart_are_each_restarted() -> None:
    stage = new_stage(restart_policy=RestartPolicy(limit=1, window_s=5.0))
    for t in (0.0, 6.0, 12.0, 18.0):
        assert stage.task_died("probe", "err", t) == [RestartTask("probe")]


def test_a_stop_request_stops_once() -> None:
    stage = registered()
    assert stage.stop_requested("signal") == [Exit("signal")]
    assert stage.stop_requested("signal") == []
