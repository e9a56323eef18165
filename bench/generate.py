"""Pipelined generation against transformers' single-process ``generate``, same run.

A random-init Llama-style model (grouped-query attention; ``--hidden``,
``--layers``...) is saved as a checkpoint; ``--sequences`` prompts of
``--prompt-tokens`` random ids (equal lengths, so the baseline needs no padding).

Baseline (``bench/_generate_hf.py``, a process of its own, torch's own threads):
``generate`` at the batch of every prompt, greedy, for 1 new token (time to first
token) and for ``--new-tokens``; the median of ``--repeats``.

Pipeline: three stage processes (``LocalCluster``, ``--threads`` each) on this
machine, the units split by the coordinator's planner, one generation run per
setting (``--steps-in-flight`` micro-batches on the ring: by default 1, the S
sequences decoding as one batch as the baseline's do); in each, the same prompts
are submitted together and timed to their last event, for 1 and for
``--new-tokens`` tokens (warmed up first, median of ``--repeats``). Decode
tokens/s, in both: ``S * (N - 1) / (t_N - t_1)``.

Summary keys:

- ``decode_ratio_vs_hf``: the pipeline's decode tokens/s with ``S`` sequences in
  flight over the baseline's at the same batch (goal >= 0.8: two cores cannot beat
  one process; this measures the runtime's overhead);
- ``decode_cpu_ratio_vs_hf``: the baseline's CPU seconds per decoded token over
  the pipeline's (its three stage processes and this client together): the
  runtime's overhead as CPU, which a loaded machine moves far less than wall time
  (on a busy machine three processes get more CPU than one, which flatters the
  wall-clock ratio);
- ``s3_over_s1_tokens_per_s``: that pipeline's tokens/s over one sequence's;
- ``ttft_ratio_vs_hf``: the pipeline's time to the first token of every sequence
  over the baseline's (above 1: slower);
- ``largest_stage_memory_over_single``: the largest stage's memory over the
  baseline process's, each its peak resident set over the timed runs (``VmHWM``,
  reset after set-up) less its resident set before the model was loaded;
- ``memory_predicted_over_measured``: the coordinator's prediction for that stage
  with the safety margin (``--margin``, the coordinator's ``--memory-margin``),
  over it: weights, KV cache for ``max_sequences x max_context``, working set, and
  the runtime (torch's code pages and kernel workspaces that the first build and
  forward bring in: ``COMPUTE_RUNTIME_BYTES``, which a stage's room leaves out as
  it leaves out the base); ``memory_unmargined_over_measured`` without the margin.
  The memory row's ``phases_mib`` shows each stage's resident set over its base
  when registered, built, after the warm-up and after the timed runs (the
  resident set and peak over the base; anonymous and file-backed memory as they
  are), and ``predicted_parts_mib`` the prediction's parts;
- ``planned_over_even_tokens_per_s``: on emulated heterogeneous devices
  (``--hetero-slowdowns``, a second cluster), the planner's split over the even
  one, decode tokens/s with ``S`` sequences;
- ``greedy_equal_hf``: every sequence's tokens equal transformers' (one sequence
  at a time, as the tests compare);
- ``other_decode_ratio_vs_hf`` and ``other_decode_cpu_ratio_vs_hf``: the same two
  ratios with ``--also-steps-in-flight`` micro-batches on the ring (default 3: one
  group of sequences per stage, as on separate devices).

Output: JSON lines (the baseline, each pipeline setting), then the summary.
``--quick``: a small model and few tokens (its figures are the runtime's fixed
costs, not the headline; the cluster start-ups take most of its minutes). Run:
``.venv/bin/python bench/generate.py`` (a few minutes on two cores).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import emit, loadavg, on_alarm, summary
from bench._generate_memory import cpu_s, reset_peak, status_kib
from zpipe.client.runs.generation import GenerateOptions, GenerationRun
from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.coordinator.generation_plan import generation_units, generation_workload
from zpipe.generation.params import SamplingParams
from zpipe.models import ModelSpec
from zpipe.models.causal_lm import causal_lm_spec, read_causal_lm_config
from zpipe.planner.generation_cost import StageMemory, stage_memory
from zpipe.planner.memory import DEFAULT_MEMORY_MARGIN

BENCH = "generate"
STAGES = ("s0", "s1", "s2")


def _model(args: argparse.Namespace, directory: Path) -> ModelSpec:
    """A seeded random-init Llama-style checkpoint in ``directory``."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.prompt_tokens + args.new_tokens,
        tie_word_embeddings=False,
        # wide enough that greedy tokens vary (a near-uniform softmax makes ties)
        initializer_range=0.1,
        bos_token_id=0,
        eos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(args.seed)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(directory)
    return causal_lm_spec(directory)


def _prompts(args: argparse.Namespace) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(args.seed + 1)
    shape = (args.sequences, args.prompt_tokens)
    return torch.randint(1, args.vocab, shape, generator=g).tolist()


def _baseline(args: argparse.Namespace, directory: Path, prompts: list[list[int]]) -> Any:
    settings = {
        "directory": str(directory),
        "prompts": prompts,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "threads": args.hf_threads,
    }
    path = directory / "bench_settings.json"
    path.write_text(json.dumps(settings))
    script = Path(__file__).resolve().parent / "_generate_hf.py"
    done = subprocess.run(
        [sys.executable, str(script), str(path)],
        capture_output=True,
        text=True,
        timeout=args.timeout,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the transformers baseline failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


class _Timer:
    """One generation run on the cluster: batches of the prompts, timed to their last
    event, with the CPU seconds the stage processes and this client spent on them."""

    def __init__(self, run: GenerationRun, pids: Mapping[str, int]) -> None:
        self.run = run
        self.pids: dict[str, int | None] = {**pids, "client": None}  # None: this process
        self.next_id = 0
        self.cpu: list[float] = []  # of each batch, every process together
        self.by_process: list[dict[str, float]] = []  # of each batch, each process's

    def _cpu(self) -> dict[str, float]:
        return {name: cpu_s(pid) or 0.0 for name, pid in self.pids.items()}

    async def batch(
        self, prompts: Sequence[Sequence[int]], tokens: int
    ) -> tuple[float, list[list[int]]]:
        params = SamplingParams(max_tokens=tokens, stop_at_eos=False)
        ids = list(range(self.next_id, self.next_id + len(prompts)))
        self.next_id += len(prompts)
        out: dict[int, list[int]] = {i: [] for i in ids}
        start, cpu_start = time.perf_counter(), self._cpu()
        for i, prompt in zip(ids, prompts, strict=True):
            await self.run.submit(i, prompt, params)
        left = set(ids)
        while left:
            event = await self.run.next_event()
            out[event.sequence].append(event.token)
            if event.finish_reason is not None:
                left.discard(event.sequence)
        elapsed = time.perf_counter() - start
        cpu_end = self._cpu()
        self.by_process.append({n: cpu_end[n] - cpu_start[n] for n in cpu_end})
        self.cpu.append(sum(self.by_process[-1].values()))
        return elapsed, [out[i] for i in ids]


async def _pipeline(
    cluster: LocalCluster,
    spec: ModelSpec,
    prompts: list[list[int]],
    args: argparse.Namespace,
    *,
    steps_in_flight: int,
    partition: list[int] | None = None,
    memory_pids: dict[str, int] | None = None,
) -> dict[str, Any]:
    """Time 1 and ``new_tokens`` tokens of ``prompts`` together in one run; with
    ``memory_pids``, each stage's peak resident set over the timed batches."""
    options = GenerateOptions(
        stage_names=list(STAGES),
        partition=partition,
        max_context=args.prompt_tokens + args.new_tokens,
        max_sequences=len(prompts),
        steps_in_flight=steps_in_flight,
        chunk_tokens=args.prompt_tokens,
        token_timeout_s=120.0,
    )
    pids = memory_pids or {}
    async with cluster.client() as client:
        run = GenerationRun(client.connection, spec, options)
        ready = await run.start()
        phases = {"ready": _phase(pids)}  # built: the model loaded, nothing run
        try:
            timer = _Timer(run, {n: cluster.processes[n].pid for n in STAGES})
            await timer.batch(prompts, 2)  # warm-up: every stage's first steps
            phases["warm"] = _phase(pids)
            peaks_reset = all(reset_peak(pid) for pid in pids.values())
            t1, tn, c1, cn, tokens = [], [], [], [], []
            p1, pn = [], []  # each process's CPU seconds, the same batches
            for _ in range(args.repeats):
                t1.append((await timer.batch(prompts, 1))[0])
                c1.append(timer.cpu[-1])
                p1.append(timer.by_process[-1])
                elapsed, tokens = await timer.batch(prompts, args.new_tokens)
                tn.append(elapsed)
                cn.append(timer.cpu[-1])
                pn.append(timer.by_process[-1])
            peaks = {n: status_kib("VmHWM", pid) for n, pid in pids.items()}
            phases["timed"] = _phase(pids)
        finally:
            await run.close()
    return {
        "bounds": ready.bounds,
        "ttft_s": statistics.median(t1),
        "generate_s": statistics.median(tn),
        "decode_tokens_per_s": _decode_rate(len(prompts), args.new_tokens, t1, tn),
        "decode_cpu_ms_per_token": _cpu_per_token(len(prompts), args.new_tokens, c1, cn),
        # where it goes: each stage process and this client (the first stage runs the
        # scheduler and streams to the client)
        "decode_cpu_ms_per_token_by_process": {
            name: _cpu_per_token(
                len(prompts), args.new_tokens, [d[name] for d in p1], [d[name] for d in pn]
            )
            for name in p1[0]
        },
        "tokens": tokens,
        "peak_kib": peaks,
        "peaks_reset": peaks_reset,
        "phases_kib": phases if pids else None,
    }


def _phase(pids: dict[str, int]) -> dict[str, dict[str, int | None]]:
    """Each stage's resident memory now (anonymous and file-backed: torch's code
    pages are the latter) and its peak so far."""
    keys = ("VmRSS", "RssAnon", "RssFile", "VmHWM")
    return {n: {k: status_kib(k, pid) for k in keys} for n, pid in pids.items()}


def _decode_rate(sequences: int, new_tokens: int, t1: list[float], tn: list[float]) -> float | None:
    span = statistics.median(tn) - statistics.median(t1)
    return sequences * (new_tokens - 1) / span if span > 0 else None


def _cpu_per_token(
    sequences: int, new_tokens: int, c1: list[float], cn: list[float]
) -> float | None:
    """Milliseconds of CPU per decoded token, by the same difference as the rate."""
    span = statistics.median(cn) - statistics.median(c1)
    return 1000 * span / (sequences * (new_tokens - 1)) if span > 0 else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def _predicted(
    spec: ModelSpec, args: argparse.Namespace, sequences: int, bounds: list[list[int]]
) -> list[StageMemory]:
    """What the coordinator predicts each stage of the run holds."""
    config = read_causal_lm_config(spec.config)
    context = args.prompt_tokens + args.new_tokens
    units = generation_units(config, element_bytes=4, max_context=context)
    workload = generation_workload(
        max_sequences=sequences,
        max_context=context,
        steps_in_flight=min(args.steps_in_flight, sequences),
        chunk_tokens=args.prompt_tokens,
        kv_budget_bytes=None,
    )
    return [stage_memory(units, s, e, workload) for s, e in bounds]


_PARTS = ("weights", "kv_cache", "activations", "runtime")


def _phases_over_base(
    phases: dict[str, Any] | None, before: dict[str, int | None]
) -> dict[str, Any] | None:
    """Each stage's memory at each phase of its run less its resident set before the
    model (MiB): where the memory beyond the model came in."""
    if not phases:
        return None
    out: dict[str, Any] = {}
    for phase, stages in phases.items():
        for name, values in stages.items():
            base = before.get(name)
            out.setdefault(name, {})[phase] = {
                k: round((v - base) / 1024, 1) if k in ("VmRSS", "VmHWM") else round(v / 1024, 1)
                for k, v in values.items()
                if v is not None and base is not None
            }
    return out


def _even(num_units: int, stages: int) -> list[int]:
    base, extra = divmod(num_units, stages)
    return [base + (1 if i < extra else 0) for i in range(stages)]


def _row(name: str, result: dict[str, Any], **more: Any) -> None:
    shown = {k: v for k, v in result.items() if k != "tokens"}
    emit({"bench": BENCH, "setting": name, **shown, **more})


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="zpipe-bench-generate-") as tmp:
        directory = Path(tmp)
        spec = _model(args, directory)
        prompts = _prompts(args)
        hf = _baseline(args, directory, prompts)
        hf_rate = _decode_rate(args.sequences, args.new_tokens, hf["times_1"], hf["times_n"])
        hf_cpu = _cpu_per_token(args.sequences, args.new_tokens, hf["cpu_1"], hf["cpu_n"])
        emit(
            {
                "bench": BENCH,
                "setting": "transformers",
                "decode_tokens_per_s": hf_rate,
                "decode_cpu_ms_per_token": hf_cpu,
                **{k: v for k, v in hf.items() if not k.startswith("tokens")},
            }
        )

        devices = [DeviceSpec(n, threads=args.threads) for n in STAGES]
        with LocalCluster(devices, heartbeat_interval_s=1.0, start_timeout_s=600.0) as cluster:
            pids = {n: cluster.processes[n].pid for n in STAGES}
            rss_before = {n: status_kib("VmRSS", pid) for n, pid in pids.items()}
            registered = _phase(pids)  # before any model: the process's base
            many = asyncio.run(
                _pipeline(
                    cluster,
                    spec,
                    prompts,
                    args,
                    steps_in_flight=args.steps_in_flight,
                    memory_pids=pids,
                )
            )
            many["phases_kib"] = {"registered": registered, **(many["phases_kib"] or {})}
            one = asyncio.run(_pipeline(cluster, spec, prompts[:1], args, steps_in_flight=1))
            other = None
            if args.also_steps_in_flight and args.also_steps_in_flight != args.steps_in_flight:
                other = asyncio.run(
                    _pipeline(
                        cluster, spec, prompts, args, steps_in_flight=args.also_steps_in_flight
                    )
                )
        _row(f"pipeline_s{args.sequences}", many, rss_before_kib=rss_before)
        _row("pipeline_s1", one)
        if other is not None:
            _row(f"pipeline_s{args.sequences}_steps{args.also_steps_in_flight}", other)

        measured = {
            n: (many["peak_kib"][n] - rss_before[n]) * 1024
            for n in STAGES
            if many["peak_kib"].get(n) is not None and rss_before[n] is not None
        }
        predicted = _predicted(spec, args, args.sequences, many["bounds"])
        # what the process holds beyond its base: the model's part and the runtime's
        predicted_bytes = [p.above_base for p in predicted]
        largest = max(measured, key=measured.__getitem__) if measured else None
        hf_bytes = (hf["peak_kib"] - hf["rss_before_kib"]) * 1024 if hf["peak_kib"] else None
        memory = {
            "stage_memory_mib": {n: round(b / 2**20, 1) for n, b in measured.items()},
            "predicted_memory_mib": [round(b / 2**20, 1) for b in predicted_bytes],
            "predicted_parts_mib": [
                {k: round(getattr(p, k) / 2**20, 2) for k in _PARTS} for p in predicted
            ],
            "single_memory_mib": round(hf_bytes / 2**20, 1) if hf_bytes else None,
            "phases_mib": _phases_over_base(many["phases_kib"], rss_before),
        }
        emit({"bench": BENCH, "setting": "memory", **memory})

        planned = even = None
        if not args.no_hetero:
            slow = [float(s) for s in args.hetero_slowdowns.split(",")]
            hetero = [
                DeviceSpec(n, slowdown=s, threads=args.threads)
                for n, s in zip(STAGES, slow, strict=True)
            ]
            num_units = read_causal_lm_config(spec.config).num_units
            with LocalCluster(hetero, heartbeat_interval_s=1.0, start_timeout_s=600.0) as cluster:
                planned = asyncio.run(
                    _pipeline(cluster, spec, prompts, args, steps_in_flight=args.steps_in_flight)
                )
                even = asyncio.run(
                    _pipeline(
                        cluster,
                        spec,
                        prompts,
                        args,
                        steps_in_flight=args.steps_in_flight,
                        partition=_even(num_units, len(STAGES)),
                    )
                )
            _row("hetero_planned", planned, slowdowns=slow)
            _row("hetero_even", even, slowdowns=slow)

    expected = hf["tokens_single"]
    idx = STAGES.index(largest) if largest is not None else None
    return summary(
        BENCH,
        decode_ratio_vs_hf=_ratio(many["decode_tokens_per_s"], hf_rate),
        s3_over_s1_tokens_per_s=_ratio(many["decode_tokens_per_s"], one["decode_tokens_per_s"]),
        ttft_ratio_vs_hf=_ratio(many["ttft_s"], hf["ttft_s"]),
        decode_cpu_ratio_vs_hf=_ratio(hf_cpu, many["decode_cpu_ms_per_token"]),
        largest_stage_memory_over_single=_ratio(
            measured.get(largest) if largest else None, hf_bytes
        ),
        memory_predicted_over_measured=_ratio(
            predicted_bytes[idx] * (1 + args.margin) if idx is not None else None,
            measured.get(largest) if largest else None,
        ),
        memory_unmargined_over_measured=_ratio(
            predicted_bytes[idx] if idx is not None else None,
            measured.get(largest) if largest else None,
        ),
        planned_over_even_tokens_per_s=_ratio(
            planned["decode_tokens_per_s"] if planned else None,
            even["decode_tokens_per_s"] if even else None,
        ),
        greedy_equal_hf=many["tokens"] == expected
        and one["tokens"] == expected[:1]
        and (other is None or other["tokens"] == expected),
        hf_batched_equal_single=hf["tokens_batched"] == expected,
        other_steps_in_flight=args.also_steps_in_flight if other else None,
        other_decode_ratio_vs_hf=_ratio(other["decode_tokens_per_s"], hf_rate) if other else None,
        other_decode_cpu_ratio_vs_hf=(
            _ratio(hf_cpu, other["decode_cpu_ms_per_token"]) if other else None
        ),
        pipeline_cpu_ms_per_token=many["decode_cpu_ms_per_token"],
        hf_cpu_ms_per_token=hf_cpu,
        pipeline_tokens_per_s=many["decode_tokens_per_s"],
        hf_tokens_per_s=hf_rate,
        sequences=args.sequences,
        steps_in_flight=args.steps_in_flight,
        new_tokens=args.new_tokens,
        threads=args.threads,
        hf_threads=hf["threads"],
        memory_peaks_reset=bool(many["peaks_reset"] and hf["peak_reset"]),
        loadavg=loadavg(),
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--sequences", type=int, default=3, help="S: sequences in flight")
    parser.add_argument(
        "--steps-in-flight",
        type=int,
        default=1,
        help="micro-batches on the ring (1: the S sequences decode as one batch, as the "
        "baseline's; on two cores, more groups cost more CPU per token than they overlap)",
    )
    parser.add_argument(
        "--also-steps-in-flight",
        type=int,
        default=3,
        help="a second run with this many (one group per stage; 0: none), its ratios as other_*",
    )
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per stage")
    parser.add_argument(
        "--hf-threads",
        type=int,
        default=1,
        help="the baseline's torch threads (0: torch's choice, which oversubscribes a loaded "
        "machine: its OpenMP threads wait on each other)",
    )
    parser.add_argument("--hetero-slowdowns", default="1,3,1.5", help="the second cluster's stages")
    parser.add_argument("--no-hetero", action="store_true", help="skip planned-vs-even")
    parser.add_argument(
        "--margin",
        type=float,
        default=DEFAULT_MEMORY_MARGIN,
        help="the safety margin the prediction is compared with (the coordinator's default)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a small model and few tokens")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds before giving up")
    args = parser.parse_args(argv)
    if args.quick:
        args.hidden, args.intermediate, args.layers, args.vocab = 64, 128, 2, 128
        args.heads, args.kv_heads = 4, 2
        args.new_tokens, args.prompt_tokens, args.repeats = 4, 6, 1
    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(args.timeout)
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
