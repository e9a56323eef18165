"""bench/_relay_counts.py's strace summary: the relay's threads between the marks, by
role, the feeder's process left out."""

from __future__ import annotations

import json
from pathlib import Path

from bench import _relay_counts


def test_strace_summary_counts_the_relays_threads_between_the_marks(tmp_path: Path) -> None:
    relay, compute, feeder, feeder_thread = 100, 101, 200, 201
    (tmp_path / f"t.{relay}").write_text(
        "10.0 getpid() = 100\n"
        f"10.1 vfork() = {feeder}\n"
        "11.0 getpgrp() = 1\n"
        "11.1 futex(0x1, FUTEX_WAKE, 1) = 1\n"
        "11.2 epoll_pwait(3, <unfinished ...>\n"
        "11.3 <... epoll_pwait resumed>[], 8, 0, NULL, 8) = 0\n"
        "12.0 getpgrp() = 1\n"
        "12.1 futex(0x1, FUTEX_WAKE, 1) = 1\n"
    )
    (tmp_path / f"t.{compute}").write_text("11.5 futex(0x2, FUTEX_WAIT, 0) = 0\n")
    (tmp_path / f"t.{feeder}").write_text(
        '10.2 execve("/bin/python", ["python", "bench/_relay_counts.py", "--feed"]) = 0\n'
        f"10.3 clone3({{flags=CLONE_VM}}, 88) = {feeder_thread}\n"
        "11.5 sendto(5, ...) = 100\n"
    )
    (tmp_path / f"t.{feeder_thread}").write_text("11.6 futex(0x3, FUTEX_WAKE, 1) = 1\n")
    (tmp_path / "threads.json").write_text(
        json.dumps({str(relay): "loop", str(compute): "compute"})
    )
    calls = _relay_counts.strace_summary(tmp_path)
    # the marks themselves and what lies outside them are not counted, nor the feeder's
    assert calls["futex"] == 2
    assert calls["epoll_pwait"] == 1  # a call split by a switch counts once
    assert calls["loop:futex"] == 1 and calls["compute:futex"] == 1
    assert "sendto" not in calls and "getpid" not in calls and "getpgrp" not in calls
