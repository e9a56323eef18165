"""How long planning for generation takes at 16 devices, and what the fixed order gives up.

A Llama-2-7B-shaped model (32 blocks, fp16; units: the embedding, each block,
the norm with the head) with synthetic times on a reference device, over 16
devices in 1, 2, 4, 8 and 16 kinds (speed, memory, access link), and 8
devices of 8 kinds, for 1, 4 and 32 sequences in flight. For each case: the
solve time of ``plan_generation`` as it chooses (exact over categories while
the state space is small, else the fixed orders), and, where the exact search
is small enough to run here, the fixed orders' tokens/s over the exact plan's.

Prints one JSON line per case and a summary with the slowest solve
(``max_solve_s``) and the worst ``fixed_over_exact_tokens_per_s``.

Run: ``.venv/bin/python bench/plan_generation.py`` (about a minute on two cores).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import emit, loadavg, summary
from zpipe.planner import ClusterDevice, ClusterSpec
from zpipe.planner.generation import MAX_STATES, plan_generation
from zpipe.planner.generation_cost import GenerationUnit, GenerationWorkload

GB = 1_000_000_000
HIDDEN, LAYERS, VOCAB, KV_HEADS, HEAD_DIM = 4096, 32, 32000, 32, 128
FP16 = 2
# Decode is memory-bound: one step reads every weight once; 50 GB/s on the reference.
REFERENCE_BYTES_PER_S = 50e9
PREFILL_FLOPS_PER_S = 2e12


def llama7b_units(decode_batch: int, chunk: int) -> list[GenerationUnit]:
    block_w = (4 * HIDDEN * HIDDEN + 3 * HIDDEN * 11008) * FP16
    embed_w = head_w = VOCAB * HIDDEN * FP16
    kv = 2 * KV_HEADS * HEAD_DIM * FP16  # keys and values, per token, per block

    def unit(name: str, weights: int, kv_per_token: int, act: int, out: int) -> GenerationUnit:
        flops = 2 * weights / FP16 * chunk
        return GenerationUnit(
            name=name,
            weight_bytes=weights,
            kv_bytes_per_token=kv_per_token,
            activation_bytes_per_token=act,
            output_bytes_per_token=out,
            decode_time_s=weights / REFERENCE_BYTES_PER_S * (1 + 0.02 * decode_batch),
            prefill_time_s=flops / PREFILL_FLOPS_PER_S,
        )

    units = [unit("embed", embed_w, 0, HIDDEN * FP16, HIDDEN * FP16)]
    units += [
        unit(f"block{k}", block_w, kv, 4 * 11008 * FP16, HIDDEN * FP16) for k in range(LAYERS)
    ]
    units.append(unit("head", head_w, 0, VOCAB * 4, 8))
    return units


KINDS = (  # speed, memory GB, Mbit/s, latency ms
    (1.0, 4, 1000, 0.3),
    (0.5, 8, 300, 1.0),
    (2.0, 6, 1000, 0.3),
    (0.25, 16, 100, 3.0),
    (1.5, 3, 940, 0.5),
    (0.75, 12, 500, 2.0),
    (3.0, 5, 2500, 0.2),
    (1.25, 10, 800, 1.5),
)


def cluster(kinds: int, count: int = 16) -> ClusterSpec:
    devices = []
    for k in range(count):
        kind = k % kinds
        speed, memory, mbps, latency = KINDS[kind % len(KINDS)]
        # kinds past the table differ by a few percent: all 16 distinct at 16 kinds
        tweak = 1 + 0.03 * (kind // len(KINDS))
        devices.append(
            ClusterDevice(f"d{k}", int(memory * GB), speed * tweak, mbps * tweak, latency)
        )
    return ClusterSpec(tuple(devices))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.parse_args(argv)
    units = llama7b_units(1, 256)
    worst_solve, worst_ratio = 0.0, 1.0
    for count, kinds in ((16, 1), (16, 2), (16, 4), (16, 8), (16, 16), (8, 8)):
        spec = cluster(kinds, count)
        for sequences in (1, 4, 32):
            workload = GenerationWorkload(
                sequences=sequences, max_context=1024, prefill_chunk=256, prompt_tokens=512
            )
            start = time.perf_counter()
            plan = plan_generation(units, spec, workload)
            solve_s = time.perf_counter() - start
            worst_solve = max(worst_solve, solve_s)
            row = {
                "devices": count,
                "kinds": kinds,
                "sequences": sequences,
                "solve_s": round(solve_s, 3),
                "exact": plan.predicted["planner_exact"] == 1.0,
                "stages": len(plan.stages),
                "decode_tokens_per_s": round(plan.predicted["decode_tokens_per_s"], 2),
                "ttft_s": round(plan.predicted["ttft_s"], 3),
                "states": int(plan.predicted["planner_states"]),
            }
            if plan.predicted["planner_exact"] == 1.0 or kinds <= 4 or count <= 8:
                fixed = plan_generation(units, spec, workload, exact=False)
                exact = plan
                if plan.predicted["planner_exact"] != 1.0:
                    start = time.perf_counter()
                    exact = plan_generation(units, spec, workload, exact=True)
                    row["exact_solve_s"] = round(time.perf_counter() - start, 3)
                ratio = (
                    fixed.predicted["decode_tokens_per_s"] / exact.predicted["decode_tokens_per_s"]
                )
                row["fixed_over_exact_tokens_per_s"] = round(ratio, 4)
                worst_ratio = min(worst_ratio, ratio)
            emit(row)
    summary(
        "plan_generation",
        max_solve_s=round(worst_solve, 3),
        fixed_over_exact_tokens_per_s=round(worst_ratio, 4),
        max_states=MAX_STATES,
        loadavg=loadavg(),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
