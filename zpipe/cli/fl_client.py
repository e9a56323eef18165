"""``python -m zpipe fl-client``: a federated client training on its digits shard.

The client itself is :class:`zpipe.federated.net_client.FederatedClient`; this
module is the command's flags and its run. ``--pipeline-home nx,tx2`` trains every
task on a pipeline over emulated devices of those classes, planned by Eco-FL
(:class:`~zpipe.federated.pipeline_trainer.PipelineTrainer` with ``home=``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from zpipe._errors import ConfigError
from zpipe.cli.common import (
    existing_dir,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from zpipe.cli.fl_run import run_net_command
from zpipe.federated.home_plan import CLASSES_BY_NAME
from zpipe.federated.home_resched import DEFAULT_THRESHOLD
from zpipe.federated.net_client import (
    CLIENT_KEY_NAME,
    SERVER_KEY_NAME,
    FederatedClient,
    NetClientConfig,
)
from zpipe.transport.sockets import validate_endpoint


def _classes(text: str) -> tuple[int, ...]:
    try:
        values = tuple(sorted({int(t) for t in text.split(",") if t.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list") from None
    if not values:
        raise argparse.ArgumentTypeError("name at least one class")
    return values


def _delay_change(text: str) -> tuple[int, float]:
    first, sep, delay = text.partition(":")
    try:
        values = (int(first), float(delay))
    except ValueError:
        values = (-1, -1.0)
    if not sep or values[0] < 0 or not 0 <= values[1] < 1e6:
        raise argparse.ArgumentTypeError(f"{text!r} is not N:S (answer N >= 0, delay S >= 0)")
    return values


def _home(text: str) -> tuple[str, ...]:
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    unknown = [n for n in names if n not in CLASSES_BY_NAME]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected device classes from {sorted(CLASSES_BY_NAME)}, comma-separated"
        )
    return names


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m zpipe fl-client",
        description="A federated client: train on a local digits shard for an fl-server.",
    )
    p.add_argument("--server", required=True, help="the fl-server's endpoint, tcp://HOST:PORT")
    p.add_argument("--id", type=non_negative_int, required=True, help="this client's id")
    p.add_argument("--classes", type=_classes, default=(), help="e.g. 3,7 (default: 2 random)")
    p.add_argument("--samples", type=positive_int, default=40, help="images in the shard")
    p.add_argument("--seed", type=non_negative_int, default=0, help="seeds the shard")
    p.add_argument("--delay", type=non_negative_float, default=0.0, help="extra s per task")
    p.add_argument(
        "--delay-from",
        type=_delay_change,
        action="append",
        default=[],
        metavar="N:S",
        help="from the N-th answer (tasks and probes, from 0) on, the extra delay is S s",
    )
    p.add_argument("--profile-steps", type=positive_int, default=10)
    p.add_argument("--connect-timeout", type=positive_float, default=15.0, metavar="S")
    p.add_argument("--idle-timeout", type=positive_float, default=600.0, metavar="S")
    p.add_argument("--send-timeout", type=positive_float, default=5.0, metavar="S")
    p.add_argument(
        "--reconnect-timeout",
        type=positive_float,
        default=120.0,
        metavar="S",
        help="after a dropped connection, exit with an error if the server has not "
        "welcomed this client back within S s (it registers again, with back-off)",
    )
    p.add_argument("--keys", type=existing_dir, default=None, metavar="DIR", help="CurveZMQ keys")
    p.add_argument("--key-name", default=CLIENT_KEY_NAME, help="this client's key in --keys")
    p.add_argument("--server-key-name", default=SERVER_KEY_NAME, help="the server's key name")
    p.add_argument(
        "--pipeline-stages",
        type=non_negative_int,
        default=0,
        help="train on a zpipe pipeline of N local stage processes (1 or 2; default 0: numpy)",
    )
    p.add_argument(
        "--pipeline-home",
        type=_home,
        default=None,
        metavar="CLASSES",
        help="train on a pipeline over emulated devices of these classes (e.g. nx,tx2,nano; "
        "--slowdown 1, 1.5, 3), planned by Eco-FL's partition and order search; fl-server's "
        "model has 2 layers, so at most 2 of the devices get units",
    )
    p.add_argument(
        "--reschedule",
        type=non_negative_float,
        default=None,
        metavar="SHARE",
        help="with --pipeline-home: plan the home again between tasks when a device's "
        "measured speed departs from its history by more than SHARE (Eco-FL 4.4; default "
        f"{DEFAULT_THRESHOLD:g}); 0: keep the first plan",
    )
    return p


def config_from_args(args: argparse.Namespace) -> NetClientConfig:
    return NetClientConfig(
        server=validate_endpoint(args.server, flag="--server"),
        client=args.id,
        classes=args.classes,
        samples=args.samples,
        seed=args.seed,
        delay_s=args.delay,
        delay_changes=tuple(args.delay_from),
        profile_steps=args.profile_steps,
        connect_timeout_s=args.connect_timeout,
        idle_timeout_s=args.idle_timeout,
        send_timeout_s=args.send_timeout,
        reconnect_timeout_s=args.reconnect_timeout,
        keys_dir=args.keys,
        key_name=args.key_name,
        server_key_name=args.server_key_name,
        pipeline_stages=args.pipeline_stages,
    )


async def _run(
    config: NetClientConfig,
    home: tuple[str, ...] | None = None,
    reschedule: float | None = DEFAULT_THRESHOLD,
) -> str:
    from zpipe.lossy.data import load_digits_dataset

    dataset = load_digits_dataset()
    if config.pipeline_stages == 0 and home is None:
        return await _serve(FederatedClient(config, dataset))
    from zpipe.federated.pipeline_trainer import PipelineTrainer

    trainer = (
        PipelineTrainer(home=home, reschedule=reschedule)
        if home is not None
        else PipelineTrainer(config.pipeline_stages)
    )
    async with trainer as pipeline:
        return await _serve(FederatedClient(config, dataset, pipeline))


def _checked(
    args: argparse.Namespace,
) -> tuple[NetClientConfig, tuple[str, ...] | None, float | None]:
    config = config_from_args(args)
    if args.pipeline_home is not None and config.pipeline_stages:
        raise ConfigError("give --pipeline-stages or --pipeline-home, not both")
    if args.reschedule is not None and args.pipeline_home is None:
        raise ConfigError("--reschedule re-plans a --pipeline-home: give one")
    reschedule = DEFAULT_THRESHOLD if args.reschedule is None else args.reschedule or None
    return config, args.pipeline_home, reschedule


async def _serve(client: FederatedClient) -> str:
    try:
        client.open()
        return await client.serve()
    finally:
        client.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # the flags are checked inside, so a bad one is a one-line error, not a traceback
    status, _ = run_net_command("fl-client", lambda: _run(*_checked(args)))
    return status
