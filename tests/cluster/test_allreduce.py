"""Ring all-reduce: the pure schedule and checks, then real sockets on loopback TCP.

Ranks run as asyncio tasks in one process (one zmq context each where CURVE needs its
own authenticator), and once as three spawned OS processes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import multiprocessing as mp
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch
import zmq
import zmq.asyncio

from zpipe._errors import ConfigError, ProtocolError, TransportTimeout
from zpipe.protocol.data_plane import AllReduce
from zpipe.stage.data_parallel import RingAllReduce, RingPort
from zpipe.stage.data_parallel.ring_links import ring_allow_list
from zpipe.training.ring import (
    KIND,
    ExpectedMessage,
    SegmentLayout,
    check_message,
    ring_allreduce_cost_s,
    ring_schedule,
)
from zpipe.transport import security
from zpipe.transport.codec import Message
from zpipe.transport.ports import free_tcp_port
from zpipe.transport.sockets import SocketOptions, new_context, open_socket, send

# Short: dead-peer tests wait this long. Long enough for a first TCP connect
# (ZeroMQ retries every 100 ms) on two busy cores.
DEAD_TIMEOUT_S = 0.6
OK_TIMEOUT_S = 10.0


# ------------------------------------------------------------------------ pure parts


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7])
def test_schedule_reduces_every_chunk_once_and_gathers_it_everywhere(n: int) -> None:
    """Run the schedules symbolically: each chunk value is the set of ranks summed in."""
    held = [[frozenset({r}) for _ in range(n)] for r in range(n)]  # held[rank][chunk]
    schedules = [ring_schedule(r, n) for r in range(n)]
    assert all(len(s) == 2 * (n - 1) for s in schedules)
    for t in range(2 * (n - 1)):
        # every rank sends what it holds, then every rank applies what it received
        sent = [held[r][schedules[r][t].send_chunk] for r in range(n)]
        for r in range(n):
            step = schedules[r][t]
            prev = (r - 1) % n
            assert schedules[prev][t].send_chunk == step.recv_chunk  # the ring agrees
            if t >= 1:  # streaming: forward what was received the step before
                assert step.send_chunk == schedules[r][t - 1].recv_chunk
            incoming = sent[prev]
            if step.phase == "reduce-scatter":
                assert not incoming & held[r][step.recv_chunk]  # nothing summed twice
                held[r][step.recv_chunk] = incoming | held[r][step.recv_chunk]
            else:
                assert incoming == frozenset(range(n))  # only complete chunks travel
                held[r][step.recv_chunk] = incoming
    everyone = frozenset(range(n))
    assert all(chunk == everyone for rank in held for chunk in rank)


def test_layout_covers_uneven_buffers_exactly() -> None:
    for numels, itemsizes, n, seg_bytes in [
        ([10], [4], 3, 8),
        ([2], [8], 4, 1024),  # fewer elements than ranks: empty chunks
        ([0, 5], [4, 2], 2, 4),
        ([1001, 37], [8, 2], 3, 64),
    ]:
        layout = SegmentLayout.build(numels, itemsizes, n, seg_bytes)
        for bucket, numel in enumerate(numels):
            spans = [span for chunk in layout.spans[bucket] for span in chunk]
            assert len(spans) == n * layout.segments
            offset = 0
            for start, size in spans:  # contiguous, in order, no gaps or overlaps
                assert start == offset and size >= 0
                offset += size
            assert offset == numel
            largest = max(size for _, size in spans)
            assert largest * itemsizes[bucket] <= max(seg_bytes, itemsizes[bucket])


def test_cost_model_is_asteroid_eq5_plus_latency() -> None:
    assert ring_allreduce_cost_s(1e9, 1, 1e6) == 0.0
    # 2(n-1)/n * bytes * 8 / (bit/s): n = 4, 100 MB over 1 Gbit/s
    assert ring_allreduce_cost_s(100e6, 4, 1e9) == pytest.approx(1.5 * 0.8)
    assert ring_allreduce_cost_s(100e6, 2, 1e9, latency_s=0.01) == pytest.approx(0.8 + 0.02)
    assert ring_allreduce_cost_s(0, 3, 1e9, latency_s=0.001) == pytest.approx(0.004)
    with pytest.raises(ConfigError):
        ring_allreduce_cost_s(1.0, 2, 0.0)
    with pytest.raises(ConfigError):
        ring_allreduce_cost_s(1.0, 0, 1e9)


def _expected(**changes: Any) -> ExpectedMessage:
    fields: dict[str, Any] = {
        "epoch": 2,
        "round_id": 5,
        "step": 1,
        "chunk": 0,
        "seg": 3,
        "src": 1,
        "frames": ((torch.float32, 4),),
    }
    fields.update(changes)
    return ExpectedMessage(**fields)


def _message(epoch: int = 2, tensor: torch.Tensor | None = None, **body: int) -> AllReduce:
    fields = {"round": 5, "step": 1, "chunk": 0, "seg": 3, "src": 1, **body}
    t = torch.zeros(4) if tensor is None else tensor
    return AllReduce(**fields, epoch=epoch, tensors=(t,))


def test_check_message_accepts_drops_stale_and_names_the_peer_on_mismatch() -> None:
    expected = _expected()
    assert check_message(_message(), expected, peer="rank 1 at X") is True
    assert check_message(_message(round=4), expected, peer="p") is False  # older round
    assert check_message(_message(epoch=1, round=9), expected, peer="p") is False
    bad = [
        (_message(round=6), "round 6"),
        (_message(epoch=3), "epoch 3"),
        (_message(src=0), "rank 0"),
        (_message(step=2), "step 2"),
        (_message(chunk=1), "chunk 1"),
        (_message(seg=0), "segment 0"),
        (_message(tensor=torch.zeros(5)), "float32[5]"),
        (_message(tensor=torch.zeros(4, dtype=torch.float64)), "float64"),
        (_message(tensor=torch.zeros(2, 2)), "float32[2, 2]"),
        (dataclasses.replace(_message(), tensors=()), "0 tensors"),
    ]
    for message, fragment in bad:
        with pytest.raises(ProtocolError, match="rank 1 at X") as info:
            check_message(message, expected, peer="rank 1 at X")
        assert fragment in str(info.value)


# --------------------------------------------------------------------- socket helpers


def _endpoints(n: int) -> list[str]:
    return [f"tcp://127.0.0.1:{free_tcp_port()}" for _ in range(n)]


@asynccontextmanager
async def ring_group(
    n: int,
    *,
    timeout_s: float = OK_TIMEOUT_S,
    contexts: Sequence[zmq.asyncio.Context] | None = None,
    per_rank: dict[str, Sequence[Any]] | None = None,
    **kwargs: Any,
) -> AsyncIterator[list[RingAllReduce]]:
    """``n`` started ranks on loopback, closed (and their contexts ended) afterwards;
    ``per_rank[arg][r]`` is rank r's value of ``arg``, ``kwargs`` go to every rank."""
    own = contexts is None
    ctxs = list(contexts) if contexts is not None else [new_context()]
    endpoints = _endpoints(n)
    rings = [
        RingAllReduce(
            context=ctxs[r % len(ctxs)],
            rank=r,
            endpoints=endpoints,
            timeout_s=timeout_s,
            name="test",
            **kwargs,
            **{arg: values[r] for arg, values in (per_rank or {}).items()},
        )
        for r in range(n)
    ]
    try:
        for ring in rings:
            await ring.start()
        yield rings
    finally:
        for ring in rings:
            await ring.close()
        if own:
            for ctx in ctxs:
                ctx.term()


def _shapes() -> list[tuple[int, ...]]:
    # uneven on purpose: prime sizes, a scalar, a 1-element tensor, numel < n
    return [(7, 3), (), (1,), (13,), (2, 5, 3)]


def _inputs(rank: int, dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + rank)
    return [torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype) for shape in _shapes()]


async def _reduce_all(
    rings: Sequence[RingAllReduce], inputs: Sequence[list[torch.Tensor]], **kwargs: Any
) -> list[Any]:
    return await asyncio.gather(
        *(ring.allreduce_(tensors, **kwargs) for ring, tensors in zip(rings, inputs, strict=True))
    )


def _assert_bit_identical(results: Sequence[list[torch.Tensor]]) -> None:
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype
            assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))


# ------------------------------------------------------------------ in one process


@pytest.mark.parametrize("n", [1, 2, 3, 4])
async def test_mean_is_exact_and_bit_identical_on_every_rank(n: int) -> None:
    inputs = [_inputs(r) for r in range(n)]
    want = [torch.stack([inputs[r][i] for r in range(n)]).mean(0) for i in range(len(_shapes()))]
    async with ring_group(n) as rings:
        stats = await _reduce_all(rings, inputs, round_id=1)
        _assert_bit_identical(inputs)
        for got, exp in zip(inputs[0], want, strict=True):
            assert torch.allclose(got, exp, rtol=1e-12, atol=1e-12)
        # a second round on the same sockets, with a sum
        again = [_inputs(r) for r in range(n)]
        await _reduce_all(rings, again, op="sum", round_id=2)
        _assert_bit_identical(again)
        total = torch.stack([_inputs(r)[0] for r in range(n)]).sum(0)
        assert torch.allclose(again[0][0], total, rtol=1e-12, atol=1e-12)
    nbytes = sum(t.numel() * 8 for t in _inputs(0))
    for s in stats:
        assert s.nbytes == nbytes and s.rejected == 0 and s.stale_dropped == 0
        # eq. (5)'s volume: 2(n-1)/n of the buffer, up to the uneven split
        assert abs(s.bytes_sent - 2 * (n - 1) / n * nbytes) <= 2 * (n - 1) * 8


async def test_every_segment_is_paced_before_it_is_sent() -> None:
    n = 3
    paced: list[list[int]] = [[] for _ in range(n)]

    def pacer(rank: int) -> Callable[[int], Awaitable[None]]:
        async def pace(nbytes: int) -> None:
            paced[rank].append(nbytes)

        return pace

    inputs = [_inputs(r) for r in range(n)]
    async with ring_group(
        n, per_rank={"pace": [pacer(r) for r in range(n)]}, segment_bytes=64
    ) as rings:
        stats = await _reduce_all(rings, inputs, round_id=1)
    for r in range(n):
        assert len(paced[r]) > 2 * (n - 1)  # segments, not whole chunks
        assert sum(paced[r]) == stats[r].bytes_sent


async def test_mixed_dtypes_many_segments_and_empty_chunks() -> None:
    """float32 + bfloat16 + float64 in one call, segments far smaller than a chunk
    (more messages than the send window) and a tensor smaller than the group."""
    n = 3
    gens = [torch.Generator().manual_seed(r) for r in range(n)]
    inputs = [
        [
            torch.randn(1001, generator=g),
            torch.randn(37, 3, generator=g).to(torch.bfloat16),
            torch.randn(2, generator=g, dtype=torch.float64),
            torch.randn(5, generator=g),
        ]
        for g in gens
    ]
    originals = [[t.clone() for t in ts] for ts in inputs]
    async with ring_group(n, segment_bytes=64) as rings:
        stats = await _reduce_all(rings, inputs, round_id=7)
    _assert_bit_identical(inputs)
    assert stats[0].messages > 2 * rings[0].window * 2
    for i, got in enumerate(inputs[0]):
        exact = torch.stack([o[i].double() for o in originals]).mean(0)
        tol = 3e-2 if got.dtype == torch.bfloat16 else 1e-6
        assert torch.allclose(got.double(), exact, rtol=tol, atol=tol)


@pytest.mark.parametrize("in_place", [True, False], ids=["one-tensor", "scratch-copy"])
async def test_a_rank_may_overwrite_its_tensors_as_soon_as_its_call_returns(
    in_place: bool,
) -> None:
    """Zero-copy sends are only queued when allreduce_ returns; none of them may point
    into the caller's tensors (or the reused scratch buffer), or a rank that finishes
    first and zeroes its gradients would corrupt what its peers still receive."""
    n = 3
    size = 3 * 40_000 + 1

    def inputs(r: int) -> list[torch.Tensor]:
        t = torch.arange(size, dtype=torch.float32) * (r + 1)
        return [t] if in_place else [t[:7].clone(), t[7:].clone()]

    async def reduce_then_scribble(
        ring: RingAllReduce, tensors: list[torch.Tensor], round_id: int
    ) -> None:
        await ring.allreduce_(tensors, op="sum", round_id=round_id)
        results.append([t.clone() for t in tensors])
        for t in tensors:
            t.fill_(float("nan"))

    async with ring_group(n, segment_bytes=4096) as rings:
        for round_id in (1, 2):  # the second round reuses the scratch buffer
            results: list[list[torch.Tensor]] = []
            await asyncio.gather(
                *(reduce_then_scribble(rings[r], inputs(r), round_id) for r in range(n))
            )
            _assert_bit_identical(results)
            want = torch.arange(size, dtype=torch.float32) * sum(range(1, n + 1))
            assert torch.equal(torch.cat(results[0]), want)


async def test_misuse_is_a_config_error() -> None:
    async with ring_group(2) as rings:
        with pytest.raises(ConfigError, match="dtype"):
            await rings[0].allreduce_([torch.zeros(3, dtype=torch.int64)], round_id=1)
        with pytest.raises(ConfigError, match="op"):
            await rings[0].allreduce_([torch.zeros(3)], op="max", round_id=1)
        await _reduce_all(rings, [[torch.ones(3)], [torch.ones(3)]], round_id=4)
        with pytest.raises(ConfigError, match="round_id 4"):
            await rings[0].allreduce_([torch.zeros(3)], round_id=4)
        with pytest.raises(ConfigError, match="rank 2"):
            RingAllReduce(context=rings[0].context, rank=2, endpoints=["a", "b"], timeout_s=1.0)
        with pytest.raises(ConfigError, match="peer_keys"):
            RingAllReduce(
                context=rings[0].context,
                rank=0,
                endpoints=["a", "b"],
                timeout_s=1.0,
                keypair=security.KeyPair("x", b"0" * 40, b"0" * 40),
            )


async def test_a_silent_peer_is_a_timeout_naming_it_and_the_step() -> None:
    n = 3
    inputs = [_inputs(r) for r in range(n)]
    async with ring_group(n, timeout_s=DEAD_TIMEOUT_S) as rings:
        started = time.monotonic()
        # rank 2 never joins: rank 0 waits on it; rank 1 waits on rank 0
        results = await asyncio.gather(
            rings[0].allreduce_(inputs[0], round_id=1),
            rings[1].allreduce_(inputs[1], round_id=1),
            return_exceptions=True,
        )
        elapsed = time.monotonic() - started
    assert all(isinstance(r, TransportTimeout) for r in results), results
    first = results[0]
    assert isinstance(first, TransportTimeout)
    assert "rank 2" in first.peer and rings[2].endpoints[2] in first.peer
    assert "step 0 (reduce-scatter)" in first.awaited
    assert "rank 0" in str(results[1])
    # the short timeout ended the wait, not a longer one (a loaded machine may add
    # seconds of scheduling to the 0.6-1.2 s it takes: no tighter bound than that)
    assert elapsed < OK_TIMEOUT_S


async def test_bad_and_stale_messages_are_dropped_and_the_round_completes() -> None:
    n = 2
    ctx = new_context()
    intruder = open_socket(ctx, zmq.PUSH)
    try:
        async with ring_group(n, contexts=[ctx], epoch=3) as rings:
            intruder.connect(rings[0].endpoints[0])
            body = {"round": 2, "step": 0, "chunk": 1, "seg": 0, "src": 1}
            good = torch.zeros(8, dtype=torch.float64)

            async def inject(epoch: int = 3, **changes: int) -> None:
                message = Message(KIND, {**body, **changes}, epoch=epoch, tensors=(good,))
                await send(intruder, message, timeout_s=1.0, peer="rank 0")

            await inject(round=1)  # stale: an older round
            await inject(epoch=2)  # stale: an older plan epoch
            await inject(round=9)  # ahead
            await inject(src=0)  # not the previous rank
            await inject(step=1)  # out of order
            await intruder.send_multipart([b"\x93garbage", b"x"])  # not a message at all
            await asyncio.sleep(0.3)  # let them all arrive before the round starts
            inputs = [[torch.full((16,), float(r + 1), dtype=torch.float64)] for r in range(n)]
            with structlog.testing.capture_logs() as logs:
                stats = await _reduce_all(rings, inputs, round_id=2)
                # the PULL socket fair-queues: what the round did not read, the next one drops
                more = [[torch.ones(16, dtype=torch.float64)] for _ in range(n)]
                stats2 = await _reduce_all(rings, more, round_id=3)
            assert all(
                torch.equal(t[0], torch.full((16,), 1.5, dtype=torch.float64)) for t in inputs
            )
            rejected = [e for e in logs if e["event"] == "allreduce_message_rejected"]
            assert stats[0].rejected + stats2[0].rejected == len(rejected) == 4
            assert stats[0].stale_dropped + stats2[0].stale_dropped == 2
            assert all("rank 1 of 'test'" in e["error"] for e in rejected[:-1])
            assert stats[1].rejected == stats[1].stale_dropped == 0
    finally:
        intruder.close(linger=0)
        ctx.term()


async def test_only_bad_messages_end_in_a_clean_timeout_that_says_why() -> None:
    ctx = new_context()
    intruder = open_socket(ctx, zmq.PUSH)
    try:
        async with ring_group(2, contexts=[ctx], timeout_s=DEAD_TIMEOUT_S) as rings:
            intruder.connect(rings[0].endpoints[0])
            forged = Message(
                KIND,
                {"round": 1, "step": 0, "chunk": 1, "seg": 0, "src": 0},
                tensors=(torch.zeros(2),),
            )
            await send(intruder, forged, timeout_s=1.0, peer="rank 0")
            with pytest.raises(TransportTimeout) as info:
                await rings[0].allreduce_([torch.zeros(4)], round_id=1)
    finally:
        intruder.close(linger=0)
        ctx.term()
    assert "rank 1" in info.value.peer
    assert "bad messages dropped" in info.value.awaited and "rank 0" in info.value.awaited


# ---------------------------------------------------------------------------- CURVE


@pytest.fixture(scope="module")
def keys_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("allreduce-keys") / "keys"
    security.generate_keys(path, ["r0", "r1", "r2", "intruder"])
    return path


async def test_curve_ring_with_own_authenticators(keys_dir: Path) -> None:
    n = 3
    pairs = [security.load_keypair(keys_dir, f"r{r}") for r in range(n)]
    publics = [p.public for p in pairs]
    contexts = [new_context() for _ in range(n)]  # one authenticator per context
    inputs = [_inputs(r, torch.float32) for r in range(n)]
    try:
        async with ring_group(
            n, contexts=contexts, peer_keys=publics, per_rank={"keypair": pairs}
        ) as rings:
            await _reduce_all(rings, inputs, round_id=1)
    finally:
        for ctx in contexts:
            ctx.term()
    _assert_bit_identical(inputs)
    exact = torch.stack([_inputs(r)[0] for r in range(n)]).mean(0)
    assert torch.allclose(inputs[0][0].double(), exact, atol=1e-6)


async def test_curve_refuses_a_well_formed_message_from_another_allowed_key(
    keys_dir: Path,
) -> None:
    """An authenticator shared with the stage may allow more keys on the ring's ZAP
    domain than the ring's previous rank (another ring's, say); the ring still accepts
    only the previous rank's key."""
    pairs = [security.load_keypair(keys_dir, name) for name in ("r0", "r1", "intruder")]
    publics = [pairs[0].public, pairs[1].public]
    contexts = [new_context(), new_context()]
    intruder_ctx = new_context()
    auth0 = security.CurveAuthenticator(contexts[0], security.PeerAllowList())
    shared_allow = ring_allow_list(auth0)
    shared_allow.allow(pairs[2].public, "intruder")
    auth0.start()
    intruder = open_socket(intruder_ctx, zmq.PUSH)
    try:
        async with ring_group(
            2,
            contexts=contexts,
            timeout_s=DEAD_TIMEOUT_S * 2,
            peer_keys=publics,
            per_rank={"keypair": pairs[:2], "authenticator": [auth0, None]},
        ) as rings:
            assert pairs[1].public in shared_allow  # rank 0 let its previous rank in
            security.secure_client(intruder, pairs[2], pairs[0].public)
            intruder.connect(rings[0].endpoints[0])
            forged = Message(
                KIND,
                {"round": 1, "step": 0, "chunk": 1, "seg": 0, "src": 1},
                tensors=(torch.zeros(2),),
            )
            await send(intruder, forged, timeout_s=1.0, peer="rank 0")
            await asyncio.sleep(0.2)
            inputs = [[torch.full((4,), 2.0 * r)] for r in range(2)]
            with structlog.testing.capture_logs() as logs:
                stats = await _reduce_all(rings, inputs, round_id=1)
            assert torch.equal(inputs[0][0], torch.ones(4))
            assert stats[0].rejected == 1
            assert any("another key" in e.get("error", "") for e in logs)
        assert pairs[1].public not in shared_allow  # close() took back what it added
    finally:
        intruder.close(linger=0)
        auth0.stop()
        for ctx in (*contexts, intruder_ctx):
            ctx.term()


# ------------------------------------------------------------------ OS processes


def _process_inputs(rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    return [torch.randn(300_001, generator=gen), torch.randn(3, 3, generator=gen)]


def _digest(tensors: Sequence[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _rank_process(rank: int, conn: Connection) -> None:
    """One rank in its own process: round 1 must work; round 2 runs after a peer died.

    The rank binds its ring port (port 0), says where over its own pipe and gets every
    rank's endpoint back (a port picked by the test could be taken before the rank
    bound it). Reports go back over the same pipe: a queue shared by all ranks would be
    left locked if the rank the test kills were holding its write lock at that moment.
    """
    torch.set_num_threads(1)

    async def main() -> None:
        ctx = new_context()
        port = RingPort(context=ctx, bind="tcp://127.0.0.1:0", options=SocketOptions())
        conn.send(("bound", rank, port.bound_endpoint, None))
        endpoints = conn.recv() if await asyncio.to_thread(conn.poll, 60.0) else None
        if endpoints is None:
            port.close()
            ctx.term()
            return
        ring = RingAllReduce(
            context=ctx,
            rank=rank,
            endpoints=endpoints,
            port=port,
            socket_options=SocketOptions(),
            timeout_s=OK_TIMEOUT_S,
            name="procs",
        )
        try:
            await ring.start()
            tensors = _process_inputs(rank)
            await ring.allreduce_(tensors, round_id=1)
            n = len(endpoints)
            exact = [
                torch.stack([_process_inputs(r)[i].double() for r in range(n)]).mean(0)
                for i in range(len(tensors))
            ]
            error = max(
                float((t.double() - e).abs().max()) for t, e in zip(tensors, exact, strict=True)
            )
            conn.send(("round1", rank, _digest(tensors), error))
            if not await asyncio.to_thread(conn.poll, 30.0):
                return
            try:
                conn.recv()
            except EOFError:
                return  # the test gave up
            try:
                await ring.allreduce_(tensors, round_id=2, timeout_s=DEAD_TIMEOUT_S * 2)
                conn.send(("round2", rank, "completed", ""))
            except TransportTimeout as exc:
                conn.send(("round2", rank, exc.peer, exc.awaited))
        finally:
            await ring.close()
            ctx.term()

    try:
        asyncio.run(main())
    finally:
        conn.close()


def _report(conn: Connection, timeout_s: float) -> tuple[str, int, str, Any]:
    if not conn.poll(timeout_s):
        raise TimeoutError(f"no report from a rank process within {timeout_s} s")
    report: tuple[str, int, str, Any] = conn.recv()
    return report


def test_three_processes_agree_and_survivors_time_out_when_one_is_killed() -> None:
    spawn = mp.get_context("spawn")
    n = 3
    pipes = [spawn.Pipe() for _ in range(n)]  # (test's end, rank's end)
    procs = [
        spawn.Process(target=_rank_process, args=(r, pipes[r][1]), daemon=True) for r in range(n)
    ]
    for proc in procs:
        proc.start()
    for _, theirs in pipes:
        theirs.close()
    try:
        endpoints = [_report(mine, 60)[2] for mine, _ in pipes]  # where each rank bound
        for mine, _ in pipes:
            mine.send(endpoints)
        first = [_report(mine, 60) for mine, _ in pipes]
        digests = {digest for _, _, digest, _ in first}
        assert len(digests) == 1, first  # bit-identical across processes
        assert all(error < 1e-6 for *_, error in first), first
        procs[2].kill()
        procs[2].join(timeout=10)
        for mine, _ in pipes[:2]:
            mine.send("go")
        second = [_report(mine, 30) for mine, _ in pipes[:2]]
        by_rank = {rank: (peer, awaited) for _, rank, peer, awaited in second}
        assert "rank 2" in by_rank[0][0] and "step 0" in by_rank[0][1], by_rank
        assert "rank 0" in by_rank[1][0], by_rank
    finally:
        for mine, _ in pipes:
            mine.close()  # a rank still waiting sees EOF and ends
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
