"""The wire codec: round trips for every kind and dtype, and a fuzzed decoder."""

from __future__ import annotations

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zpipe._errors import ProtocolError
from zpipe.transport.codec import (
    MAX_HEADER_BYTES,
    PROTOCOL_VERSION,
    SCHEMAS,
    TENSOR_KINDS,
    Message,
    decode,
    encode,
)

ALL_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]

SAMPLE_VALUES = {
    (str,): "x",
    (int,): 3,
    (int, float): 1.5,
    (dict,): {"a": [1, 2]},
    (list,): [1, "b"],
    (str, type(None)): None,
    (dict, type(None)): {"k": 1},
    (list, type(None)): [[0, 2]],
    (int, type(None)): 2,
    (int, float, type(None)): 2.5,
    (bool,): True,
    (bool, type(None)): False,
}


def sample_body(kind: str) -> dict[str, object]:
    return {key: SAMPLE_VALUES[types] for key, (types, _) in SCHEMAS[kind].items()}


def reencode(message: Message) -> Message:
    # bytes() of each frame: what a peer's socket would hand over, no shared memory
    return decode([bytes(f) for f in encode(message)])


@pytest.mark.parametrize("kind", sorted(SCHEMAS))
def test_every_kind_round_trips(kind: str) -> None:
    body = sample_body(kind)
    tensors = (torch.arange(6, dtype=torch.float32).view(2, 3),) if kind in TENSOR_KINDS else ()
    got = reencode(Message(kind, body, epoch=7, tensors=tensors))
    assert got.kind == kind and got.epoch == 7 and dict(got.body) == body
    assert len(got.tensors) == len(tensors)
    for a, b in zip(tensors, got.tensors, strict=False):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (5,), (2, 3, 4), (1, 1, 1, 1, 1, 1, 1, 1)])
def test_every_dtype_and_shape_round_trips(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    source = (torch.randn(shape) * 50).to(dtype)
    got = reencode(Message("data", {"run": 1, "mb": 2, "src": "s"}, tensors=(source,)))
    (tensor,) = got.tensors
    assert tensor.dtype == dtype and tuple(tensor.shape) == shape
    assert torch.equal(tensor, source)


def test_non_contiguous_and_multiple_tensors_round_trip() -> None:
    a = torch.randn(4, 6).t()  # not contiguous
    b = torch.randint(0, 100, (3,), dtype=torch.int64)
    got = reencode(Message("data", {"run": 0, "mb": 0, "src": "s"}, tensors=(a, b)))
    assert torch.equal(got.tensors[0], a) and torch.equal(got.tensors[1], b)


def test_large_tensor_is_received_without_copy() -> None:
    source = torch.randn(256, 1024)
    frames = encode(Message("data", {"run": 0, "mb": 0, "src": "s"}, tensors=(source,)))
    buffer = bytearray(frames[1])  # a writable, aligned receive buffer
    got = decode([frames[0], buffer])
    buffer[0:4] = b"\x00\x00\x80\x7f"  # +inf written into the buffer shows in the tensor
    assert torch.isinf(got.tensors[0].view(-1)[0])


def header(**fields: object) -> bytes:
    base: dict[str, object] = {
        "v": PROTOCOL_VERSION,
        "k": "heartbeat_ack",
        "e": 0,
        "b": {},
        "t": [],
    }
    base.update(fields)
    return msgpack.packb(base, use_bin_type=True)


@pytest.mark.parametrize(
    ("frames", "fragment"),
    [
        ([], "empty"),
        ([b"\xc1garbage"], "msgpack"),
        ([msgpack.packb([1, 2])], "map"),
        ([header(v=99)], "version"),
        ([header(k="launch_missiles")], "unknown message kind"),
        ([header(e=-1)], "epoch"),
        ([header(e=True)], "epoch"),
        ([header(k="probe", b={})], "missing field 'nonce'"),
        ([header(k="probe", b={"nonce": "1"})], "must be int"),
        ([header(k="probe", b={"nonce": 1, "extra": 2})], "unexpected field"),
        ([header(k="data", b={"run": -1, "mb": 0, "src": "s"})], ">= 0"),
        (
            [header(k="data", b={"run": 0, "mb": 0, "src": "s"}, t=[["float32", [2]]])],
            "frames follow",
        ),
        (
            [header(k="data", b={"run": 0, "mb": 0, "src": "s"}, t=[["float32", [2]]]), b"123"],
            "needs 8",
        ),
        (
            [header(k="data", b={"run": 0, "mb": 0, "src": "s"}, t=[["complex7", [1]]]), b"x"],
            "unknown dtype",
        ),
        (
            [header(k="data", b={"run": 0, "mb": 0, "src": "s"}, t=[["uint8", [-1]]]), b""],
            "bad dimension",
        ),
        ([header(k="probe", b={"nonce": 1}, t=[["uint8", [1]]]), b"x"], "carries no tensors"),
        ([b"\x00" * (MAX_HEADER_BYTES + 1)], "header of"),
    ],
)
def test_malformed_messages_raise_protocol_error(frames: list[bytes], fragment: str) -> None:
    with pytest.raises(ProtocolError, match=fragment):
        decode(frames)


def test_oversized_message_is_refused_before_parsing() -> None:
    frames = encode(Message("data", {"run": 0, "mb": 0, "src": "s"}, tensors=(torch.zeros(1024),)))
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        decode([bytes(f) for f in frames], max_message_bytes=1000)


def test_encode_refuses_what_decode_would_refuse() -> None:
    with pytest.raises(ProtocolError):
        encode(Message("probe", {}))
    with pytest.raises(ProtocolError, match="carries no tensors"):
        encode(Message("probe", {"nonce": 1}, tensors=(torch.zeros(1),)))
    with pytest.raises(ProtocolError, match="cannot cross the wire"):
        encode(
            Message(
                "data",
                {"run": 0, "mb": 0, "src": "s"},
                tensors=(torch.zeros(1, dtype=torch.complex64),),
            )
        )


valid_frames = st.sampled_from(sorted(SCHEMAS)).map(
    lambda kind: [
        bytes(f)
        for f in encode(
            Message(
                kind,
                sample_body(kind),
                tensors=(torch.arange(4, dtype=torch.int32),) if kind == "data" else (),
            )
        )
    ]
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames=st.lists(st.binary(max_size=256), max_size=4))
def test_random_frames_give_a_typed_error_or_a_message(frames: list[bytes]) -> None:
    try:
        message = decode(frames)
    except ProtocolError:
        return
    assert message.kind in SCHEMAS


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames=valid_frames, data=st.data())
def test_truncated_or_corrupted_valid_messages_never_crash(frames: list[bytes], data) -> None:
    index = data.draw(st.integers(0, len(frames) - 1))
    frame = frames[index]
    mutation = data.draw(st.sampled_from(["truncate", "flip", "drop", "append"]))
    if mutation == "truncate" and frame:
        frames[index] = frame[: data.draw(st.integers(0, len(frame) - 1))]
    elif mutation == "flip" and frame:
        pos = data.draw(st.integers(0, len(frame) - 1))
        frames[index] = frame[:pos] + bytes([frame[pos] ^ 0xFF]) + frame[pos + 1 :]
    elif mutation == "drop":
        del frames[index]
    else:
        frames.append(data.draw(st.binary(max_size=16)))
    try:
        message = decode(frames)
    except ProtocolError:
        return
    # A mutation that still decodes must give a self-consistent message.
    assert message.kind in SCHEMAS
    for tensor in message.tensors:
        assert tensor.numel() * tensor.element_size() >= 0


@settings(max_examples=200, deadline=None)
@given(
    body=st.dictionaries(
        st.text(max_size=8),
        st.one_of(st.integers(-(2**63), 2**63 - 1), st.text(max_size=8), st.none()),
        max_size=4,
    ),
    kind=st.sampled_from(sorted(SCHEMAS)),
)
def test_random_bodies_never_crash(body: dict[str, object], kind: str) -> None:
    try:
        decode([header(k=kind, b=body)])
    except ProtocolError:
        pass
