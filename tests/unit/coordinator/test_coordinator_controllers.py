"""The coordinator's controllers, in-process: events in, commands out, no sockets."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests._support.coordinator_harness import CLIENT, Harness
from zpipe._errors import ConfigError, TransportTimeout
from zpipe.coordinator.commands import (
    AwaitReplies,
    Log,
    Now,
    Persist,
    PlanInference,
    Send,
    StartTimer,
)
from zpipe.coordinator.events import RegisterAsked, StallReported, Tick
from zpipe.coordinator.flows import FlowRunner
from zpipe.coordinator.runs.inference import InferenceController
from zpipe.protocol.client_control import Stalled
from zpipe.protocol.stage_control import (
    BackedUp,
    BackupRequest,
    Register,
    Weights,
    WeightsRequest,
)


def _weights(name: str) -> Weights:
    return Weights(run=0, name=name, step=0, keys=[], error="")


def _backed_up(name: str) -> BackedUp:
    return BackedUp(run=0, name=name, step=0, holder="", keys=[], nbytes=0, error="")


NAMES = ["a", "b", "c"]


def test_a_stream_is_assigned_made_ready_and_connected() -> None:
    h = Harness()
    run = h.start_stream(NAMES)
    assigns = {n: h.to(n, "assign")[0] for n in NAMES}
    # the even partition of six units, each stage sending to the next, the last to the client
    assert [(m.body["start"], m.body["end"]) for m in assigns.values()] == [(0, 2), (2, 4), (4, 6)]
    assert assigns["a"].body["downstream_endpoint"] == "tcp://b:1"
    assert assigns["c"].body["downstream"] == "client"
    assert assigns["c"].body["downstream_endpoint"] == "tcp://client:9"
    ready = h.to_client("run_ready")[0]
    body = ready.body
    assert (body["first_stage"], body["last_stage"], body["run"]) == ("a", "c", run)
    assert all(h.to(n, "connect") for n in NAMES)
    assert isinstance(h.state.current, InferenceController) and h.state.current.run.streaming


def test_run_ready_tells_the_client_the_first_stages_data_port_limit() -> None:
    h = Harness()
    for name in NAMES:
        h.register(name)
    h.client(
        "run_request",
        model=h_spec(),
        dtype="float32",
        sink_endpoint="tcp://client:9",
        wait_for_stages_s=0.0,
        planner="even",
        stage_names=NAMES,
    )
    run = h.core.run
    assert run is not None
    for name, limit in zip(NAMES, (1 << 20, 1 << 30, None), strict=True):
        body = {"max_message_bytes": limit} if limit is not None else {}
        h.stage(name, "ready", run=run.run, build_s=0.1, **body)
    (ready,) = h.to_client("run_ready")
    assert ready.body["first_stage"] == "a" and ready.body["first_max_message_bytes"] == 1 << 20
    # a first stage that says nothing (an older one): the field is left out
    older = Harness()
    older.start_stream(NAMES)
    assert "first_max_message_bytes" not in dict(older.to_client("run_ready")[0].body)


def test_a_stage_that_fails_to_build_fails_the_run_with_its_error() -> None:
    h = Harness()
    for name in NAMES:
        h.register(name)
    h.client(
        "run_request",
        model=h_spec(),
        dtype="float32",
        sink_endpoint="tcp://client:9",
        wait_for_stages_s=0.0,
        planner="even",
        stage_names=NAMES,
    )
    run = h.core.run
    assert run is not None
    h.stage("a", "ready", run=run.run, build_s=0.1)
    h.stage("b", "assign_failed", run=run.run, error="out of memory")
    (failed,) = h.to_client("run_failed")
    assert failed.body["error"] == "stage 'b': out of memory"
    assert h.core.run is None
    assert not h.to_client("run_ready")


def test_a_run_that_names_missing_stages_is_refused() -> None:
    h = Harness()
    h.register("a")
    h.client(
        "run_request",
        model=h_spec(),
        dtype="float32",
        sink_endpoint="tcp://client:9",
        wait_for_stages_s=0.0,
        planner="even",
        stage_names=["a", "z"],
    )
    (failed,) = h.to_client("run_failed")
    assert "stages ['z'] are not registered" in failed.body["error"]


def test_ready_that_never_comes_times_out_naming_the_silent_stages() -> None:
    h = Harness()
    for name in NAMES:
        h.register(name)
    h.client(
        "run_request",
        model=h_spec(),
        dtype="float32",
        sink_endpoint="tcp://client:9",
        wait_for_stages_s=0.0,
        planner="even",
        stage_names=NAMES,
    )
    run = h.core.run
    assert run is not None
    h.stage("a", "ready", run=run.run, build_s=0.1)
    h.advance(h.state.timeouts.assign_s + 1, alive=("a", "b", "c"))
    (failed,) = h.to_client("run_failed")
    assert "waiting for ready after assignment from b, c" in failed.body["error"]


def test_a_dead_stage_is_replanned_around_and_the_client_told_to_replay() -> None:
    h = Harness()
    run = h.start_stream(NAMES, recover=True)
    epoch = h.core.run.epoch  # type: ignore[union-attr]
    h.advance(8.0, alive=("a", "c"))
    assert [e["stage"] for e in h.events("stage_dead")] == ["b"]
    # survivors are assigned under a new epoch and connected; only then is the client told
    reassigned = {n: h.to(n, "assign")[-1] for n in ("a", "c")}
    assert {m.epoch for m in reassigned.values()} == {epoch + 1}
    assert not h.to_client("run_replanned")
    h.answer_all("ready", ["a", "c"], run=run, build_s=0.01)
    assert not h.to_client("run_replanned")
    h.answer_all("connected", ["a", "c"], run=run)
    (notice,) = h.to_client("run_replanned")
    assert notice.epoch == epoch + 1 and notice.body["dead"] == "b"
    assert [tuple(s) for s in notice.body["plan"]["stages"]] == [("a", 0, 3), ("c", 3, 6)]
    (recovered,) = h.events("run_recovered")
    assert recovered["policy"] == "lightweight"
    assert recovered["detected_s"] >= 3.0 and recovered["recovered_s"] >= 0
    assert h.records[-1]["event"] == "run_recovered"


def test_survivors_the_clients_stall_report_made_suspect_are_kept_in_the_new_plan() -> None:
    h = Harness()
    run = h.start_stream(NAMES, recover=True)
    h.advance(4.5, alive=("a", "c"))  # b silent: suspect at 3 s, its probe unanswered
    assert not h.events("stage_dead")
    # the results stalled: the client's report suspects every stage of the stream
    h.feed(StallReported(Stalled(run=run, waited_s=4.0, deadline_s=0.25)))
    h.advance(1.0, answer=False)  # b is declared dead before a and c answer
    assert [e["stage"] for e in h.events("stage_dead")] == ["b"]
    assert not h.to_client("run_failed")
    # the recovery waited for a and c to be judged (they answered): they run the model
    h.answer_all("ready", ["a", "c"], run=run, build_s=0.01)
    h.answer_all("connected", ["a", "c"], run=run)
    (notice,) = h.to_client("run_replanned")
    assert [tuple(s) for s in notice.body["plan"]["stages"]] == [("a", 0, 3), ("c", 3, 6)]


def test_without_recover_the_client_hears_the_stage_failed() -> None:
    h = Harness()
    h.start_stream(NAMES)
    h.advance(8.0, alive=("a", "c"))
    (failed,) = h.to_client("stage_failed")
    assert failed.body["stage"] == "b" and "heartbeat" in failed.body["reason"]
    assert not h.to_client("run_replanned")


def test_the_end_of_a_run_gathers_metrics_and_a_silent_stage_reports_none() -> None:
    h = Harness()
    run = h.start_stream(NAMES)
    h.client("run_end", run=run)
    h.client("run_end", run=run)  # sent again: one request to stages, one answer (a
    # second to the same client would be read as the answer to its next request)
    assert len(h.to("a", "metrics_request")) == 1
    h.stage("a", "metrics", run=run, metrics={"microbatches": 3})
    h.stage("b", "metrics", run=run, metrics={"microbatches": 3})
    h.advance(h.state.timeouts.reply_s + 1, alive=tuple(NAMES))
    reports = h.to_client("run_report")
    assert len(reports) == 1
    assert reports[0].body["stages"] == {
        "a": {"microbatches": 3},
        "b": {"microbatches": 3},
        "c": {"error": "no metrics"},
    }
    assert h.core.run is None


def test_a_stall_report_probes_the_runs_stages_at_once() -> None:
    h = Harness()
    run = h.start_stream(NAMES)
    h.feed(StallReported(Stalled(run=run, waited_s=2.0, deadline_s=1.0)))
    assert all(h.to(n, "probe") for n in NAMES)
    assert [e["reason"] for e in h.events("stage_suspect")] == ["stall"] * 3


def test_an_unknown_peer_heartbeat_is_asked_to_register_and_other_kinds_dropped() -> None:
    h = Harness()
    h.stage("ghost", "heartbeat")
    assert h.to("ghost", "register_again")
    h.stage("ghost", "ready", run=1, build_s=0.0)
    assert h.events("dropped_message")


def test_a_registration_asks_for_its_save_soon_and_is_answered_at_once() -> None:
    # the shell saves a burst of registrations once (``soon``), not once each
    h = Harness()
    register = Register(name="a", data_endpoint="tcp://a:1", info={})
    commands = h.feed(RegisterAsked(b"a", None, register))
    assert [c for c in commands if isinstance(c, Persist)] == [Persist(soon=True)]
    assert [s.wire.kind for s in h.sent] == ["registered"]


def test_a_registration_sent_again_on_its_connection_is_answered_alone() -> None:
    # a stage repeats its registration every second until answered: a coordinator that
    # took seconds to start reads them all, and each used to make the member anew, log
    # it at info and ask for a save
    h = Harness()
    register = Register(name="a", data_endpoint="tcp://a:1", info={"cores": 2})
    h.feed(RegisterAsked(b"a", None, register, bulk_token="t1"))
    member = h.state.membership.get("a")
    h.now += 0.5
    again = h.feed(RegisterAsked(b"a", None, register, bulk_token="t2"))
    assert not [c for c in again if isinstance(c, Persist)]
    assert [c.event for c in again if isinstance(c, Log)] == ["stage_registered_again"]
    assert h.state.membership.get("a") is member and member is not None
    assert member.last_seen == 0.5  # heard from, as by any message
    replies = [s.wire for s in h.sent]
    assert [r.kind for r in replies] == ["registered", "registered"]
    assert replies[0].body["bulk_token"] == replies[1].body["bulk_token"] == "t1"
    assert replies[1].body["clock"] == 0.5


def test_a_registration_that_changed_or_came_on_another_connection_is_made_anew() -> None:
    h = Harness()
    register = Register(name="a", data_endpoint="tcp://a:1", info={})
    h.feed(RegisterAsked(b"a", None, register))
    first = h.state.membership.get("a")
    moved = Register(name="a", data_endpoint="tcp://a:9", info={})
    changed = h.feed(RegisterAsked(b"a", None, moved))
    assert [c for c in changed if isinstance(c, Persist)] == [Persist(soon=True)]
    second = h.state.membership.get("a")
    assert second is not first and second is not None
    assert second.data_endpoint == "tcp://a:9"
    h.state.membership.declare_dead("a", "test", h.now)
    back = h.feed(RegisterAsked(b"a", None, moved))
    assert [c.event for c in back if isinstance(c, Log)] == ["stage_registered"]


# ----------------------------------------------------------------- flow runner


def test_a_flow_that_raises_ends_alone_and_is_logged() -> None:
    runner = FlowRunner()

    def broken():  # type: ignore[no-untyped-def]
        yield Log("info", "before", {})
        raise RuntimeError("a bug")

    out = runner.start(broken(), 0.0)
    assert [c.event for c in out if isinstance(c, Log)] == ["before", "flow_failed"]
    assert runner.suspended == 0


def test_a_wait_that_times_out_raises_in_its_flow_naming_the_silent() -> None:
    runner = FlowRunner()
    seen: list[BaseException] = []

    def waiting():  # type: ignore[no-untyped-def]
        try:
            yield AwaitReplies(("a", "b"), Weights, 5.0, "weights")
        except TransportTimeout as exc:
            seen.append(exc)
        now = yield Now()
        seen.append(now)

    (timer,) = runner.start(waiting(), 1.0)
    assert runner.reply("a", _weights("a"), 2.0) == []
    runner.timer(timer.tag, 6.0)  # type: ignore[attr-defined]
    assert "weights from b" in str(seen[0]) and seen[1] == 6.0


def test_a_request_lost_on_its_way_is_sent_again_to_the_silent_stage_only() -> None:
    """A request sent while a connection is replaced can vanish: the wait asks again,
    every resend_s, only the stages that neither answered nor moved a chunk."""
    runner = FlowRunner()
    seen: list[object] = []
    ask = {n: Send(n.encode(), BackupRequest(run=1, step=3, holder=n), n, stage=n) for n in "abc"}

    def backing_up():  # type: ignore[no-untyped-def]
        seen.append(
            (
                yield AwaitReplies(
                    tuple(ask),
                    BackedUp,
                    60.0,
                    "backups",
                    requests=tuple(ask.values()),
                    resend_s=4.0,
                )
            )
        )

    first = runner.start(backing_up(), 0.0)
    assert first[:3] == list(ask.values())  # the requests go out when the wait starts
    (timer,) = first[3:]
    assert isinstance(timer, StartTimer) and timer.delay_s == 4.0
    runner.reply("a", _backed_up("a"), 1.0)  # a answered
    runner.progress("b", 3.0)  # b is sending its answer in chunks
    again = runner.timer(timer.tag, 4.0)
    assert [c for c in again if isinstance(c, Send)] == [ask["c"]]
    (timer,) = [c for c in again if isinstance(c, StartTimer)]
    assert timer.delay_s == pytest.approx(4.0)
    # b's chunks stopped before the last asking: it is asked again too
    again = runner.timer(timer.tag, 8.0)
    assert [c for c in again if isinstance(c, Send)] == [ask["b"], ask["c"]]
    runner.reply("b", _backed_up("b"), 9.0)
    runner.reply("c", _backed_up("c"), 9.5)
    assert seen and set(seen[0]) == {"a", "b", "c"}  # type: ignore[arg-type]


def test_a_wait_without_resend_asks_once_and_times_out_at_its_deadline() -> None:
    runner = FlowRunner()
    ask = Send(b"a", WeightsRequest(run=1, step=0), "a", stage="a")

    def waiting():  # type: ignore[no-untyped-def]
        with pytest.raises(TransportTimeout):
            yield AwaitReplies(("a",), Weights, 5.0, "weights", requests=(ask,))

    out = runner.start(waiting(), 0.0)
    assert out[0] == ask and isinstance(out[1], StartTimer) and out[1].delay_s == 5.0
    assert runner.timer(out[1].tag, 5.0) == [] and runner.suspended == 0


def test_a_jobs_failure_is_raised_in_the_flow_that_asked() -> None:
    runner = FlowRunner()
    seen: list[BaseException] = []

    def planning():  # type: ignore[no-untyped-def]
        try:
            yield PlanInference(None, 1, (), "even", None, 1, "float32")  # type: ignore[arg-type]
        except ConfigError as exc:
            seen.append(exc)

    (job,) = runner.start(planning(), 0.0)
    runner.job_failed(job.tag, ConfigError("no plan fits"), 1.0)  # type: ignore[attr-defined]
    assert str(seen[0]) == "no plan fits"


# ----------------------------------------------------------------- properties


@settings(max_examples=40, deadline=None)
@given(
    delays=st.lists(st.floats(min_value=0.0, max_value=1.9), min_size=1, max_size=12),
    gaps=st.lists(st.floats(min_value=0.0, max_value=6.0), min_size=1, max_size=12),
)
def test_a_stage_that_answers_every_probe_in_time_is_never_declared_dead(
    delays: list[float], gaps: list[float]
) -> None:
    """Heartbeats may stop for any length; each probe is answered within the probe
    intervals (2 s here): the stage is slow, never dead."""
    h = Harness(interval=1.0, suspect_after=3, probes=2)
    h.register("a")
    pending: list[float] = []
    step = 0.25
    for i, gap in enumerate(gaps):
        end = h.now + gap
        while h.now < end:
            h.now += step
            for due in [d for d in pending if d <= h.now]:
                pending.remove(due)
                h.stage("a", "probe_ack", nonce=0)
            before = len(h.sent)
            h.feed(Tick())
            for send in h.sent[before:]:
                if send.wire.kind == "probe":
                    # answered a little later, before the probe's time runs out
                    pending.append(h.now + delays[i % len(delays)])
        h.stage("a", "heartbeat")
    assert h.events("stage_dead") == []


@settings(max_examples=25, deadline=None)
@given(
    order=st.permutations(["a", "b", "c", "d", "e"]),
    kills=st.integers(min_value=1, max_value=4),
    policy=st.sampled_from(["lightweight", "respipe", "heavy"]),
)
def test_every_death_is_answered_once_with_a_larger_epoch_and_units_owned_once(
    order: list[str], kills: int, policy: str
) -> None:
    """Kill stages one after another during a stream: each death gives the client
    exactly one notice (the replay it triggers happens once per epoch), epochs
    only increase, and every new plan gives each unit exactly one live owner."""
    names = sorted(order)
    h = Harness()
    run = h.start_stream(names, recover=True, recovery=policy)
    epochs = [h.core.run.epoch]  # type: ignore[union-attr]
    dead: list[str] = []
    for victim in order[:kills]:
        dead.append(victim)
        alive = tuple(n for n in names if n not in dead)
        h.advance(7.0, alive=alive)
        assert [e["stage"] for e in h.events("stage_dead")] == dead
        current = h.core.run
        assert current is not None
        h.answer_all("ready", list(current.devices), run=run, build_s=0.01)
        h.answer_all("connected", list(current.devices), run=run)
        notices = h.to_client("run_replanned")
        assert [n.body["dead"] for n in notices] == dead  # one notice per death, none twice
        epochs.append(notices[-1].epoch)
        plan = notices[-1].body["plan"]
        owners = [device for device, start, end in plan["stages"] for _ in range(start, end)]
        assert len(owners) == 6 and not set(owners) & set(dead)
        bounds = [(start, end) for _, start, end in plan["stages"]]
        assert bounds[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    assert epochs == sorted(set(epochs))  # strictly increasing
    assert not h.to_client("stage_failed")


def h_spec() -> dict[str, object]:
    from tests._support.coordinator_harness import SPEC

    return SPEC.to_dict()


def test_harness_sends_are_commands() -> None:
    h = Harness()
    h.register("a")
    assert all(isinstance(s, Send) for s in h.sent)
    assert h.sent[-1].to == b"a" and h.sent[-1].wire.kind == "registered"
    assert CLIENT not in {s.to for s in h.sent}


@pytest.mark.parametrize("kind", ["run_go", "weights_request"])
def test_requests_for_a_run_that_is_not_current_fail_clearly(kind: str) -> None:
    h = Harness()
    h.client(kind, run=9, **({"step": 0} if kind == "weights_request" else {}))
    (failed,) = h.to_client("run_failed")
    assert failed.body["error"] == "run 9 is not the current run"


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"model": {"family": "no-such-family", "config": {}}}, "no-such-family"),
        ({"mode": "dream"}, "unknown run mode 'dream'"),
        ({"recovery": "pray"}, "unknown recovery 'pray'"),
        ({"rebalance": 1.5}, "rebalance must lie in (0, 1)"),
        ({"stage_names": None, "stages": 4}, "3 stages registered, 4 needed"),
    ],
)
def test_a_bad_run_request_is_answered_with_run_failed(
    change: dict[str, object], problem: str
) -> None:
    h = Harness()
    for name in NAMES:
        h.register(name)
    body = {
        "model": h_spec(),
        "dtype": "float32",
        "sink_endpoint": "tcp://client:9",
        "wait_for_stages_s": 0.0,
        "planner": "even",
        "stage_names": NAMES,
        **change,
    }
    h.client("run_request", **body)
    (failed,) = h.to_client("run_failed")
    assert problem in failed.body["error"]
    assert h.core.run is None and not h.to("a", "assign")


def test_a_send_that_fails_ends_the_wait_on_that_stage_at_once() -> None:
    from zpipe._errors import PeerGoneError
    from zpipe.coordinator.events import RequestFailed

    h = Harness()
    for name in NAMES:
        h.register(name)
    h.client(
        "run_request",
        model=h_spec(),
        dtype="float32",
        sink_endpoint="tcp://client:9",
        wait_for_stages_s=0.0,
        planner="even",
        stage_names=NAMES,
    )
    assert [s.stage for s in h.sent if s.wire.kind == "assign"] == NAMES
    h.feed(RequestFailed("b", PeerGoneError("b", "assign")))
    (failed,) = h.to_client("run_failed")
    assert failed.body["error"] == "b is not connected: could not send assign"


def test_metrics_of_a_stage_that_dies_at_the_end_are_none_not_a_wait() -> None:
    h = Harness()
    run = h.start_stream(NAMES)
    h.client("run_end", run=run)
    h.stage("a", "metrics", run=run, metrics={"microbatches": 1})
    h.stage("c", "metrics", run=run, metrics={"microbatches": 1})
    h.advance(6.0, alive=("a", "c"))  # b dies before it answers: no need to wait longer
    (report,) = h.to_client("run_report")
    assert report.body["stages"]["b"] == {"error": "no metrics"}


def test_a_request_that_could_not_leave_is_asked_again_not_taken_for_a_death() -> None:
    """A stage not connected for a moment (a link cut, a reconnect) makes its request's
    send fail: a wait that resends keeps waiting and asks again, so the stage answers
    once it is back; a wait without resends ends at once, as before."""
    from zpipe._errors import PeerGoneError

    runner = FlowRunner()
    seen: list[object] = []
    ask = {n: Send(n.encode(), WeightsRequest(run=1, step=0), n, stage=n) for n in "ab"}

    def gathering():  # type: ignore[no-untyped-def]
        seen.append((yield AwaitReplies(tuple(ask), Weights, 60.0, "weights",
                                        requests=tuple(ask.values()), resend_s=4.0)))  # fmt: skip

    (timer,) = runner.start(gathering(), 0.0)[2:]
    assert runner.request_unsent("b", PeerGoneError("b", "weights_request"), 0.5) == []
    runner.reply("a", _weights("a"), 1.0)
    again = runner.timer(timer.tag, 4.0)  # type: ignore[attr-defined]
    assert [c for c in again if isinstance(c, Send)] == [ask["b"]]
    runner.reply("b", _weights("b"), 5.0)
    assert seen and set(seen[0]) == {"a", "b"}  # type: ignore[arg-type]

    failed: list[BaseException] = []

    def once():  # type: ignore[no-untyped-def]
        try:
            yield AwaitReplies(("b",), Weights, 60.0, "weights", requests=(ask["b"],))
        except PeerGoneError as exc:
            failed.append(exc)

    runner.start(once(), 10.0)
    runner.request_unsent("b", PeerGoneError("b", "weights_request"), 10.5)
    assert failed
