"""The pure parts of the ring all-reduce (:mod:`zpipe.stage.data_parallel`): its cost
(Asteroid's eq. 5), the per-rank schedule, how buffers are cut into chunks and
segments, what message a rank expects next and the check of one received message,
the statistics of a round, and the flat buffers tensors are reduced in."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from zpipe._errors import ConfigError, ProtocolError
from zpipe.protocol import WireMessage
from zpipe.protocol.data_plane import AllReduce
from zpipe.transport.codec import dtype_name

KIND = AllReduce.KIND
OPS = ("mean", "sum")
REDUCIBLE_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
REDUCE_SCATTER = "reduce-scatter"
ALL_GATHER = "all-gather"


def ring_allreduce_cost_s(
    nbytes: float, n: int, bandwidth_bps: float, latency_s: float = 0.0
) -> float:
    """Seconds a ring all-reduce of ``nbytes`` takes among ``n`` ranks (Asteroid eq. 5).

    ``2(n-1)/n * nbytes * 8 / bandwidth_bps + 2(n-1) * latency_s``: each rank sends
    and receives 2(n-1)/n of the buffer over the slowest link of the ring
    (``bandwidth_bps`` in bit/s, as everywhere in zpipe's planner), in 2(n-1) steps
    that each wait for one message (``latency_s``, one way). One rank costs nothing.
    """
    if n < 1 or nbytes < 0 or latency_s < 0:
        raise ConfigError(
            f"ring all-reduce cost needs n >= 1, nbytes >= 0 and latency_s >= 0; "
            f"got n={n}, nbytes={nbytes}, latency_s={latency_s}"
        )
    if n == 1:
        return 0.0
    if not bandwidth_bps > 0:
        raise ConfigError(f"bandwidth_bps must be positive, got {bandwidth_bps}")
    steps = 2 * (n - 1)
    return steps / n * nbytes * 8.0 / bandwidth_bps + steps * latency_s


@dataclass(frozen=True)
class RingStep:
    """What one rank does in one step: send one chunk, receive (and reduce) another."""

    step: int
    phase: str  # REDUCE_SCATTER or ALL_GATHER
    send_chunk: int
    recv_chunk: int


def ring_schedule(rank: int, world_size: int) -> list[RingStep]:
    """The 2(n-1) steps of ``rank``; empty for one rank.

    The chunk a rank sends in step t+1 is the one it received in step t, which is what
    lets segments stream: a received segment is forwarded as soon as it is reduced.
    """
    n = world_size
    if not 0 <= rank < n:
        raise ConfigError(f"rank {rank} is outside a group of {n}")
    steps = [RingStep(s, REDUCE_SCATTER, (rank - s) % n, (rank - s - 1) % n) for s in range(n - 1)]
    steps += [
        RingStep(n - 1 + s, ALL_GATHER, (rank + 1 - s) % n, (rank - s) % n) for s in range(n - 1)
    ]
    return steps


def split_evenly(length: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` near-equal (offset, size) pieces of ``length``; the first ones get the rest."""
    base, extra = divmod(length, parts)
    pieces = []
    offset = 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        pieces.append((offset, size))
        offset += size
    return pieces


@dataclass(frozen=True)
class SegmentLayout:
    """Where each segment of each chunk lies in each bucket (identical on every rank)."""

    segments: int
    # spans[bucket][chunk][seg] = (offset, size) in the bucket's flat buffer
    spans: tuple[tuple[tuple[tuple[int, int], ...], ...], ...]

    @classmethod
    def build(
        cls, numels: Sequence[int], itemsizes: Sequence[int], n: int, segment_bytes: int
    ) -> SegmentLayout:
        chunks = [split_evenly(numel, n) for numel in numels]
        largest = max(
            (
                size * item
                for pieces, item in zip(chunks, itemsizes, strict=True)
                for _, size in pieces
            ),
            default=0,
        )
        segments = max(1, math.ceil(largest / segment_bytes))
        spans = tuple(
            tuple(
                tuple((start + off, size) for off, size in split_evenly(length, segments))
                for start, length in pieces
            )
            for pieces in chunks
        )
        return cls(segments, spans)


@dataclass(frozen=True)
class ExpectedMessage:
    """The one message a rank may accept next."""

    epoch: int
    round_id: int
    step: int
    chunk: int
    seg: int
    src: int
    # (dtype, numel) of each tensor frame, one per bucket
    frames: tuple[tuple[torch.dtype, int], ...]


def check_message(message: WireMessage, expected: ExpectedMessage, *, peer: str) -> bool:
    """True if ``message`` is the expected one; False if it is stale (drop it quietly).

    Stale means an older plan epoch or round, left over from an aborted round. Anything
    else that differs raises :class:`ProtocolError` naming ``peer``.
    """

    def refuse(what: str) -> ProtocolError:
        return ProtocolError(
            f"allreduce message from {peer}: {what} (expected epoch {expected.epoch}, "
            f"round {expected.round_id}, step {expected.step}, chunk {expected.chunk}, "
            f"segment {expected.seg}, src {expected.src})"
        )

    if not isinstance(message, AllReduce):
        raise refuse(f"kind {message.KIND!r} is not {KIND!r}")
    if message.epoch < expected.epoch:
        return False
    if message.epoch > expected.epoch:
        raise refuse(f"newer plan epoch {message.epoch}")
    if message.round < expected.round_id:
        return False
    if message.round > expected.round_id:
        raise refuse(f"round {message.round} is ahead of this rank")
    if message.src != expected.src:
        raise refuse(f"claims to come from rank {message.src}")
    got = (message.step, message.chunk, message.seg)
    if got != (expected.step, expected.chunk, expected.seg):
        raise refuse(f"got step {got[0]}, chunk {got[1]}, segment {got[2]}")
    if len(message.tensors) != len(expected.frames):
        raise refuse(f"{len(message.tensors)} tensors instead of {len(expected.frames)}")
    for index, (tensor, (dtype, numel)) in enumerate(
        zip(message.tensors, expected.frames, strict=True)
    ):
        if tensor.dtype != dtype or tensor.dim() != 1 or tensor.numel() != numel:
            raise refuse(
                f"tensor {index} is {dtype_name(tensor.dtype)}{list(tensor.shape)}, not "
                f"{dtype_name(dtype)}[{numel}] (do all ranks reduce the same tensors with "
                "the same segment_bytes?)"
            )
    return True


# ------------------------------------------------------------------------ the runtime


@dataclass(frozen=True)
class AllReduceStats:
    """What one :meth:`RingAllReduce.allreduce_` call did, for metrics and re-estimation."""

    round_id: int
    world_size: int
    nbytes: int  # size of the reduced tensors: the ``nbytes`` of ring_allreduce_cost_s
    bytes_sent: int  # tensor bytes this rank sent (2(n-1)/n of nbytes, up to rounding)
    messages: int  # messages this rank sent (as many as it received)
    seconds: float
    stale_dropped: int  # messages of an older epoch or round, dropped quietly
    rejected: int  # messages that failed validation (ProtocolError), logged and dropped


def group_by_dtype(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The tensors grouped by dtype, groups in the order their dtypes first appear."""
    dtypes: list[torch.dtype] = []
    members: list[list[torch.Tensor]] = []
    for index, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor):
            raise ConfigError(f"all-reduce tensor {index} is a {type(tensor).__name__}")
        if tensor.dtype not in REDUCIBLE_DTYPES:
            known = ", ".join(dtype_name(d) for d in REDUCIBLE_DTYPES)
            raise ConfigError(
                f"all-reduce tensor {index} has dtype {tensor.dtype}; reducible: {known}"
            )
        if tensor.dtype not in dtypes:
            dtypes.append(tensor.dtype)
            members.append([])
        members[dtypes.index(tensor.dtype)].append(tensor)
    return members


def in_place_ok(group: list[torch.Tensor]) -> bool:
    """A dtype group the ring can reduce where it lies: one contiguous CPU tensor."""
    return len(group) == 1 and group[0].device.type == "cpu" and group[0].is_contiguous()


def flatten_into(group: list[torch.Tensor], out: torch.Tensor) -> None:
    with torch.no_grad():
        torch.cat([t.detach().reshape(-1).cpu() for t in group], out=out)


def unflatten_from(group: list[torch.Tensor], flat: torch.Tensor) -> None:
    with torch.no_grad():
        offset = 0
        for tensor in group:
            numel = tensor.numel()
            tensor.copy_(flat[offset : offset + numel].view(tensor.shape))
            offset += numel


class ScratchBuffers:
    """One flat buffer per dtype, kept from round to round, so large buffers are not
    page-faulted in again each round. Reusing it is safe because no message that is
    still queued when allreduce_ returns points into it (see RingAllReduce._run_ring)."""

    def __init__(self) -> None:
        self._by_dtype: dict[torch.dtype, torch.Tensor] = {}

    def flat_buffers(
        self, members: list[list[torch.Tensor]]
    ) -> tuple[list[torch.Tensor], list[int]]:
        """One flat buffer per dtype group, and the indices of groups that need a copy.

        A lone contiguous CPU tensor is reduced where it lies (as gloo does); other
        groups are copied into this object's scratch buffer of their dtype.
        """
        flats: list[torch.Tensor] = []
        copied: list[int] = []
        for index, group in enumerate(members):
            if in_place_ok(group):
                flats.append(group[0].detach().view(-1))
                continue
            dtype = group[0].dtype
            numel = sum(t.numel() for t in group)
            scratch = self._by_dtype.get(dtype)
            if scratch is None or scratch.numel() < numel:
                scratch = torch.empty(numel, dtype=dtype)
                self._by_dtype[dtype] = scratch
            flats.append(scratch[:numel])
            copied.append(index)
        return flats, copied

    def clear(self) -> None:
        """Let the buffers go (the group is closed)."""
        self._by_dtype.clear()


def check_ring_settings(
    *,
    world_size: int,
    rank: int,
    timeout_s: float,
    epoch: int,
    segment_bytes: int,
    max_message_bytes: int,
    secured: bool,
    peer_keys: int | None,
    authenticator: bool,
) -> None:
    """ConfigError for a rank's settings that cannot work (see RingAllReduce)."""
    n = world_size
    if n < 1:
        raise ConfigError("an all-reduce group needs at least one endpoint")
    if not 0 <= rank < n:
        raise ConfigError(f"rank {rank} is outside a group of {n} endpoints")
    if not timeout_s > 0:
        raise ConfigError(f"timeout_s must be positive, got {timeout_s}")
    if epoch < 0:
        raise ConfigError(f"epoch must be >= 0, got {epoch}")
    if not 8 <= segment_bytes <= max_message_bytes // 2:
        raise ConfigError(
            f"segment_bytes must lie in [8, {max_message_bytes // 2}] "
            f"(half the socket's maximum message size), got {segment_bytes}"
        )
    if secured:
        if peer_keys != n:
            raise ConfigError(
                f"with a keypair, peer_keys must hold one public key per rank ({n}), in rank order"
            )
    elif authenticator:
        raise ConfigError("an authenticator without a keypair would secure nothing")
