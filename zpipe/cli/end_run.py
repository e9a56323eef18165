"""``python -m zpipe end-run --coordinator tcp://hub:5555 RUN``: end a run by its id.

A coordinator runs one run at a time and refuses other clients' runs while one
is in flight (:class:`~zpipe.RunRefusedError` names it). A run whose client is
gone is ended by the coordinator itself when the next request comes, if the
client's connection dropped; this ends one whose client is still connected but
will never end it (a frozen process, a client on a host cut off), from a shell
instead of Python (:meth:`~zpipe.client.PipelineClient.end_run`). Prints each
stage's counters as JSON (none for a run that is not the coordinator's current one).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from zpipe._errors import ZpipeError
from zpipe.cli.common import non_negative_int


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m zpipe end-run",
        description="End a run on a coordinator, whatever client started it (one whose "
        "client is gone, which the coordinator refuses other runs for).",
    )
    parser.add_argument("run", type=non_negative_int, metavar="RUN", help="the run's id")
    parser.add_argument(
        "--coordinator", required=True, help="the coordinator's endpoint, e.g. tcp://hub:5555"
    )
    parser.add_argument("--keys", type=Path, default=None, help="CurveZMQ key directory")
    return parser


async def end_run(coordinator: str, run: int, keys: Path | None) -> dict[str, Any]:
    from zpipe.client import PipelineClient  # torch: only once the flags are good

    # it streams nothing: its sink (every client binds one) listens on loopback only
    async with PipelineClient(coordinator, keys_dir=keys, sink_bind="tcp://127.0.0.1:0") as client:
        return await client.end_run(run)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        stages = asyncio.run(end_run(args.coordinator, args.run, args.keys))
    except ZpipeError as exc:
        print(f"python -m zpipe end-run: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({"run": args.run, "stages": stages}, sort_keys=True, default=str))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
