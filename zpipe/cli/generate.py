"""``python -m zpipe generate``: stream a causal LM's tokens from a pipeline of stages.

    python -m zpipe generate --model /models/tiny-llama --prompt "hello" --local 3
    python -m zpipe generate --model DIR --prompt-ids 5,17,3 --coordinator tcp://hub:5555

With ``--local N`` (the default, 2) it starts a coordinator and N stages on this
machine; with ``--coordinator`` it runs on that cluster's stages (``--stages`` of
them). When the model directory has a tokenizer (``transformers``), prompts are
text and the first stage streams text (honouring ``--stop``); otherwise token ids
go in and come out. One prompt streams token by token; several print each
sequence when it ends.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from zpipe._errors import ConfigError, ZpipeError
from zpipe.cli.common import (
    existing_dir,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    unit_interval,
)
from zpipe.client import PipelineClient
from zpipe.cluster import LocalCluster
from zpipe.generation.params import SamplingParams, TokenEvent
from zpipe.models import ModelSpec
from zpipe.models.causal_lm import causal_lm_spec


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m zpipe generate",
        description="Generate text with a causal language model pipelined over stages, "
        "streaming each token to the terminal as the first stage sends it.",
    )
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument(
        "--model",
        type=existing_dir,
        help="a Hugging Face checkpoint directory (config.json and safetensors)",
    )
    model.add_argument(
        "--preset",
        choices=("gpt2-tiny", "llama-tiny"),
        help="a tiny built-in model with random weights (token ids only)",
    )
    prompts = parser.add_mutually_exclusive_group(required=True)
    prompts.add_argument(
        "--prompt",
        action="append",
        help="prompt text, tokenized with the model directory's tokenizer (repeat for "
        "several sequences)",
    )
    prompts.add_argument(
        "--prompt-ids",
        action="append",
        metavar="IDS",
        help="a prompt as comma-separated token ids, e.g. 5,17,3 (repeat for several)",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--local",
        type=positive_int,
        default=None,
        metavar="N",
        help="start a coordinator and N stages on this machine (default: 2)",
    )
    where.add_argument(
        "--coordinator", help="the coordinator of a running cluster, e.g. tcp://hub:5555"
    )
    parser.add_argument(
        "--stages",
        type=positive_int,
        default=None,
        help="stages of the cluster to run on (default: every local stage; with --coordinator: 2)",
    )
    parser.add_argument("--keys", type=Path, default=None, help="CurveZMQ key directory")
    parser.add_argument(
        "--max-tokens", type=positive_int, default=32, help="new tokens (default: 32)"
    )
    parser.add_argument(
        "--temperature",
        type=non_negative_float,
        default=0.0,
        help="0 is greedy (default); above 0 samples from a seeded generator",
    )
    parser.add_argument("--top-k", type=non_negative_int, default=0, help="0: no cut (default)")
    parser.add_argument(
        "--top-p", type=unit_interval, default=1.0, help="nucleus mass, 1 for none (default)"
    )
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    parser.add_argument(
        "--stop",
        action="append",
        metavar="TEXT",
        help="end a sequence where its text holds this string (repeatable; needs a tokenizer)",
    )
    parser.add_argument(
        "--chunk-tokens",
        type=positive_int,
        default=256,
        help="prefill tokens per pipeline step (default: 256)",
    )
    parser.add_argument(
        "--token-timeout",
        type=positive_float,
        default=120.0,
        metavar="S",
        help="the longest wait for the next token, in seconds (default: 120)",
    )
    return parser


def _tokenizer(directory: Path | None) -> Any:
    """The directory's tokenizer, or None (no directory, no tokenizer files, or no
    transformers installed)."""
    if directory is None:
        return None
    try:
        import transformers
    except ImportError:
        return None
    try:
        return transformers.AutoTokenizer.from_pretrained(str(directory))
    except (OSError, ValueError):
        return None


def _prompts(args: argparse.Namespace, tokenizer: Any) -> list[list[int]]:
    if args.prompt_ids is not None:
        out = []
        for text in args.prompt_ids:
            try:
                ids = [int(t) for t in text.split(",") if t.strip()]
            except ValueError:
                raise ConfigError(
                    f"--prompt-ids takes comma-separated integers, got {text!r}"
                ) from None
            if not ids:
                raise ConfigError("--prompt-ids: a prompt needs at least one token")
            out.append(ids)
        return out
    if tokenizer is None:
        raise ConfigError(
            "--prompt needs a model directory with a tokenizer (and transformers); "
            "give --prompt-ids instead"
        )
    return [list(tokenizer.encode(text)) for text in args.prompt]


class _Printer:
    """Streams one sequence's text (the first stage's, with a tokenizer) or ids as it
    grows; several sequences, each when it ends."""

    def __init__(self, text: bool, count: int) -> None:
        self.text = text
        self.count = count
        self.pieces: dict[int, list[str]] = {i: [] for i in range(count)}

    def event(self, event: TokenEvent) -> None:
        piece = event.text if self.text else f"{event.token} "
        self.pieces[event.sequence].append(piece)
        if self.count > 1:
            if event.finish_reason is not None:
                whole = "".join(self.pieces[event.sequence]).strip()
                print(f"[{event.sequence}] {whole}  [finished: {event.finish_reason}]", flush=True)
            return
        sys.stdout.write(piece)
        sys.stdout.flush()
        if event.finish_reason is not None:
            print(f"\n[finished: {event.finish_reason}]")


async def _stream(events: AsyncIterator[TokenEvent], printer: _Printer) -> None:
    async for event in events:
        printer.event(event)


def _run(
    args: argparse.Namespace, spec: ModelSpec, prompts: Sequence[list[int]], printer: _Printer
) -> None:
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=tuple(args.stop or ()),
    )
    settings: dict[str, Any] = {
        "text": printer.text,
        "chunk_tokens": args.chunk_tokens,
        "token_timeout_s": args.token_timeout,
        "max_sequences": max(8, len(prompts)),
    }
    if args.coordinator is not None:

        async def remote() -> None:
            async with PipelineClient(args.coordinator, keys_dir=args.keys) as client:
                stream = client.generate(spec, prompts, params, stages=args.stages or 2, **settings)
                await _stream(stream, printer)

        asyncio.run(remote())
        return
    local = args.local or 2
    with LocalCluster(local, keys_dir=args.keys, log_level="warning") as cluster:
        names = [d.name for d in cluster.devices][: args.stages or local]

        async def here() -> None:
            async with cluster.client() as client:
                stream = client.generate(spec, prompts, params, stage_names=names, **settings)
                await _stream(stream, printer)

        asyncio.run(here())


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.model is not None:
            spec = causal_lm_spec(args.model)
        else:
            spec = ModelSpec.preset(args.preset, seed=args.seed)
        tokenizer = _tokenizer(args.model)
        prompts = _prompts(args, tokenizer)
        if args.local is not None and args.stages is not None and args.stages > args.local:
            raise ConfigError(f"--stages {args.stages} exceeds the {args.local} local stages")
        if args.stop and tokenizer is None:
            raise ConfigError("--stop needs a model directory with a tokenizer")
        _run(args, spec, prompts, _Printer(tokenizer is not None, len(prompts)))
    except ZpipeError as exc:
        print(f"python -m zpipe generate: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
