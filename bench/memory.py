"""Memory per stage: what the planners predict from a profile against what a stage uses.

One process, no network: the model is profiled (``--train``), partitioned evenly
into ``--stages`` stages, and each stage's shard is built and run on the input
it would receive, on ``--device``. Per stage:

- forward (inference), the planners' ``M(i..j)`` (PipeEdge Alg. 1, additive):
  the sum over the stage's units of their profiled activation memory (each
  unit's input plus the peak its forward allocates). ``tight`` is the
  largest single unit's figure plus the stage's input (which its sender
  keeps alive while later units run) instead of the sum; ``estimate`` is the
  profiler's former figure, each unit's input plus output, summed. Measured: the stage's
  input plus the peak its whole forward allocates (zpipe.peak_memory: CUDA's
  allocator statistics, live tensor storages on the CPU).
- saved for backward (training, Asteroid eq. 3's ``ACT``): the sum of the
  units' profiled ``activation_bytes`` against what the stage's training
  forward keeps for its backward (saved tensors, each storage counted once
  over the whole stage, as the stage's counters count it) and, as a second
  measurement, what is still allocated after that forward (saved tensors and
  outputs; the allocator's count on CUDA).

Why the predictions err high (the numbers this prints):

- forward, additive: the sum adds peaks that never coexist (one unit's
  intermediates are freed before the next runs) and counts every boundary
  tensor twice (as one unit's output and the next one's input). For a stage
  of ``n`` similar units that is close to ``n`` times the largest unit's
  figure; ``tight`` is close to what the stage needs. The planner
  keeps PipeEdge's additive model: it is the paper's, and safe.
- saved for backward: a tensor between two units that both save it (a ReLU
  its output, the next Linear its input) is counted by each, a few percent.

Weights are exact in both (parameter and buffer bytes) and are left out of the
ratios, which would otherwise hide the activation error behind them.

Output: one JSON line per stage, then a summary with the ratio ranges
(``forward_pred_over_measured``, ``forward_tight_over_measured``,
``saved_pred_over_measured``) over the stages.

Run: ``.venv/bin/python bench/memory.py`` (``--help`` for options).
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench._common import emit, loadavg, on_alarm, summary
from zpipe.devices import resolve_device
from zpipe.models import ModelSpec, load_layer_sequence, run_units
from zpipe.peak_memory import PeakMemory
from zpipe.planner.plan import plan_even_partition
from zpipe.stage.executors.training_shard import TrainShard
from zpipe.stage.profiling import profile_model

MIB = 2**20


def _nbytes(tensors: tuple[torch.Tensor, ...]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--model", default="vit-tiny")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks")
    parser.add_argument("--batch", type=int, default=8, help="micro-batch size")
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--timeout", type=int, default=600, help="seconds before giving up")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(args.timeout)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    overrides = {"num_layers": args.layers} if "vit" in args.model or "bert" in args.model else {}
    spec = ModelSpec.preset(args.model, **overrides)
    b = args.batch
    profile = profile_model(spec, batch_sizes=[b], warmup=1, repeats=1, train=True, device=device)
    k = profile.batch_sizes.index(b)
    unit_input_bytes = [profile.input_bytes[k], *(u.output_bytes[k] for u in profile.units[:-1])]
    sequence = load_layer_sequence(spec)
    plan = plan_even_partition(profile.num_units, [f"s{i}" for i in range(args.stages)])
    inputs = tuple(t.to(device) for t in sequence.example_input(b, seed=b))
    ratios: dict[str, list[float]] = {"forward": [], "tight": [], "saved": [], "estimate": []}
    for index, stage in enumerate(plan.stages):
        units = [u.to(device) for u in sequence.build_units(stage.start, stage.end)]
        profiled = profile.units[stage.start : stage.end]
        weights = sum(u.param_bytes for u in profiled)
        with torch.inference_mode():
            with PeakMemory.on(device) as forward_peak:
                outputs = run_units(units, inputs)
        measured_forward = _nbytes(inputs) + forward_peak.bytes
        predicted_forward = sum(u.memory_bytes[k] for u in profiled)
        # the profiler's former estimate, a unit's input plus its output, summed
        unit_inputs = unit_input_bytes[stage.start : stage.end]
        estimated_forward = sum(
            i + u.output_bytes[k] for i, u in zip(unit_inputs, profiled, strict=True)
        )
        # the stage's input stays alive (its sender holds it) while later units run
        stage_input = _nbytes(inputs)
        tight_forward = max(
            profiled[0].memory_bytes[k],
            *(stage_input + u.memory_bytes[k] for u in profiled[1:]),
        )
        shard = TrainShard(
            units,
            start=stage.start,
            first=index == 0,
            last=False,
            loss="mse",
            optimizer={"name": "sgd", "lr": 0.01},
            device=device,
        )
        host_inputs = tuple(t.detach().cpu().clone() for t in inputs)  # not inference tensors
        with PeakMemory.on(device) as training_forward:
            sent, _, _ = shard.forward(0, host_inputs)
        measured_saved = shard.live_activation_bytes
        predicted_saved = sum((u.activation_bytes or ())[k] for u in profiled)
        row = {
            "bench": "memory",
            "stage": index,
            "units": [stage.start, stage.end],
            "weights_mib": round(weights / MIB, 3),
            "forward_predicted_mib": round(predicted_forward / MIB, 3),
            "forward_tight_mib": round(tight_forward / MIB, 3),
            "forward_estimate_mib": round(estimated_forward / MIB, 3),
            "forward_measured_mib": round(measured_forward / MIB, 3),
            "saved_predicted_mib": round(predicted_saved / MIB, 3),
            "saved_measured_mib": round(measured_saved / MIB, 3),
            # everything the training forward left allocated: saved tensors and outputs
            "training_retained_mib": round(training_forward.retained_bytes / MIB, 3),
            "forward_pred_over_measured": round(predicted_forward / measured_forward, 3),
            "forward_tight_over_measured": round(tight_forward / measured_forward, 3),
            "forward_estimate_over_measured": round(estimated_forward / measured_forward, 3),
            "saved_pred_over_measured": round(predicted_saved / max(1, measured_saved), 3),
        }
        emit(row)
        ratios["forward"].append(row["forward_pred_over_measured"])
        ratios["tight"].append(row["forward_tight_over_measured"])
        ratios["saved"].append(row["saved_pred_over_measured"])
        ratios["estimate"].append(row["forward_estimate_over_measured"])
        shard.backward(0, tuple(torch.zeros_like(t) for t in sent))
        inputs = tuple(t.to(device) for t in outputs)
        del shard, units
    summary(
        "memory",
        model=args.model,
        layers=args.layers,
        batch=b,
        stages=args.stages,
        device=str(device),
        loadavg=loadavg(),
        forward_pred_over_measured=[min(ratios["forward"]), max(ratios["forward"])],
        forward_tight_over_measured=[min(ratios["tight"]), max(ratios["tight"])],
        saved_pred_over_measured=[min(ratios["saved"]), max(ratios["saved"])],
        forward_estimate_over_measured=[min(ratios["estimate"]), max(ratios["estimate"])],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
