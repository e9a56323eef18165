"""Tensor transport benchmark: zpipe's send/receive against raw pyzmq on loopback.

What it measures, between two processes (this one, the *sender*, and a spawned
*receiver*) over ``tcp://127.0.0.1`` on random free ports, for float32 tensors of
64 KiB, 1 MiB and 16 MiB (``--sizes``):

``raw``
    The ceiling: plain synchronous pyzmq PUSH/PULL,
    ``send_multipart([small_header, tensor_buffer], copy=False)`` and
    ``recv_multipart(copy=False)``, nothing decoded. Same high-water marks as
    zpipe's sockets (``--raw-hwm``), so only the software layers differ. It waits
    inside libzmq (blocking, GIL released), which no asyncio process can.
``raw_asyncio``
    The like-for-like baseline: the same messages and socket options (but the
    blocking timeouts) under ``zmq.asyncio``, its own asyncio context,
    ``await send_multipart([small_header, tensor_buffer], copy=False)`` and
    ``await recv_multipart(copy=False)``, nothing decoded, on the same loop
    runner as ``zpipe`` (uvloop when importable), one deadline per run
    (``asyncio.wait_for``), in both processes (sink and echo alike): what plain
    asyncio use of pyzmq gets, so ``zpipe`` over it is zpipe's own cost and
    ``raw_asyncio`` over ``raw`` is what asyncio alone costs.
``zpipe``
    What a stage does: ``zmq.asyncio`` sockets from ``open_socket`` (PUSH->PULL),
    each message built as ``Message("data", {"run", "mb", "src"}, tensors=(t,))``,
    sent with ``sockets.send`` (encode + per-send deadline), received with
    ``recv_frames(timeout_s=None)`` inside one deadline per run (as a stage's and
    the client's receive loops do) and decoded with ``decode_frames`` (header
    validated, tensor view built), on uvloop when it is importable (as the zpipe
    CLI runs).
``zpipe_curve``
    The ``zpipe`` path with CurveZMQ: ``secure_server`` on each bound PULL with a
    ``CurveAuthenticator`` in each process, ``secure_client`` on each PUSH, keys
    from ``generate_keys`` in a temporary directory; the receiver also checks the
    sender's key on every message, as a stage does.

``libsodium`` (printed with ``zpipe_curve``)
    The limit: libsodium's own CPU per encrypt and decrypt of one frame of each
    size, on one core, with the calls libzmq's CURVE makes
    (``crypto_box_easy_afternm`` and ``crypto_box_open_easy_afternm``, through
    ctypes on the libsodium pyzmq's libzmq links; see ``bench/_sodium.py``),
    timed in the sender process in the same run. ``gbps`` is what one thread can
    encrypt or decrypt per second: libzmq does all of a connection's frames in
    one I/O thread per end, so no CURVE link goes faster. ``frame_gbps``,
    ``frame_encrypt_us`` and ``frame_decrypt_us`` time libzmq's whole work per
    frame: the same calls with the copies libzmq 4.3.5 makes around them (a
    zeroed plaintext buffer the frame is copied into; the box opened in place,
    which makes libsodium move the ciphertext first, then the plaintext moved
    down a byte). Nulls if no libsodium loads.

Throughput: the sender pushes N messages back to back and the receiver answers
with one small ack after the last; GB/s = N * tensor bytes / (send start -> ack),
in 1e9 bytes per second. N is picked per size from a warm-up so that one run
lasts about ``--seconds``, and every path uses the same N. There are
``--repeats`` rounds; each round runs every path once, back to back, in an order
that rotates from round to round, and each path's median over the rounds is
printed.

Round-trip time: ping-pong of the same message sizes over a second PUSH/PULL
pair (receiver -> sender); the receiver decodes each ping and sends its tensor
back (zero-copy). The M round trips of each path are split over
``--rtt-rounds`` rounds, paths alternating as above; the median of all M is
printed (``rtt_ms``), and each round's median (``rtt_rounds_ms``).
``rtt_steps_us`` splits a round trip into ``send`` (the sender's encode and send,
until the send returns), ``to_echo`` (libzmq on both sides and the wake-up of
the echo's receive), ``echo`` (its decode and send), ``to_sender`` (likewise
back) and ``decode`` (the sender's), from readings of the system's monotonic
clock in both processes (medians over the trips); the summary's
``rtt_extra_us_by_step_X`` is zpipe's minus raw's. ``rtt_cpu_us_per_trip_by_thread``
splits the round trip's CPU as ``cpu_us_per_message_by_thread`` does a stream's.

Why rounds and pairs. On a 2-core machine the two processes and their libzmq I/O
threads are four busy threads on two cores: a run's wall time depends on which
threads the scheduler puts together, and on anything else that runs, and both
drift within seconds (quiet runs of the same code gave ``rtt_ratio_1mb`` 1.28,
2.07 and 2.28, and ``ratio_16mb`` 0.71-1.12). So ``ratio_X`` and ``rtt_ratio_X``
are the medians over rounds of the ratio *within* each round, whose two paths ran
back to back (``ratio_rounds_X``, ``rtt_ratio_rounds_X`` list them; the spread of
those lists is the run's own error bar); the ratios of the paths' medians are
``ratio_of_medians_X`` and ``rtt_ratio_of_medians_X`` (the definition before).
``--pin`` pins the sender, all its threads, to one CPU and the receiver to
another, the same for every path (the summary's ``pinned``): no migrations, and
never both benched processes on one core; its I/O thread then shares its core
with its main thread, on both paths alike. The CPU ratios (``cpu_ratio_X``,
``rtt_cpu_ratio_X``) move far less than the wall-clock ones: compare both.

Output, on stdout, one JSON line per path and size::

    {"bench": "transport", "path": "zpipe", "size_bytes": 1048576, "gbps": ..., "rtt_ms": ...}

then one summary line::

    {"bench": "transport", "summary": true, "ratio_64kb": ..., "ratio_1mb": ...,
     "ratio_16mb": ..., "rtt_ratio_1mb": ..., "curve_over_plain_1mb": ...,
     "curve_over_plain_16mb": ..., "uvloop": true, ...}

``ratio_X`` is zpipe/raw throughput (the goal is >= 0.9 at 1 MiB and 16 MiB),
``rtt_ratio_X`` is zpipe/raw round-trip time (1.0 is parity, higher is slower),
both the median of the rounds' ratios (see "Why rounds and pairs" above), and
``curve_over_plain_X`` is zpipe_curve/zpipe throughput.
Like for like, with ``raw_asyncio`` (paired by round as ``ratio_X``):
``ratio_X_vs_asyncio_raw`` (zpipe/raw_asyncio throughput; its rounds in
``ratio_rounds_X_vs_asyncio_raw``), ``rtt_ratio_X_vs_asyncio_raw`` (round trip),
``cpu_ratio_X_vs_asyncio_raw`` and ``rtt_cpu_ratio_X_vs_asyncio_raw`` (CPU per
message and per round trip, both processes); what asyncio alone costs against
blocking pyzmq: ``asyncio_raw_over_raw_X`` (raw_asyncio/raw throughput) and
``rtt_asyncio_raw_over_raw_X`` (round trip). All None without ``raw_asyncio``.
With ``zpipe_curve``: ``libsodium_gbps_X`` (the limit above),
``curve_over_libsodium_X``, ``curve_limit_over_plain_X`` (that limit over plain
zpipe: the best ``curve_over_plain_X`` with a free core for each end),
``curve_cpu_limit_over_plain_X`` (plain's CPU per message over plain's plus the
cipher's: the best ratio when the cores are the bottleneck, as with both ends on
2 cores), ``crypto_cpu_us_X`` (encrypt + decrypt), ``curve_extra_cpu_us_X``
(the curve path's CPU per message minus plain's) and
``curve_extra_over_crypto_X`` (the two divided: 1.0 means the cipher is all of
CURVE's extra cost; above it, libzmq's copies of each frame, see
docs/benchmarks.md), and with those copies: ``libzmq_curve_gbps_X``,
``curve_frame_cpu_us_X`` and ``curve_extra_over_frame_X`` (1.0: nothing but
libzmq's own per-frame work is left). ``cpu_ratio_X`` is zpipe/raw CPU time per
message of a throughput run, both processes and all their threads
(``time.process_time``; median over the repeats): the per-message software
cost, which moves far less than wall-clock ratios when other work shares the
cores. ``switches_per_message`` (throughput
runs) and ``rtt_switches_per_trip`` count the voluntary context switches of both
processes, all threads (each one a sleep that a hand-off, the network or a wait
for the GIL had to end), and ``rtt_cpu_us_per_trip`` the CPU per round trip
(``rtt_cpu_ratio_X`` in the summary): the robust measures of the round-trip path.

zpipe's sends copy tensors under ``--copy-below`` bytes (default
``zpipe.transport.sockets.COPY_BELOW_BYTES``; ``--copy-below 0`` shares every
buffer from 64 KiB, as zpipe did before), and the zpipe echo sends the tensor it
decoded on unchanged, which goes as the received ``zmq.Frame`` (as the raw echo
forwards its frames). The summary records ``copy_below`` and ``loadavg``.
``--paths raw,zpipe,zpipe_shared`` adds ``zpipe_shared``, the zpipe path with
``--copy-below 0``, and the same-run ratios ``copied_over_shared_X``
(throughput) and ``copied_over_shared_rtt_X`` (round trip) of the two.

Run it from the repository root::

    .venv/bin/python bench/transport.py            # full run, about 75 s on 2 cores
    .venv/bin/python bench/transport.py --quick    # smoke run, a few seconds

Both processes share the machine, so on a small or busy host the numbers move by
tens of percent from run to run; compare ratios from the same run only.
Both processes keep freed message memory (``zpipe.transport.allocator``, as
zpipe's stages do), for both paths alike; ``--no-retain-memory`` turns that off,
and then every large message libzmq receives may page-fault its buffer in again,
which lowers both paths and hurts the slower consumer (zpipe) most.

Fairness. Alike: high-water marks, LINGER, one libzmq I/O thread per context,
allocator settings (per process), zero-copy sends from 512 KiB (at 64 KiB zpipe
copies and raw shares: ``zpipe_shared`` has raw's flags). The raw sender builds
a buffer per message, as zpipe's ``encode`` does (it reused one before, which
spared pyzmq's collector thread a release). Raw's by design: nothing decoded or
validated, and it waits inside libzmq (blocking, GIL released); an asyncio
sender or receiver cannot (``raw_asyncio`` is raw with that one difference, and
shares raw's flags: zero-copy from 64 KiB). zpipe's sink holds a message until the next arrives
(raw's drops it at once): one message more memory, no CPU or faults seen.
``cpu_us_per_message_by_thread`` splits the CPU by
process and thread (main, zmq_io, other: mostly pyzmq's collector of zero-copy
buffers). At 1 MiB (2 cores, load 8-13, three runs) the I/O threads cost the
same on both paths (about 150 us sending, 100-150 receiving); zpipe's extra is
Python: sender main 32-49 us against 13-23, receiver main 48-85 against 13-26;
the collector costs alike (10-23). In isolation encode is 3 us, decode 6, the
zero-copy frame 2.5 (raw's too), a failed non-blocking receive 3; in the loop
each costs 2-3x that (cold caches). Cyclic GC (4 passes per 12000 messages),
page faults (none per message) and system calls are not it: a receive costs
libzmq's own (3-4 polls of the socket's mailbox, one read) on both paths, plus
one epoll wait on zpipe's. At 16 MiB zpipe's receiver main thread costs 380-470
us against 130-170 although nothing in it reads the data: every step slows
alike (decode 7 us in isolation, 80-130 in the loop; reading a frame's
``buffer`` 1.3 us at 1 MiB, 7-15 at 16), most likely cold caches.

Every wait has a deadline (``--timeout``), the whole run has one too
(``--deadline``), and the receiver is killed if anything fails.
"""

from __future__ import annotations

import argparse
import faulthandler
import multiprocessing as mp
import os
import sys
import tempfile
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from zpipe.log import configure_logging
from zpipe.transport import security
from zpipe.transport.allocator import retain_freed_memory
from zpipe.transport.sockets import COPY_BELOW_BYTES

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import emit, loadavg, summary
from bench._transport_paths import (
    OPTIONS,
    RECEIVER_KEY,
    SENDER_KEY,
    ReceiverSettings,
    loop_runner,
    receiver_main,
)
from bench._transport_results import BENCH, Result, size_ratios, sodium_line
from bench._transport_sender import Sender

PATHS = ("raw", "raw_asyncio", "zpipe", "zpipe_curve", "zpipe_shared")
DEFAULT_PATHS = ("raw", "raw_asyncio", "zpipe", "zpipe_curve")
DEFAULT_SIZES = "64K,1M,16M"


def parse_size(text: str) -> int:
    """``64K``, ``1M``, ``16M``, ``4096``: binary units, a multiple of 4 bytes."""
    text = text.strip().upper().removesuffix("B")
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    scale = units.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in units else text
    try:
        size = int(float(number) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: use e.g. 64K, 1M, 16M") from None
    if size <= 0 or size % 4:
        raise argparse.ArgumentTypeError(f"size {text!r} must be a positive multiple of 4 bytes")
    return size


def size_label(size: int) -> str:
    """Key suffix in the summary: 64kb, 1mb, 16mb (or the byte count)."""
    if size % (1 << 20) == 0:
        return f"{size >> 20}mb"
    if size % (1 << 10) == 0:
        return f"{size >> 10}kb"
    return f"{size}b"


async def run_sender(
    args: argparse.Namespace, conn: Connection, proc: Any, keys_dir: Path, has_uvloop: bool
) -> dict[str, Any]:
    sender = Sender(args, conn, proc, keys_dir)
    try:
        hello = await sender.reply("hello", timeout_s=args.startup_timeout)
        uvloop_both = has_uvloop and bool(hello.get("uvloop"))
        paths: list[str] = list(args.paths)
        for path in paths:
            await sender.setup(path)
        all_results: dict[int, dict[str, Result]] = {}
        for size in args.sizes:
            all_results[size] = await sender.measure_size(size, paths)
            for path in paths:
                emit(all_results[size][path].line(uvloop_both))
            if size in sender.boxes:
                emit(sodium_line(sender.boxes[size], sender.sodium))
        conn.send({"op": "quit", "path": None})
        await sender.reply("bye")
    finally:
        sender.close()
    ratios: dict[str, Any] = {}
    for size, results in all_results.items():
        ratios.update(size_ratios(size_label(size), results, sender.boxes.get(size)))
    for key in (
        "ratio_64kb",
        "ratio_1mb",
        "ratio_16mb",
        "rtt_ratio_1mb",
        "curve_over_plain_1mb",
        "curve_over_plain_16mb",
        "libsodium_gbps_1mb",
        "curve_over_libsodium_1mb",
        "curve_limit_over_plain_1mb",
        "ratio_64kb_vs_asyncio_raw",
        "ratio_1mb_vs_asyncio_raw",
        "rtt_ratio_1mb_vs_asyncio_raw",
        "asyncio_raw_over_raw_64kb",
        "asyncio_raw_over_raw_1mb",
    ):
        ratios.setdefault(key, None)
    return {
        **ratios,
        "uvloop": uvloop_both,
        "copy_below": args.copy_below,
        "loadavg": loadavg(),
        "quick": bool(args.quick),
        "repeats": args.repeats,
        "torch_threads": torch.get_num_threads(),
        "pinned": {"sender": args.pin_sender, "receiver": args.pin_receiver} if args.pin else None,
    }


# -------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench/transport.py",
        description="zpipe tensor send/receive vs raw pyzmq zero-copy multipart on loopback "
        "(throughput, round-trip time, CurveZMQ cost); prints JSON lines.",
    )
    parser.add_argument(
        "--sizes",
        default=None,
        help=f"comma-separated tensor sizes in bytes, K or M (default {DEFAULT_SIZES})",
    )
    parser.add_argument(
        "--paths",
        default=",".join(DEFAULT_PATHS),
        help=f"comma-separated subset of {','.join(PATHS)} (default: {','.join(DEFAULT_PATHS)})",
    )
    parser.add_argument(
        "--quick", action="store_true", help="fast smoke run: short runs, 1 repeat, few round trips"
    )
    parser.add_argument(
        "--seconds",
        type=float,
        default=None,
        help="target duration of one throughput run (default 0.45, quick 0.05)",
    )
    parser.add_argument(
        "--rtt-seconds",
        type=float,
        default=None,
        help="target total time of the round trips per path and size (default 0.3, quick 0.03)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="throughput rounds per size, paths alternating (default 5, quick 1); ratio_X "
        "is the median of the rounds' ratios",
    )
    parser.add_argument(
        "--rtt-rounds",
        type=int,
        default=None,
        help="round-trip rounds per size, paths alternating (default 7, quick 1); "
        "rtt_ratio is the median of the rounds' ratios",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="pin the sender (all its threads) to one CPU and the receiver to another "
        "(the first two this process may use), the same for every path: no migrations, "
        "no two benched processes on one core",
    )
    parser.add_argument(
        "--count", type=int, default=0, help="messages per throughput run (default: from --seconds)"
    )
    parser.add_argument("--min-count", type=int, default=5, help="fewest messages per run")
    parser.add_argument("--max-count", type=int, default=100_000, help="most messages per run")
    parser.add_argument(
        "--trips",
        type=int,
        default=0,
        help="round trips per path and size (default: from --rtt-seconds)",
    )
    parser.add_argument(
        "--raw-hwm",
        type=int,
        default=OPTIONS.send_hwm,
        help=f"high-water mark of the raw sockets (default: zpipe's, {OPTIONS.send_hwm})",
    )
    parser.add_argument(
        "--no-retain-memory",
        dest="tune_malloc",
        action="store_false",
        help="let glibc return freed message memory at once (zpipe's stages "
        "keep it; see zpipe.transport.allocator)",
    )
    parser.add_argument(
        "--copy-below",
        type=int,
        default=COPY_BELOW_BYTES,
        help="zpipe's sends copy tensor buffers under this many bytes instead of sharing "
        f"them (default COPY_BELOW_BYTES, {COPY_BELOW_BYTES}; 0: share from 64 KiB, "
        "as zpipe did before)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        help="deadline of every single wait, seconds (default 30)",
    )
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=120.0,
        help="deadline for the receiver process to start, seconds",
    )
    parser.add_argument(
        "--deadline",
        type=float,
        default=900.0,
        help="the whole benchmark is aborted after this many seconds",
    )
    args = parser.parse_args(argv)
    sizes_text = args.sizes or DEFAULT_SIZES
    try:
        args.sizes = [parse_size(s) for s in sizes_text.split(",") if s.strip()]
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    args.paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    unknown = [p for p in args.paths if p not in PATHS]
    if unknown or not args.paths or not args.sizes:
        parser.error(f"--paths takes a subset of {','.join(PATHS)}; --sizes at least one size")
    if args.seconds is None:
        args.seconds = 0.05 if args.quick else 0.45
    if args.rtt_seconds is None:
        args.rtt_seconds = 0.03 if args.quick else 0.3
    if args.repeats is None:
        args.repeats = 1 if args.quick else 5
    if args.rtt_rounds is None:
        args.rtt_rounds = 1 if args.quick else 7
    args.pin_sender = args.pin_receiver = None
    if args.pin:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            parser.error("--pin needs two CPUs")
        args.pin_sender, args.pin_receiver = cpus[0], cpus[1]
    if args.repeats < 1 or args.rtt_rounds < 1 or args.timeout <= 0 or args.min_count < 1:
        parser.error("--repeats, --timeout and --min-count must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(level="warning")  # zpipe logs go to stderr, JSON lines to stdout
    faulthandler.dump_traceback_later(args.deadline, exit=True)
    runner, has_uvloop = loop_runner()
    if args.pin_sender is not None:
        # before any zmq context: libzmq's and pyzmq's threads inherit it
        os.sched_setaffinity(0, {args.pin_sender})
    spawn = mp.get_context("spawn")
    parent_conn, child_conn = spawn.Pipe(duplex=True)
    malloc_tuned = retain_freed_memory() if args.tune_malloc else False
    settings = ReceiverSettings(
        timeout_s=args.timeout,
        deadline_s=args.deadline + 30,
        raw_hwm=args.raw_hwm,
        tune_malloc=args.tune_malloc,
        copy_below=args.copy_below,
        cpu=args.pin_receiver,
    )
    proc = spawn.Process(
        target=receiver_main, args=(child_conn, settings), name="zpipe-bench-receiver", daemon=True
    )
    proc.start()
    child_conn.close()
    status = 1
    try:
        with tempfile.TemporaryDirectory(prefix="zpipe-bench-") as tmp:
            keys_dir = Path(tmp) / "keys"
            if "zpipe_curve" in args.paths:
                security.generate_keys(keys_dir, [SENDER_KEY, RECEIVER_KEY])
            result = runner(run_sender(args, parent_conn, proc, keys_dir, has_uvloop))
        summary(BENCH, **result, malloc_tuned=malloc_tuned)
        status = 0
    except Exception as exc:
        print(f"bench/transport.py: failed: {exc!r}", file=sys.stderr)
    finally:
        parent_conn.close()
        proc.join(timeout=5)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
        faulthandler.cancel_dump_traceback_later()
    return status


if __name__ == "__main__":
    sys.exit(main())
