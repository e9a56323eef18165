"""``bench/generate.py``'s baseline: transformers' single-process ``generate``, in a
process of its own (its peak memory is its own), on the same checkpoint and prompts.

Run by the bench as ``python bench/_generate_hf.py SETTINGS.json``; prints one JSON
object: the median seconds of ``generate`` at the batch of every prompt for 1 and for
``new_tokens`` new tokens (and the CPU seconds they took), greedy tokens (batched and
one sequence at a time), and resident memory (``VmRSS`` before the model was
loaded, ``VmHWM`` over the timed runs, the load's own transient left out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._generate_memory import reset_peak, status_kib


def _generate(model: Any, ids: Any, new_tokens: int) -> Any:
    import torch

    with torch.no_grad():
        return model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )


def run(settings: dict[str, Any]) -> dict[str, Any]:
    import torch
    import transformers

    if settings.get("threads"):
        torch.set_num_threads(int(settings["threads"]))
    rss_before = status_kib("VmRSS")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        settings["directory"], dtype=torch.float32
    ).eval()
    prompts: list[list[int]] = settings["prompts"]
    new_tokens = int(settings["new_tokens"])
    ids = torch.tensor(prompts)  # equal lengths: no padding
    _generate(model, ids, 2)  # warm-up
    peak_reset = reset_peak()
    times: dict[int, list[float]] = {1: [], new_tokens: []}
    cpu: dict[int, list[float]] = {1: [], new_tokens: []}
    batched: list[list[int]] = []
    for _ in range(int(settings["repeats"])):
        for n in (1, new_tokens):
            start, cpu_start = time.perf_counter(), time.process_time()
            out = _generate(model, ids, n)
            times[n].append(time.perf_counter() - start)
            cpu[n].append(time.process_time() - cpu_start)
            if n == new_tokens:
                batched = out[:, ids.shape[1] :].tolist()
    peak = status_kib("VmHWM")
    single = [
        _generate(model, ids[i : i + 1], new_tokens)[0, ids.shape[1] :].tolist()
        for i in range(len(prompts))
    ]
    return {
        "threads": torch.get_num_threads(),
        "ttft_s": statistics.median(times[1]),
        "generate_s": statistics.median(times[new_tokens]),
        "times_1": times[1],
        "times_n": times[new_tokens],
        "cpu_1": cpu[1],
        "cpu_n": cpu[new_tokens],
        "tokens_batched": batched,
        "tokens_single": single,
        "rss_before_kib": rss_before,
        "peak_kib": peak,
        "peak_reset": peak_reset,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("settings", type=Path, help="the JSON settings bench/generate.py wrote")
    args = parser.parse_args(argv)
    print(json.dumps(run(json.loads(args.settings.read_text()))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
