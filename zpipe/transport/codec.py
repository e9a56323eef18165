"""The wire codec: validated messages to ZeroMQ frames and back, with no I/O.

A message is one multipart ZeroMQ message::

    frame 0      msgpack map  {"v": version, "k": kind, "e": epoch, "b": body, "t": tensor metas}
    frame 1..n   one raw frame per tensor, in the order of "t" (sent zero-copy)

A tensor meta is ``[dtype_name, [dim, ...]]``. Nothing is pickled: the header is
msgpack of plain data and each tensor is its raw bytes.

Decoding is total: it validates the frame count and sizes, the header (its
msgpack, its nesting depth, its fields), the version, the kind and the body
against the kind's schema (from :mod:`zpipe.protocol`, which owns every
kind), every dtype and shape, and every frame's length, before it allocates
anything, and raises :class:`ProtocolError` on the first problem and no other
exception, so a receive loop can log and drop the message and keep serving.
"""

from __future__ import annotations

import math
import operator
import threading
import warnings
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgpack

from zpipe._errors import ProtocolError
from zpipe.protocol import REGISTRY, Message, Registry, WireMessage
from zpipe.protocol._schema import short_repr

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "MAX_DIMS",
    "MAX_HEADER_BYTES",
    "MAX_NESTING",
    "MAX_TENSORS",
    "PROTOCOL_VERSION",
    "SCHEMAS",
    "TENSOR_KINDS",
    "Message",
    "decode",
    "decode_typed",
    "dtype_name",
    "encode",
    "parse_dtype",
    "register_kinds",
    "shares_received_frame",
]

PROTOCOL_VERSION = 1

# Limits a receiver enforces before it trusts anything else in a message.
MAX_HEADER_BYTES = 1 << 20
# A checkpoint carries every tensor of a model, replicas of data-parallel groups
# included (ViT-Base alone has about 200); 4096 metas stay far under the header limit.
MAX_TENSORS = 4096
MAX_DIMS = 8
DEFAULT_MAX_MESSAGE_BYTES = 1 << 31
# Maps and lists inside the header: plans and model specs nest a few levels; a
# peer's 1000-deep list would make repr, logging or json raise RecursionError.
MAX_NESTING = 64
# What a zero-element tensor's other dimensions may span (torch sizes strides from
# them even with no elements), whatever message limit a caller sets.
_MAX_SPAN_BYTES = 1 << 48

# Every kind's body schema and the kinds that carry tensors (read-only views of
# the protocol's registry, kept under their old names).
SCHEMAS: Mapping[str, Mapping[str, tuple[tuple[type, ...], bool]]] = REGISTRY.schemas
TENSOR_KINDS: frozenset[str] = REGISTRY.tensor_kinds

# The dtypes that cross the wire, filled with torch's at the first message that
# carries a tensor (:func:`_bind_torch`): a process that only exchanges control
# messages (the coordinator serving membership) never imports torch for them. The
# per-message paths pay nothing for it: while the tables are empty, encode's
# look-up misses and takes dtype_name, decode's fast check fails and takes
# parse_dtype, and both bind.
_DTYPE_ORDER = (
    "float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
)  # fmt: skip
_DTYPES: dict[str, torch.dtype] = {}
_DTYPE_NAMES: dict[torch.dtype, str] = {}
_HEADER_FIELDS = frozenset({"v", "k", "e", "b", "t"})
# Tensors decode built over a received frame (a zmq.Frame, received without a
# copy), by id: (a weak reference to the tensor, the frame, the data address and
# byte count at decode), so that encode can send the frame itself when the tensor
# goes on unchanged: libzmq then counts one more reference to the message it
# received, where a Python buffer sent zero-copy costs a wake-up of pyzmq's
# garbage-collector thread when libzmq releases it (bench/send_copy.py). A side
# table, not an attribute: torch.save and deepcopy carry a tensor's attributes,
# and a zmq.Frame cannot be pickled. An entry leaves with its tensor.
_SOURCE_FRAMES: dict[int, tuple[weakref.ref[torch.Tensor], Any, int, int]] = {}
_LEAVES = frozenset({str, int, float, bytes, bool, type(None)})
_NBYTES = operator.attrgetter("nbytes")
_PACKERS = threading.local()


def _bind_torch() -> None:
    """Import torch once, at the first tensor, and fill the dtype tables.

    Binds the module-level name ``torch`` that the tensor functions below use: no
    import, and no check on the per-message paths, after the first.
    """
    global torch  # bound once, at the first tensor
    import torch

    _DTYPE_NAMES.update({getattr(torch, name): name for name in _DTYPE_ORDER})
    _DTYPES.update({name: getattr(torch, name) for name in _DTYPE_ORDER})


def dtype_name(dtype: torch.dtype) -> str:
    if not _DTYPES:
        _bind_torch()
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ProtocolError(f"dtype {dtype} cannot cross the wire") from None


def parse_dtype(name: str) -> torch.dtype:
    if not _DTYPES:
        _bind_torch()
    try:
        return _DTYPES[name]
    except (KeyError, TypeError):  # TypeError: an unhashable name
        known = ", ".join(sorted(_DTYPES))
        raise ProtocolError(f"unknown dtype {short_repr(name)}; known: {known}") from None


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's raw bytes without a copy where it is already contiguous.

    Viewing as uint8 first is what lets bfloat16 (which numpy lacks) cross.
    """
    if (
        tensor.is_cpu
        and not tensor.requires_grad
        and tensor.dtype is not torch.bfloat16
        and tensor.numel()
        and tensor.is_contiguous()
    ):
        # The common activation: numpy's view of it directly (a third of the
        # cost of the general path below, which any refusal falls back to).
        try:
            return memoryview(tensor.numpy()).cast("B")  # type: ignore[arg-type]
        except (RuntimeError, TypeError, ValueError):
            pass  # e.g. a conjugate or negative bit numpy refuses
    flat = tensor.detach()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.contiguous()
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


def _remember_frame(tensor: torch.Tensor, frame: Any, nbytes: int) -> None:
    key = id(tensor)

    def forget(ref: weakref.ref[torch.Tensor]) -> None:
        entry = _SOURCE_FRAMES.get(key)
        if entry is not None and entry[0] is ref:
            del _SOURCE_FRAMES[key]

    _SOURCE_FRAMES[key] = (weakref.ref(tensor, forget), frame, tensor.data_ptr(), nbytes)


def _source_frame(tensor: torch.Tensor) -> Any:
    """The received frame ``tensor`` still views whole (see :data:`_SOURCE_FRAMES`),
    or None."""
    entry = _SOURCE_FRAMES.get(id(tensor))
    if entry is not None and entry[0]() is tensor:
        _, frame, address, nbytes = entry
        # in-place ops (t_(), resize_(), set_()) keep the object but may move or
        # re-stride its storage: then the frame no longer holds its bytes in order
        if tensor.data_ptr() == address and tensor.nbytes == nbytes and tensor.is_contiguous():
            return frame
    return None


def shares_received_frame(tensor: torch.Tensor) -> bool:
    """Whether :func:`encode` sends ``tensor`` as the frame it was received in (a
    tensor passed on unchanged), which an untracked send neither copies nor shares
    as a Python buffer."""
    return _source_frame(tensor) is not None


def _packer() -> msgpack.Packer:
    """This thread's header packer. ``msgpack.packb`` builds a Packer, and its buffer,
    per call: a quarter of a header's packing (callgrind, 11,200 -> 8,600
    instructions). One per thread: a pack may run Python code, and let another
    thread in, halfway through its buffer."""
    packer: msgpack.Packer | None = getattr(_PACKERS, "packer", None)
    if packer is None:
        packer = _PACKERS.packer = msgpack.Packer(use_bin_type=True)
    return packer


def encode(message: Message, *, registry: Registry = REGISTRY) -> list[Any]:
    """Frames for ``message``: the header, then one buffer per tensor (no copies).

    A tensor that :func:`decode` built over a received frame, sent on unchanged,
    is that frame itself (a ``zmq.Frame``, still a byte buffer); any other tensor
    is a memoryview of its bytes.

    The caller must never modify a sent tensor in place: a zero-copy send only
    queues the buffers, and libzmq's I/O thread may read them after the send
    returns.
    """
    kind = message.kind
    body = message.body
    if type(body) is not dict:  # a plain dict goes as it is (msgpack reads, never keeps it)
        body = dict(body)
    # One precompiled pass proves the common flat body valid (and nesting-free);
    # anything else takes the full check, which names the problem.
    flat = type(kind) is str and registry.fits_flat(kind, body)
    if not flat:
        registry.check_body(kind, body)
    if message.tensors and not registry.carries_tensors(kind):
        raise ProtocolError(f"{kind}: this kind carries no tensors")
    if len(message.tensors) > MAX_TENSORS:
        raise ProtocolError(f"{len(message.tensors)} tensors exceed the limit of {MAX_TENSORS}")
    metas = []
    frames: list[Any] = []
    for tensor in message.tensors:
        if tensor.dim() > MAX_DIMS:
            raise ProtocolError(f"tensor of {tensor.dim()} dims exceeds the limit of {MAX_DIMS}")
        name = _DTYPE_NAMES.get(tensor.dtype)  # dtype_name and the received-frame look-up, inlined
        if name is None:
            name = dtype_name(tensor.dtype)  # binds torch at the first tensor, or refuses
        metas.append([name, list(tensor.shape)])
        frame = _source_frame(tensor)
        frames.append(frame if frame is not None else _tensor_bytes(tensor))
    packer = _packer()
    try:
        header = packer.pack(
            {"v": PROTOCOL_VERSION, "k": kind, "e": message.epoch, "b": body, "t": metas}
        )
    except (TypeError, ValueError, OverflowError) as exc:
        _PACKERS.packer = None  # what a failed pack left in its buffer goes with it
        raise ProtocolError(f"{kind}: body cannot be encoded: {exc}") from None
    if len(header) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(header)} bytes exceeds {MAX_HEADER_BYTES}")
    if not flat:
        # what a receiver would refuse, refused here, where the sender's bug is (a
        # flat body and metas of torch shapes nest three levels at most)
        _check_plain({"b": body, "t": metas}, received=False)
    return [header, *frames]


def _frame_view(frame: Any) -> memoryview:
    buffer = getattr(frame, "buffer", None)
    if type(buffer) is memoryview:  # a received zmq.Frame's own view: no other to make
        return buffer
    try:
        if isinstance(frame, (bytes, bytearray, memoryview)):
            return memoryview(frame)
        buffer = getattr(frame, "buffer", None)  # zmq.Frame, received with copy=False
        if buffer is not None:
            return memoryview(buffer)
    except (TypeError, ValueError, BufferError):
        pass
    raise ProtocolError(f"frame of type {type(frame).__name__} is not a byte buffer")


def _check_plain(header: Any, *, received: bool = True) -> None:
    """Refuse nesting deeper than :data:`MAX_NESTING` and, in a ``received`` header,
    values that are not plain data (msgpack gives exact types; ext types and
    timestamps are others).

    Level by level, not recursion: the point is to bound depth before anything
    recurses. A header to send may hold tuples and subclasses (msgpack packs them).
    """
    level: list[Any] = [header]
    depth = 0
    while level:
        if depth >= MAX_NESTING:
            raise ProtocolError(f"header nests deeper than {MAX_NESTING} levels")
        below: list[Any] = []
        for container in level:
            for child in container.values() if isinstance(container, dict) else container:
                kind = type(child)
                if kind is dict or kind is list:
                    below.append(child)
                elif not received:
                    if isinstance(child, (dict, list, tuple)):
                        below.append(child)
                elif kind not in _LEAVES:
                    raise ProtocolError(f"header holds a {kind.__name__}, which is not plain data")
        level = below
        depth += 1


def _unpack_header(view: memoryview) -> Any:
    try:
        return msgpack.unpackb(view, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"header is not valid msgpack: {short_repr(exc)}") from None


def _fits_fast(header: Any, registry: Registry) -> bool:
    """One pass over a data-plane header: True proves that :func:`_check_header`
    accepts it unchanged (exact plain types, version, epoch, a flat body that fits
    its kind) and that :func:`_shape_of` accepts every meta (a known dtype name, at
    most :data:`MAX_DIMS` non-negative int dims); False proves nothing.
    """
    if type(header) is not dict or header.keys() != _HEADER_FIELDS:
        return False
    version, kind, epoch, metas = header["v"], header["k"], header["e"], header["t"]
    if type(version) is not int or version != PROTOCOL_VERSION:
        return False
    if type(kind) is not str or type(epoch) is not int or epoch < 0:
        return False
    if type(metas) is not list or len(metas) > MAX_TENSORS:
        return False
    for meta in metas:
        if type(meta) is not list or len(meta) != 2:
            return False
        name, shape = meta
        if type(name) is not str or name not in _DTYPES:
            return False
        if type(shape) is not list or len(shape) > MAX_DIMS:
            return False
        for dim in shape:
            if type(dim) is not int or dim < 0:
                return False
    return registry.fits_flat(kind, header["b"])


def _check_header(header: Any, registry: Registry) -> None:
    """Every check of a received header; :class:`ProtocolError` on the first problem."""
    if not isinstance(header, dict):
        raise ProtocolError("header must be a map")
    _check_plain(header)
    if set(header) != _HEADER_FIELDS:
        got = short_repr(sorted(map(str, header)))
        raise ProtocolError(f"header fields must be v, k, e, b, t; got {got}")
    version = header["v"]
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {short_repr(version)} is not {PROTOCOL_VERSION}")
    kind = header["k"]
    if not isinstance(kind, str):
        raise ProtocolError("kind must be a string")
    epoch = header["e"]
    if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
        raise ProtocolError(f"epoch must be a non-negative integer, got {short_repr(epoch)}")
    registry.check_body(kind, header["b"])
    metas = header["t"]
    if not isinstance(metas, list) or len(metas) > MAX_TENSORS:
        raise ProtocolError(f"tensor metas must be a list of at most {MAX_TENSORS}")


def _shape_of(meta: Any, index: int) -> tuple[torch.dtype, list[int]]:
    if not (isinstance(meta, list) and len(meta) == 2):
        raise ProtocolError(f"tensor {index}: meta must be [dtype, shape]")
    name, shape = meta
    if not isinstance(name, str):
        raise ProtocolError(f"tensor {index}: dtype must be a string")
    dtype = parse_dtype(name)
    if not isinstance(shape, list) or len(shape) > MAX_DIMS:
        raise ProtocolError(f"tensor {index}: shape must be a list of at most {MAX_DIMS} dims")
    for dim in shape:
        if not isinstance(dim, int) or isinstance(dim, bool) or dim < 0:
            raise ProtocolError(
                f"tensor {index}: bad dimension {short_repr(dim)} in shape {short_repr(shape)}"
            )
    return dtype, shape


def _decode_tensor(
    meta: Any, view: memoryview, index: int, span_limit: int, frame: Any = None
) -> torch.Tensor:
    """One tensor over its frame; every size is checked before torch sees the shape.

    A tensor that shares the memory of ``frame`` (a received ``zmq.Frame``, not a
    plain byte buffer) is remembered with it (see :data:`_SOURCE_FRAMES`)."""
    dtype, shape = _shape_of(meta, index)
    return _tensor_over(dtype, shape, view, index, span_limit, frame)


def _tensor_over(
    dtype: torch.dtype,
    shape: list[int],
    view: memoryview,
    index: int,
    span_limit: int,
    frame: Any,
) -> torch.Tensor:
    """:func:`_decode_tensor` for a meta already validated."""
    itemsize = dtype.itemsize
    expected = math.prod(shape) * itemsize
    if view.nbytes != expected:
        raise ProtocolError(
            f"tensor {index}: frame has {view.nbytes} bytes, "
            f"{dtype_name(dtype)}{short_repr(shape)} needs {expected}"
        )
    try:
        if expected == 0:
            # No elements, but torch still multiplies the other dimensions into
            # strides: [0, 2**62, 2**62] overflows them, [0, 2**63] is not an int64.
            span = math.prod(d for d in shape if d) * itemsize
            if span > span_limit:
                raise ProtocolError(
                    f"tensor {index}: empty shape {short_repr(shape)} spans {span} bytes, "
                    f"over the limit of {span_limit}"
                )
            return torch.empty(shape, dtype=dtype)
        raw = view.cast("B") if view.format != "B" else view
        if raw.readonly:
            raw = memoryview(bytearray(raw))
            frame = None  # a copy: nothing shared with the frame
        # The frame's length is a whole number of items (checked above), so torch
        # reads it as ``dtype`` directly.
        tensor = torch.frombuffer(raw, dtype=dtype)
        # zmq keeps small frames unaligned; torch kernels want aligned storage, so
        # copy those (they are small), and share memory with the frame otherwise.
        if tensor.data_ptr() % max(itemsize, 8):
            tensor = tensor.clone()
            frame = None
        if len(shape) != 1:  # else frombuffer's own shape: [numel]
            tensor = tensor.view(shape)
        if frame is not None and not isinstance(frame, (bytes, bytearray, memoryview)):
            _remember_frame(tensor, frame, expected)
        return tensor
    except (RuntimeError, TypeError, ValueError, OverflowError, BufferError) as exc:
        # The checks above leave nothing for torch to refuse; this keeps decoding total
        # should a torch version refuse more.
        raise ProtocolError(f"tensor {index}: {short_repr(exc)}") from None


def decode(
    frames: Sequence[Any],
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    registry: Registry = REGISTRY,
) -> Message:
    """Validate ``frames`` and return the message; :class:`ProtocolError` on any problem."""
    if not frames:
        raise ProtocolError("empty message")
    if len(frames) > MAX_TENSORS + 1:
        raise ProtocolError(f"{len(frames)} frames exceed the limit of {MAX_TENSORS + 1}")
    views = list(map(_frame_view, frames))
    header_view = views[0]
    if header_view.nbytes > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {header_view.nbytes} bytes exceeds {MAX_HEADER_BYTES}")
    total = sum(map(_NBYTES, views))
    if total > max_message_bytes:
        raise ProtocolError(f"message of {total} bytes exceeds the limit of {max_message_bytes}")
    try:  # _unpack_header, inlined: decode runs for every message received
        header = msgpack.unpackb(header_view, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"header is not valid msgpack: {short_repr(exc)}") from None
    checked = _fits_fast(header, registry)
    if not checked:
        _check_header(header, registry)
    kind, epoch, body, metas = header["k"], header["e"], header["b"], header["t"]
    if metas and not registry.carries_tensors(kind):
        raise ProtocolError(f"{kind}: this kind carries no tensors")
    if len(frames) != 1 + len(metas):
        raise ProtocolError(f"{len(metas)} tensors announced but {len(frames) - 1} frames follow")
    span_limit = min(max_message_bytes, _MAX_SPAN_BYTES)
    tensors = []
    for i, meta in enumerate(metas):
        if checked:  # every meta proved valid by _fits_fast
            tensor = _tensor_over(
                _DTYPES[meta[0]], meta[1], views[i + 1], i, span_limit, frames[i + 1]
            )
        else:
            tensor = _decode_tensor(meta, views[i + 1], i, span_limit, frames[i + 1])
        tensors.append(tensor)
    return Message(kind, body, epoch, tuple(tensors))


def decode_typed(
    frames: Sequence[Any],
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    registry: Registry = REGISTRY,
) -> WireMessage:
    """:func:`decode`, then the typed class of its kind in ``registry``; the body is
    checked once, by :func:`decode` (``registry.parse(decode(...))`` checks it twice);
    :class:`ProtocolError` on any problem, a kind without a typed class included."""
    return registry.parse_checked(
        decode(frames, max_message_bytes=max_message_bytes, registry=registry)
    )


def register_kinds(
    schemas: Mapping[str, Mapping[str, tuple[tuple[type, ...], bool]]],
    *,
    tensor_kinds: Sequence[str] = (),
) -> None:
    """Deprecated: add kinds without a typed class to the codec's registry.

    Declare a :class:`zpipe.protocol.WireMessage` subclass and list it in a
    conversation module of :mod:`zpipe.protocol` instead. Registering a kind again
    with the same schema is a no-op; with another schema it is a programming error.
    """
    warnings.warn(
        "register_kinds is deprecated: declare typed messages in zpipe.protocol",
        DeprecationWarning,
        stacklevel=2,
    )
    global TENSOR_KINDS
    unknown = set(tensor_kinds) - set(schemas) - set(REGISTRY.schemas)
    if unknown:
        raise ValueError(f"tensor kinds {sorted(unknown)} have no schema")
    for kind, schema in schemas.items():
        REGISTRY.add_schema(kind, schema, carries_tensors=kind in tensor_kinds)
    for kind in tensor_kinds:
        if kind not in schemas:
            REGISTRY.add_schema(kind, REGISTRY.schemas[kind], carries_tensors=True)
    TENSOR_KINDS = REGISTRY.tensor_kinds
