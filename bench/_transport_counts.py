"""Per-message counts of zpipe's transport against raw pyzmq, for tools that count.

Wall-clock time on a shared 2-core machine is noise; instructions (valgrind's
callgrind), system calls (strace -c) and Python bytecodes are not. This driver runs
one process (no receiver to spawn) with a PUSH->PULL pair on loopback TCP per
direction and moves ``--count`` messages of one float32 tensor per phase:

``stream``
    raw: a thread sends ``[small_header, buffer]`` zero-copy, the main thread
    ``recv_multipart(copy=False)``; zpipe: one task ``send``s ``Message``s, another
    ``recv_frames`` and ``decode_frames`` them (one event loop, uvloop as the CLI).
``echo``
    ping-pong as ``bench/transport.py``'s round trips: raw with an echo thread
    that sends back the frames it received; zpipe with an echo task that decodes
    each ping and sends its tensor on (the received frame), the pinger decoding
    the pong.

Paths: ``raw`` (blocking pyzmq, threads), ``asyncio`` (raw pyzmq under
``zmq.asyncio`` on the same event loop as ``zpipe``, nothing encoded: the
like-for-like baseline of an asyncio process) and ``zpipe``.

Each phase has a warm-up of ``--warm`` messages, then calls libc's ``getpgrp``
(``os.getpgrp``; nothing else here calls it) before and after the measured messages: run under
``valgrind --tool=callgrind --dump-before=getpgrp`` every measured phase is one
dump file (the even-numbered ones: 2, 4, ...; phase order on stderr), whose
instruction total over ``--count`` is the cost per message of all threads. With
``--opcodes`` it counts the Python bytecodes each function runs instead, in the
measured messages only, all threads (deterministic, ``sys.settrace``).

    valgrind --tool=callgrind --dump-before=getpgrp --callgrind-out-file=cg.%p \\
        python bench/_transport_counts.py --phases zpipe:echo:1M,raw:echo:1M
    strace -f -c python bench/_transport_counts.py --phases zpipe:stream:64K
    python bench/_transport_counts.py --opcodes --phases zpipe:echo:64K
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import zmq
import zmq.asyncio

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._transport_paths import (
    MAX_BYTES,
    RAW_HEADER,
    check_tensor,
    data_message,
    loop_runner,
    make_tensor,
    raw_buffer,
)
from zpipe.transport.allocator import retain_freed_memory
from zpipe.transport.sockets import decode_frames, new_context, open_socket, recv_frames, send

TIMEOUT_S = 600.0  # valgrind runs tens of times slower: generous, but never unbounded


def mark() -> None:
    """A call callgrind's ``--dump-before=getpgrp`` dumps at (a phase boundary); through
    the os module, since callgrind missed the same call made through ctypes."""
    os.getpgrp()


class OpcodeCounter:
    """Python bytecodes run per function (``file:function``), on every thread."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.on = False

    def _trace(self, frame: FrameType, event: str, arg: Any) -> Any:
        if not self.on:
            return None
        frame.f_trace_opcodes = True
        if event == "opcode":
            code = frame.f_code
            self.counts[f"{Path(code.co_filename).name}:{code.co_name}"] += 1
        return self._trace

    def start(self) -> None:
        self.on = True
        threading.settrace(self._trace)
        sys.settrace(self._trace)

    def stop(self) -> None:
        sys.settrace(None)
        threading.settrace(None)  # type: ignore[arg-type,unused-ignore]
        self.on = False


def raw_pairs(ctx: zmq.Context[Any]) -> tuple[Any, Any, Any, Any]:
    """PUSH a -> PULL b and PUSH c -> PULL d, as the bench's raw sockets."""
    socks = [ctx.socket(k) for k in (zmq.PUSH, zmq.PULL, zmq.PUSH, zmq.PULL)]
    for sock in socks:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 16)
        sock.setsockopt(zmq.RCVHWM, 16)
        sock.setsockopt(zmq.RCVTIMEO, int(TIMEOUT_S * 1000))
        sock.setsockopt(zmq.SNDTIMEO, int(TIMEOUT_S * 1000))
    for push, pull in ((socks[0], socks[1]), (socks[2], socks[3])):
        pull.bind("tcp://127.0.0.1:*")
        push.connect(pull.getsockopt_string(zmq.LAST_ENDPOINT))
    return socks[0], socks[1], socks[2], socks[3]


def raw_phase(pattern: str, size: int, warm: int, count: int, around: Callable[[], None]) -> None:
    ctx: zmq.Context[Any] = zmq.Context(io_threads=1)
    a, b, c, d = raw_pairs(ctx)
    tensor = make_tensor(size)
    total = warm + count

    def far_side() -> None:
        for _ in range(total):
            if pattern == "stream":
                a.send_multipart([RAW_HEADER, raw_buffer(tensor)], copy=False)
            else:
                c.send_multipart(b.recv_multipart(copy=False), copy=False)

    thread = threading.Thread(target=far_side)
    thread.start()
    for i in range(total):
        if i == warm:
            around()
        if pattern == "stream":
            frames = b.recv_multipart(copy=False)
        else:
            a.send_multipart([RAW_HEADER, raw_buffer(tensor)], copy=False)
            frames = d.recv_multipart(copy=False)
        if len(frames[1]) != size:
            raise RuntimeError("raw message of the wrong size")
    around()
    thread.join(TIMEOUT_S)
    for sock in (a, b, c, d):
        sock.close(linger=0)
    ctx.term()


async def asyncio_raw_phase(
    pattern: str, size: int, warm: int, count: int, around: Callable[[], None]
) -> None:
    """Raw pyzmq under zmq.asyncio, on the same event loop as the zpipe path: the
    like-for-like baseline of an asyncio process (raw's blocking receive waits in
    libzmq with no event loop at all), nothing encoded or validated."""
    ctx = zmq.asyncio.Context(io_threads=1)
    a, b, c, d = raw_pairs(ctx)
    tensor = make_tensor(size)
    total = warm + count

    async def far_side() -> None:
        for _ in range(total):
            if pattern == "stream":
                await a.send_multipart([RAW_HEADER, raw_buffer(tensor)], copy=False)
            else:
                await c.send_multipart(await b.recv_multipart(copy=False), copy=False)

    async def near_side() -> None:
        for i in range(total):
            if i == warm:
                around()
            if pattern == "echo":
                await a.send_multipart([RAW_HEADER, raw_buffer(tensor)], copy=False)
            frames = await (b if pattern == "stream" else d).recv_multipart(copy=False)
            if len(frames[1]) != size:
                raise RuntimeError("raw message of the wrong size")
        around()

    far = asyncio.ensure_future(far_side())
    await asyncio.wait_for(asyncio.gather(far, near_side()), TIMEOUT_S)
    for sock in (a, b, c, d):
        sock.close(linger=0)
    ctx.term()


async def zpipe_phase(
    pattern: str, size: int, warm: int, count: int, around: Callable[[], None]
) -> None:
    ctx = new_context()
    a, b, c, d = (open_socket(ctx, k) for k in (zmq.PUSH, zmq.PULL, zmq.PUSH, zmq.PULL))
    for push, pull in ((a, b), (c, d)):
        pull.bind("tcp://127.0.0.1:*")
        push.connect(pull.getsockopt_string(zmq.LAST_ENDPOINT))
    tensor = make_tensor(size)
    total = warm + count

    async def far_side() -> None:
        for mb in range(total):
            if pattern == "stream":
                await send(a, data_message(mb, tensor, "bench"), timeout_s=TIMEOUT_S, peer="b")
            else:
                frames = await recv_frames(b, timeout_s=None, peer="a", awaited="ping")
                message = decode_frames(frames, MAX_BYTES)
                check_tensor(message, size)
                echo = data_message(int(message.body["mb"]), message.tensors[0], "echo")
                await send(c, echo, timeout_s=TIMEOUT_S, peer="d")

    async def near_side() -> None:
        for mb in range(total):
            if mb == warm:
                around()
            if pattern == "echo":
                await send(a, data_message(mb, tensor, "bench"), timeout_s=TIMEOUT_S, peer="b")
            frames = await recv_frames(
                b if pattern == "stream" else d, timeout_s=None, peer="a", awaited="message"
            )
            check_tensor(decode_frames(frames, MAX_BYTES), size)
        around()

    far = asyncio.ensure_future(far_side())
    await asyncio.wait_for(asyncio.gather(far, near_side()), TIMEOUT_S)
    for sock in (a, b, c, d):
        sock.close(linger=0)
    ctx.term()


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    text = text.upper()
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--phases",
        default="raw:echo:64K,zpipe:echo:64K,raw:echo:1M,zpipe:echo:1M",
        help="comma-separated path:pattern:size (path raw|asyncio|zpipe, pattern stream|echo)",
    )
    parser.add_argument("--count", type=int, default=200, help="measured messages per phase")
    parser.add_argument("--warm", type=int, default=50, help="warm-up messages per phase")
    parser.add_argument("--opcodes", action="store_true", help="count Python bytecodes")
    parser.add_argument("--top", type=int, default=25, help="functions shown with --opcodes")
    args = parser.parse_args(argv)
    retain_freed_memory()
    runner, _ = loop_runner()
    for n, phase in enumerate(args.phases.split(",")):
        path, pattern, size_text = phase.split(":")
        size = parse_size(size_text)
        counter = OpcodeCounter()
        marks = 0

        def around(counter: OpcodeCounter = counter) -> None:
            nonlocal marks
            marks += 1
            if args.opcodes:
                counter.stop() if counter.on else counter.start()
            mark()

        print(f"phase {n}: {phase}: dump {2 * n + 2}", file=sys.stderr, flush=True)
        if path == "raw":
            raw_phase(pattern, size, args.warm, args.count, around)
        elif path == "asyncio":
            runner(asyncio_raw_phase(pattern, size, args.warm, args.count, around))
        else:
            runner(zpipe_phase(pattern, size, args.warm, args.count, around))
        if args.opcodes:
            total = sum(counter.counts.values())
            print(f"{phase}: {total / args.count:.1f} bytecodes per message")
            for name, k in counter.counts.most_common(args.top):
                print(f"  {k / args.count:8.1f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
