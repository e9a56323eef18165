"""The order in which ``--dist loadfile`` hands test files to the xdist workers.

xdist's loadfile scheduler hands out whole files, by default those with the most
tests first. In the integration and cluster lanes many of the slowest files hold
one or two tests (a Flower deployment, a recovery run, a real-link test), so they
came last and one worker ran the tail alone while the other had finished. Here
the files measured slowest go first, longest first (the longest-processing-time
rule), and every other file follows in xdist's own order, the most tests first.

``SLOWEST`` is measured (how, when and at what load: beside the list). It only
orders: a file that got faster or slower still runs, and a new slow file runs by
its number of tests until it is measured and listed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol


class _Item(Protocol):
    nodeid: str


# Seconds per file, rounded. Measured 2026-11-29 on the 2-core machine at load 25-36
# (other sessions' work; about 2.5 times CI's figures): the time between a worker's
# last result before the file and its last in it, in a run of CI's command
# (`-n 2 --dist loadfile`, xdist's own order, where these files ran last); marked
# "s42" or "s37", the serial figures of earlier sessions' notes (load 12-19) for
# files that had not run when the run was stopped at 50 minutes (27 files, most
# of them one-test cluster files, had not). test_real_links.py is a lower bound.
# Every file over 25 s of that run is listed.
SLOWEST: Mapping[str, float] = {
    "tests/cluster/test_flower_simulation.py": 512,
    "tests/cluster/test_real_links.py": 269,
    "tests/cluster/test_lazy_torch.py": 200,
    "tests/cluster/test_flower_deploy_auth.py": 151,  # s42
    "tests/cluster/test_bench_imported_vit.py": 99,
    "tests/cluster/test_secure_cluster.py": 84,
    "tests/cluster/test_generation_recovery.py": 62,
    "tests/cluster/test_parent_watch.py": 49,
    "tests/cluster/test_lossy_run_control.py": 43,
    "tests/cluster/test_lossy_stage_death.py": 42,
    "tests/cluster/test_bulk_cluster.py": 39,  # s42
    "tests/cluster/test_zygote.py": 30,
    "tests/cluster/test_serve_command.py": 30,
    "tests/cluster/test_coordinator_restart_global.py": 29,  # s37
    "tests/cluster/test_federated_home_resched.py": 28,
    "tests/cluster/test_coordinator_restart.py": 28,
    "tests/cluster/test_serve_cluster.py": 25,
}


def file_of(nodeid: str) -> str:
    """The file a test belongs to: xdist's loadfile scope (the node id up to ``::``)."""
    return nodeid.split("::", 1)[0]


def slowest_files_first(
    items: Sequence[_Item], seconds: Mapping[str, float] = SLOWEST
) -> list[_Item]:
    """``items`` grouped by file: the files of ``seconds`` first, the longest first,
    then the others with the most tests first; within a file the order is kept."""
    by_file: dict[str, list[_Item]] = {}
    for item in items:
        by_file.setdefault(file_of(item.nodeid), []).append(item)
    order = sorted(
        by_file,
        key=lambda f: (f not in seconds, -seconds.get(f, 0.0), -len(by_file[f])),
    )
    return [item for f in order for item in by_file[f]]
