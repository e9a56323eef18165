"""``python -m zpipe fl-server``'s flags: what :class:`NetServerConfig` a command line gives.

The server itself is :mod:`zpipe.federated.net_server`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from zpipe.cli.fl_run import run_net_command
from zpipe.cli.fl_sim import _alpha, _lambda
from zpipe.federated.grouping import GroupingPolicy
from zpipe.federated.net_commands import NetServerConfig
from zpipe.federated.net_server import FederatedShell
from zpipe.federated.net_wire import SERVER_KEY_NAME
from zpipe.federated.server import METHODS, ServerConfig
from zpipe.transport.sockets import validate_endpoint


def build_parser() -> argparse.ArgumentParser:
    from zpipe.cli.common import (
        existing_dir,
        non_negative_float,
        non_negative_int,
        positive_float,
        positive_int,
    )
    from zpipe.federated.aggregation import STALENESS_FUNCTIONS

    defaults = NetServerConfig()
    p = argparse.ArgumentParser(
        prog="python -m zpipe fl-server",
        description="Serve federated learning (Eco-FL or a baseline) to fl-client processes.",
    )
    p.add_argument("--bind", default="tcp://0.0.0.0:5600", help="ZeroMQ endpoint to listen on")
    p.add_argument("--clients", type=positive_int, default=3, help="registrations to await")
    p.add_argument("--method", choices=METHODS, default="ecofl")
    p.add_argument("--groups", type=positive_int, default=2, help="latency groups")
    p.add_argument("--concurrent", type=positive_int, default=20, help="K: clients in flight")
    p.add_argument("--lam", type=_lambda, default=10.0, help="eq. 4's lambda, s (inf allowed)")
    p.add_argument("--rt-factor", type=positive_float, default=1.0, help="RT^g / K-means radius")
    p.add_argument(
        "--rt-floor", type=non_negative_float, default=0.1, help="RT^g at least this x centre"
    )
    p.add_argument("--alpha", type=_alpha, default=0.6, help="FedAsync mixing alpha")
    p.add_argument("--staleness", choices=STALENESS_FUNCTIONS, default="polynomial")
    p.add_argument("--staleness-a", type=non_negative_float, default=0.5)
    p.add_argument("--intra-syncs", type=positive_int, default=1)
    p.add_argument("--hidden", type=positive_int, default=defaults.hidden, help="MLP width")
    p.add_argument("--local-steps", type=positive_int, default=defaults.local_steps)
    p.add_argument("--batch-size", type=positive_int, default=defaults.batch_size)
    p.add_argument("--lr", type=positive_float, default=defaults.lr)
    p.add_argument("--mu", type=non_negative_float, default=defaults.mu, help="FedProx mu")
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--updates", type=positive_int, default=50, help="global updates to run")
    p.add_argument("--duration", type=positive_float, default=600.0, help="wall-clock limit, s")
    p.add_argument("--eval-every", type=positive_int, default=5, help="updates between evals")
    p.add_argument("--register-timeout", type=positive_float, default=60.0, metavar="S")
    p.add_argument(
        "--task-timeout",
        type=positive_float,
        default=30.0,
        metavar="S",
        help="the longest a task may stay unanswered (a client never measured waits this long)",
    )
    p.add_argument(
        "--task-floor",
        type=positive_float,
        default=defaults.task_floor_s,
        metavar="S",
        help="a measured client's task is taken back after 4x its slowest recent latency, "
        "never sooner than S s",
    )
    p.add_argument(
        "--ids-per-address",
        type=positive_int,
        default=defaults.ids_per_address,
        metavar="N",
        help="without --keys: live client ids one peer address may hold (a key holds one)",
    )
    p.add_argument(
        "--release-after",
        type=positive_float,
        default=defaults.release_after_s,
        metavar="S",
        help="release the id of a set-aside client silent for S s (a closed connection's "
        "at once): its address may register another; after two releases for silence, that "
        "id (or any id of that address) gets no task until it answers a probe",
    )
    p.add_argument(
        "--probe-interval",
        type=non_negative_float,
        default=defaults.probe_interval_s,
        metavar="S",
        help="probe each dropped or set-aside client every S s, for re-admission (0: never)",
    )
    p.add_argument(
        "--probe-timeout",
        type=positive_float,
        default=defaults.probe_timeout_s,
        metavar="S",
        help="an unanswered probe measures S s",
    )
    p.add_argument("--send-timeout", type=positive_float, default=5.0, metavar="S")
    p.add_argument("--keys", type=existing_dir, default=None, metavar="DIR", help="CurveZMQ keys")
    p.add_argument("--key-name", default=SERVER_KEY_NAME, help="this server's key in --keys")
    p.add_argument("--trace", type=Path, default=None, help="JSON lines of the server's inputs")
    return p


def config_from_args(args: argparse.Namespace) -> NetServerConfig:
    return NetServerConfig(
        server=ServerConfig(
            method=args.method,
            max_concurrent=args.concurrent,
            alpha=args.alpha,
            staleness=args.staleness,
            staleness_a=args.staleness_a,
            intra_syncs=args.intra_syncs,
            grouping=GroupingPolicy(
                n_groups=args.groups,
                lam=args.lam,
                rt_factor=args.rt_factor,
                rt_floor_fraction=args.rt_floor,
                seed=args.seed,
            ),
            seed=args.seed,
        ),
        bind=validate_endpoint(args.bind, flag="--bind"),
        clients=args.clients,
        hidden=args.hidden,
        local_steps=args.local_steps,
        batch_size=args.batch_size,
        lr=args.lr,
        mu=args.mu,
        seed=args.seed,
        register_timeout_s=args.register_timeout,
        task_timeout_s=args.task_timeout,
        task_floor_s=args.task_floor,
        ids_per_address=args.ids_per_address,
        release_after_s=args.release_after,
        probe_interval_s=args.probe_interval,
        probe_timeout_s=args.probe_timeout,
        send_timeout_s=args.send_timeout,
        max_updates=args.updates,
        duration_s=args.duration,
        eval_every=args.eval_every,
        keys_dir=args.keys,
        key_name=args.key_name,
        trace=args.trace,
    )


async def _serve(config: NetServerConfig) -> dict[str, Any]:
    from zpipe.lossy.data import load_digits_dataset

    shell = FederatedShell(config, load_digits_dataset())
    try:
        shell.open()
        return await shell.serve()
    finally:
        shell.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # the flags are checked inside, so a bad one is a one-line error, not a traceback
    status, summary = run_net_command("fl-server", lambda: _serve(config_from_args(args)))
    if summary is not None:
        print(json.dumps(summary), flush=True)
    return status
