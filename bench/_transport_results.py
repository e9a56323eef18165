"""Results of ``bench/transport.py``: one path and size's runs, the JSON line it
prints, and the summary's ratios per size (split out of that module to keep it
small)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench._common import thread_cpu_by_role, thread_switches
from bench._sodium import BoxTiming, Sodium

BENCH = "transport"

# The steps of one round trip, timed on the system's monotonic clock in both
# processes: the sender's encode and send (until it returns), the ping's way to the
# echo's hands (libzmq both sides, the wake-up of the echo's receive), the echo's
# decode and send, the pong's way back (likewise), and the sender's decode.
RTT_STEPS = ("send", "to_echo", "echo", "to_sender", "decode")


def round_trip_steps(
    sender: list[tuple[float, float, float, float]], echo: list[tuple[float, float]]
) -> list[tuple[float, ...]]:
    """Per round trip, the seconds of each of :data:`RTT_STEPS` from the sender's
    stamps (start, sent, received, decoded) and the echo's (received, sent)."""
    return [
        (sent - start, got - sent, echoed - got, received - echoed, done - received)
        for (start, sent, received, done), (got, echoed) in zip(sender, echo, strict=True)
    ]


def paired_ratio(a: list[float], b: list[float]) -> float | None:
    """Median over rounds of a[i] / b[i]: the two paths of a round ran back to back,
    so load that drifts between rounds moves both alike and cancels."""
    pairs = [x / y for x, y in zip(a, b, strict=True) if y]
    return _round(statistics.median(pairs)) if pairs else None


def round_ratios(a: list[float], b: list[float]) -> list[float | None]:
    return [_round(x / y) if y else None for x, y in zip(a, b, strict=True)]


@dataclass
class Usage:
    """CPU seconds and voluntary context switches of both processes, all threads;
    ``by_thread``: CPU seconds per process and thread role (``sender_main``,
    ``receiver_zmq_io``, ... see :func:`bench._common.thread_cpu_by_role`)."""

    cpu_s: float = 0.0
    switches: int = 0
    by_thread: dict[str, float] = field(default_factory=dict)

    def plus(self, other: Usage) -> Usage:
        by_thread = dict(self.by_thread)
        for key, seconds in other.by_thread.items():
            by_thread[key] = by_thread.get(key, 0.0) + seconds
        return Usage(self.cpu_s + other.cpu_s, self.switches + other.switches, by_thread)


@dataclass(frozen=True)
class UsageMark:
    """This process's usage at one moment; :meth:`since` gives what it spent after."""

    cpu_s: float
    switches: int
    by_role: dict[str, float]

    @classmethod
    def now(cls) -> UsageMark:
        return cls(time.process_time(), thread_switches(), thread_cpu_by_role())

    def since(self, side: str) -> Usage:
        """Usage since this mark; ``side`` ("sender", "receiver") prefixes the roles."""
        roles = thread_cpu_by_role()
        return Usage(
            time.process_time() - self.cpu_s,
            thread_switches() - self.switches,
            {f"{side}_{role}": s - self.by_role.get(role, 0.0) for role, s in roles.items()},
        )


@dataclass
class Result:
    path: str
    size: int
    count: int = 0
    seconds: list[float] = field(default_factory=list)
    rtts: list[float] = field(default_factory=list)
    # CPU seconds of both processes (all their threads) per throughput run
    cpu_seconds: list[float] = field(default_factory=list)
    switches: list[int] = field(default_factory=list)
    # CPU seconds per process and thread role, per throughput run
    thread_seconds: list[dict[str, float]] = field(default_factory=list)
    rtt_usage: Usage = field(default_factory=Usage)  # of all round trips together
    # median round trip of each round (paths alternate round by round)
    rtt_rounds: list[float] = field(default_factory=list)
    # per round trip, seconds of each step of RTT_STEPS
    rtt_steps: list[tuple[float, ...]] = field(default_factory=list)

    def add_rtt_usage(self, usage: Usage) -> None:
        self.rtt_usage = self.rtt_usage.plus(usage)

    def rtt_cpu_us_by_thread(self) -> dict[str, float]:
        """CPU per round trip of each process's main, libzmq I/O and other threads."""
        if not self.rtts:
            return {}
        n = len(self.rtts)
        return {k: round(s / n * 1e6, 2) for k, s in sorted(self.rtt_usage.by_thread.items())}

    def rtt_steps_us(self) -> dict[str, float]:
        """Median microseconds of each step of a round trip (:data:`RTT_STEPS`)."""
        if not self.rtt_steps:
            return {}
        return {
            name: round(statistics.median(trip[i] for trip in self.rtt_steps) * 1e6, 1)
            for i, name in enumerate(RTT_STEPS)
        }

    def switches_per_message(self) -> float | None:
        if not self.switches or not self.count:
            return None
        return statistics.median(self.switches) / self.count

    def rtt_cpu_us(self) -> float | None:
        return self.rtt_usage.cpu_s / len(self.rtts) * 1e6 if self.rtts else None

    def rtt_switches(self) -> float | None:
        return self.rtt_usage.switches / len(self.rtts) if self.rtts else None

    def gbps_runs(self) -> list[float]:
        return [self.count * self.size / s / 1e9 for s in self.seconds]

    def gbps(self) -> float | None:
        runs = self.gbps_runs()
        return statistics.median(runs) if runs else None

    def cpu_us_per_message(self) -> float | None:
        if not self.cpu_seconds or not self.count:
            return None
        return statistics.median(self.cpu_seconds) / self.count * 1e6

    def cpu_us_per_message_by_thread(self) -> dict[str, float]:
        """Median CPU per message of each process's main, libzmq I/O and other
        threads: where the CPU of ``cpu_us_per_message`` goes."""
        if not self.thread_seconds or not self.count:
            return {}
        keys = sorted({key for run in self.thread_seconds for key in run})
        return {
            key: round(
                statistics.median(run.get(key, 0.0) for run in self.thread_seconds)
                / self.count
                * 1e6,
                2,
            )
            for key in keys
        }

    def rtt_ms(self) -> float | None:
        return statistics.median(self.rtts) * 1e3 if self.rtts else None

    def line(self, has_uvloop: bool) -> dict[str, Any]:
        gbps, rtt = self.gbps(), self.rtt_ms()
        q = statistics.quantiles(self.rtts, n=10) if len(self.rtts) >= 2 else [None] * 9
        return {
            "bench": BENCH,
            "path": self.path,
            "size_bytes": self.size,
            "gbps": _round(gbps),
            "gbps_runs": [_round(g) for g in self.gbps_runs()],
            "messages": self.count,
            "rtt_ms": _round(rtt),
            "cpu_us_per_message": _round(self.cpu_us_per_message(), 2),
            "switches_per_message": _round(self.switches_per_message(), 3),
            "cpu_us_per_message_by_thread": self.cpu_us_per_message_by_thread(),
            "rtt_cpu_us_per_trip": _round(self.rtt_cpu_us(), 2),
            "rtt_cpu_us_per_trip_by_thread": self.rtt_cpu_us_by_thread(),
            "rtt_steps_us": self.rtt_steps_us(),
            "rtt_rounds_ms": [_round(r * 1e3) for r in self.rtt_rounds],
            "rtt_switches_per_trip": _round(self.rtt_switches(), 3),
            "rtt_p10_ms": _round(q[0] * 1e3 if q[0] is not None else None),
            "rtt_p90_ms": _round(q[-1] * 1e3 if q[-1] is not None else None),
            "round_trips": len(self.rtts),
            "uvloop": has_uvloop and self.path != "raw",
        }


def _round(value: float | None, digits: int = 4) -> float | None:
    if value is None:
        return None
    return round(value, digits)


def same_run_ratio(a: float | None, b: float | None) -> float | None:
    return _round(a / b) if a is not None and b else None


def size_ratios(label: str, results: dict[str, Result], box: BoxTiming | None) -> dict[str, Any]:
    """The summary's keys for one size (suffix ``label``), from the paths' results.

    Against ``raw`` (blocking pyzmq): ``ratio``, ``rtt_ratio`` (and their rounds),
    ``rtt_extra_us_by_step``, the ratios of medians, ``cpu_ratio``, ``rtt_cpu_ratio``.
    Against ``raw_asyncio`` (the like-for-like baseline: raw pyzmq under zmq.asyncio
    on the same loop): ``ratio_X_vs_asyncio_raw``, ``rtt_ratio_X_vs_asyncio_raw``
    (with ``ratio_rounds_X_vs_asyncio_raw``), ``cpu_ratio_X_vs_asyncio_raw``,
    ``rtt_cpu_ratio_X_vs_asyncio_raw``; and what asyncio alone costs against
    blocking: ``asyncio_raw_over_raw_X`` (throughput) and
    ``rtt_asyncio_raw_over_raw_X``. Paired ratios are medians over rounds of each
    round's own ratio (both paths ran in that round); a path not run gives None.
    """

    def get(path: str, what: Callable[[Result], float | None]) -> float | None:
        return what(results[path]) if path in results else None

    ratios: dict[str, Any] = {}
    zpipe, raw = results.get("zpipe"), results.get("raw")
    if zpipe is not None and raw is not None:
        # Round by round: the two paths of a round ran back to back (see the notes).
        ratios[f"ratio_{label}"] = paired_ratio(zpipe.gbps_runs(), raw.gbps_runs())
        ratios[f"ratio_rounds_{label}"] = round_ratios(zpipe.gbps_runs(), raw.gbps_runs())
        ratios[f"rtt_ratio_{label}"] = paired_ratio(zpipe.rtt_rounds, raw.rtt_rounds)
        ratios[f"rtt_ratio_rounds_{label}"] = round_ratios(zpipe.rtt_rounds, raw.rtt_rounds)
        steps_z, steps_r = zpipe.rtt_steps_us(), raw.rtt_steps_us()
        if steps_z and steps_r:
            ratios[f"rtt_extra_us_by_step_{label}"] = {
                k: round(steps_z[k] - steps_r[k], 1) for k in steps_z
            }
    ratios[f"ratio_of_medians_{label}"] = same_run_ratio(
        get("zpipe", Result.gbps), get("raw", Result.gbps)
    )
    ratios[f"rtt_ratio_of_medians_{label}"] = same_run_ratio(
        get("zpipe", Result.rtt_ms), get("raw", Result.rtt_ms)
    )
    ratios[f"cpu_ratio_{label}"] = same_run_ratio(
        get("zpipe", Result.cpu_us_per_message), get("raw", Result.cpu_us_per_message)
    )
    ratios[f"rtt_cpu_ratio_{label}"] = same_run_ratio(
        get("zpipe", Result.rtt_cpu_us), get("raw", Result.rtt_cpu_us)
    )
    ratios.update(_asyncio_raw_ratios(label, results))
    ratios[f"copied_over_shared_{label}"] = same_run_ratio(
        get("zpipe", Result.gbps), get("zpipe_shared", Result.gbps)
    )
    ratios[f"copied_over_shared_rtt_{label}"] = same_run_ratio(
        get("zpipe", Result.rtt_ms), get("zpipe_shared", Result.rtt_ms)
    )
    ratios[f"curve_over_plain_{label}"] = same_run_ratio(
        get("zpipe_curve", Result.gbps), get("zpipe", Result.gbps)
    )
    ratios.update(curve_limits(label, box, results.get("zpipe"), results.get("zpipe_curve")))
    return ratios


def _asyncio_raw_ratios(label: str, results: dict[str, Result]) -> dict[str, Any]:
    """zpipe against raw_asyncio (like for like), and raw_asyncio against raw
    (what asyncio alone costs): see :func:`size_ratios`."""
    keys = (
        f"ratio_{label}_vs_asyncio_raw",
        f"ratio_rounds_{label}_vs_asyncio_raw",
        f"rtt_ratio_{label}_vs_asyncio_raw",
        f"cpu_ratio_{label}_vs_asyncio_raw",
        f"rtt_cpu_ratio_{label}_vs_asyncio_raw",
        f"asyncio_raw_over_raw_{label}",
        f"rtt_asyncio_raw_over_raw_{label}",
    )
    out: dict[str, Any] = dict.fromkeys(keys)
    zpipe, raw, asyncio_raw = (results.get(p) for p in ("zpipe", "raw", "raw_asyncio"))
    if asyncio_raw is None:
        return out
    if zpipe is not None:
        z_runs, a_runs = zpipe.gbps_runs(), asyncio_raw.gbps_runs()
        out[keys[0]] = paired_ratio(z_runs, a_runs)
        out[keys[1]] = round_ratios(z_runs, a_runs)
        out[keys[2]] = paired_ratio(zpipe.rtt_rounds, asyncio_raw.rtt_rounds)
        out[keys[3]] = same_run_ratio(zpipe.cpu_us_per_message(), asyncio_raw.cpu_us_per_message())
        out[keys[4]] = same_run_ratio(zpipe.rtt_cpu_us(), asyncio_raw.rtt_cpu_us())
    if raw is not None:
        out[keys[5]] = paired_ratio(asyncio_raw.gbps_runs(), raw.gbps_runs())
        out[keys[6]] = paired_ratio(asyncio_raw.rtt_rounds, raw.rtt_rounds)
    return out


def sodium_line(box: BoxTiming, sodium: Sodium | None) -> dict[str, Any]:
    """The ``libsodium`` line: CPU per encrypt and decrypt of one frame, one core."""
    return {
        "bench": BENCH,
        "path": "libsodium",
        "size_bytes": box.size,
        "gbps": round(box.gbps(), 4),
        "encrypt_us": round(box.encrypt_s * 1e6, 2),
        "decrypt_us": round(box.decrypt_s * 1e6, 2),
        # with libzmq's copies around the two calls: all CURVE does per frame
        "frame_gbps": _round_or_none(box.frame_gbps(), 4),
        "frame_encrypt_us": round(box.frame_encrypt_s * 1e6, 2),
        "frame_decrypt_us": round(box.frame_decrypt_s * 1e6, 2),
        "cipher": "crypto_box_easy_afternm (XSalsa20-Poly1305), as libzmq's CURVE",
        "library": sodium.path if sodium else None,
    }


def _round_or_none(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def curve_limits(
    label: str, box: BoxTiming | None, plain: Result | None, curve: Result | None
) -> dict[str, float | None]:
    """What the cipher allows CURVE, against what the curve path got (same run).

    ``libsodium_gbps``: frames one thread encrypts (or decrypts) per second; libzmq
    does each connection's in one I/O thread per end, so no CURVE link beats it.
    ``curve_limit_over_plain``: that over plain zpipe, the best
    ``curve_over_plain`` with a free core for each end. ``curve_cpu_limit_over_plain``:
    plain's CPU per message over plain's plus the cipher's, the best ratio when the
    cores are the bottleneck (both ends on 2 shared cores, as here).
    ``curve_extra_over_crypto``: the curve path's extra CPU per message over plain,
    divided by the cipher's (1.0: all of the extra is the cipher).
    ``libzmq_curve_gbps``, ``curve_frame_cpu_us`` and ``curve_extra_over_frame``: the
    same with libzmq's copies around the cipher (:meth:`bench._sodium.Sodium.time_box`),
    all CURVE does per frame: 1.0 leaves nothing else in the curve path's extra.
    """
    keys = (
        "libsodium_gbps",
        "curve_over_libsodium",
        "curve_limit_over_plain",
        "curve_cpu_limit_over_plain",
        "crypto_cpu_us",
        "curve_extra_cpu_us",
        "curve_extra_over_crypto",
        "libzmq_curve_gbps",
        "curve_frame_cpu_us",
        "curve_extra_over_frame",
    )
    out: dict[str, float | None] = {f"{key}_{label}": None for key in keys}
    if box is None:
        return out
    limit = box.gbps()
    out[f"libsodium_gbps_{label}"] = round(limit, 4)
    out[f"crypto_cpu_us_{label}"] = round(box.both_us(), 1)
    out[f"libzmq_curve_gbps_{label}"] = _round_or_none(box.frame_gbps(), 4)
    frame_us = box.frame_both_us()
    out[f"curve_frame_cpu_us_{label}"] = _round_or_none(frame_us, 1)
    plain_gbps = plain.gbps() if plain else None
    curve_gbps = curve.gbps() if curve else None
    out[f"curve_over_libsodium_{label}"] = same_run_ratio(curve_gbps, limit)
    if plain_gbps:
        out[f"curve_limit_over_plain_{label}"] = round(min(1.0, limit / plain_gbps), 4)
    plain_cpu = plain.cpu_us_per_message() if plain else None
    curve_cpu = curve.cpu_us_per_message() if curve else None
    if plain_cpu:
        out[f"curve_cpu_limit_over_plain_{label}"] = round(
            plain_cpu / (plain_cpu + box.both_us()), 4
        )
    if plain_cpu and curve_cpu:
        extra = curve_cpu - plain_cpu
        out[f"curve_extra_cpu_us_{label}"] = round(extra, 1)
        out[f"curve_extra_over_crypto_{label}"] = round(extra / box.both_us(), 4)
        if frame_us:
            out[f"curve_extra_over_frame_{label}"] = round(extra / frame_us, 4)
    return out
