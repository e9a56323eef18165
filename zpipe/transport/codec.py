"""The wire codec: validated messages to ZeroMQ frames and back, with no I/O.

A message is one multipart ZeroMQ message::

    frame 0      msgpack map  {"v": version, "k": kind, "e": epoch, "b": body, "t": tensor metas}
    frame 1..n   one raw frame per tensor, in the order of "t" (sent zero-copy)

A tensor meta is ``[dtype_name, [dim, ...]]``. Nothing is pickled: the header is
msgpack of plain data and each tensor is its raw bytes. Decoding validates the
version, the kind, every body field against the kind's schema, every dtype and
shape, and every frame's length, and raises :class:`ProtocolError` on the first
problem, so a receive loop can log and drop the message and keep serving.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

from zpipe._errors import ProtocolError

PROTOCOL_VERSION = 1

# Limits a receiver enforces before it trusts anything else in a message.
MAX_HEADER_BYTES = 1 << 20
# A checkpoint carries every tensor of a model, replicas of data-parallel groups
# included (ViT-Base alone has about 200); 4096 metas stay far under the header limit.
MAX_TENSORS = 4096
MAX_DIMS = 8
DEFAULT_MAX_MESSAGE_BYTES = 1 << 31

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}

# Body schema of each kind: field -> (accepted types, required). Unknown fields
# are refused, so a typo in a sender shows up as an error instead of a silently
# ignored setting. Nested maps (plans, model specs) are validated by the code
# that consumes them.
_Types = tuple[type, ...]
_STR: _Types = (str,)
_INT: _Types = (int,)
_NUM: _Types = (int, float)
_MAP: _Types = (dict,)
_LIST: _Types = (list,)
_OPT_STR: _Types = (str, type(None))
_OPT_MAP: _Types = (dict, type(None))
_OPT_LIST: _Types = (list, type(None))
_OPT_INT: _Types = (int, type(None))
_OPT_NUM: _Types = (int, float, type(None))
_BOOL: _Types = (bool,)

SCHEMAS: dict[str, dict[str, tuple[_Types, bool]]] = {
    # data plane
    "data": {
        "run": (_INT, True),
        "mb": (_INT, True),
        "src": (_STR, True),
        "rows": (_LIST, False),
        "total": (_INT, False),
    },
    # training: the gradient of the receiver's outputs, labels for the last stage
    # ("samples": the mini-batch's size, which the loss is averaged over), losses back
    # Training pieces: "rows" [lo, hi) of a micro-batch of "total" rows (data-parallel
    # groups split each micro-batch; a piece may hold no rows, and then no tensors).
    "grad": {
        "run": (_INT, True),
        "mb": (_INT, True),
        "src": (_STR, True),
        "rows": (_LIST, True),
        "total": (_INT, True),
    },
    "labels": {
        "run": (_INT, True),
        "mb": (_INT, True),
        "src": (_STR, True),
        "samples": (_INT, True),
        "rows": (_LIST, True),
        "total": (_INT, True),
    },
    "loss": {
        "run": (_INT, True),
        "mb": (_INT, True),
        "step": (_INT, True),
        "loss": (_NUM, True),
        "src": (_STR, True),
    },
    # a micro-batch that failed: "stage" is where it failed, "src" the last hop
    "error": {
        "run": (_INT, True),
        "mb": (_INT, True),
        "src": (_STR, True),
        "stage": (_STR, True),
        "message": (_STR, True),
    },
    # stage <-> coordinator
    "register": {
        "name": (_STR, True),
        "data_endpoint": (_STR, True),
        "info": (_MAP, True),
        "public_key": (_OPT_STR, False),
    },
    "registered": {"name": (_STR, True), "heartbeat_interval": (_NUM, True)},
    "refused": {"reason": (_STR, True)},
    "heartbeat": {"name": (_STR, True), "metrics": (_MAP, True)},
    "heartbeat_ack": {},
    # a coordinator that does not know a heartbeating stage (it restarted without
    # its state): the stage registers again and keeps serving
    "register_again": {"reason": (_STR, True)},
    "probe": {"nonce": (_INT, True)},
    "probe_ack": {"nonce": (_INT, True)},
    "assign": {
        "run": (_INT, True),
        "model": (_MAP, True),
        "start": (_INT, True),
        "end": (_INT, True),
        "index": (_INT, True),
        "num_stages": (_INT, True),
        "upstream": (_STR, True),
        "upstream_key": (_OPT_STR, False),
        "downstream": (_STR, True),
        "downstream_endpoint": (_STR, True),
        "downstream_key": (_OPT_STR, False),
        "dtype": (_STR, True),
        "mode": (_STR, False),
        "train": (_OPT_MAP, False),
        "upstream_endpoint": (_STR, False),
        # training resumed from a replica: the keys of the tensors that follow, which
        # are the stage's weights and optimizer state (TrainShard.training_state)
        "state_keys": (_OPT_LIST, False),
        # ...and the units the stage gets from snapshots kept by the stages (chain
        # replication): [{"from", "endpoint", "key", "owner", "run", "step",
        # "start", "end"}], "from" being this stage for its own snapshot
        "fetch": (_OPT_LIST, False),
    },
    "ready": {
        "run": (_INT, True),
        "name": (_STR, True),
        "build_s": (_NUM, True),
        "ring_endpoint": (_STR, False),
    },
    # second phase: connect downstream only once every stage allows its upstream;
    # "ring": the all-reduce ring of a data-parallel group ({"endpoints", "keys"})
    "connect": {"run": (_INT, True), "ring": (_OPT_MAP, False)},
    "connected": {"run": (_INT, True), "name": (_STR, True)},
    "assign_failed": {"run": (_INT, True), "name": (_STR, True), "error": (_STR, True)},
    "profile_request": {
        "model": (_MAP, True),
        "batch_size": (_INT, True),
        "dtype": (_STR, True),
        "repeats": (_INT, True),
        "train": (_BOOL, False),  # also backward times and saved activation bytes
    },
    "profile_reply": {"name": (_STR, True), "profile": (_OPT_MAP, True), "error": (_STR, True)},
    "metrics_request": {"run": (_INT, True)},
    "metrics": {"run": (_INT, True), "name": (_STR, True), "metrics": (_MAP, True)},
    "shutdown": {"reason": (_STR, True)},
    # client <-> coordinator
    "run_request": {
        "model": (_MAP, True),
        "partition": (_OPT_LIST, False),
        "stages": (_OPT_INT, False),
        "stage_names": (_OPT_LIST, False),
        "dtype": (_STR, True),
        "planner": (_STR, False),
        "microbatch_size": (_OPT_INT, False),
        "profile": (_OPT_MAP, False),
        "sink_endpoint": (_STR, True),
        "wait_for_stages_s": (_NUM, True),
        "mode": (_STR, False),
        "train": (_OPT_MAP, False),
        # re-plan without a stage that dies mid-stream, and replay (inference)
        "recover": (_BOOL, False),
        # how: "lightweight", "heavy" or "respipe" (zpipe.recovery.POLICIES)
        "recovery": (_STR, False),
        # training: resume run "run" from its replica after mini-batch "step", without
        # the "dead" stages ({"run", "step", "dead"})
        "resume": (_OPT_MAP, False),
        # training: re-balance at a replica when the bottleneck would shrink by this share
        "rebalance": (_OPT_NUM, False),
        # training: "global" replicas (all at the coordinator), "chain" (FTPipeHD) or
        # "topology" (Asteroid): snapshots kept at the stages, backed up to neighbours
        "replication": (_STR, False),
        # training with "rebalance": devices that may join the plan at a replica when
        # they register (or come back); null: any device that registers
        "admit": (_OPT_LIST, False),
    },
    "run_ready": {
        "run": (_INT, True),
        "plan": (_MAP, True),
        "baseline": (_OPT_MAP, False),
        "first_endpoint": (_STR, True),
        "first_stage": (_STR, True),
        "first_key": (_OPT_STR, False),
        "last_stage": (_STR, True),
        "last_key": (_OPT_STR, False),
        "last_endpoint": (_STR, False),
        "training_plan": (_OPT_MAP, False),
    },
    "run_failed": {"error": (_STR, True)},
    "run_go": {"run": (_INT, True)},
    "run_started": {"run": (_INT, True)},
    "run_end": {"run": (_INT, True)},
    "run_report": {"run": (_INT, True), "stages": (_MAP, True)},
    "stage_failed": {"run": (_INT, True), "stage": (_STR, True), "reason": (_STR, True)},
    # a stream re-planned without a dead stage: where to resend what has no result yet
    "run_replanned": {
        "run": (_INT, True),
        "plan": (_MAP, True),
        "dead": (_STR, True),
        # how long the stage was silent when declared dead, and from then to the new plan
        "detected_s": (_NUM, False),
        "recovered_s": (_NUM, True),
        "first_endpoint": (_STR, True),
        "first_stage": (_STR, True),
        "first_key": (_OPT_STR, True),
        "last_stage": (_STR, True),
        "last_key": (_OPT_STR, True),
        "last_endpoint": (_STR, True),
    },
    # training weights: client -> coordinator -> every stage, gathered back
    # ("optimizer": with the optimizer's state, for a replica to resume from)
    # "latest": the state as it is now, without waiting for round "step"; the stage
    # stops training that run first (its run broke: the `fast` consistency resumes
    # from the survivors' newest weights)
    "weights_request": {
        "run": (_INT, True),
        "step": (_INT, True),
        "optimizer": (_BOOL, False),
        "latest": (_BOOL, False),
    },
    # a global replica: the coordinator keeps every stage's state after mini-batch "step"
    "replicate": {"run": (_INT, True), "step": (_INT, True)},
    # chain replication (FTPipeHD) and Asteroid's topology-driven replication: after
    # round "step" a stage keeps a snapshot of its state and sends a copy to its
    # backup "holder": a stage (at "holder_endpoint", its probe socket), the
    # coordinator (in the reply), or nobody ("")
    "backup_request": {
        "run": (_INT, True),
        "step": (_INT, True),
        "holder": (_STR, True),
        "holder_endpoint": (_OPT_STR, False),
        "holder_key": (_OPT_STR, False),
    },
    "backed_up": {
        "run": (_INT, True),
        "name": (_STR, True),
        "step": (_INT, True),
        "holder": (_STR, True),
        "keys": (_LIST, True),
        "bytes": (_INT, True),
        "error": (_STR, True),
        "metrics": (_OPT_MAP, False),
    },
    # stage to stage, on the probe socket: a backup to keep, and units to fetch
    "backup": {
        "run": (_INT, True),
        "step": (_INT, True),
        "owner": (_STR, True),
        "keys": (_LIST, True),
    },
    "backup_ok": {"run": (_INT, True), "step": (_INT, True), "error": (_STR, True)},
    "fetch_units": {
        "owner": (_STR, True),
        "run": (_INT, True),
        "step": (_INT, True),
        "start": (_INT, True),
        "end": (_INT, True),
    },
    "units": {"keys": (_LIST, True), "error": (_STR, True)},
    # the client waited past its adaptive deadline for the run's next result
    # (FTPipeHD's deadline at the data source): probe the run's stages now
    "stalled": {"run": (_INT, True), "waited_s": (_NUM, True), "deadline_s": (_NUM, True)},
    "replicated": {
        "run": (_INT, True),
        "step": (_INT, True),
        "tensors": (_INT, True),
        "bytes": (_INT, True),
        "error": (_STR, True),
        # a plan that balances the stages' measured speeds: resume from the replica on it
        "rebalance": (_OPT_MAP, False),
    },
    # the coordinator's state on disk (zpipe.coordinator.persistence), never on the wire
    "coordinator_state": {
        "epoch": (_INT, True),
        "run_counter": (_INT, True),
        "members": (_LIST, True),
        "run": (_OPT_MAP, True),
        "saved_at": (_NUM, True),
    },
    # one chunk of a global replica on disk: "keys" name this chunk's tensors
    "replica_file": {
        "run": (_INT, True),
        "step": (_INT, True),
        "plan": (_MAP, True),
        "keys": (_LIST, True),
        "chunk": (_INT, True),
        "chunks": (_INT, True),
        "holders": (_OPT_MAP, False),
    },
    "weights": {
        "run": (_INT, True),
        "name": (_STR, True),
        "step": (_INT, True),
        "keys": (_LIST, True),
        "error": (_STR, True),
        # the stage's counters at that round (forward/backward time, micro-batches)
        "metrics": (_OPT_MAP, False),
        # the rounds the stage had completed (with "latest")
        "completed": (_INT, False),
    },
    "checkpoint": {"run": (_INT, True), "step": (_INT, True), "keys": (_LIST, True)},
    "cluster_request": {},
    "cluster_state": {"members": (_LIST, True)},
    # link measurement: the coordinator names the peers a stage's probe socket allows,
    # then asks one stage at a time to measure its link to another
    "link_peers": {"keys": (_MAP, True)},
    "link_peers_ok": {"name": (_STR, True)},
    "link_probe_request": {
        "target": (_STR, True),
        "endpoint": (_STR, True),
        "key": (_OPT_STR, False),
    },
    "link_probe_reply": {
        "name": (_STR, True),
        "target": (_STR, True),
        "bandwidth_bps": (_OPT_NUM, True),
        "rtt_s": (_OPT_NUM, True),
        "error": (_STR, True),
    },
    # stage <-> stage, on the probe socket
    "link_ping": {"nonce": (_INT, True)},
    "link_pong": {"nonce": (_INT, True)},
    "link_burst": {"burst": (_INT, True), "seq": (_INT, True)},
    "link_burst_end": {"burst": (_INT, True), "sent": (_INT, True)},
    "link_burst_report": {
        "burst": (_INT, True),
        "received": (_INT, True),
        "bytes_after_first": (_INT, True),
        "span_s": (_NUM, True),
    },
    # data-parallel group all-reduce (zpipe.training.allreduce): one segment of one
    # chunk per message, one tensor frame per dtype bucket
    "allreduce": {
        "round": (_INT, True),
        "step": (_INT, True),
        "chunk": (_INT, True),
        "seg": (_INT, True),
        "src": (_INT, True),
    },
}

# Kinds whose frames carry tensors; every other kind must have none.
TENSOR_KINDS = frozenset(
    {
        "allreduce",
        "assign",
        "backed_up",
        "backup",
        "checkpoint",
        "data",
        "grad",
        "labels",
        "link_burst",
        "replica_file",
        "units",
        "weights",
    }
)


@dataclass(frozen=True)
class Message:
    """One validated message: a kind, the plan epoch it belongs to, a body and tensors."""

    kind: str
    body: Mapping[str, Any] = field(default_factory=dict)
    epoch: int = 0
    tensors: tuple[torch.Tensor, ...] = ()

    def __getitem__(self, key: str) -> Any:
        return self.body[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.body.get(key, default)


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ProtocolError(f"dtype {dtype} cannot cross the wire") from None


def parse_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        known = ", ".join(sorted(_DTYPES))
        raise ProtocolError(f"unknown dtype {name!r}; known: {known}") from None


def _validate_body(kind: str, body: Any) -> dict[str, Any]:
    schema = SCHEMAS.get(kind)
    if schema is None:
        raise ProtocolError(f"unknown message kind {kind!r}")
    if not isinstance(body, dict):
        raise ProtocolError(f"{kind}: body must be a map, got {type(body).__name__}")
    for key in body:
        if key not in schema:
            raise ProtocolError(f"{kind}: unexpected field {key!r}")
    for key, (types, required) in schema.items():
        if key not in body:
            if required:
                raise ProtocolError(f"{kind}: missing field {key!r}")
            continue
        value = body[key]
        # bool is an int subclass; a flag where a number belongs is a sender bug.
        if isinstance(value, bool) and bool not in types:
            raise ProtocolError(f"{kind}: field {key!r} must not be a bool")
        if not isinstance(value, types):
            names = "/".join("null" if t is type(None) else t.__name__ for t in types)
            raise ProtocolError(
                f"{kind}: field {key!r} must be {names}, got {type(value).__name__}"
            )
        if isinstance(value, int) and key in ("run", "mb", "start", "end", "index") and value < 0:
            raise ProtocolError(f"{kind}: field {key!r} must be >= 0, got {value}")
    return body


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's raw bytes without a copy where it is already contiguous.

    Viewing as uint8 first is what lets bfloat16 (which numpy lacks) cross.
    """
    flat = tensor.detach()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.contiguous()
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


def encode(message: Message) -> list[bytes | memoryview]:
    """Frames for ``message``: the header, then one buffer per tensor (no copies).

    The caller must never modify a sent tensor in place: a zero-copy send only
    queues the buffers, and libzmq's I/O thread may read them after the send
    returns.
    """
    _validate_body(message.kind, dict(message.body))
    if message.tensors and message.kind not in TENSOR_KINDS:
        raise ProtocolError(f"{message.kind}: this kind carries no tensors")
    if len(message.tensors) > MAX_TENSORS:
        raise ProtocolError(f"{len(message.tensors)} tensors exceed the limit of {MAX_TENSORS}")
    metas = []
    frames: list[bytes | memoryview] = []
    for tensor in message.tensors:
        if tensor.dim() > MAX_DIMS:
            raise ProtocolError(f"tensor of {tensor.dim()} dims exceeds the limit of {MAX_DIMS}")
        metas.append([dtype_name(tensor.dtype), list(tensor.shape)])
        frames.append(_tensor_bytes(tensor))
    try:
        header = msgpack.packb(
            {
                "v": PROTOCOL_VERSION,
                "k": message.kind,
                "e": message.epoch,
                "b": dict(message.body),
                "t": metas,
            },
            use_bin_type=True,
        )
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"{message.kind}: body cannot be encoded: {exc}") from None
    if len(header) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(header)} bytes exceeds {MAX_HEADER_BYTES}")
    return [header, *frames]


def _frame_view(frame: Any) -> memoryview:
    if isinstance(frame, (bytes, bytearray, memoryview)):
        return memoryview(frame)
    buffer = getattr(frame, "buffer", None)  # zmq.Frame, received with copy=False
    if buffer is None:
        raise ProtocolError(f"frame of type {type(frame).__name__} is not a byte buffer")
    return memoryview(buffer)


def _decode_tensor(meta: Any, view: memoryview, index: int) -> torch.Tensor:
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
            raise ProtocolError(f"tensor {index}: bad dimension {dim!r} in shape {shape!r}")
    itemsize = dtype.itemsize
    expected = math.prod(shape) * itemsize
    if view.nbytes != expected:
        raise ProtocolError(
            f"tensor {index}: frame has {view.nbytes} bytes, {name}{shape} needs {expected}"
        )
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    raw = view.cast("B") if view.format != "B" else view
    if raw.readonly:
        raw = memoryview(bytearray(raw))
    tensor = torch.frombuffer(raw, dtype=torch.uint8)
    # zmq keeps small frames unaligned; torch kernels want aligned storage, so
    # copy those (they are small), and share memory with the frame otherwise.
    if tensor.data_ptr() % max(itemsize, 8):
        tensor = tensor.clone()
    return tensor.view(dtype).view(shape)


def decode(frames: Sequence[Any], *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Message:
    """Validate ``frames`` and return the message; :class:`ProtocolError` on any problem."""
    if not frames:
        raise ProtocolError("empty message")
    views = [_frame_view(f) for f in frames]
    header_view = views[0]
    if header_view.nbytes > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {header_view.nbytes} bytes exceeds {MAX_HEADER_BYTES}")
    total = sum(v.nbytes for v in views)
    if total > max_message_bytes:
        raise ProtocolError(f"message of {total} bytes exceeds the limit of {max_message_bytes}")
    try:
        header = msgpack.unpackb(header_view, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"header is not valid msgpack: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError("header must be a map")
    if set(header) != {"v", "k", "e", "b", "t"}:
        raise ProtocolError(f"header fields must be v, k, e, b, t; got {sorted(map(str, header))}")
    version = header["v"]
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version!r} is not {PROTOCOL_VERSION}")
    kind = header["k"]
    if not isinstance(kind, str):
        raise ProtocolError("kind must be a string")
    epoch = header["e"]
    if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
        raise ProtocolError(f"epoch must be a non-negative integer, got {epoch!r}")
    body = _validate_body(kind, header["b"])
    metas = header["t"]
    if not isinstance(metas, list) or len(metas) > MAX_TENSORS:
        raise ProtocolError(f"tensor metas must be a list of at most {MAX_TENSORS}")
    if metas and kind not in TENSOR_KINDS:
        raise ProtocolError(f"{kind}: this kind carries no tensors")
    if len(frames) != 1 + len(metas):
        raise ProtocolError(f"{len(metas)} tensors announced but {len(frames) - 1} frames follow")
    tensors = tuple(_decode_tensor(meta, views[i + 1], i) for i, meta in enumerate(metas))
    return Message(kind=kind, body=body, epoch=epoch, tensors=tensors)


def register_kinds(
    schemas: Mapping[str, Mapping[str, tuple[tuple[type, ...], bool]]],
    *,
    tensor_kinds: Sequence[str] = (),
) -> None:
    """Add the message kinds a subsystem owns (``zpipe.lossy.wire`` does, at import).

    They are validated like every built-in kind. Registering a kind again with
    the same schema is a no-op; with another schema it is a programming error.
    """
    global TENSOR_KINDS
    for kind, schema in schemas.items():
        known = SCHEMAS.get(kind)
        if known is not None and known != dict(schema):
            raise ValueError(f"message kind {kind!r} is already registered with another schema")
        SCHEMAS[kind] = dict(schema)
    unknown = set(tensor_kinds) - set(SCHEMAS)
    if unknown:
        raise ValueError(f"tensor kinds {sorted(unknown)} have no schema")
    TENSOR_KINDS = TENSOR_KINDS | frozenset(tensor_kinds)
