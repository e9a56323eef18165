"""Helpers shared by tests (moved from test_training.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zpipe.client import split_minibatch
from zpipe.models import ModelSpec, build_full_model, load_layer_sequence
from zpipe.planner.schedules import pipeline_actions
from zpipe.stage.executors.training_shard import TrainShard
from zpipe.training.objectives import (
    check_train_settings,
    make_optimizer,
)

SPEC = ModelSpec("mlp", {"dims": [12, 24, 24, 24, 4], "activation": "gelu"}, seed=11)
SGD = {"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4}


def make_batches(
    count: int, size: int, *, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(size, 12, generator=generator),
            torch.randint(0, 4, (size,), generator=generator),
        )
        for _ in range(count)
    ]


def train_single_process(
    spec: ModelSpec, batches: list[tuple[torch.Tensor, torch.Tensor]], optimizer: dict[str, object]
) -> tuple[dict[str, torch.Tensor], list[float]]:
    model = build_full_model(spec).train()
    opt = make_optimizer(optimizer, model.parameters())
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = F.cross_entropy(model(x)[0], y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return model.state_dict(), losses


def train_in_process(
    spec: ModelSpec,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    optimizer: dict[str, object],
    bounds: list[int],
    schedule: str,
    num_microbatches: int,
    warmups: list[int] | None = None,
) -> tuple[dict[str, torch.Tensor], list[float], list[int]]:
    """Run each stage's actions in a valid global order (a round-robin over stages
    that executes whatever action is ready), moving tensors by hand."""
    sequence = load_layer_sequence(spec)
    p = len(bounds) - 1
    shards = [
        TrainShard(
            sequence.build_units(bounds[i], bounds[i + 1]),
            start=bounds[i],
            first=i == 0,
            last=i == p - 1,
            loss="cross_entropy",
            optimizer=optimizer,
        )
        for i in range(p)
    ]
    settings = check_train_settings(
        {
            "schedule": schedule,
            "num_microbatches": num_microbatches,
            "optimizer": optimizer,
            "warmups": warmups,
        },
        p,
    )
    actions = pipeline_actions(
        schedule, num_stages=p, num_microbatches=num_microbatches, warmups=settings["warmups"]
    )
    losses = []
    for x, y in batches:
        parts = split_minibatch((x, y), num_microbatches)
        acts: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {
            (0, m): (part[0],) for m, part in enumerate(parts)
        }
        grads: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        cursor = [0] * p
        round_loss = 0.0
        while any(cursor[s] < len(actions[s]) for s in range(p)):
            progressed = False
            for s in range(p):
                while cursor[s] < len(actions[s]):
                    action = actions[s][cursor[s]]
                    m = action.microbatch
                    if action.kind == "F":
                        if (s, m) not in acts:
                            break
                        target = parts[m][1] if s == p - 1 else None
                        out, loss, _ = shards[s].forward(m, acts.pop((s, m)), target, len(x))
                        if loss is not None:
                            round_loss += loss
                        else:
                            acts[(s + 1, m)] = out
                    elif action.kind == "B":
                        if s < p - 1 and (s, m) not in grads:
                            break
                        g, _ = shards[s].backward(m, grads.pop((s, m), ()))
                        if s > 0:
                            grads[(s - 1, m)] = g
                    elif action.kind == "STEP":
                        shards[s].step()
                    cursor[s] += 1
                    progressed = True
            assert progressed, "the schedules deadlocked"
        losses.append(round_loss)
    state = {k: v for shard in shards for k, v in shard.state_dict().items()}
    return state, losses, [shard.peak_live for shard in shards]


def assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=key)
