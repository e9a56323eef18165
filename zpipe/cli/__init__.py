"""Every zpipe command: ``python -m zpipe COMMAND`` (or the ``zpipe`` script).

Each command lives in its own module of this package with a parser and a
``main(argv) -> int``; this one only dispatches, so ``python -m zpipe --help``
stays fast (no torch import). Nothing outside ``zpipe.cli`` imports a command
module (an import-linter contract). The process commands keep their own entry
points too, because code spawns them: ``python -m zpipe.coordinator``,
``python -m zpipe.stage`` and ``python -m zpipe.lossy`` are thin forwards to
``python -m zpipe coordinator``, ``stage`` and ``lossy``.
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
        "zpipe.cli.demo",
        "pipelined inference across emulated heterogeneous devices on this machine",
    ),
    "train": Command(
        "zpipe.cli.train", "train a built-in model with pipeline parallelism (GPipe or 1F1B-Sync)"
    ),
    "coordinator": Command(
        "zpipe.cli.coordinator", "run the coordinator: membership, plans, recovery"
    ),
    "stage": Command("zpipe.cli.stage", "run one pipeline stage on this device"),
    "profile": Command(
        "zpipe.cli.profile",
        "measure a model's units on this device (time, output, weights, memory)",
    ),
    "plan": Command(
        "zpipe.cli.plan", "choose devices, order and unit ranges from a profile and a cluster file"
    ),
    "keys": Command("zpipe.cli.keys", "generate CurveZMQ key pairs for a secure cluster"),
    "lossy": Command(
        "zpipe.cli.lossy", "EdgePipe lossy-link training experiments (JSON and plots)"
    ),
    "fl-sim": Command(
        "zpipe.cli.fl_sim", "Eco-FL grouped federated learning vs baselines, simulated time"
    ),
    "import": Command(
        "zpipe.cli.import_checkpoint",
        "convert a timm or Hugging Face ViT / BERT checkpoint into zpipe's weights layout",
    ),
    "fl-server": Command(
        "zpipe.cli.fl_server", "serve Eco-FL (or a baseline) to fl-client processes"
    ),
    "fl-client": Command("zpipe.cli.fl_client", "a federated client training on its digits shard"),
    "serve": Command(
        "zpipe.cli.serve", "an OpenAI-compatible HTTP endpoint for a causal language model"
    ),
    "generate": Command(
        "zpipe.cli.generate", "stream a causal language model's tokens from a pipeline of stages"
    ),
    "end-run": Command(
        "zpipe.cli.end_run", "end a run on a coordinator (one whose client is gone)"
    ),
}


def usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: python -m zpipe COMMAND [ARGS]   (or: zpipe COMMAND [ARGS])", "", "commands:"]
    lines += [f"  {name:<{width}}  {command.summary}" for name, command in COMMANDS.items()]
    lines += [
        "",
        "run 'python -m zpipe COMMAND --help' for a command's flags; the processes also run as",
        "python -m zpipe.coordinator, python -m zpipe.stage and python -m zpipe.lossy",
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
