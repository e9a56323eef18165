"""bench/inference.py's ``imported`` section: a Hugging Face ViT through zpipe's importer.

A random-init ``transformers.ViTForImageClassification`` (the size of the bench's
``--model`` preset and ``--layers``; no download) is saved as transformers saves
it (``model.safetensors`` and ``config.json``), converted by zpipe's own CLI
(``python -m zpipe import hf-vit SRC DEST``, in a subprocess, as a user runs
it), and the spec that CLI wrote is run through a LocalCluster. Its pipelined
outputs are compared with the Hugging Face model's own logits on the same
images, and its samples/s with the Hugging Face model run whole in this
process (all cores), the baseline, and with zpipe's model run whole likewise.

Every tensor of the random-init model gets small seeded noise on top of its
initialisation: transformers starts biases at zero and LayerNorms at one, which
would let a bias or a norm mapped to the wrong place go unnoticed.

Memory per stage: the planners' prediction (zpipe.planner.memory's model part:
the stage's weights plus the largest unit's activation memory plus the stage's
input, the "tight" figure, which this also reports by its own arithmetic) at the
micro-batch size, against the stage's weights plus its input plus the peak its
forward allocates (zpipe.peak_memory), and the stage process's own resident memory:
its peak (``VmHWM``) after the timed runs and how much that grew from before
the model was sent to it (which includes receive buffers and the runtime's
allocations, not only the model's).

Nothing here is imported by zpipe; transformers is a test dependency.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from bench._common import emit
from zpipe.client import RunReport
from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.models import ModelSpec, build_full_model, load_layer_sequence, run_units
from zpipe.peak_memory import PeakMemory
from zpipe.planner import Plan
from zpipe.planner.memory import profile_stage_memory
from zpipe.stage.profiling import profile_model

BENCH = "inference"
MIB = 2**20
NOISE_STD = 0.02  # added to every tensor of the random-init model (see the docstring)
Outputs = tuple[torch.Tensor, ...]


def hf_vit_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """transformers' ``ViTConfig`` keywords for a zpipe ViT config (a preset's)."""
    return {
        "hidden_size": int(config["hidden"]),
        "num_hidden_layers": int(config["num_layers"]),
        "num_attention_heads": int(config["heads"]),
        "intermediate_size": int(config["mlp"]),
        "image_size": int(config["image_size"]),
        "patch_size": int(config["patch"]),
        "num_channels": int(config.get("channels", 3)),
        "num_labels": int(config["num_classes"]),
        "hidden_act": "gelu",
    }


def make_hf_vit(hf_config: Mapping[str, Any], seed: int) -> torch.nn.Module:
    """A seeded random-init ``ViTForImageClassification`` in eval mode, every tensor
    perturbed so that no bias is zero and no LayerNorm is the identity."""
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(seed)
    model = ViTForImageClassification(ViTConfig(**hf_config)).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(NOISE_STD * torch.randn(param.shape, generator=generator))
    return model


def import_with_cli(model: torch.nn.Module, folder: Path) -> ModelSpec:
    """Save ``model`` as transformers does, convert it with ``python -m zpipe import
    hf-vit`` and return the spec that command wrote."""
    source, dest = folder / "hf", folder / "zpipe-vit.safetensors"
    model.save_pretrained(str(source))  # type: ignore[operator]
    command = [sys.executable, "-m", "zpipe", "import", "hf-vit", str(source), str(dest)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr}")
    spec_data = json.loads(dest.with_suffix(".spec.json").read_text())
    return ModelSpec.from_dict(spec_data, from_peer=False)


def hf_logits(model: torch.nn.Module, batch: Outputs) -> Outputs:
    with torch.inference_mode():
        return (model(pixel_values=batch[0]).logits,)


def max_abs_diff(a: list[Outputs], b: list[Outputs]) -> float:
    return max(
        float((x.float() - y.float()).abs().max())
        for xs, ys in zip(a, b, strict=True)
        for x, y in zip(xs, ys, strict=True)
    )


def all_close(a: list[Outputs], b: list[Outputs], tol: float) -> bool:
    return len(a) == len(b) and all(
        len(xs) == len(ys)
        and all(
            x.shape == y.shape and torch.allclose(x.float(), y.float(), atol=tol, rtol=tol)
            for x, y in zip(xs, ys, strict=True)
        )
        for xs, ys in zip(a, b, strict=True)
    )


def _single_process_run(
    forward: Callable[[Outputs], Outputs], batches: list[Outputs]
) -> tuple[float, list[Outputs]]:
    """Samples/s of ``forward`` over ``batches`` in this process, and its outputs."""
    started = time.perf_counter()
    with torch.inference_mode():
        outputs = [forward(batch) for batch in batches]
    elapsed = time.perf_counter() - started
    return sum(int(b[0].shape[0]) for b in batches) / elapsed, outputs


def _proc_memory_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak resident) of process ``pid`` in KiB (Linux); {} if unknown."""
    found: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    found[key] = int(value.split()[0])
    except (OSError, ValueError, IndexError):
        return {}
    return found


def _nbytes(tensors: Outputs) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def stage_memory_rows(
    spec: ModelSpec, plan: Plan, microbatch: Outputs, rss: Mapping[str, Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """Per stage of ``plan``: predicted memory against measured (see the docstring)."""
    size = int(microbatch[0].shape[0])
    profile = profile_model(spec, batch_sizes=[size], warmup=1, repeats=1)
    sequence = load_layer_sequence(spec)
    inputs = microbatch
    rows = []
    for index, stage in enumerate(plan.stages):
        units = sequence.build_units(stage.start, stage.end)
        weights = sum(
            t.numel() * t.element_size()
            for unit in units
            for t in (*unit.parameters(), *unit.buffers())
        )
        with torch.inference_mode(), PeakMemory.on(torch.device("cpu")) as peak:
            outputs = run_units(units, inputs)
        measured = weights + _nbytes(inputs) + peak.bytes
        # the planners' prediction: the one memory model (zpipe.planner.memory)
        stage_predicted = profile_stage_memory(profile, stage.start, stage.end, size).model
        # bench/memory.py's "tight" figure: the largest unit's activation memory, plus
        # the stage's input that its sender keeps alive while later units run
        activations = [u.memory_bytes[0] for u in profile.units[stage.start : stage.end]]
        tight = weights + max(activations[0], *(_nbytes(inputs) + a for a in activations[1:]))
        process = rss.get(stage.device, {})
        rows.append(
            {
                "stage": index,
                "device": stage.device,
                "units": [stage.start, stage.end],
                "microbatch_size": size,
                "weights_mib": round(weights / MIB, 3),
                "predicted_mib": round(stage_predicted / MIB, 3),
                "measured_mib": round(measured / MIB, 3),
                "predicted_over_measured": round(stage_predicted / measured, 3),
                "tight_mib": round(tight / MIB, 3),
                "tight_over_measured": round(tight / measured, 3),
                "activations_predicted_mib": round((stage_predicted - weights) / MIB, 3),
                "activations_measured_mib": round((measured - weights) / MIB, 3),
                **process,
            }
        )
        inputs = outputs
    return rows


def run_imported(
    args: argparse.Namespace, spec: ModelSpec, warmup: list[Outputs], batches: list[Outputs]
) -> tuple[dict[str, Any], bool]:
    """The section: summary keys (``imported_*``) and whether the outputs match."""
    hf_config = hf_vit_config({**spec.config, "num_layers": args.layers})
    cores = os.cpu_count() or 1
    stages = args.imported_stages
    threads = args.threads or max(1, cores // stages)
    tol = 1e-4
    print(f"imported section: hf-vit over {stages} stages", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="zpipe-bench-hf-vit-") as tmp:
        hf_model = make_hf_vit(hf_config, args.seed)
        imported = import_with_cli(hf_model, Path(tmp))
        devices = [DeviceSpec(f"stage{i}", threads=threads) for i in range(stages)]
        stream = {"microbatch_size": args.microbatch_size, "max_in_flight": args.max_in_flight}
        full = build_full_model(imported)
        runs: dict[str, list[float]] = {"zpipe": [], "hf": [], "zpipe_single": []}
        outputs: dict[str, list[Outputs]] = {}
        reports: list[RunReport] = []
        with LocalCluster(devices, log_level="warning") as cluster:
            pids = {d.name: int(cluster.processes[d.name].pid) for d in devices}
            rss_before = {name: _proc_memory_kib(pid) for name, pid in pids.items()}
            _, warm = cluster.infer(imported, warmup, planner="even", **stream)
            _single_process_run(lambda b: hf_logits(hf_model, b), warmup)
            _single_process_run(lambda b: full(*b), warmup)
            for repeat in range(args.repeats):
                turn = ["zpipe", "hf", "zpipe_single"]
                for system in turn if repeat % 2 == 0 else turn[::-1]:
                    if system == "zpipe":
                        out, report = cluster.infer(imported, batches, planner="even", **stream)
                        if report.plan.stages != warm.plan.stages:
                            raise RuntimeError("zpipe changed its partition between runs")
                        reports.append(report)
                        rate = report.throughput
                    elif system == "hf":
                        rate, out = _single_process_run(lambda b: hf_logits(hf_model, b), batches)
                    else:
                        rate, out = _single_process_run(lambda b: full(*b), batches)
                    runs[system].append(rate)
                    outputs[system] = out
                    print(
                        f"  repeat {repeat + 1}/{args.repeats} {system}: {rate:.2f} samples/s",
                        file=sys.stderr,
                        flush=True,
                    )
            rss_after = {name: _proc_memory_kib(pid) for name, pid in pids.items()}
        rss = {
            name: {
                "process_peak_rss_mib": round(after.get("VmHWM", 0) / 1024, 1),
                "process_rss_growth_mib": round(
                    (after.get("VmHWM", 0) - rss_before[name].get("VmHWM", 0)) / 1024, 1
                ),
            }
            for name, after in rss_after.items()
            if after and rss_before.get(name)
        }
        microbatch = tuple(t[: args.microbatch_size] for t in batches[0])
        memory_rows = stage_memory_rows(imported, warm.plan, microbatch, rss)

    medians = {system: statistics.median(rates) for system, rates in runs.items()}
    zpipe_vs_hf = max_abs_diff(outputs["zpipe"], outputs["hf"])
    single_vs_hf = max_abs_diff(outputs["zpipe_single"], outputs["hf"])
    outputs_match = all_close(outputs["zpipe"], outputs["hf"], tol) and all_close(
        outputs["zpipe_single"], outputs["hf"], tol
    )
    partition = [[s.start, s.end] for s in warm.plan.stages]
    for row in memory_rows:
        emit({"bench": BENCH, "section": "imported", "kind": "stage_memory", **row})
    config = {
        "imported_hf_config": hf_config,
        "imported_zpipe_config": imported.config,
        "imported_stages": stages,
        "imported_threads_per_stage": threads,
        "imported_baseline_threads": torch.get_num_threads(),
        "imported_partition": partition,
    }
    for system, label in (
        ("zpipe", "zpipe pipelined"),
        ("hf", "transformers, one process"),
        ("zpipe_single", "zpipe model, one process"),
    ):
        emit(
            {
                "bench": BENCH,
                "section": "imported",
                "system": system,
                "description": label,
                "samples_per_s": round(medians[system], 4),
                "samples_per_s_runs": [round(r, 4) for r in runs[system]],
                **config,
            }
        )
    keys = {
        "imported_zpipe_samples_per_s": round(medians["zpipe"], 4),
        "imported_hf_samples_per_s": round(medians["hf"], 4),
        "imported_zpipe_single_samples_per_s": round(medians["zpipe_single"], 4),
        "imported_ratio_vs_hf": round(medians["zpipe"] / medians["hf"], 4),
        "imported_single_ratio_vs_hf": round(medians["zpipe_single"] / medians["hf"], 4),
        "imported_outputs_match_hf": outputs_match,
        "imported_max_abs_diff_vs_hf": zpipe_vs_hf,
        "imported_single_max_abs_diff_vs_hf": single_vs_hf,
        "imported_memory_predicted_over_measured": {
            row["device"]: row["predicted_over_measured"] for row in memory_rows
        },
        "imported_memory_tight_over_measured": {
            row["device"]: row["tight_over_measured"] for row in memory_rows
        },
        "imported_memory_predicted_mib": {
            row["device"]: row["predicted_mib"] for row in memory_rows
        },
        "imported_memory_measured_mib": {row["device"]: row["measured_mib"] for row in memory_rows},
        "imported_process_peak_rss_mib": {
            name: value["process_peak_rss_mib"] for name, value in rss.items()
        },
        **config,
    }
    return keys, outputs_match
