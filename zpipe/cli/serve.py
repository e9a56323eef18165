"""``python -m zpipe serve``: an OpenAI-compatible HTTP endpoint for a causal language model."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

from zpipe._errors import ConfigError
from zpipe.cli.common import positive_int, seconds
from zpipe.log import LOG_LEVELS, configure_logging

_DESCRIPTION = """\
Serve a Hugging Face causal language model checkpoint (a directory with
config.json, safetensors weights and, for text and chat, the tokenizer's files)
over OpenAI's HTTP API: GET /v1/models, POST /v1/completions and
POST /v1/chat/completions, streamed (server-sent events) or not. Any OpenAI
client works against it, e.g. OpenAI(base_url="http://127.0.0.1:8000/v1",
api_key="unused").

Today the model runs in this one process (transformers). Pipelined serving
across stages arrives with the generation run kind; the endpoint stays the same.
"""

_EPILOG = """\
example:
  python -m zpipe serve --model ./tiny-lm --port 8000
  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
       -d '{"model": "tiny-lm", "prompt": "hello", "max_tokens": 8}'
"""

DEFAULT_PORT = 8000


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
    parser.add_argument(
        "--stages",
        type=positive_int,
        default=1,
        metavar="N",
        help="pipeline stages; only 1 for now (pipelined serving arrives with the "
        "generation run kind)",
    )
    parser.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default="info",
        help="log level of zpipe and the web server (default: info: one line per request)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.stages != 1:
        print(
            "zpipe serve: error: --stages must be 1 for now; pipelined serving across "
            "stages arrives with the generation run kind",
            file=sys.stderr,
        )
        return 2
    if not 0 <= args.port <= 65535:
        print(f"zpipe serve: error: --port {args.port} is not a TCP port", file=sys.stderr)
        return 2
    try:
        from zpipe.serve.app import build_app
        from zpipe.serve.server import bind, url_of, uvicorn_server
        from zpipe.serve.transformers_backend import TransformersBackend
    except ImportError as exc:
        print(
            f"zpipe serve: error: {exc}; install the serve extra: pip install 'zpipe[serve]'",
            file=sys.stderr,
        )
        return 1
    try:
        backend = TransformersBackend.from_pretrained(
            args.model, model_id=args.model_name, max_context=args.max_context
        )
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
    print(f"zpipe serve: model {backend.model_id!r} at {url_of(sock)}", flush=True)
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then raises the signal
    # again for the handler that was there before; this one makes that a clean exit
    stopped: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: stopped.append(signum))
    try:
        asyncio.run(server.serve(sockets=[sock]))
    finally:
        sock.close()
        backend.close()
    print("zpipe serve: stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
