"""``python -m zpipe COMMAND``: the demo and the utilities.

Commands:
  demo   pipelined inference across emulated heterogeneous devices on this machine
  keys   generate CurveZMQ key pairs for a secure cluster
  train  train a built-in model with pipeline parallelism

The coordinator and stages have their own entry points:
``python -m zpipe.coordinator`` and ``python -m zpipe.stage``.
"""

from __future__ import annotations

import sys

COMMANDS = {
    "demo": "pipelined inference across emulated heterogeneous devices on this machine",
    "keys": "generate CurveZMQ key pairs (python -m zpipe keys --dir DIR NAME ...)",
    "profile": "measure a model's units on this device (time, output, weights, memory)",
    "plan": "choose devices, order and unit ranges from a profile and a cluster file",
    "train": "train a built-in model with pipeline parallelism (GPipe or 1F1B-Sync)",
}


def _usage() -> str:
    lines = ["usage: python -m zpipe COMMAND [ARGS]", "", "commands:"]
    lines += [f"  {name:<6} {text}" for name, text in COMMANDS.items()]
    lines += [
        "",
        "processes: python -m zpipe.coordinator --help, python -m zpipe.stage --help",
        "run 'python -m zpipe COMMAND --help' for a command's flags",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print(f"python -m zpipe: a command is required\n\n{_usage()}", file=sys.stderr)
        return 2
    if args[0] in ("-h", "--help"):
        print(_usage())
        return 0
    command, rest = args[0], args[1:]
    if command == "demo":
        from zpipe.demo import main as demo_main

        return demo_main(rest)
    if command == "plan":
        from zpipe.plan_cli import main as plan_main

        return plan_main(rest)
    if command == "profile":
        from zpipe.profiler import main as profile_main

        return profile_main(rest)
    if command == "train":
        from zpipe.train_cli import main as train_main

        return train_main(rest)
    if command == "keys":
        from zpipe.keys_cli import main as keys_main

        return keys_main(rest)
    print(f"python -m zpipe: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
