"""The typed protocol: every kind round-trips, and the wire is protocol version 1 unchanged."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests._support import SUPPORT_DIR
from zpipe._errors import ProtocolError
from zpipe.protocol import CONVERSATIONS, REGISTRY, Message, WireMessage
from zpipe.protocol._schema import NON_NEGATIVE_KEYS, FieldSchema
from zpipe.protocol.client_control import RunFailed, RunRequest
from zpipe.protocol.data_plane import Data, Loss
from zpipe.protocol.lossy import LossyGo, LossyPartial
from zpipe.protocol.peer import Backup, FetchUnits, LinkPing
from zpipe.protocol.stage_control import Assign, Heartbeat, Probe, Register
from zpipe.protocol.storage import CoordinatorState
from zpipe.transport import codec
from zpipe.transport.codec import decode, encode

V1 = json.loads((SUPPORT_DIR / "protocol_v1.json").read_text())
ALL_CLASSES = sorted(REGISTRY.classes.values(), key=lambda cls: cls.KIND)


def _type_names(schema: FieldSchema) -> str:
    return "/".join("null" if t is type(None) else t.__name__ for t in schema.types)


# Optional fields added within version 1: a sender leaves them out unless it needs them
# (run_request's num_units: only for user-code model families, which an older
# coordinator would have imported itself), so what older peers exchange is unchanged.
ADDED_IN_V1 = {
    # num_units; progress: the client takes progress notices while state moves;
    # bucketing: how PipeEdge treats measured values, when not "auto"
    "run_request": {
        "num_units": ["int/null", False],
        "progress": ["bool", False],
        "bucketing": ["str/null", False],
        # sent again after a reconnection: answered once (issue 33)
        "request_id": ["str/null", False],
    },
    # the run in flight that kept a run_request from starting
    "run_failed": {"in_flight": ["int/null", False]},
    # the stage process's resident memory before its model (the memory model's base)
    "register": {"base_bytes": ["int/null", False]},
    # the token of the stage's bulk connection, from a coordinator that has one
    "registered": {"bulk_token": ["str/null", False], "clock": ["int/float/null", False]},
    # a notice's number, which the client acknowledges (an older client ignores it)
    "stage_failed": {"seq": ["int/null", False]},
    "run_replanned": {
        "seq": ["int/null", False],
        "first_max_message_bytes": ["int/null", False],
        # the coordinator's clock at the recovery (a trace marks it)
        "clock": ["int/float/null", False],
    },
    # the unit fetches the new plan makes from this stage (a holder refuses others)
    "link_peers": {"fetches": ["list/null", False]},
    # a stage's data port limit per frame, and the first stage's for the client
    "ready": {"max_message_bytes": ["int/null", False]},
    "run_ready": {
        "first_max_message_bytes": ["int/null", False],
        "resumed": ["dict/null", False],
        # an asynchronous run's fast recovery: its plan's summary for the report
        "fast_recovery": ["dict/null", False],
    },
    # an asynchronous stage's update count, with a weights request's ``latest``
    "weights": {"updates": ["int/null", False]},
    # chain replication with a global copy (FTPipeHD runs both), and whether one was kept
    "replicate": {"global": ["bool", False]},
    "replicated": {"global": ["bool", False]},
    # a replica file says whether it holds every unit (the newest global copy's file)
    "replica_file": {"global": ["bool/null", False]},
    # the current run's notices its client has not acknowledged, kept across a restart
    "coordinator_state": {"notices": ["dict/null", False]},
    # heavy recovery gathers snapshots kept at the stages
    "weights_request": {
        "snapshot": ["list/null", False],
        # a fast recovery's survivor keeps its state for peers to fetch
        "keep": ["bool/null", False],
    },
    # a requester that takes a big answer in state_chunk messages of this size
    "fetch_units": {"chunk_bytes": ["int/null", False]},
    # every batch size a training profile measures, sent to stages that reported a device
    "profile_request": {"batch_sizes": ["list/null", False]},
    # clock offsets for timelines: a coordinator that stamps acks says so on registering
    # (registered's clock), and only then do heartbeats carry the stage's clock
    "heartbeat": {"clock": ["int/float/null", False]},
    "heartbeat_ack": {"echo": ["int/float/null", False], "clock": ["int/float/null", False]},
    # each stage's timeline (a trace), only when the client asks for one
    "metrics_request": {"timeline": ["bool/null", False]},
    "metrics": {"timeline": ["dict/null", False]},
    "run_end": {"timeline": ["bool/null", False]},
    "run_report": {"timelines": ["dict/null", False]},
    # asynchronous training's end of the feed (only async stages are sent one)
    "data": {"end": ["bool/null", False]},
    # a lossy run on ordinary stages: the peers' names and keys; a start relative to receipt
    "lossy_setup": {
        "names": ["dict/null", False],
        "keys": ["dict/null", False],
        "replica_every": ["int/null", False],
    },
    "lossy_go": {"start_in_s": ["int/float/null", False]},
    # measured by ordinary stages: the stage's device index, its peers' names and keys
    "lossy_probe_request": {
        "device": ["int/null", False],
        "names": ["dict/null", False],
        "keys": ["dict/null", False],
    },
    "lossy_result": {
        "name": ["str/null", False],
        "dead": ["dict/null", False],
        "stale": ["int/null", False],
        "test": ["dict/null", False],
        "on_wire": ["dict/null", False],
        "ack_waits": ["dict/null", False],
    },
    # r-TX and ACK: each copy numbered; ACK: the copy's drop key
    "lossy_partial": {
        "copy": ["int/null", False],
        "link_layer": ["int/null", False],
        "direction": ["int/null", False],
    },
    # a chain copy an asynchronous stage made without draining (kept apart at the holder)
    "backup": {"live": ["bool/null", False]},
}
# Kinds added within version 1, spoken only to peers that offered them (the bulk
# connection: a stage uses it once ``registered`` gave it a token; a client
# acknowledges numbered notices).
KINDS_ADDED_IN_V1 = {
    "bulk_open": {"name": ["str", True], "token": ["str", True]},
    "bulk_opened": {"name": ["str", True]},
    "bulk_chunk": {
        "name": ["str", True],
        "token": ["str", True],
        "transfer": ["int", True],
        "seq": ["int", True],
        "chunks": ["int", True],
        "bytes": ["int", True],
        "frames": ["list/null", False],
    },
    "bulk_done": {"transfer": ["int", True]},
    "bulk_refused": {"transfer": ["int", True], "reason": ["str", True]},
    "notice_ack": {"run": ["int", True], "seq": ["int", True]},
    # big stage-to-stage state in chunks: a backup's (acknowledged one by one), or a
    # fetch's answer to a requester that offered chunk_bytes
    "state_chunk": {
        "owner": ["str", True],
        "transfer": ["int", True],
        "seq": ["int", True],
        "chunks": ["int", True],
        "bytes": ["int", True],
        "frames": ["list/null", False],
    },
    "state_chunk_ok": {"transfer": ["int", True], "seq": ["int", True], "error": ["str", True]},
    # to a client whose run_request offered progress: the state it awaits is moving
    "progress": {"run": ["int", True], "awaited": ["str", True]},
    # a lossy (EdgePipe) run on ordinary stages, from a client and back to it
    "lossy_run_request": {
        "layer_sizes": ["list", True],
        "allocation": ["str", True],
        "mapping": ["str", True],
        "prr_measured": ["list", True],
        "spec": ["dict", True],
        "stages": ["int/null", False],
        "stage_names": ["list/null", False],
        "wait_for_stages_s": ["int/float", True],
        "result_s": ["int/float", True],
        "start_in_s": ["int/float/null", False],
        "probes": ["int/null", False],
        "on_death": ["str/null", False],
        "request_id": ["int/null", False],
        "replica_every": ["int/null", False],
    },
    "lossy_run_report": {
        "run": ["int", True],
        "alloc": ["dict", True],
        "stages": ["list", True],
        "results": ["list", True],
        "dead": ["list/null", False],
        "measured": ["list/null", False],
        "remaps": ["list/null", False],
        "metrics": ["dict/null", False],
    },
    # to a lossy run's surviving stages: a device of the run died (remap: re-mapped)
    "lossy_dead": {"run": ["int", True], "device": ["int", True], "remap": ["bool/null", False]},
    "lossy_hold": {"run": ["int", True], "device": ["int", True], "frontier": ["int", True]},
    "lossy_replica": {
        "run": ["int", True],
        "device": ["int", True],
        "step": ["int", True],
        "slices": ["list", True],
        "name": ["str/null", False],
    },
    # ACK recovery: a receiver's acknowledgement of one copy, stage to stage
    "lossy_ack": {
        "run": ["int", True],
        "data": ["int", True],
        "kind": ["str", True],
        "layer": ["int", True],
        "src": ["int", True],
        "copy": ["int", True],
    },
    "lossy_remap": {
        "run": ["int", True],
        "switch_at": ["int/null", False],
        "alloc": ["dict/null", False],
        "pieces": ["list/null", False],
        "inputs": ["bool/null", False],
        "labels": ["bool/null", False],
    },
    # federated learning over the network: fl-server and fl-client on their own socket
    "fl_register": {
        "client": ["int", True],
        "label_counts": ["list", True],
        "latency_s": ["int/float", True],
    },
    "fl_welcome": {"client": ["int", True]},
    "fl_task": {
        "task": ["int", True],
        "version": ["int", True],
        "shape": ["list", True],
        "local_steps": ["int", True],
        "batch_size": ["int", True],
        "lr": ["int/float", True],
        "mu": ["int/float", True],
        "seed": ["int", True],
    },
    "fl_update": {
        "task": ["int", True],
        "client": ["int", True],
        "n_samples": ["int", True],
        "train_s": ["int/float", True],
    },
    "fl_error": {"reason": ["str", True]},
    "fl_done": {"reason": ["str", True]},
    "fl_probe": {"probe": ["int", True]},
    "fl_probe_reply": {
        "probe": ["int", True],
        "client": ["int", True],
        "work_s": ["int/float", True],
    },
    # look: a look before any flush; pause: its answer that the cuts move (pause, ask again)
    "repartition": {"run": ["int", True], "step": ["int", True], "look": ["bool/null", False]},
    "repartitioned": {
        "run": ["int", True],
        "step": ["int", True],
        "error": ["str", True],
        "bounds": ["list/null", False],
        "plan_epoch": ["int/null", False],
        "decision": ["dict/null", False],
        "pause": ["bool/null", False],
    },
    "repartition_request": {
        "run": ["int", True],
        "step": ["int", True],
        "phase": ["str", True],
        "bounds": ["list/null", False],
        "fetch": ["list/null", False],
        "plan_epoch": ["int/null", False],
        # a commit that leaves a device out: the stage's place in the shorter chain
        "chain": ["dict/null", False],
    },
    # copies an asynchronous stage made without draining, sent to (and saved by) the
    # coordinator of a run that asked for them
    "async_copy": {
        "run": ["int", True],
        "name": ["str", True],
        "kind": ["str", True],
        "step": ["int", True],
        "start": ["int", True],
        "end": ["int", True],
        "keys": ["list", True],
        "digest": ["str/null", False],
        "holder": ["str/null", False],
    },
    "copy_file": {
        "record": ["dict", True],
        "keys": ["list", True],
        "chunk": ["int", True],
        "chunks": ["int", True],
    },
    "repartition_reply": {
        "run": ["int", True],
        "name": ["str", True],
        "step": ["int", True],
        "phase": ["str", True],
        "error": ["str", True],
        "metrics": ["dict/null", False],
    },
    # a stage's speed verdict, relayed by the coordinator to the client (issue 30)
    "speed_changed": {
        "run": ["int", True],
        "name": ["str", True],
        "step": ["int", True],
        "plan_epoch": ["int", True],
        "ratio": ["int/float", True],
        "baseline_s": ["int/float", True],
        "now_s": ["int/float", True],
    },
    # a pipelined generation run: set-up through the coordinator, then the data path
    # (client -> first stage, stage -> stage, the ring's tokens, the stream to the sink)
    "gen_run_request": {
        "model": ["dict", True],
        "sink_endpoint": ["str", True],
        "max_context": ["int", True],
        "max_sequences": ["int", True],
        "steps_in_flight": ["int", True],
        "chunk_tokens": ["int", True],
        "wait_for_stages_s": ["int/float", True],
        "stages": ["int/null", False],
        "stage_names": ["list/null", False],
        "partition": ["list/null", False],
        "kv_budget_bytes": ["int/null", False],
        "dtype": ["str/null", False],
        "text": ["bool/null", False],
    },
    "gen_setup": {
        "run": ["int", True],
        "model": ["dict", True],
        "start": ["int", True],
        "end": ["int", True],
        "index": ["int", True],
        "num_stages": ["int", True],
        "upstream": ["str", True],
        "downstream": ["str", True],
        "max_context": ["int", True],
        "max_sequences": ["int", True],
        "steps_in_flight": ["int", True],
        "chunk_tokens": ["int", True],
        "upstream_key": ["str/null", False],
        "downstream_endpoint": ["str/null", False],
        "downstream_key": ["str/null", False],
        "sink_endpoint": ["str/null", False],
        "client_key": ["str/null", False],
        "kv_budget_bytes": ["int/null", False],
        "kv_budget_tokens": ["int/null", False],
        "dtype": ["str/null", False],
        "text": ["bool/null", False],
        "upstream_endpoint": ["str/null", False],
    },
    "gen_ready": {"run": ["int", True], "name": ["str", True], "error": ["str", True]},
    "gen_run_ready": {
        "run": ["int", True],
        "stages": ["list", True],
        "bounds": ["list", True],
        "first_endpoint": ["str", True],
        "first_stage": ["str", True],
        "first_key": ["str/null", False],
    },
    "gen_submit": {
        "run": ["int", True],
        "sequence": ["int", True],
        "src": ["str", True],
        "params": ["dict", True],
    },
    "gen_cancel": {"run": ["int", True], "sequence": ["int", True], "src": ["str", True]},
    "gen_close": {"run": ["int", True], "src": ["str", True]},
    "gen_step": {
        "run": ["int", True],
        "step": ["int", True],
        "src": ["str", True],
        "rows": ["list", True],
        "sampling": ["list", True],
    },
    "gen_free": {"run": ["int", True], "src": ["str", True], "sequences": ["list", True]},
    "gen_tokens": {
        "run": ["int", True],
        "step": ["int", True],
        "src": ["str", True],
        "tokens": ["list", True],
    },
    "gen_step_failed": {
        "run": ["int", True],
        "step": ["int", True],
        "src": ["str", True],
        "stage": ["str", True],
        "error": ["str", True],
        "sequences": ["list", True],
    },
    "gen_token": {
        "run": ["int", True],
        "sequence": ["int", True],
        "index": ["int", True],
        "token": ["int", True],
        "src": ["str", True],
        "text": ["str/null", False],
        "finish": ["str/null", False],
    },
    # a step's events in one message (gen_token: one event, an older first stage's)
    "gen_token_batch": {"run": ["int", True], "src": ["str", True], "events": ["list", True]},
    "gen_refused": {
        "run": ["int", True],
        "sequence": ["int", True],
        "src": ["str", True],
        "error": ["str", True],
        # why, for a program: capacity, context_length, bad_request, stage_failed
        "kind": ["str/null", False],
    },
}
# EdgePipe's separate device processes, gone (lossy runs take ordinary stages): a peer
# that still says hello hears "unknown kind".
KINDS_REMOVED_SINCE_V1 = {"lossy_hello"}
TENSOR_KINDS_ADDED_IN_V1 = [
    "bulk_chunk",
    "state_chunk",
    "lossy_run_request",
    "lossy_run_report",
    "lossy_remap",
    "lossy_replica",
    "fl_task",
    "fl_update",
    "async_copy",
    "copy_file",
    "gen_submit",
    "gen_step",
]


def test_every_kind_keeps_its_version_1_schema() -> None:
    got = {
        kind: {key: [_type_names(f), f.required] for key, f in schema.items()}
        for kind, schema in REGISTRY.schemas.items()
    }
    expected = {
        kind: {**fields, **ADDED_IN_V1.get(kind, {})}
        for kind, fields in V1["schemas"].items()
        if kind not in KINDS_REMOVED_SINCE_V1
    }
    assert got == {**expected, **KINDS_ADDED_IN_V1}
    assert sorted(REGISTRY.tensor_kinds) == sorted(V1["tensor_kinds"] + TENSOR_KINDS_ADDED_IN_V1)
    assert codec.PROTOCOL_VERSION == 1


def test_every_kind_has_one_typed_class_in_one_conversation() -> None:
    listed = [cls for module in CONVERSATIONS for cls in module.MESSAGES]
    assert len(listed) == len({cls.KIND for cls in listed}) == len(REGISTRY.schemas)
    assert set(REGISTRY.classes) == set(REGISTRY.schemas)
    for cls in listed:
        assert cls.__dataclass_params__.frozen  # type: ignore[attr-defined]


def test_codec_schemas_are_the_registry() -> None:
    # one source of truth: what the codec validates is what the classes declare
    assert codec.SCHEMAS == {cls.KIND: cls.schema() for cls in ALL_CLASSES}
    assert codec.TENSOR_KINDS == {cls.KIND for cls in ALL_CLASSES if cls.CARRIES_TENSORS}


T = torch.arange(6, dtype=torch.float32).view(2, 3)

# The messages whose frames main encoded into protocol_v1.json, built the typed way.
REPRESENTATIVES: dict[str, WireMessage] = {
    "register": Register(
        name="s0",
        data_endpoint="tcp://127.0.0.1:5001",
        info={"cores": 2, "probe_endpoint": "tcp://127.0.0.1:5002"},
    ),
    "heartbeat": Heartbeat(name="s0", metrics={"mb": 3, "fwd_s": 0.25}),
    "assign": Assign(
        epoch=3,
        run=4,
        model={"family": "mlp", "config": {"width": 8}},
        start=0,
        end=2,
        index=0,
        num_stages=2,
        upstream="client",
        downstream="s1",
        downstream_endpoint="tcp://127.0.0.1:5003",
        dtype="float32",
    ),
    "run_request": RunRequest(
        model={"family": "mlp", "config": {}},
        stages=2,
        dtype="float32",
        planner="pipeedge",
        sink_endpoint="tcp://127.0.0.1:6000",
        wait_for_stages_s=10.0,
        recover=True,
        recovery="lightweight",
    ),
    "run_failed": RunFailed(error="no stage is left"),
    "data": Data(epoch=3, run=4, mb=7, src="client", tensors=(T,)),
    "loss": Loss(epoch=3, run=4, mb=7, step=1, loss=0.5, src="s1"),
    "backup": Backup(
        run=4,
        step=2,
        owner="s0",
        keys=["0.w", "0.b"],
        tensors=(T, torch.zeros(3, dtype=torch.bfloat16)),
    ),
    "fetch_units": FetchUnits(owner="s0", run=4, step=2, start=0, end=1),
    "link_ping": LinkPing(nonce=99),
    "coordinator_state": CoordinatorState(
        cluster_epoch=3, run_counter=4, members=[], run=None, saved_at=1.5
    ),
    "lossy_partial": LossyPartial(
        run=1, data=2, kind="F", layer=3, src=0, tensors=(torch.arange(4, dtype=torch.float64),)
    ),
    "lossy_go": LossyGo(run=1, start_at=1234.5),
}


def test_representatives_cover_every_conversation() -> None:
    modules = {type(message).__module__ for message in REPRESENTATIVES.values()}
    # bulk: a conversation added within version 1, of which main produced no frames
    added = {
        "zpipe.protocol.bulk",
        "zpipe.protocol.federated",
        "zpipe.protocol.repartition",
        "zpipe.protocol.generation",
    }
    assert modules == {module.__name__ for module in CONVERSATIONS} - added
    assert set(REPRESENTATIVES) == set(V1["frames"])


@pytest.mark.parametrize("name", sorted(REPRESENTATIVES))
def test_typed_messages_encode_to_the_bytes_main_produced(name: str) -> None:
    frames = [bytes(f).hex() for f in encode(REPRESENTATIVES[name].to_message())]
    assert frames == V1["frames"][name]


@pytest.mark.parametrize("name", sorted(REPRESENTATIVES))
def test_frames_main_produced_decode_to_the_typed_messages(name: str) -> None:
    message = decode([bytes.fromhex(f) for f in V1["frames"][name]])
    typed = REGISTRY.parse(message)
    expected = REPRESENTATIVES[name]
    assert typed == expected and type(typed) is type(expected)
    _assert_same_tensors(typed, expected)


def _assert_same_tensors(a: WireMessage, b: WireMessage) -> None:
    got, want = a.to_message().tensors, b.to_message().tensors
    assert len(got) == len(want)
    for x, y in zip(got, want, strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y)


# -- round trips of every kind, generated from the declared fields --------------------

_plain = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)


def _value(key: str, schema: FieldSchema) -> st.SearchStrategy[Any]:
    options: list[st.SearchStrategy[Any]] = []
    for t in schema.types:
        if t is type(None):
            options.append(st.none())
        elif t is bool:
            options.append(st.booleans())
        elif t is int:
            low = 0 if key in NON_NEGATIVE_KEYS else -(2**63)
            options.append(st.integers(low, 2**63 - 1))
        elif t is float:
            options.append(st.floats(allow_nan=False))
        elif t is str:
            options.append(st.text(max_size=12))
        elif t is list:
            options.append(st.lists(_plain, max_size=3))
        elif t is dict:
            options.append(st.dictionaries(st.text(max_size=6), _plain, max_size=3))
        else:  # pragma: no cover
            raise AssertionError(f"no strategy for {t}")
    value = st.one_of(options)
    return value if schema.required else st.none() | value


_tensors = st.lists(
    st.sampled_from(
        [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.uint8, torch.bool]
    ).flatmap(
        lambda dtype: st.lists(st.integers(0, 3), max_size=3).map(
            lambda shape: (torch.arange(math.prod(shape)) % 7).to(dtype).view(shape)
        )
    ),
    max_size=3,
)


@st.composite
def _instances(draw: st.DrawFn, cls: type[WireMessage]) -> WireMessage:
    values = {f.attr: draw(_value(f.key, f.schema)) for f in cls.wire_fields()}
    if cls.CARRIES_TENSORS:
        values["tensors"] = tuple(draw(_tensors))
    return cls(epoch=draw(st.integers(0, 2**63 - 1)), **values)


@pytest.mark.parametrize("cls", ALL_CLASSES, ids=lambda cls: cls.KIND)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_kind_round_trips_through_the_codec(cls: type[WireMessage], data: Any) -> None:
    original = data.draw(_instances(cls))
    frames = [bytes(f) for f in encode(original.to_message())]
    back = cls.from_message(decode(frames))
    assert back == original
    _assert_same_tensors(back, original)
    assert REGISTRY.parse(decode(frames)) == original


# -- from_message refuses what does not fit --------------------------------------------


@pytest.mark.parametrize(
    ("message", "fragment"),
    [
        (Message("probe_ack", {"nonce": 1}), "reads 'probe' messages"),
        (Message("probe", {}), "missing field 'nonce'"),
        (Message("probe", {"nonce": "1"}), "must be int"),
        (Message("probe", {"nonce": True}), "must not be a bool"),
        (Message("probe", {"nonce": 1, "extra": 2}), "unexpected field"),
        (Message("probe", {"nonce": 1}, tensors=(torch.zeros(1),)), "carries no tensors"),
    ],
)
def test_from_message_raises_protocol_error_on_a_misfit(message: Message, fragment: str) -> None:
    with pytest.raises(ProtocolError, match=fragment):
        Probe.from_message(message)


def test_from_message_refuses_negative_counters() -> None:
    with pytest.raises(ProtocolError, match=">= 0"):
        Data.from_message(Message("data", {"run": -1, "mb": 0, "src": "c"}))


def test_registry_parse_refuses_unknown_kinds() -> None:
    with pytest.raises(ProtocolError, match="launch_missiles"):
        REGISTRY.parse(Message("launch_missiles", {}))


def test_optional_fields_are_absent_or_null_as_senders_send_them() -> None:
    # nullable keys today's stages send as null; optional ones they leave out
    body = Assign(
        run=0,
        model={},
        start=0,
        end=1,
        index=0,
        num_stages=1,
        upstream="client",
        downstream="client",
        downstream_endpoint="tcp://h:1",
        dtype="float32",
    ).body()
    assert body["upstream_key"] is None and body["downstream_key"] is None
    assert not {"mode", "train", "upstream_endpoint", "state_keys", "fetch"} & set(body)


def test_fields_renamed_for_python_keep_their_wire_keys() -> None:
    state = CoordinatorState(cluster_epoch=5, run_counter=1, members=[], run=None, saved_at=0.0)
    assert state.to_message().body["epoch"] == 5
    assert CoordinatorState.from_message(state.to_message()).cluster_epoch == 5


def test_register_kinds_is_a_deprecated_wrapper_over_the_registry() -> None:
    with pytest.warns(DeprecationWarning):
        codec.register_kinds({"probe": {"nonce": ((int,), True)}})  # same schema: a no-op
    assert REGISTRY.classes["probe"] is Probe
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="another schema"):
        codec.register_kinds({"probe": {"nonce": ((str,), True)}})


def test_a_message_is_built_as_the_frozen_dataclass_was() -> None:
    # Message writes its fields in one update of its dict (a per-message cost): the
    # defaults, positional order, immutability, equality and replace stay as they were.
    first, second = Message("data"), Message("data")
    assert first.body == {} and first.body is not second.body  # a fresh dict each
    assert (first.epoch, first.tensors) == (0, ())
    built = Message("data", {"run": 1}, 3, ())
    assert built == Message(kind="data", body={"run": 1}, epoch=3, tensors=())
    assert Message("data", None).body is None  # explicit values are kept as given
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.epoch = 4  # type: ignore[misc]
    assert dataclasses.replace(built, epoch=5) == Message("data", {"run": 1}, 5)
    assert Message.__match_args__ == ("kind", "body", "epoch", "tensors")
    assert repr(built) == "Message(kind='data', body={'run': 1}, epoch=3, tensors=())"
