"""``python -m zpipe COMMAND`` (or the ``zpipe`` script): every zpipe command.

Each command lives in its own module with a ``main(argv) -> int``; this one only
dispatches, so ``python -m zpipe --help`` stays fast (no torch import). The
process commands keep their own entry points too, because code spawns them:
``python -m zpipe.coordinator``, ``python -m zpipe.stage`` and
``python -m zpipe.lossy.experiment`` are the same as ``python -m zpipe coordinator``,
``stage`` and ``lossy``.
"""

from __future__ import annotations

import importlib
import sys
from typing import NamedTuple


class Command(NamedTuple):
    module: str  # holds main(argv: list[str] | None) -> int
    summary: str


COMMANDS: dict[str, Command] = {
    "demo": Command(
        "zpipe.demo", "pipelined inference across emulated heterogeneous devices on this machine"
    ),
    "train": Command(
        "zpipe.train_cli", "train a built-in model with pipeline parallelism (GPipe or 1F1B-Sync)"
    ),
    "coordinator": Command(
        "zpipe.coordinator.__main__", "run the coordinator: membership, plans, recovery"
    ),
    "stage": Command("zpipe.stage.__main__", "run one pipeline stage on this device"),
    "profile": Command(
        "zpipe.profiler", "measure a model's units on this device (time, output, weights, memory)"
    ),
    "plan": Command(
        "zpipe.plan_cli", "choose devices, order and unit ranges from a profile and a cluster file"
    ),
    "keys": Command("zpipe.keys_cli", "generate CurveZMQ key pairs for a secure cluster"),
    "lossy": Command(
        "zpipe.lossy.experiment", "EdgePipe lossy-link training experiments (JSON and plots)"
    ),
    "fl-sim": Command(
        "zpipe.federated.cli", "Eco-FL grouped federated learning vs baselines, simulated time"
    ),
    "import": Command(
        "zpipe.import_cli",
        "convert a timm or Hugging Face ViT / BERT checkpoint into zpipe's weights layout",
    ),
    "fl-server": Command(
        "zpipe.federated.net_server_cli", "serve Eco-FL (or a baseline) to fl-client processes"
    ),
    "fl-client": Command(
        "zpipe.federated.net_client", "a federated client training on its digits shard"
    ),
}


def usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: python -m zpipe COMMAND [ARGS]   (or: zpipe COMMAND [ARGS])", "", "commands:"]
    lines += [f"  {name:<{width}}  {command.summary}" for name, command in COMMANDS.items()]
    lines += [
        "",
        "run 'python -m zpipe COMMAND --help' for a command's flags; the processes also run as",
        "python -m zpipe.coordinator, python -m zpipe.stage and python -m zpipe.lossy.experiment",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args:
        print(f"python -m zpipe: a command is required\n\n{usage()}", file=sys.stderr)
        return 2
    if args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = args[0], args[1:]
    command = COMMANDS.get(name)
    if command is None:
        print(f"python -m zpipe: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    return int(importlib.import_module(command.module).main(rest))


if __name__ == "__main__":
    sys.exit(main())
