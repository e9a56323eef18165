"""What bench/hostile.py's attackers put on the wire: every hostile message as frames,
and the bytes of a ZMTP 3.0 peer that sends part of one huge frame. Pure: no sockets.

Messages a real peer would send are built from the protocol classes (a registration,
a bulk chunk, a run request); only the malformed ones are written by hand.
"""

from __future__ import annotations

import random
import socket
import struct
from collections.abc import Iterator
from typing import Any

import msgpack
import torch

from zpipe.protocol.bulk import BulkChunk
from zpipe.protocol.client_control import RunRequest
from zpipe.protocol.federated import FlRegister
from zpipe.protocol.stage_control import Register
from zpipe.transport.bulk import MAX_CHUNK_BYTES, chunk_count
from zpipe.transport.codec import Message, encode

PROTOCOL_VERSION = 1


def header(kind: str, body: dict[str, Any], metas: list[Any], epoch: int = 1) -> bytes:
    """A codec header frame written by hand (so that it can lie about its tensors)."""
    return msgpack.packb({"v": PROTOCOL_VERSION, "k": kind, "e": epoch, "b": body, "t": metas})


def frames_of(message: Message) -> list[bytes]:
    """A message as the codec writes it, each frame as bytes."""
    return [bytes(memoryview(f)) for f in encode(message)]


def poison_messages() -> Iterator[list[bytes]]:
    while True:
        yield from _poison_once()


def _poison_once() -> Iterator[list[bytes]]:
    body = {"run": 1, "mb": 0, "src": "attacker"}
    for shape in ([0, 2**63], [0, 2**64 - 1], [0, 2**62, 2**62], [2**40, 2**40], [-1, 4]):
        yield [header("data", body, [["float32", shape]]), b""]
    yield [header("data", body, [["float32", [4]]]), b"\0" * 3]  # short frame
    yield [header("data", body, [["complex128", [1]]]), b"\0" * 16]  # unknown dtype
    yield [header("heartbeat", {"name": "x", "metrics": {"m": [[[[[]]]]]}}, [])]


def garbage_messages(rng: random.Random) -> Iterator[list[bytes]]:
    while True:
        yield [rng.randbytes(rng.randint(0, 256)) for _ in range(rng.randint(1, 4))]


def many_frames(count: int, frame: bytes) -> list[bytes]:
    """One message of ``count`` frames, each ``frame`` (the same object: no copies):
    findings 1 (a million 1-byte frames) and 3 (8,000 frames of 60 kB)."""
    if count < 1:
        raise ValueError(f"a message has at least one frame, got {count}")
    return [frame] * count


def factory_request(marker: str) -> list[bytes]:
    """A run request whose model factory is ``os:system`` (it must never run)."""
    model = {
        "family": "sequential",
        "config": {
            "factory": "os:system",
            "kwargs": {"command": f"touch {marker}"},
            "input_shape": [4],
        },
    }
    body = {
        "model": model,
        "dtype": "float32",
        "wait_for_stages_s": 1.0,
        "mode": "infer",
        "sink_endpoint": "tcp://127.0.0.1:1",
    }
    return [header("run_request", body, [], epoch=0)]


def model_bomb_request() -> list[bytes]:
    """A built-in MLP of 10**18 parameters (refused before anything is allocated)."""
    body = {
        "model": {"family": "mlp", "config": {"dims": [10**9, 10**9]}},
        "dtype": "float32",
        "wait_for_stages_s": 1.0,
        "mode": "infer",
        "sink_endpoint": "tcp://127.0.0.1:1",
    }
    return [header("run_request", body, [], epoch=0)]


def tiny_sequential_request(hidden: int, sink: str) -> list[bytes]:
    """Finding 2: the always-allowed example factory with a hidden width of ``hidden``
    (16,384: about 1 GiB of float32 weights, growing with the square of the width)."""
    model = {
        "family": "sequential",
        "config": {
            "factory": "zpipe.models.examples:tiny_sequential",
            "kwargs": {"in_features": 8, "hidden": hidden, "out_features": 4},
            "input_shape": [8],
        },
    }
    request = RunRequest(
        model=model,
        dtype="float32",
        sink_endpoint=sink,
        wait_for_stages_s=5.0,
        mode="infer",
        num_units=5,  # tiny_sequential's five children
    )
    return frames_of(request.to_message())


def tiny_sequential_bytes(hidden: int) -> int:
    """float32 bytes of tiny_sequential(in 8, hidden, out 4): what the stage would hold."""
    return 4 * ((8 + 1) * hidden + (hidden + 1) * hidden + (hidden + 1) * 4)


def planted_backups(count: int) -> list[list[bytes]]:
    """Backups of 4 MiB each under made-up owners (frames as the codec writes them)."""
    out = []
    for i in range(count):
        body = {"run": 1, "step": i, "owner": f"mallory{i}", "keys": ["units.0.linear.weight"]}
        out.append(frames_of(Message("backup", body, tensors=(torch.zeros(1 << 20),))))
    return out


def fetches(owner: str, count: int) -> list[list[bytes]]:
    body = {"owner": owner, "run": 1, "step": 0, "start": 0, "end": 4}
    return [[header("fetch_units", {**body, "step": i}, [], epoch=0)] for i in range(count)]


# ---------------------------------------------------------------- a fake stage (finding 5)


def registration(name: str) -> list[bytes]:
    """A stage's ``register`` that takes no work (its data port is never connected to)."""
    return frames_of(Register(name=name, data_endpoint="tcp://127.0.0.1:9", info={}).to_message())


def bulk_chunks(
    name: str, token: str, transfer: int, announced: int, sent: int
) -> Iterator[list[bytes]]:
    """The first chunks of a transfer announced at ``announced`` bytes (one frame), in
    chunks of the most a receiver takes, until ``sent`` bytes have gone: the rest never
    comes (finding 5)."""
    if not 0 < sent <= announced:
        raise ValueError(f"send 1..{announced} bytes of the transfer, not {sent}")
    chunks = chunk_count(announced, MAX_CHUNK_BYTES)
    payload = torch.zeros(MAX_CHUNK_BYTES, dtype=torch.uint8)
    for seq in range(chunk_count(sent, MAX_CHUNK_BYTES)):
        size = min(MAX_CHUNK_BYTES, sent - seq * MAX_CHUNK_BYTES)
        chunk = BulkChunk(
            name=name,
            token=token,
            transfer=transfer,
            seq=seq,
            chunks=chunks,
            nbytes=announced,
            frames=[announced] if seq == 0 else None,
            tensors=(payload[:size],),
        )
        yield frames_of(chunk.to_message())


# ---------------------------------------------------------- fl-server's peers (finding 4)

# the digits data set that fl-server trains on has ten classes
FL_CLASSES = 10


def fl_registration(client: int, latency_s: float, label_counts: list[int]) -> list[bytes]:
    message = FlRegister(client=client, label_counts=label_counts, latency_s=latency_s)
    return frames_of(message.to_message())


def absurd_fl_registrations(first_id: int) -> list[list[bytes]]:
    """Finding 4's registrations: latencies of 1e308, 5e-324 and 0, a label count of
    2**31 (each must get an ``fl_error``)."""
    fine = [10] * FL_CLASSES
    return [
        fl_registration(first_id, 1e308, fine),
        fl_registration(first_id + 1, 5e-324, fine),
        fl_registration(first_id + 2, 0.0, fine),
        fl_registration(first_id + 3, 0.05, [2**31] + [1] * (FL_CLASSES - 1)),
    ]


# ------------------------------------------------------- a ZMTP 3.0 peer by hand (finding 7)


def zmtp_greeting() -> bytes:
    """ZMTP 3.0's 64-byte greeting of a NULL-mechanism client (RFC 23)."""
    signature = b"\xff" + b"\0" * 8 + b"\x7f"
    mechanism = b"NULL".ljust(20, b"\0")
    return signature + bytes([3, 0]) + mechanism + b"\0" + b"\0" * 31


def zmtp_ready(socket_type: str) -> bytes:
    """The READY command of a NULL handshake, naming the socket type."""
    name, value = b"Socket-Type", socket_type.encode()
    body = b"\x05READY" + bytes([len(name)]) + name + struct.pack(">I", len(value)) + value
    if len(body) > 255:
        raise ValueError("a short command carries at most 255 bytes")
    return b"\x04" + bytes([len(body)]) + body


def zmtp_long_frame_header(size: int, *, more: bool = False) -> bytes:
    """The header of a message frame of ``size`` bytes in ZMTP 3.0's long form."""
    if not 0 <= size < 2**63:
        raise ValueError(f"a frame size is 0..2**63-1, got {size}")
    return bytes([0x02 | (0x01 if more else 0)]) + struct.pack(">Q", size)


# the length of a ZMTP 3.0 greeting (signature, version, mechanism, as-server, filler)
ZMTP_GREETING_BYTES = 64


def zmtp_handshake(conn: socket.socket, socket_type: str) -> None:
    """A NULL handshake over ``conn``, a step at a time: our greeting, the peer's, our
    READY, the peer's. Sent in one write, greeting and READY are often refused:
    libzmq 4.3.5 reset 8 of 18 such connections (``HANDSHAKE_FAILED_PROTOCOL``), and
    10 of 10 with a frame behind them, before it read a frame, so an attack that
    wrote them together may only test the handshake. Raises OSError when the peer
    closes first."""
    conn.sendall(zmtp_greeting())
    _read_exactly(conn, ZMTP_GREETING_BYTES)
    conn.sendall(zmtp_ready(socket_type))
    flags, size = _read_exactly(conn, 2)
    if flags & 0x02:  # a long command: an 8-byte size follows the flags
        size = struct.unpack(">Q", bytes([size]) + _read_exactly(conn, 7))[0]
    _read_exactly(conn, size)


def _read_exactly(conn: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionResetError(f"the peer closed after {len(data)} of {n} bytes")
        data += chunk
    return bytes(data)


def describe_request(frames: list[bytes]) -> dict[str, Any]:
    """The kind and body of a message built here (for tests and logs)."""
    decoded = msgpack.unpackb(frames[0])
    return {"kind": decoded["k"], "body": decoded["b"]}
