"""``python -m zpipe import KIND SRC DEST``: convert a timm or Hugging Face checkpoint.

The conversion itself is zpipe.models.importers; this writes its result: the
weights in zpipe's layout and the spec that loads them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from zpipe._errors import ZpipeError
from zpipe.models.importers import IMPORTERS, import_checkpoint, read_checkpoint
from zpipe.models.weights import SAFETENSORS_SUFFIXES, TORCH_SUFFIXES, write_state

PROG = "python -m zpipe import"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Convert a timm or Hugging Face checkpoint into zpipe's weights layout, "
        "and write the model spec that loads it.",
    )
    parser.add_argument("kind", choices=list(IMPORTERS), help="the checkpoint's library and model")
    parser.add_argument(
        "source",
        metavar="SRC",
        help="the checkpoint: a .safetensors/.bin/.pt file, or a directory holding "
        "model.safetensors or pytorch_model.bin (and config.json)",
    )
    parser.add_argument(
        "dest", metavar="DEST", help="the zpipe weights file to write (.safetensors or .pt)"
    )
    parser.add_argument(
        "--heads",
        type=int,
        default=None,
        help="attention heads (default: config.json's num_attention_heads / num_heads)",
    )
    parser.add_argument(
        "--config",
        default=None,
        metavar="JSON",
        help="the checkpoint's config.json when it does not lie beside it",
    )
    parser.add_argument(
        "--spec",
        default=None,
        metavar="FILE",
        help="where to write the model spec as JSON (default: DEST with suffix .spec.json)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    dest = Path(args.dest)
    if dest.suffix not in (*SAFETENSORS_SUFFIXES, *TORCH_SUFFIXES):
        parser.error(f"DEST {dest}: the suffix must be .safetensors, .pt, .pth or .bin")
    if not dest.parent.is_dir():
        parser.error(f"DEST {dest}: the directory {dest.parent} does not exist")
    try:
        state, config = read_checkpoint(args.source)
        if args.config is not None:
            config = json.loads(Path(args.config).read_text())
        imported = import_checkpoint(args.kind, state, config=config, heads=args.heads)
        write_state(imported.state, dest)
        spec = imported.spec(weights=str(dest))
        spec_path = Path(args.spec) if args.spec else dest.with_suffix(".spec.json")
        spec_path.write_text(json.dumps(spec.to_dict(), indent=2) + "\n")
    except (ZpipeError, OSError, ValueError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {len(imported.state)} tensors to {dest} and the spec to {spec_path}")
    print(json.dumps(imported.config))
    if imported.dropped:
        shown = ", ".join(imported.dropped[:8])
        more = f" and {len(imported.dropped) - 8} more" if len(imported.dropped) > 8 else ""
        print(f"not loaded (no place in zpipe's model): {shown}{more}")
    return 0
