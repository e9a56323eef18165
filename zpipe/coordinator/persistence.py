"""The coordinator's state on disk, so that a restarted coordinator resumes its run.

Two files live in the state directory (``python -m zpipe.coordinator --state-dir``):

- ``coordinator.state``: plan epoch and run counters, the members it knew, the
  current run (its plan, its devices, the client's request) and the run's notices
  its client has not acknowledged (:mod:`zpipe.coordinator.notices`). Small;
  rewritten on every change of membership or run and before each notice is sent.
- ``replica.state``: the latest global replica (FTPipeHD): every unit's weights
  and optimizer state after a mini-batch, and the plan it was taken under. It is
  written before the client is told the replica is kept, so a replica the client
  relies on (and drops its replay buffer for) is never only in memory.
- ``global.state``: the newest replica that held every unit here (a global copy).
  Under chain replication with a global copy (FTPipeHD runs both) the latest
  replica holds here only the last stage's backup, and the newest global copy
  behind it is what a recovery falls back to when two adjacent stages died; the
  next chain replica overwrites ``replica.state``, so the global copy keeps a
  file of its own. It is the same file as ``replica.state`` when written (a hard
  link, else a copy), so it costs no second encoding; at most two replicas are
  ever on disk.

- ``copies/<kind>-<stage>.state``: the newest copy of each stage and kind that an
  asynchronous run's stages made without draining
  (:mod:`zpipe.coordinator.runs.async_copies`): its ledger record and, when the
  coordinator holds it, its tensors; each replaces the older one of its stage and
  kind, so a restarted coordinator holds every copy it held.

All are sequences of wire-codec messages (msgpack headers and raw tensor bytes:
nothing is pickled), framed by lengths and closed by a CRC-32, and written
atomically (a temporary file, fsync, rename), so a coordinator killed in the
middle of a write leaves the previous file whole. A file that does not parse
raises :class:`StateFileError` naming the file: never a half-restored state.

The records themselves (what the pure core saves and restores) are plain data in
:mod:`zpipe.coordinator.records`; this module is their file I/O only.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import struct
import threading
import time
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zpipe._errors import ConfigError, ProtocolError, StateFileError
from zpipe.coordinator.notices import NOTICES, Notice
from zpipe.coordinator.records import SavedMember, SavedNotices, SavedReplica, SavedState
from zpipe.protocol import REGISTRY, Message, WireMessage, storage
from zpipe.recovery.live_copies import CopyRecord
from zpipe.transport import codec

if TYPE_CHECKING:
    import torch


STATE_FILE = "coordinator.state"
REPLICA_FILE = "replica.state"
GLOBAL_FILE = "global.state"
COPIES_DIR = "copies"
# Format tag and version: a file of another layout is refused, not misread.
MAGIC = b"ZPSTATE1"
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


__all__ = [
    "GLOBAL_FILE",
    "REPLICA_FILE",
    "STATE_FILE",
    "SavedMember",
    "SavedReplica",
    "SavedState",
    "StateFileError",
    "StateStore",
    "read_messages",
    "write_messages",
]


# -------------------------------------------------------------- file format


def _encode_file(messages: Sequence[Message]) -> list[bytes | memoryview]:
    parts: list[bytes | memoryview] = [_U32.pack(len(messages))]
    for message in messages:
        frames = codec.encode(message)
        parts.append(_U32.pack(len(frames)))
        for frame in frames:
            parts.append(_U64.pack(memoryview(frame).nbytes))
            parts.append(frame)
    return parts


def _temporary_name(path: Path) -> Path:
    """Where ``path``'s next version is written before the rename: one name per
    process and thread, since the coordinator saves live copies on several threads
    at once and two writes of the same file under one name would unlink or rename
    each other's half-written file."""
    return path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")


def write_messages(path: Path, messages: Sequence[Message]) -> int:
    """Write ``messages`` to ``path`` atomically; returns the file's size in bytes."""
    parts = _encode_file(messages)
    crc = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
    tmp = _temporary_name(path)
    size = 0
    try:
        with open(tmp, "wb") as out:
            out.write(MAGIC)
            for part in parts:
                out.write(part)
                size += memoryview(part).nbytes
            out.write(_U32.pack(crc))
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_directory(path.parent)
    return size + len(MAGIC) + _U32.size


def link_atomically(source: Path, path: Path) -> None:
    """Make ``path`` the file ``source`` is now (a hard link; a copy where the file
    system has none), atomically: a temporary name, fsync, rename."""
    tmp = _temporary_name(path)
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    try:
        try:
            os.link(source, tmp)
        except OSError:
            shutil.copyfile(source, tmp)
            with open(tmp, "rb") as copied:
                os.fsync(copied.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_directory(path.parent)


def _fsync_directory(directory: Path) -> None:
    # The rename is durable only once the directory entry is; not every OS can.
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def read_messages(path: Path) -> list[Message]:
    """The messages of a file :func:`write_messages` wrote; :class:`StateFileError` if
    it is not one, or not whole."""
    try:
        # A bytearray: tensors decoded from it are writable, as a received frame's are.
        data = bytearray(path.read_bytes())
    except OSError as exc:
        raise StateFileError(f"cannot read the state file {path}: {exc}") from exc
    if not data.startswith(MAGIC):
        raise StateFileError(f"{path} is not a zpipe coordinator state file")
    body = memoryview(data)[len(MAGIC) :]
    if body.nbytes < _U32.size * 2:
        raise StateFileError(f"{path} is truncated")
    (crc,) = _U32.unpack_from(body, body.nbytes - _U32.size)
    body = body[: body.nbytes - _U32.size]
    if zlib.crc32(body) != crc:
        raise StateFileError(f"{path} is corrupt (checksum mismatch); it was not written whole")
    try:
        return _decode_file(body)
    except (ProtocolError, struct.error, ValueError) as exc:
        raise StateFileError(f"{path} does not parse: {exc}") from exc


def read_records(path: Path) -> list[WireMessage]:
    """The messages of a state file, each parsed into its protocol class."""
    messages = read_messages(path)
    try:
        return [REGISTRY.parse(m) for m in messages]
    except ProtocolError as exc:
        raise StateFileError(f"{path} does not parse: {exc}") from exc


def _decode_file(body: memoryview) -> list[Message]:
    offset = 0

    def take(n: int) -> memoryview:
        nonlocal offset
        if offset + n > body.nbytes:
            raise ValueError("a length runs past the end of the file")
        view = body[offset : offset + n]
        offset += n
        return view

    (count,) = _U32.unpack(take(_U32.size))
    messages = []
    for _ in range(count):
        (nframes,) = _U32.unpack(take(_U32.size))
        if nframes > codec.MAX_TENSORS + 1:
            raise ValueError(f"{nframes} frames in one message")
        frames = [take(_U64.unpack(take(_U64.size))[0]) for _ in range(nframes)]
        messages.append(codec.decode(frames))
    if offset != body.nbytes:
        raise ValueError(f"{body.nbytes - offset} bytes after the last message")
    return messages


# ------------------------------------------------------------------- store


class StateStore:
    """The state directory of one coordinator."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create the state directory {directory}: {exc}") from exc
        if not os.access(directory, os.W_OK | os.X_OK):
            raise ConfigError(f"the state directory {directory} is not writable")

    @property
    def state_path(self) -> Path:
        return self.directory / STATE_FILE

    @property
    def replica_path(self) -> Path:
        return self.directory / REPLICA_FILE

    @property
    def global_path(self) -> Path:
        return self.directory / GLOBAL_FILE

    def save_state(self, state: SavedState) -> None:
        record = storage.CoordinatorState(
            cluster_epoch=state.epoch,
            run_counter=state.run_counter,
            members=[m.to_dict() for m in state.members],
            run=None if state.run is None else dict(state.run),
            saved_at=time.time(),
            notices=None if state.notices is None else _notices_record(state.notices),
        )
        write_messages(self.state_path, [record.to_message()])

    def load_state(self) -> SavedState | None:
        if not self.state_path.exists():
            return None
        records = read_records(self.state_path)
        record = records[0] if len(records) == 1 else None
        if not isinstance(record, storage.CoordinatorState):
            raise StateFileError(f"{self.state_path} holds no coordinator state")
        try:
            members = tuple(SavedMember.from_dict(m) for m in record.members)
        except (KeyError, TypeError, ValueError) as exc:
            raise StateFileError(f"{self.state_path}: a member does not parse: {exc}") from exc
        try:
            run = record.run
            if run is not None and not isinstance(run, Mapping):
                raise TypeError(f"the run is a {type(run).__name__}, not a map")
            notices = None if record.notices is None else _notices_of(record.notices)
            return SavedState(
                epoch=int(record.cluster_epoch),
                run_counter=int(record.run_counter),
                members=members,
                run=run,
                saved_at=float(record.saved_at),
                notices=notices,
            )
        except (KeyError, TypeError, ValueError, ProtocolError) as exc:
            # A CRC guards against torn writes, not against a file of another shape.
            raise StateFileError(f"{self.state_path} does not hold a valid state: {exc}") from exc

    def save_replica(self, replica: SavedReplica) -> int:
        """Write the replica (in chunks: a message carries at most MAX_TENSORS tensors),
        and keep it as the newest global copy too when it holds every unit; returns the
        file's size in bytes."""
        size = self._write_replica(replica)
        if replica.complete:
            link_atomically(self.replica_path, self.global_path)
        return size

    def _write_replica(self, replica: SavedReplica) -> int:
        keys = list(replica.state)
        per = codec.MAX_TENSORS
        chunks = max(1, -(-len(keys) // per))
        messages = []
        for index in range(chunks):
            part = keys[index * per : (index + 1) * per]
            record = storage.ReplicaFile(
                run=replica.run,
                step=replica.step,
                plan=dict(replica.plan),
                keys=part,
                chunk=index,
                chunks=chunks,
                holders=dict(replica.holders),
                global_copy=replica.global_copy,
                tensors=tuple(replica.state[k] for k in part),
            )
            messages.append(record.to_message())
        return write_messages(self.replica_path, messages)

    def load_replica(self) -> SavedReplica | None:
        return self._load_replica(self.replica_path)

    def copy_path(self, record: CopyRecord) -> Path:
        # the stage's name hashed: a file name whatever characters a name holds
        tag = hashlib.sha256(record.owner.encode()).hexdigest()[:16]
        return self.directory / COPIES_DIR / f"{record.kind}-{tag}.state"

    def save_copy(self, record: CopyRecord, state: Mapping[str, torch.Tensor]) -> int:
        """Write the newest ``record.kind`` copy of ``record.owner`` (replacing the one
        before, atomically); returns the file's size in bytes."""
        path = self.copy_path(record)
        path.parent.mkdir(exist_ok=True)
        keys = list(state)
        per = codec.MAX_TENSORS
        chunks = max(1, -(-len(keys) // per))
        messages = [
            storage.CopyFile(
                record=record.to_dict(),
                keys=keys[i * per : (i + 1) * per],
                chunk=i,
                chunks=chunks,
                tensors=tuple(state[k] for k in keys[i * per : (i + 1) * per]),
            ).to_message()
            for i in range(chunks)
        ]
        return write_messages(path, messages)

    def load_copies(self) -> list[tuple[CopyRecord, dict[str, torch.Tensor]]]:
        """Every copy saved by :meth:`save_copy` (in no particular order)."""
        folder = self.directory / COPIES_DIR
        if not folder.is_dir():
            return []
        copies = []
        for path in sorted(folder.glob("*.state")):
            records = read_records(path)
            files = [r for r in records if isinstance(r, storage.CopyFile)]
            if not records or len(files) != len(records):
                raise StateFileError(f"{path} holds no copy")
            try:
                record = CopyRecord.from_dict(files[0].record)
                if [int(f.chunk) for f in files] != list(range(int(files[0].chunks))):
                    raise ValueError("chunks missing or out of order")
                state: dict[str, torch.Tensor] = {}
                for f in files:
                    if f.record != files[0].record or len(f.keys) != len(f.tensors):
                        raise ValueError("chunks of different copies, or keys without tensors")
                    state.update({str(k): t for k, t in zip(f.keys, f.tensors, strict=True)})
            except (ConfigError, TypeError, ValueError) as exc:
                raise StateFileError(f"{path} does not hold a valid copy: {exc}") from exc
            copies.append((record, state))
        return copies

    def load_global(self) -> SavedReplica | None:
        """The newest global copy (see the module notes), or None."""
        return self._load_replica(self.global_path)

    def _load_replica(self, path: Path) -> SavedReplica | None:
        if not path.exists():
            return None
        records = read_records(path)
        files = [r for r in records if isinstance(r, storage.ReplicaFile)]
        if not records or len(files) != len(records):
            raise StateFileError(f"{path} holds no replica")
        try:
            return self._replica_of(path, files)
        except (KeyError, TypeError, ValueError) as exc:
            raise StateFileError(f"{path} does not hold a valid replica: {exc}") from exc

    def _replica_of(self, path: Path, records: Sequence[storage.ReplicaFile]) -> SavedReplica:
        first = records[0]
        chunks = int(first.chunks)
        if [int(r.chunk) for r in records] != list(range(chunks)):
            raise StateFileError(f"{path}: chunks missing or out of order")
        state: dict[str, torch.Tensor] = {}
        for record in records:
            if (record.run, record.step) != (first.run, first.step):
                raise StateFileError(f"{path} mixes replicas of different steps")
            if len(record.keys) != len(record.tensors):
                raise StateFileError(f"{path}: keys and tensors do not match")
            for key, tensor in zip(record.keys, record.tensors, strict=True):
                if not isinstance(key, str):
                    raise StateFileError(
                        f"{path}: 'keys' must be unit state names (strings), got {key!r}"
                    )
                state[key] = tensor
        holders = _holders_of(path, first.holders)
        whole = first.global_copy
        if whole is not None and not isinstance(whole, bool):
            raise StateFileError(f"{path}: 'global' must be true or false, got {whole!r}")
        return SavedReplica(
            int(first.run), int(first.step), dict(first.plan), state, holders, whole
        )


def _holders_of(path: Path, holders: Mapping[str, object] | None) -> dict[str, str]:
    """A replica's ``holders`` as written (device name -> the name of the stage that
    keeps its backup, "" for none). Anything else is refused, never turned into a
    string: a holder named "[1, 2]" would send a recovery to fetch from nobody."""
    checked: dict[str, str] = {}
    for device, holder in (holders or {}).items():
        if not isinstance(device, str) or not isinstance(holder, str):
            raise StateFileError(
                f"{path}: 'holders' must map device names to holder names (strings), "
                f"got {device!r}: {holder!r}"
            )
        checked[device] = holder
    return checked


def _notices_record(saved: SavedNotices) -> dict[str, Any]:
    """The notices as the state file keeps them: each as its kind, body and epoch."""
    kept = [{"to": to, "kind": m.KIND, "body": m.body(), "epoch": m.epoch} for to, m in saved.kept]
    return {"run": saved.run, "last_seq": saved.last_seq, "kept": kept}


def _notices_of(record: Mapping[str, Any]) -> SavedNotices:
    """:func:`_notices_record` read back; anything of another shape raises (the caller
    names the file): a notice restored with a wrong number or run could be dropped by
    the client as one it has seen, or never acknowledged."""
    run, last_seq, kept = record["run"], record["last_seq"], record["kept"]
    if not (_is_int(run) and _is_int(last_seq) and run >= 0 and last_seq >= 1):
        raise ValueError(f"notices: run {run!r} and last_seq {last_seq!r} must be counts")
    if not isinstance(kept, list):
        raise TypeError(f"notices: 'kept' must be a list, got {type(kept).__name__}")
    out: list[tuple[bytes, Notice]] = []
    for entry in kept:
        if not isinstance(entry, Mapping) or not isinstance(entry.get("to"), bytes):
            raise TypeError(f"notices: an entry without a client routing id: {entry!r}")
        if entry.get("kind") not in _NOTICE_KINDS or not isinstance(entry.get("body"), Mapping):
            raise ValueError(f"notices: {entry.get('kind')!r} is not a notice kind")
        epoch = entry.get("epoch", 0)
        if not _is_int(epoch):
            raise TypeError(f"notices: epoch {epoch!r} is not an integer")
        message = _NOTICE_KINDS[entry["kind"]].from_body(entry["body"], epoch=epoch)
        seq = message.seq
        if message.run != run or seq is None or not 1 <= seq <= last_seq:
            raise ValueError(
                f"notices: a {message.KIND} of run {message.run} numbered {seq!r} "
                f"among run {run}'s notices up to {last_seq}"
            )
        out.append((entry["to"], message))
    return SavedNotices(run, last_seq, tuple(out))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_NOTICE_KINDS: dict[str, type[Notice]] = {cls.KIND: cls for cls in NOTICES}
