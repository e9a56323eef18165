"""Decoding is total: any frames give a valid Message or a ProtocolError, nothing else.

A property-based fuzz over headers (random msgpack structures, mutated valid
headers, random tensor metas) and frames, and the poison messages found by hand
(issue 19: shapes that made torch raise TypeError/RuntimeError and killed
receive loops, nesting that raised RecursionError) as explicit regressions.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zpipe._errors import ProtocolError
from zpipe.protocol import REGISTRY, Message
from zpipe.transport import codec
from zpipe.transport.codec import (
    MAX_DIMS,
    MAX_HEADER_BYTES,
    MAX_NESTING,
    MAX_TENSORS,
    PROTOCOL_VERSION,
    decode,
    encode,
)
from zpipe.transport.sockets import decode_frames

DATA_BODY = {"run": 0, "mb": 0, "src": "s"}
DTYPE_NAMES = ["float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8"]
DTYPE_NAMES += ["uint8", "bool"]


def header(**fields: Any) -> bytes:
    base: dict[str, Any] = {"v": PROTOCOL_VERSION, "k": "data", "e": 0, "b": DATA_BODY, "t": []}
    base.update(fields)
    return msgpack.packb(base, use_bin_type=True)


def decodes_or_refuses(frames: list[Any], **kwargs: Any) -> Message | None:
    """The property: a valid message, or ProtocolError; any other exception fails the test."""
    try:
        message = decode(frames, **kwargs)
    except ProtocolError:
        return None
    assert message.kind in REGISTRY
    REGISTRY.check_body(message.kind, dict(message.body))
    assert isinstance(message.epoch, int) and message.epoch >= 0
    assert len(message.tensors) == len(frames) - 1
    for tensor, frame in zip(message.tensors, frames[1:], strict=True):
        assert tensor.numel() * tensor.element_size() == len(frame)
    return message


# -- the poison messages, one by one ----------------------------------------------------


@pytest.mark.parametrize(
    "shape",
    [
        [0, 2**63],  # torch.empty: TypeError (not an int64)
        [0, 2**64 - 1],
        [2**63, 0],
        [0, 2**62, 2**62],  # torch.empty: RuntimeError (stride overflow)
        [0, 2**40, 2**40],
        [0, 2**31, 2**31, 2**31],
        [0, *[2**62] * (MAX_DIMS - 1)],
    ],
    ids=str,
)
def test_zero_element_tensors_with_huge_dimensions_are_refused(shape: list[int]) -> None:
    frames = [header(t=[["float32", shape]]), b""]
    with pytest.raises(ProtocolError, match="tensor 0"):
        decode(frames)
    # the way receive loops call it, on zmq frames
    with pytest.raises(ProtocolError):
        decode_frames([zmq.Frame(f) for f in frames], 1 << 20)


@pytest.mark.parametrize(
    ("shape", "frame"),
    [
        ([2**63], b""),
        ([2**62, 4], b"\x00" * 16),
        ([2**32, 2**32], b"\x00" * 8),
        ([-1], b""),
        ([-(2**63)], b""),
        ([1.5], b"\x00" * 4),
        ([True], b"\x00" * 4),
        (["2"], b"\x00" * 8),
        ([None], b""),
        ([[2]], b"\x00" * 8),
        ([1] * (MAX_DIMS + 1), b"\x00" * 4),
        ({"0": 1}, b"\x00" * 4),
        ("2", b"\x00" * 8),
        (7, b"\x00" * 28),
    ],
    ids=str,
)
def test_bad_shapes_are_refused_before_any_allocation(shape: Any, frame: bytes) -> None:
    with pytest.raises(ProtocolError, match="tensor 0"):
        decode([header(t=[["float32", shape]]), frame])


def test_element_count_and_byte_size_are_checked_against_the_frame() -> None:
    with pytest.raises(ProtocolError, match="needs 8000"):
        decode([header(t=[["float64", [1000]]]), b"\x00" * 8])
    with pytest.raises(ProtocolError, match="needs 0"):
        decode([header(t=[["float64", [0]]]), b"\x00" * 8])
    # a zero-element tensor whose other dimensions stay in range decodes
    (tensor,) = decode([header(t=[["float32", [0, 1 << 10, 1 << 10]]]), b""]).tensors
    assert tuple(tensor.shape) == (0, 1 << 10, 1 << 10)


def test_zero_element_spans_are_held_to_the_message_limit() -> None:
    frames = [header(t=[["float32", [0, 1 << 20]]]), b""]
    assert decode(frames).tensors[0].shape == (0, 1 << 20)
    with pytest.raises(ProtocolError, match="spans"):
        decode(frames, max_message_bytes=1 << 20)


@pytest.mark.parametrize(
    "meta",
    [
        ["complex64", [1]],
        [["float32"], [1]],  # an unhashable dtype name
        [{"d": 1}, [1]],
        [None, [1]],
        ["float32"],
        ["float32", [1], "extra"],
        "float32",
        None,
        {"dtype": "float32", "shape": [1]},
    ],
    ids=str,
)
def test_bad_tensor_metas_are_refused(meta: Any) -> None:
    with pytest.raises(ProtocolError, match=r"tensor 0|dtype"):
        decode([header(t=[meta]), b"\x00" * 4])


@pytest.mark.parametrize(
    "frames",
    [
        [header(t=[["uint8", [1]]] * 3), b"x"],  # fewer frames than metas
        [header(), b"x"],  # more frames than metas
        [header(t=[["uint8", [1]]] * (MAX_TENSORS + 1)), *[b"x"] * (MAX_TENSORS + 1)],
        [header(t={"0": ["uint8", [1]]}), b"x"],
        [header(t="uint8"), b"x"],
    ],
    ids=["too-few", "too-many", "over-limit", "map", "str"],
)
def test_frame_counts_that_do_not_match_are_refused(frames: list[bytes]) -> None:
    with pytest.raises(ProtocolError):
        decode(frames)


def test_more_frames_than_any_message_has_are_refused_before_reading_them() -> None:
    frames: list[Any] = [header(), *[object()] * (MAX_TENSORS + 1)]
    with pytest.raises(ProtocolError, match="frames exceed"):
        decode(frames)


@pytest.mark.parametrize(
    "frame", [None, 7, "text", object(), [b"x"], 1.5], ids=lambda f: type(f).__name__
)
def test_frames_that_are_not_buffers_are_refused(frame: Any) -> None:
    with pytest.raises(ProtocolError, match="not a byte buffer"):
        decode([header(t=[["uint8", [1]]]), frame])
    with pytest.raises(ProtocolError):
        decode([frame])


def nested(depth: int, leaf: Any = 0) -> Any:
    value = leaf
    for i in range(depth):
        value = [value] if i % 2 else {"x": value}
    return value


@pytest.mark.parametrize("depth", [MAX_NESTING, 200, 1000, 1020])
def test_deep_nesting_is_refused_without_recursion(depth: int) -> None:
    frames = [header(k="heartbeat", b={"name": "s", "metrics": nested(depth)})]
    with pytest.raises(ProtocolError, match="nests deeper"):
        decode(frames)


def test_encode_refuses_the_nesting_decode_refuses() -> None:
    too_deep = Message("heartbeat", {"name": "s", "metrics": {"m": nested(MAX_NESTING, ())}})
    with pytest.raises(ProtocolError, match="nests deeper"):
        encode(too_deep)
    fine = Message("heartbeat", {"name": "s", "metrics": {"m": nested(MAX_NESTING - 4, ())}})
    assert decode([bytes(f) for f in encode(fine)]).body["metrics"]["m"] is not None


def test_msgpack_beyond_its_own_stack_is_refused() -> None:
    with pytest.raises(ProtocolError, match="msgpack"):
        decode([b"\x91" * 100_000 + b"\xc0"])


def test_nesting_under_the_limit_is_accepted() -> None:
    # header map, body map, metrics map: three levels above the value itself
    metrics = nested(MAX_NESTING - 3)
    message = decode([header(k="heartbeat", b={"name": "s", "metrics": metrics})])
    assert message.body["metrics"] == metrics


@pytest.mark.parametrize(
    ("frames", "fragment"),
    [
        ([msgpack.packb(msgpack.ExtType(1, b"x"))], "map"),
        ([header(b={**DATA_BODY, "src": msgpack.ExtType(1, b"x")})], "not plain data"),
        (
            [header(k="heartbeat", b={"name": "s", "metrics": {"t": msgpack.ExtType(5, b"")}})],
            "plain",
        ),
        ([b"\x81\xa1v\xd6\xff\x00\x00\x00\x00"], "plain data"),  # a msgpack timestamp
        ([b"\x81\xa2\xff\xfe\x01"], "msgpack"),  # a key that is not UTF-8
        ([b"\x81\x01\x02"], "msgpack"),  # an integer map key
        ([header(e=2.0)], "epoch"),
        ([header(e=None)], "epoch"),
        ([header(v="1")], "version"),
        ([header(k=["data"])], "kind"),
        ([header(k="x" * 100_000)], "unknown message kind"),
        ([header(b=[1, 2])], "body must be a map"),
        ([header(b={**DATA_BODY, "x" * 100_000: 1})], "unexpected field"),
        ([msgpack.packb({"v": 1, "k": "data", "e": 0, "b": DATA_BODY})], "header fields"),
        ([msgpack.packb({str(i): i for i in range(50_000)})], "header fields"),
        ([b"\x00" * MAX_HEADER_BYTES + b"\x00"], "header of"),
        ([b"\xdd\xff\xff\xff\xff"], "msgpack"),  # an array of 2**32 - 1 items, announced
        ([b""], "msgpack"),
    ],
)
def test_malformed_headers_are_refused(frames: list[bytes], fragment: str) -> None:
    with pytest.raises(ProtocolError, match=fragment) as refused:
        decode(frames)
    assert len(str(refused.value)) < 400  # a peer's 100 kB name is not logged whole


# -- the fuzz ----------------------------------------------------------------------------

_leaf = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=6)
    | st.binary(max_size=6)
)
_plain = st.recursive(
    _leaf,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=4) | st.sampled_from(list("vkebt")), inner, max_size=4)
    ),
    max_leaves=20,
)
_dims = st.integers(0, 4) | st.sampled_from([2**31, 2**62, 2**63, 2**64 - 1, -1, 10**6])
_shapes = st.lists(_dims, max_size=MAX_DIMS + 1)


def _sometimes(draw: st.DrawFn, valid: st.SearchStrategy[Any], odds: int = 5) -> Any:
    """Mostly ``valid``, one time in ``odds`` anything: a single corruption reaches deep."""
    return draw(_plain) if draw(st.integers(1, odds)) == 1 else draw(valid)


@st.composite
def _metas(draw: st.DrawFn) -> list[Any]:
    return [
        [_sometimes(draw, st.sampled_from(DTYPE_NAMES)), _sometimes(draw, _shapes)]
        for _ in range(draw(st.integers(0, 3)))
    ]


@st.composite
def _frames_for(draw: st.DrawFn, metas: Any) -> list[bytes]:
    """One frame per meta: the size the meta needs where that is small, or any size."""
    frames = []
    for meta in metas if isinstance(metas, list) else []:
        exact = _exact_size(meta)
        if exact is not None and 0 <= exact <= 4096 and draw(st.integers(0, 4)):
            frames.append(b"\x01" * exact)
        else:
            frames.append(draw(st.binary(max_size=64)))
    if draw(st.integers(0, 9)) == 0:
        frames.append(draw(st.binary(max_size=8)))
    return frames


def _exact_size(meta: Any) -> int | None:
    try:
        name, shape = meta
        size = math.prod(shape) * getattr(torch, name).itemsize
    except Exception:
        return None
    return size if isinstance(size, int) else None


@st.composite
def _headers(draw: st.DrawFn) -> tuple[dict[str, Any], list[bytes]]:
    """A header valid in most fields; now and then one field (or one body value) is anything."""
    kinds = sorted(REGISTRY.tensor_kinds) if draw(st.booleans()) else sorted(REGISTRY.schemas)
    kind = draw(st.sampled_from(kinds))
    body = {
        key: draw(_value_for(types)) for key, (types, required) in REGISTRY.schemas[kind].items()
    }
    fields: dict[str, Any] = {
        "v": PROTOCOL_VERSION,
        "k": kind,
        "e": draw(st.integers(0, 2**64 - 1)),
        "b": body,
        "t": draw(_metas()) if REGISTRY.carries_tensors(kind) else [],
    }
    if draw(st.integers(0, 4)) == 0:
        fields[draw(st.sampled_from(sorted(fields)))] = draw(_plain)
    if draw(st.integers(0, 4)) == 0 and isinstance(fields["b"], dict):
        fields["b"][draw(st.text(max_size=5) | st.sampled_from(sorted(body) or ["x"]))] = draw(
            _plain
        )
    return fields, draw(_frames_for(fields["t"]))


def _value_for(types: tuple[type, ...]) -> st.SearchStrategy[Any]:
    by_type: dict[type, st.SearchStrategy[Any]] = {
        type(None): st.none(),
        bool: st.booleans(),
        int: st.integers(0, 2**64 - 1),
        float: st.floats(),
        str: st.text(max_size=6),
        list: st.lists(_plain, max_size=3),
        dict: st.dictionaries(st.text(max_size=4), _plain, max_size=3),
    }
    return st.one_of([by_type[t] for t in types])


FUZZ = settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck))


@FUZZ
@given(structure=_plain, extra=st.lists(st.binary(max_size=32), max_size=3))
def test_any_msgpack_structure_as_a_header(structure: Any, extra: list[bytes]) -> None:
    decodes_or_refuses([msgpack.packb(structure, use_bin_type=True), *extra])


@FUZZ
@given(header_and_frames=_headers())
def test_mostly_valid_headers_with_any_tensor_metas(header_and_frames: Any) -> None:
    fields, frames = header_and_frames
    decodes_or_refuses([msgpack.packb(fields, use_bin_type=True), *frames])


@FUZZ
@given(header_and_frames=_headers(), data=st.data())
def test_byte_mutations_of_headers(header_and_frames: Any, data: Any) -> None:
    fields, frames = header_and_frames
    raw = bytearray(msgpack.packb(fields, use_bin_type=True))
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "insert", "delete", "truncate"]))
        pos = data.draw(st.integers(0, max(len(raw) - 1, 0)))
        if op == "flip" and raw:
            raw[pos] = data.draw(st.integers(0, 255))
        elif op == "insert":
            raw[pos:pos] = data.draw(st.binary(min_size=1, max_size=9))
        elif op == "delete" and raw:
            del raw[pos]
        else:
            del raw[pos:]
    decodes_or_refuses([bytes(raw), *frames])


@FUZZ
@given(
    message=st.sampled_from(
        [
            Message("data", DATA_BODY, epoch=2, tensors=(torch.arange(6.0).view(2, 3),)),
            Message(
                "backup",
                {"run": 1, "step": 2, "owner": "s", "keys": ["a", "b"]},
                tensors=(torch.zeros(0, 4), torch.ones(3, dtype=torch.bfloat16)),
            ),
            Message("register", {"name": "s", "data_endpoint": "tcp://h:1", "info": {"c": 2}}),
        ]
    ),
    data=st.data(),
)
def test_valid_messages_with_mutated_frames(message: Message, data: Any) -> None:
    frames = [bytes(f) for f in encode(message)]
    index = data.draw(st.integers(0, len(frames)))
    if index == len(frames):
        frames.append(data.draw(st.binary(max_size=16)))
    elif data.draw(st.booleans()):
        frames[index] = data.draw(st.binary(max_size=64))
    else:
        cut = data.draw(st.integers(0, len(frames[index])))
        frames[index] = frames[index][:cut] + data.draw(st.binary(max_size=4))
    decodes_or_refuses(frames, max_message_bytes=data.draw(st.sampled_from([1 << 31, 64, 0])))


@FUZZ
@given(dtype=st.sampled_from(DTYPE_NAMES), shape=_shapes, data=st.data())
def test_any_shape_with_the_frame_it_announces(dtype: str, shape: list[int], data: Any) -> None:
    frames = data.draw(_frames_for([[dtype, shape]]))
    decodes_or_refuses([header(t=[[dtype, shape]]), *frames])


# -- the fast paths: a one-pass check may accept only what the full checks accept -------


def _received(fields: Any) -> Any:
    """What the codec's unpacker hands the checks for ``fields``."""
    return msgpack.unpackb(msgpack.packb(fields, use_bin_type=True), strict_map_key=False)


@FUZZ
@given(header_and_frames=_headers(), structure=_plain)
def test_the_one_pass_header_check_accepts_only_what_the_full_check_accepts(
    header_and_frames: Any, structure: Any
) -> None:
    fields, _ = header_and_frames
    for candidate in (_received(fields), _received(structure)):
        if codec._fits_fast(candidate, REGISTRY):
            codec._check_header(candidate, REGISTRY)  # must not raise


@FUZZ
@given(
    kind=st.sampled_from(sorted(REGISTRY.schemas)),
    extra=st.dictionaries(st.text(max_size=4), _plain, max_size=2),
    data=st.data(),
)
def test_the_flat_body_check_accepts_only_what_check_body_accepts(
    kind: str, extra: dict[str, Any], data: Any
) -> None:
    schema = REGISTRY.schemas[kind]
    body = {
        key: data.draw(_value_for(types) | _leaf)
        for key, (types, _) in schema.items()
        if data.draw(st.integers(0, 5))
    }
    if data.draw(st.booleans()):
        body.update(extra)
    if REGISTRY.fits_flat(kind, body):
        assert REGISTRY.check_body(kind, body) is body
        codec._check_plain(body)


@pytest.mark.parametrize(
    "body, fits",
    [
        (DATA_BODY, True),
        ({"run": 0, "mb": -1, "src": "s"}, False),  # negative counter
        ({"run": 0, "mb": True, "src": "s"}, False),  # a flag where a number belongs
        ({"run": 0, "mb": 1.0, "src": "s"}, False),
        ({"run": 0, "src": "s"}, False),  # a required field missing
        ({**DATA_BODY, "zz": 1}, False),  # an unknown field
        ({**DATA_BODY, "src": b"s"}, False),
        ({**DATA_BODY, "src": ["s"]}, False),
        ([("run", 0)], False),
    ],
    ids=str,
)
def test_the_flat_body_check_on_data_bodies(body: Any, fits: bool) -> None:
    assert REGISTRY.fits_flat("data", body) is fits
    if not fits:  # what the one-pass check leaves to the full one, the full one refuses
        frames = [header(b=body), b""]
        with pytest.raises(ProtocolError):
            decode(frames)


def test_a_data_plane_header_takes_the_one_pass_path() -> None:
    frames = encode(Message("data", DATA_BODY, epoch=3, tensors=(torch.ones(2, 3),)))
    assert codec._fits_fast(_received(msgpack.unpackb(frames[0])), REGISTRY)
    message = decode([bytes(f) for f in frames])
    assert message.epoch == 3 and torch.equal(message.tensors[0], torch.ones(2, 3))


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(12.0).view(3, 4),
        torch.arange(12.0).view(3, 4).t(),  # not contiguous
        torch.arange(12.0).view(3, 4)[1:],  # storage offset
        torch.arange(6.0, requires_grad=True) * 2,
        torch.ones(3, dtype=torch.bfloat16),
        torch.tensor(2.5),  # zero dims
        torch.zeros(0, 4),
        torch.tensor([True, False, True]),
        torch.arange(5, dtype=torch.int8),
        torch.arange(4.0).neg(),
    ],
    ids=lambda t: f"{t.dtype}{tuple(t.shape)}",
)
def test_the_fast_tensor_bytes_are_the_general_paths_bytes(tensor: torch.Tensor) -> None:
    expected = tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    assert bytes(codec._tensor_bytes(tensor)) == expected
    frames = [bytes(f) for f in encode(Message("data", DATA_BODY, tensors=(tensor,)))]
    (back,) = decode(frames).tensors
    assert back.shape == tensor.shape and torch.equal(back, tensor.detach())
