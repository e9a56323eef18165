"""``python -m zpipe serve``: an OpenAI-compatible HTTP endpoint for a causal language model."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path
from typing import Any

from zpipe._errors import ConfigError, ZpipeError
from zpipe.cli.common import existing_dir, positive_int, seconds
from zpipe.log import LOG_LEVELS, configure_logging

_DESCRIPTION = """\
Serve a Hugging Face causal language model checkpoint (a directory with
config.json, safetensors weights and, for text and chat, the tokenizer's files)
over OpenAI's HTTP API: GET /v1/models, POST /v1/completions and
POST /v1/chat/completions, streamed (server-sent events) or not. Any OpenAI
client works against it, e.g. OpenAI(base_url="http://127.0.0.1:8000/v1",
api_key="unused").

Without --coordinator the model runs in this one process (transformers). With
--coordinator it runs pipelined across that cluster's stages: one long-lived
generation run serves every request (sequences join between its steps); each
stage reads the checkpoint directory at the same path.
"""

_EPILOG = """\
example:
  python -m zpipe serve --model ./tiny-lm --port 8000
  python -m zpipe serve --model /models/tiny-lm --coordinator tcp://hub:5555 --stages 3
  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
       -d '{"model": "tiny-lm", "prompt": "hello", "max_tokens": 8}'
"""

DEFAULT_PORT = 8000
DEFAULT_CLUSTER_STAGES = 2  # as python -m zpipe generate --coordinator
DEFAULT_MAX_SEQUENCES = 8


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m zpipe serve",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--model",
        required=True,
        type=Path,
        metavar="DIR",
        help="a Hugging Face checkpoint directory (config.json, safetensors, tokenizer)",
    )
    parser.add_argument(
        "--model-name",
        default=None,
        metavar="NAME",
        help="the id clients give as 'model' (default: the directory's name)",
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default: 127.0.0.1, this machine only; the "
        "endpoint has no authentication)",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=DEFAULT_PORT,
        help=f"TCP port; 0 picks a free one (default: {DEFAULT_PORT})",
    )
    parser.add_argument(
        "--max-context",
        type=positive_int,
        default=None,
        metavar="TOKENS",
        help="prompt plus completion tokens per request, at most (default: the "
        "model's max_position_embeddings)",
    )
    parser.add_argument(
        "--token-timeout",
        type=seconds,
        default=120.0,
        metavar="S",
        help="give up on a request whose next token takes longer than S seconds: "
        "504, or an error event in a stream (default: 120)",
    )
    cluster = parser.add_argument_group("serving through a cluster")
    cluster.add_argument(
        "--coordinator",
        metavar="EP",
        default=None,
        help="generate on the stages of the coordinator at EP (e.g. tcp://hub:5555) "
        "instead of in this process",
    )
    cluster.add_argument(
        "--keys",
        type=existing_dir,
        default=None,
        metavar="DIR",
        help="with --coordinator: the directory of CurveZMQ key pairs (the client's)",
    )
    cluster.add_argument(
        "--stages",
        type=positive_int,
        default=None,
        metavar="N",
        help="pipeline stages: with --coordinator, how many of the cluster's stages "
        f"hold the model (default: {DEFAULT_CLUSTER_STAGES}); without it only 1",
    )
    cluster.add_argument(
        "--max-sequences",
        type=positive_int,
        default=None,
        metavar="N",
        help="with --coordinator: requests generating at once; more wait their turn on "
        f"the first stage (default: {DEFAULT_MAX_SEQUENCES})",
    )
    cluster.add_argument(
        "--wait-for-stages",
        type=seconds,
        default=None,
        metavar="S",
        help="with --coordinator: how long the coordinator waits for the stages to "
        "register when the run starts (default: 30)",
    )
    parser.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default="info",
        help="log level of zpipe and the web server (default: info: one line per request)",
    )
    return parser


def cluster_settings(args: argparse.Namespace) -> dict[str, Any] | None:
    """The generation run's settings (GenerateOptions' keywords) with --coordinator,
    None without it; ConfigError for a cluster flag given without it."""
    if args.coordinator is None:
        given = [
            flag
            for flag, value in (
                ("--keys", args.keys),
                ("--max-sequences", args.max_sequences),
                ("--wait-for-stages", args.wait_for_stages),
            )
            if value is not None
        ]
        if given:
            raise ConfigError(f"{', '.join(given)} only go with --coordinator")
        if args.stages not in (None, 1):
            raise ConfigError(
                "--stages above 1 needs --coordinator: without it the model runs in this process"
            )
        return None
    settings: dict[str, Any] = {
        "stages": args.stages or DEFAULT_CLUSTER_STAGES,
        "max_sequences": args.max_sequences or DEFAULT_MAX_SEQUENCES,
        "token_timeout_s": args.token_timeout,
    }
    if args.max_context is not None:
        settings["max_context"] = args.max_context
    if args.wait_for_stages is not None:
        settings["wait_for_stages_s"] = args.wait_for_stages
    return settings


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = cluster_settings(args)
    except ConfigError as exc:
        print(f"zpipe serve: error: {exc}", file=sys.stderr)
        return 2
    if not 0 <= args.port <= 65535:
        print(f"zpipe serve: error: --port {args.port} is not a TCP port", file=sys.stderr)
        return 2
    try:
        from zpipe.serve.app import build_app
        from zpipe.serve.server import bind, url_of, uvicorn_server
    except ImportError as exc:
        print(
            f"zpipe serve: error: {exc}; install the serve extra: pip install 'zpipe[serve]'",
            file=sys.stderr,
        )
        return 1
    try:
        backend = _backend(args, settings)
    except (ConfigError, OSError, ValueError) as exc:
        print(f"zpipe serve: error: cannot load {args.model}: {exc}", file=sys.stderr)
        return 1
    try:
        sock = bind(args.host, args.port)
    except OSError as exc:
        print(
            f"zpipe serve: error: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr
        )
        return 1
    configure_logging(level=args.log_level, role="serve")
    app = build_app(backend, token_timeout=args.token_timeout)
    server = uvicorn_server(app, log_level=args.log_level)
    where = "" if settings is None else f" on {settings['stages']} stages of {args.coordinator}"
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then raises the signal
    # again for the handler that was there before; this one makes that a clean exit
    stopped: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: stopped.append(signum))

    async def serve() -> int:
        start = getattr(backend, "start", None)
        if start is not None:  # the cluster's run: started before the URL is printed
            try:
                await start()
            except ZpipeError as exc:
                await backend.aclose()
                print(f"zpipe serve: error: {exc}", file=sys.stderr)
                return 1
        print(f"zpipe serve: model {backend.model_id!r}{where} at {url_of(sock)}", flush=True)
        await server.serve(sockets=[sock])  # the lifespan closes the backend
        return 0

    try:
        code = asyncio.run(serve())
    finally:
        sock.close()
        close = getattr(backend, "close", None)
        if close is not None:
            close()
    if code == 0:
        print("zpipe serve: stopped", flush=True)
    return code


def _backend(args: argparse.Namespace, settings: dict[str, Any] | None) -> Any:
    if settings is None:
        from zpipe.serve.transformers_backend import TransformersBackend

        return TransformersBackend.from_pretrained(
            args.model, model_id=args.model_name, max_context=args.max_context
        )
    from zpipe.client import PipelineClient
    from zpipe.serve.cluster_backend import ClusterBackend

    client = PipelineClient(args.coordinator, keys_dir=args.keys)
    return ClusterBackend.from_checkpoint(args.model, client, model_id=args.model_name, **settings)


if __name__ == "__main__":
    sys.exit(main())
