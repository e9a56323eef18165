"""Results of ``bench/transport.py``: one path and size's runs, and the JSON line
it prints (split out of that module to keep it small; behaviour unchanged)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from bench._common import thread_cpu_by_role, thread_switches

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
