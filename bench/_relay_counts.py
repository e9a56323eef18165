"""Per-message counts of a stage's relay path, for tools that count (issue 34).

``bench/stage_relay.py`` times the relay on a shared 2-core machine, where wall
clock is noise; instructions (valgrind's callgrind), system calls (strace -c) and
Python bytecodes are not. This driver runs the same relay as that bench's
``stage`` path (the real :class:`~zpipe.stage.dataport.DataPort` feeding the real
:class:`~zpipe.stage.executors.inference.InferenceLoop` over a one-unit identity
shard, on uvloop, imports frozen out of the cyclic collector) in *this* process,
and its feeder (plain synchronous pyzmq, ``--window`` messages in the relay at
once) in a child process that tools not told to follow children leave out.

The relay calls libc's ``getpgrp`` (``os.getpgrp``; nothing else here calls it)
when its data port takes message ``--warm`` and again at message ``--warm`` +
``--count``: under ``valgrind --tool=callgrind --dump-before=getpgrp`` dump 2 is
the measured messages, whose instruction total over ``--count`` is the relay
process's cost per message, all threads. ``--opcodes`` counts the Python bytecodes
each function runs between the marks instead (all threads, ``sys.settrace``);
``--calls`` counts function calls, Python and C (``sys.setprofile``).

    valgrind --tool=callgrind --dump-before=getpgrp --callgrind-out-file=cg.%p \\
        python bench/_relay_counts.py --size 64K
    strace -f -ff -ttt -o st/t python bench/_relay_counts.py --size 64K --count 2000 \\
        --threads-to st/threads.json
    python bench/_relay_counts.py --strace-summary st --count 2000 --top 40
    python bench/_relay_counts.py --opcodes --size 64K

Every wait has a deadline (``TIMEOUT_S``).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import re
import subprocess
import sys
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import FrameType
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import zmq

from bench._relay_parts import EPOCH, OPTIONS, RUN, running_lifecycle, thread_role
from bench._transport_counts import OpcodeCounter, mark
from zpipe.log import configure_logging
from zpipe.stage.dataport import DataPort
from zpipe.stage.executors.inference import InferenceLoop
from zpipe.stage.metrics import StageCounters
from zpipe.stage.shard import Shard
from zpipe.transport.allocator import retain_freed_memory
from zpipe.transport.codec import Message, encode
from zpipe.transport.emulation import LinkSpec
from zpipe.transport.sockets import new_context, open_socket

TIMEOUT_S = 600.0  # valgrind runs tens of times slower: generous, but never unbounded


class Counts(OpcodeCounter):
    """Python bytecodes (``--opcodes``, :class:`OpcodeCounter`'s hook) or calls
    (``--calls``) per function, all threads, switched on and off by :meth:`toggle`."""

    def __init__(self, what: str | None) -> None:
        super().__init__()
        self.what = what

    def _call(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self.on:
            return
        if event == "call":
            code = frame.f_code
            self.counts[f"{Path(code.co_filename).name}:{code.co_name}"] += 1
        elif event == "c_call":
            self.counts[f"C:{getattr(arg, '__qualname__', arg)}"] += 1

    def install(self) -> None:
        """Before any thread starts: threads started later inherit the hook."""
        if self.what == "opcodes":
            threading.settrace(self._trace)
            sys.settrace(self._trace)
        elif self.what == "calls":
            threading.setprofile(self._call)
            sys.setprofile(self._call)

    def toggle(self) -> None:
        self.on = not self.on
        mark()


def feeder(data_in: str, data_out: str, size: int, total: int, window: int) -> None:
    """The child: ``total`` messages of one float32 tensor, ``window`` in the relay."""
    ctx = zmq.Context(io_threads=1)
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    for sock in (push, pull):
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, int(TIMEOUT_S * 1000))
        sock.setsockopt(zmq.RCVTIMEO, int(TIMEOUT_S * 1000))
    push.connect(data_in)
    pull.connect(data_out)
    tensor = torch.arange(size // 4, dtype=torch.float32)
    headers = []
    for mb in range(total):
        message = Message("data", {"run": RUN, "mb": mb, "src": "client"}, epoch=EPOCH,
                          tensors=(tensor,))  # fmt: skip
        frames = encode(message)
        headers.append(bytes(frames[0]))
    payload = frames[1]
    sent = received = 0
    while received < total:
        while sent < total and sent - received < window:
            push.send_multipart([headers[sent], payload], copy=False)
            sent += 1
        frames = pull.recv_multipart(copy=False)
        if len(frames) != 2 or len(frames[1]) != size:
            raise RuntimeError("the relay returned a different message")
        received += 1
    push.close()
    pull.close()
    ctx.term()


async def relay(args: argparse.Namespace, counts: Counts) -> None:
    ctx = new_context()
    data_in = open_socket(ctx, zmq.PULL, OPTIONS)
    data_in.bind("tcp://127.0.0.1:*")
    downstream = open_socket(ctx, zmq.PUSH, OPTIONS)
    downstream.bind("tcp://127.0.0.1:*")
    total = args.warm + args.count + args.tail
    child = subprocess.Popen(  # noqa: ASYNC220 (once, before any message is counted)
        [sys.executable, __file__, "--feed", data_in.getsockopt_string(zmq.LAST_ENDPOINT),
         downstream.getsockopt_string(zmq.LAST_ENDPOINT), "--size", str(args.size),
         "--total", str(total), "--window", str(args.window)],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )  # fmt: skip
    counters = StageCounters()
    compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute-relay")
    loop = InferenceLoop(
        name="relay", run=RUN, epoch=EPOCH, shard=Shard([torch.nn.Identity()]),
        compute=compute, counters=counters, downstream=downstream, downstream_name="sink",
        link=LinkSpec(), send_timeout_s=30.0,
    )  # fmt: skip
    port = DataPort(
        socket=data_in, lifecycle=running_lifecycle(), counters=counters, name="relay",
        max_message_bytes=OPTIONS.max_message_bytes,
    )  # fmt: skip
    taken = 0
    done = asyncio.Event()

    async def deliver(message: Any) -> None:
        nonlocal taken
        if taken in (args.warm, args.warm + args.count):
            counts.toggle()
        taken += 1
        await loop.deliver(message)
        if taken == total:
            done.set()

    tasks = [
        asyncio.create_task(port.serve(deliver, upstream="client")),
        asyncio.create_task(loop.compute_loop()),
        asyncio.create_task(loop.send_loop()),
    ]
    await asyncio.wait_for(done.wait(), TIMEOUT_S)
    if args.threads_to is not None:  # while every thread still runs
        args.threads_to.write_text(json.dumps(thread_roles()))
    await asyncio.to_thread(child.wait, TIMEOUT_S)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await loop.close()
    compute.shutdown(wait=True)
    data_in.close(linger=0)
    downstream.close(linger=0)
    ctx.term()
    if child.returncode != 0:
        raise RuntimeError(f"the feeder failed: {child.returncode}")


def thread_roles() -> dict[int, str]:
    """This process's threads by id: their role, as bench/stage_relay.py names them."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    roles = {}
    for task in Path("/proc/self/task").iterdir():
        name = names.get(int(task.name)) or (task / "comm").read_text().strip()
        roles[int(task.name)] = thread_role(name)
    return roles


def strace_summary(directory: Path) -> Counter[str]:
    """System calls per message of the relay process's threads between the two marks,
    from ``strace -f -ff -ttt -o DIR/t`` files (one per thread; the feeder's, a child
    process that execs, and its threads, left out)."""
    line = re.compile(r"^(\d+\.\d+) (?:<\.\.\. )?(\w+)")
    files = {int(f.suffix[1:]): f.read_text().splitlines() for f in directory.glob("t.*")}
    children: dict[int, list[int]] = {}
    feeder_roots = []
    for tid, lines in files.items():
        for text in lines:
            if "execve(" in text and "--feed" in text:
                feeder_roots.append(tid)
            if (m := re.search(r"(?:clone3?|vfork|fork)\(.*= (\d+)$", text)) is not None:
                children.setdefault(tid, []).append(int(m.group(1)))
    left_out = set(feeder_roots)
    todo = list(feeder_roots)
    while todo:
        for child in children.get(todo.pop(), []):
            left_out.add(child)
            todo.append(child)
    marks = sorted(
        float(text.split()[0]) for lines in files.values() for text in lines if "getpgrp()" in text
    )
    if len(marks) < 2:
        raise SystemExit("no two getpgrp marks in the trace")
    start, end = marks[0], marks[-1]
    roles_file = directory / "threads.json"
    roles = json.loads(roles_file.read_text()) if roles_file.exists() else {}
    calls: Counter[str] = Counter()
    for tid, lines in files.items():
        if tid in left_out:
            continue
        role = roles.get(str(tid), "thread")
        for text in lines:
            m = line.match(text)
            if m is None or "resumed>" in text or not start < float(m.group(1)) < end:
                continue
            calls[m.group(2)] += 1
            calls[f"{role}:{m.group(2)}"] += 1
    return calls


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    text = text.upper()
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=parse_size, default=64 << 10)
    parser.add_argument("--count", type=int, default=400, help="measured messages")
    parser.add_argument("--warm", type=int, default=100, help="messages before the first mark")
    parser.add_argument("--tail", type=int, default=20, help="messages after the second mark")
    parser.add_argument("--window", type=int, default=4, help="messages in the relay at once")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--opcodes", action="store_true", help="count Python bytecodes")
    group.add_argument("--calls", action="store_true", help="count calls (Python and C)")
    parser.add_argument(
        "--inline-compute",
        action="store_true",
        help="diagnostic, as bench/stage_relay.py's: forwards on the event loop",
    )
    parser.add_argument("--top", type=int, default=30, help="functions shown")
    parser.add_argument(
        "--threads-to", type=Path, help="write the relay's thread roles by id here (json)"
    )
    parser.add_argument("--strace-summary", type=Path, help="summarize strace -ff files")
    parser.add_argument("--feed", nargs=2, metavar=("DATA_IN", "DATA_OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--total", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.strace_summary:
        calls = strace_summary(args.strace_summary)
        total = sum(k for name, k in calls.items() if ":" not in name)
        print(f"{total / args.count:.2f} system calls per message (then by thread role)")
        for name, k in calls.most_common(args.top):
            print(f"  {k / args.count:8.2f}  {name}")
        return 0
    if args.feed:
        feeder(args.feed[0], args.feed[1], args.size, args.total, args.window)
        return 0
    configure_logging(level="warning")
    retain_freed_memory()
    torch.set_num_threads(1)
    gc.collect()
    gc.freeze()  # as the stage CLI and bench/stage_relay.py's relay do
    if args.inline_compute:
        from bench.stage_relay import _compute_on_the_loop

        _compute_on_the_loop()
    counts = Counts("opcodes" if args.opcodes else "calls" if args.calls else None)
    counts.install()
    try:
        import uvloop

        uvloop.run(relay(args, counts))
    except ImportError:
        asyncio.run(relay(args, counts))
    if counts.what:
        total = sum(counts.counts.values())
        print(f"size {args.size}: {total / args.count:.1f} {counts.what} per message")
        for name, k in counts.counts.most_common(args.top):
            print(f"  {k / args.count:8.1f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
