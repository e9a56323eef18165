"""Live re-partitioning of asynchronous runs (FTPipeHD III-D, III-F): pure parts.

The decision (capacities from measured times, eq. 5 / eq. 7, a gain threshold,
checks after ``first`` and then every ``every`` batches) is fed events; moving a
flushed pipeline's units between stages must not change what it computes.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from zpipe._errors import ConfigError, PipelineError, ProtocolError
from zpipe.cluster import LocalCluster
from zpipe.models import ModelSpec, build_full_model, load_layer_sequence
from zpipe.planner.async_schedule import async_global_order, async_stage_actions
from zpipe.training.async_reference import AsyncSettings, train_async_reference
from zpipe.training.async_regroup import (
    LIVE_VERSIONS_KEY,
    VERSION_KEY,
    is_versioned_state,
    needed_versions,
    unit_state_from_tensors,
    unit_state_tensors,
)
from zpipe.training.async_stage import AsyncStageCompute
from zpipe.training.objectives import make_optimizer
from zpipe.training.repartition import (
    RepartitionController,
    RepartitionSettings,
    decide_repartition,
)

SPEC = ModelSpec("mlp", {"dims": [12, 24, 24, 24, 20, 4], "activation": "gelu"}, seed=5)
ADAM = {"name": "adam", "lr": 0.01, "betas": [0.8, 0.99]}
SGD = {"name": "sgd", "lr": 0.05, "momentum": 0.9}


def make_batches(count: int, size: int = 4, *, seed: int = 0) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 12, generator=g), torch.randint(0, 4, (size,), generator=g))
            for _ in range(count)]  # fmt: skip


def close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol: float = 1e-6) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=rtol, atol=1e-7) for k in a)


# ---------------------------------------------------------------- schedule after a flush


def test_the_list_after_a_flush_warms_up_again_from_its_first_batch() -> None:
    actions = [str(a) for a in async_stage_actions(0, 3, 9, first_batch=5)]
    assert actions[:6] == ["F5", "F6", "F7", "B5", "STEP", "F8"]
    assert async_stage_actions(1, 3, 5, first_batch=5) == []
    # aggregation keeps counting backwards from the run's start: before B6 (every 3)
    agg = [str(a) for a in async_stage_actions(0, 3, 12, aggregate_every=3, first_batch=5)]
    assert agg.index("AGG") == agg.index("B6") - 1
    order = async_global_order(3, 9, first_batch=5)
    assert {a.batch for _, a in order if a.kind == "B"} == {5, 6, 7, 8}
    with pytest.raises(ConfigError):
        async_stage_actions(0, 3, 9, first_batch=-1)


# ---------------------------------------------------------------- exactness in one process


@pytest.mark.parametrize("optimizer", [ADAM, SGD], ids=["adam", "sgd"])
def test_moving_units_at_a_flush_changes_nothing_with_vertical_sync(optimizer: dict) -> None:
    batches = make_batches(14, seed=1)
    plain = train_async_reference(SPEC, batches, bounds=[0, 1, 2, 5], optimizer=optimizer)
    moved = train_async_reference(
        SPEC,
        batches,
        bounds=[0, 1, 2, 5],
        optimizer=optimizer,
        repartitions={4: [0, 3, 4, 5], 9: [0, 2, 3, 5]},
    )
    # the flushes change the order things run in, never a batch's version
    assert moved.forward_versions[0] == plain.forward_versions[0]
    assert torch.allclose(torch.tensor(moved.losses), torch.tensor(plain.losses), rtol=1e-6)
    assert close(moved.state_dict, plain.state_dict)


def test_with_aggregation_a_moved_unit_follows_its_new_stage() -> None:
    batches = make_batches(14, seed=2)
    settings = AsyncSettings(aggregate=True)
    plain = train_async_reference(
        SPEC, batches, bounds=[0, 1, 2, 5], optimizer=ADAM, settings=settings
    )
    moved = train_async_reference(
        SPEC,
        batches,
        bounds=[0, 1, 2, 5],
        optimizer=ADAM,
        settings=settings,
        repartitions={5: [0, 3, 4, 5]},
    )
    # unit 2 moved from the last stage (no aggregation) to the first (3 versions)
    assert moved.losses[:6] == plain.losses[:6]
    assert not close(moved.state_dict, plain.state_dict)


def test_a_repartition_needs_vertical_sync_and_a_batch_inside_the_run() -> None:
    batches = make_batches(6)
    with pytest.raises(ConfigError, match="vertical sync"):
        train_async_reference(
            SPEC,
            batches,
            bounds=[0, 2, 5],
            optimizer=SGD,
            settings=AsyncSettings(vertical_sync=False),
            repartitions={3: [0, 3, 5]},
        )
    with pytest.raises(ConfigError, match="outside"):
        train_async_reference(
            SPEC, batches, bounds=[0, 2, 5], optimizer=SGD, repartitions={6: [0, 3, 5]}
        )


# ---------------------------------------------------------------- a unit's state on the wire


def trained_stage(batches: int) -> AsyncStageCompute:
    units = load_layer_sequence(SPEC).build_units(0, 2)
    compute = AsyncStageCompute(units, first=True, last=False, loss="cross_entropy", optimizer=ADAM)
    for b, (x, _) in enumerate(make_batches(batches)):
        out, _ = compute.forward(b, compute.updates, (x,))
        compute.backward(b, tuple(torch.ones_like(t) for t in out))
        compute.step(b)
    return compute


def test_a_unit_state_crosses_as_named_tensors_and_trains_on_identically() -> None:
    compute = trained_stage(4)
    states = compute.export_units()
    fresh = load_layer_sequence(SPEC).build_units(0, 2)
    wire: dict[str, torch.Tensor] = {}
    for u, s in enumerate(states):
        wire.update(unit_state_tensors(u, s, needed_versions(4, 3)))
    assert "units.0.linear.weight#v2" in wire and "units.1.linear.weight#opt.exp_avg" in wire
    moved = [unit_state_from_tensors(u, m, wire) for u, m in enumerate(fresh)]
    copy = AsyncStageCompute.adopt(
        moved, updates=4, first=True, last=False, loss="cross_entropy", optimizer=ADAM
    )
    assert copy.versions_kept == [2, 3, 4]
    x = make_batches(1, seed=9)[0][0]
    for c in (compute, copy):
        out, _ = c.forward(4, 2, (x,))
        c.backward(4, tuple(torch.ones_like(t) for t in out))
        c.step(4)
    for a, b in zip(compute.units, copy.units, strict=True):
        assert close(a.state_dict(), b.state_dict(), rtol=0)


def test_units_do_not_move_with_a_batch_in_flight_and_bad_keys_are_refused() -> None:
    compute = trained_stage(2)
    x = make_batches(1)[0][0]
    compute.forward(2, 1, (x,))
    with pytest.raises(PipelineError, match="in flight"):
        compute.export_units()
    state = trained_stage(2).export_units()[0]
    with pytest.raises(PipelineError, match="no longer kept"):
        unit_state_tensors(0, state, range(0, 9))
    module = load_layer_sequence(SPEC).build_units(0, 1)[0]
    with pytest.raises(ProtocolError):
        unit_state_from_tensors(0, module, {"units.0.nothing#opt.exp_avg": torch.zeros(1)})
    with pytest.raises(ProtocolError):
        unit_state_from_tensors(0, module, {"units.0.linear.weight#vx": torch.zeros(1)})
    with pytest.raises(ProtocolError):
        unit_state_from_tensors(0, module, {"units.0.linear.weight": torch.zeros(1)})


def previous_format(unit: int, state: Any, versions: range) -> dict[str, torch.Tensor]:
    """What a unit's state was on the wire before live versions were only named: the
    live weights, the optimizer's state and every version, the newest included."""
    out = {f"units.{unit}.{k}": t for k, t in state.module.state_dict().items()}
    for v in versions:
        out.update({f"units.{unit}.{n}{VERSION_KEY}{v}": t for n, t in state.versions[v].items()})
    for name, entries in state.optimizer.items():
        out.update({f"units.{unit}.{name}#opt.{k}": t for k, t in entries.items()})
    return out


def wire_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def test_a_moved_unit_sends_the_newest_version_once_and_it_comes_back_identical() -> None:
    compute = trained_stage(5)
    state = compute.export_units()[0]  # a linear unit, Adam's two moments
    versions = needed_versions(5, 3)
    before, after = previous_format(0, state, versions), unit_state_tensors(0, state, versions)
    assert after[f"units.0.{LIVE_VERSIONS_KEY}"].tolist() == [5]
    assert not any(k.endswith(f"{VERSION_KEY}5") for k in after)
    params = sum(p.numel() * p.element_size() for p in state.module.parameters())
    # live + 2 moments + 3 versions -> live + 2 moments + 2 versions (+ one int64)
    assert wire_bytes(before) - wire_bytes(after) == params - 8
    assert len(before) - len(after) == len(list(state.module.parameters())) - 1
    for wire in (before, after):  # a replica kept by the previous format still loads
        fresh = load_layer_sequence(SPEC).build_units(0, 1)[0]
        moved = unit_state_from_tensors(0, fresh, wire)
        assert sorted(moved.versions) == [3, 4, 5]
        for v in (3, 4, 5):
            for name, tensor in state.versions[v].items():
                assert torch.equal(moved.versions[v][name], tensor)
        # a rebuilt version is a copy: the optimizer updates the live weights in place
        assert all(
            t.data_ptr() != p.data_ptr()
            for t, p in zip(moved.versions[5].values(), fresh.parameters(), strict=True)
        )


def test_a_state_whose_only_version_is_the_live_one_still_reads_as_versioned() -> None:
    state = trained_stage(4).export_units()[0]
    wire = unit_state_tensors(0, state, needed_versions(4, 1))
    assert not any(VERSION_KEY in k for k in wire) and is_versioned_state(wire)
    moved = unit_state_from_tensors(0, load_layer_sequence(SPEC).build_units(0, 1)[0], wire)
    assert sorted(moved.versions) == [4]


def test_a_version_that_differs_from_the_live_weights_is_still_sent() -> None:
    compute = trained_stage(3)
    compute.aggregate(2)  # the live weights are now the mean, not version 3
    state = compute.export_units()[0]
    wire = unit_state_tensors(0, state, needed_versions(3, 3))
    assert f"units.0.{LIVE_VERSIONS_KEY}" not in wire
    assert "units.0.linear.weight#v3" in wire


def test_a_peers_list_of_live_versions_is_checked() -> None:
    state = trained_stage(2).export_units()[0]
    wire = unit_state_tensors(0, state, needed_versions(2, 3))
    key = f"units.0.{LIVE_VERSIONS_KEY}"
    module = load_layer_sequence(SPEC).build_units(0, 1)[0]
    for bad in (torch.tensor([2.0]), torch.tensor([[2]]), torch.tensor([2, 2]),
                torch.tensor([-1]), torch.tensor([1])):  # fmt: skip
        with pytest.raises(ProtocolError):
            unit_state_from_tensors(0, module, {**wire, key: bad})


# ---------------------------------------------------------------- the decision


def counters(seconds: float, batches: int) -> dict[str, float]:
    return {"forward_s": seconds / 2, "backward_s": seconds / 2, "step_s": 0.0,
            "microbatches": batches}  # fmt: skip


def test_looks_after_first_then_every() -> None:
    settings = RepartitionSettings(first=10, every=100)
    assert [d for d in range(1, 400) if settings.due(d)] == [10, 110, 210, 310]
    with pytest.raises(ConfigError):
        RepartitionSettings(first=0)
    with pytest.raises(ConfigError):
        RepartitionSettings(gain=1.0)
    with pytest.raises(ConfigError, match="unknown"):
        RepartitionSettings.from_dict({"firts": 3})
    again = RepartitionSettings.from_dict(RepartitionSettings(3, 7, 0.2, (0, 2, 4)).to_dict())
    assert again == RepartitionSettings(3, 7, 0.2, (0, 2, 4))


def test_a_slow_stage_sheds_units_to_the_fast_ones() -> None:
    controller = RepartitionController(
        RepartitionSettings(first=2, every=4, gain=0.1),
        devices=["a", "b", "c"],
        bounds=[0, 2, 4, 6],
        reference_unit_s=[1.0] * 6,
    )
    # b is 4x slower than a and c over the same two units
    decision = controller.look(2, {"a": counters(4, 2), "b": counters(16, 2), "c": counters(4, 2)})
    assert decision.measured and decision.moves
    assert decision.capacities == {"a": 1.0, "b": 4.0, "c": 1.0}
    assert decision.bounds is not None and decision.bounds[2] - decision.bounds[1] == 1
    assert decision.period_s == 8.0 and decision.new_period_s < decision.period_s
    # Algorithm 1: every unit that changes stage comes from its current holder
    assert decision.redistribution is not None
    old = {
        u: d
        for d, (lo, hi) in zip("abc", [(0, 2), (2, 4), (4, 6)], strict=True)
        for u in range(lo, hi)
    }
    for t in decision.redistribution.transfers:
        assert t.dest != t.source and {old[u] for u in range(t.start, t.end)} == {t.source}
    assert decision.redistribution.units_moved > 0
    assert controller.committed(decision) == 1 and controller.bounds == decision.bounds


def test_the_times_since_the_last_look_count_not_the_run_average() -> None:
    controller = RepartitionController(
        RepartitionSettings(first=1, every=1, gain=0.05),
        devices=["a", "b"],
        bounds=[0, 2, 4],
        reference_unit_s=[1.0] * 4,
    )
    first = controller.look(4, {"a": counters(8, 4), "b": counters(8, 4)})
    assert not first.moves and first.reason == "the best cuts are the current ones"
    # b becomes 3x slower: 4 more batches at 6 s each, its whole average only 4 s
    later = controller.look(8, {"a": counters(16, 8), "b": counters(32, 8)})
    assert later.capacities["b"] == pytest.approx(3.0) and later.moves


def test_small_gains_and_unmeasured_stages() -> None:
    base = dict(devices=["a", "b"], bounds=[0, 2, 4], reference_unit_s=[1.0, 1.0, 1.0, 1.2])
    # b 1.2x slower over 10 of 20 units: one unit less saves 1/12 of the period
    fine = dict(devices=["a", "b"], bounds=[0, 10, 20], reference_unit_s=[1.0] * 20)
    slight = decide_repartition(
        RepartitionSettings(gain=0.1), at=3, measured_s={"a": 10.0, "b": 12.0}, **fine
    )
    assert not slight.moves and "below" in slight.reason
    assert slight.gain == pytest.approx(1 / 12)
    taken = decide_repartition(
        RepartitionSettings(gain=0.05), at=3, measured_s={"a": 10.0, "b": 12.0}, **fine
    )
    assert taken.bounds == (0, 11, 20)
    # nothing measured from b: eq. 7 on the reference times (all capacities 1)
    eq7 = decide_repartition(RepartitionSettings(gain=0.0), at=3, measured_s={"a": 2.0}, **base)
    assert not eq7.measured and eq7.capacities == {"a": 1.0, "b": 1.0}
    assert not eq7.moves  # [0, 2, 4] already balances 2.0 against 2.2 best
    forced = decide_repartition(RepartitionSettings(bounds=(0, 3, 4)), at=3, measured_s={}, **base)
    assert forced.moves and forced.bounds == (0, 3, 4)
    assert forced.redistribution is not None
    assert [t.to_dict() for t in forced.redistribution.transfers] == [
        {"dest": "a", "source": "b", "start": 2, "end": 3, "version": 3}
    ]
    with pytest.raises(ConfigError):
        decide_repartition(RepartitionSettings(bounds=(0, 4)), at=3, **base)


def noisy_run(
    settings: RepartitionSettings,
    noise: list[list[float]],
    *,
    overhead: float = 2.0,
    forget: bool = False,
) -> list[tuple[int, ...] | None]:
    """Feed a controller looks of four stages over 12 units, capacities 10, 2, 5, 10:
    each stage's time per batch ``overhead + C * units``, times ``noise[look][stage]``;
    ``forget``: drop the periods the cuts measured (no memory)."""
    devices, capacities = ["a", "b", "c", "d"], [10.0, 2.0, 5.0, 10.0]
    controller = RepartitionController(
        settings, devices=devices, bounds=[0, 3, 6, 9, 12], reference_unit_s=[1.0] * 12
    )
    total = dict.fromkeys(devices, 0.0)
    moves = []
    for look, factors in enumerate(noise, start=1):
        b = controller.bounds
        for i, d in enumerate(devices):
            total[d] += 10 * (overhead + capacities[i] * (b[i + 1] - b[i])) * factors[i]
        if forget:
            controller.tried.clear()
        decision = controller.look(10 * look, {d: counters(total[d], 10 * look) for d in devices})
        if decision.moves:
            controller.committed(decision)
        moves.append(decision.bounds)
    return moves


# b's time swings 1.6x on every other look, d's 1.3x on every third (load spikes)
NOISY = [[1.0, 1.6 if k % 2 else 1.0, 1.0, 1.3 if k % 3 == 0 else 1.0] for k in range(10)]


def test_noisy_times_do_not_make_the_cuts_oscillate() -> None:
    undamped = RepartitionSettings(first=1, every=1, gain=0.1, smoothing=0.0, revisit_looks=0)
    swinging = noisy_run(undamped, NOISY, forget=True)
    assert sum(m is not None for m in swinging) >= 8  # a move at nearly every look
    # any damping alone stops it: the cuts move once or twice, then stay
    for kept in (
        noisy_run(undamped, NOISY),
        noisy_run(replace(undamped, smoothing=0.5), NOISY, forget=True),
        noisy_run(replace(undamped, revisit_looks=10), NOISY, forget=True),
    ):
        assert sum(m is not None for m in kept) <= 3
        assert all(m is None for m in kept[4:])


def test_a_move_back_is_judged_by_the_period_those_cuts_measured() -> None:
    settings = RepartitionSettings(first=1, every=1, gain=0.1, smoothing=0.0, revisit_looks=0)
    # b's time swings: every other look it calls for the cuts just left
    moves = noisy_run(settings, NOISY[:4])
    first, *rest = [m for m in moves if m is not None]
    back = [d for d in noisy_run(settings, NOISY[:4], forget=True) if d is not None]
    assert back[2] == back[0]  # without the memory it goes back to the cuts it left
    assert first not in rest  # with it, it does not


def test_a_real_change_is_taken_at_once_and_forgets_what_cuts_measured() -> None:
    settings = RepartitionSettings(first=1, every=1, gain=0.1)
    controller = RepartitionController(
        settings, devices=["a", "b"], bounds=[0, 4, 8], reference_unit_s=[1.0] * 8
    )
    controller.look(1, {"a": counters(4, 1), "b": counters(4, 1)})
    assert controller.tried == {(0, 4, 8): 4.0}
    # noise (1.5x, within 1 + deviation): averaged with the past look
    noisy = controller.look(2, {"a": counters(8, 2), "b": counters(10, 2)})
    assert noisy.capacities == {"a": 1.0, "b": pytest.approx(1.375)} and not noisy.moves
    # a 10x slower: taken whole, and the old period is forgotten
    slow = controller.look(3, {"a": counters(48, 3), "b": counters(15, 3)})
    assert slow.capacities["a"] == pytest.approx(10.0)
    assert slow.moves and controller.tried == {(0, 4, 8): pytest.approx(40.0)}
    with pytest.raises(ConfigError):
        RepartitionSettings(smoothing=1.0)
    with pytest.raises(ConfigError):
        RepartitionSettings(deviation=-0.5)
    damped = RepartitionSettings(smoothing=0.25, deviation=3.0)
    assert RepartitionSettings.from_dict(damped.to_dict()) == damped
    assert "smoothing" not in RepartitionSettings().to_dict()  # old coordinators refuse it


# ---------------------------------------------------------------- a real pipeline


def _logged(text: str, event: str) -> list[dict[str, Any]]:
    """The JSON log lines of ``event``."""
    out = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("event") == event:
            out.append(record)
    return out


def test_cluster_async_run_repartitions_live_and_equals_the_reference(
    cluster: LocalCluster,
) -> None:
    batches = make_batches(10, 5, seed=7)
    since = {name: len(cluster.logs(name)) for name in ("coordinator", "s0", "s1", "s2")}
    report = cluster.fit(
        SPEC,
        batches,
        optimizer=ADAM,
        num_microbatches=1,
        schedule="async-1f1b",
        partition=[[0, 1], [1, 2], [2, 5]],
        # the first look moves two units forward (the test hook); the second, at a
        # gain no measurement reaches, keeps the cuts
        repartition={"first": 3, "every": 4, "gain": 0.95, "bounds": [0, 3, 4, 5]},
        progress=False,
    )
    assert report.steps == len(batches)
    looks = report.repartitions
    assert [r["at"] for r in looks] == [3, 7]
    assert [r["moved"] for r in looks] == [True, False]
    assert looks[0]["bounds"] == [0, 3, 4, 5] and looks[0]["plan_epoch"] == 1
    assert looks[1]["bounds"] == [0, 3, 4, 5] and looks[1]["plan_epoch"] == 1
    assert looks[1]["measured"] and set(looks[1]["capacities"]) == {"s0", "s1", "s2"}
    # the stages themselves say which units they train after each commit
    after = {"s0": [0, 3], "s1": [3, 4], "s2": [4, 5]}
    assert looks[0]["held"] == after and looks[1]["held"] == after
    # both looked while the pipeline ran; only the one that moved paused it and flushed
    considered = _logged(
        cluster.logs("coordinator")[since["coordinator"] :], "repartition_considered"
    )
    assert [(e["at"], e["flush"]) for e in considered if "flush" in e] == [(3, False), (7, False)]
    for name in ("s0", "s1", "s2"):
        prepared = _logged(cluster.logs(name)[since[name] :], "repartition_prepared")
        assert [e["step"] for e in prepared] == [3], name
    moved = train_async_reference(
        SPEC, batches, bounds=[0, 1, 2, 5], optimizer=ADAM, repartitions={3: [0, 3, 4, 5]}
    )
    plain = train_async_reference(SPEC, batches, bounds=[0, 1, 2, 5], optimizer=ADAM)
    for want in (moved, plain):
        assert report.losses == pytest.approx(want.losses, rel=1e-6)
        assert set(report.state_dict) == set(want.state_dict)
        for key, value in want.state_dict.items():
            torch.testing.assert_close(report.state_dict[key], value, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------- options and flags


def test_fit_options_take_repartition_only_for_async_runs_with_vertical_sync() -> None:
    from zpipe.client.options import TrainOptions

    base = {"optimizer": ADAM, "num_microbatches": 1, "schedule": "async-1f1b"}
    assert TrainOptions(**base, repartition=True).repartition_settings == RepartitionSettings()
    given = TrainOptions(**base, repartition={"first": 2, "gain": 0.0}).repartition_settings
    assert given == RepartitionSettings(first=2, gain=0.0)
    assert TrainOptions(**base).repartition_settings is None
    sync = TrainOptions(optimizer=ADAM, num_microbatches=2, repartition={"every": 5})
    assert sync.repartition_settings == RepartitionSettings(every=5)
    with pytest.raises(ConfigError, match="rebalance"):
        TrainOptions(optimizer=ADAM, num_microbatches=2, recover=True, repartition=True)
    with pytest.raises(ConfigError, match="vertical sync"):
        TrainOptions(**base, vertical_sync=False, repartition=True)
    with pytest.raises(ConfigError, match="unknown"):
        TrainOptions(**base, repartition={"often": 3})


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (["--repartition", "--recover"], "no --recover"),
        (
            ["--schedule", "async-1f1b", "--no-vertical-sync", "--repartition-every", "5"],
            "vertical sync",
        ),
        (["--schedule", "async-1f1b", "--repartition-gain", "1.5"], "[0, 1)"),
    ],
)
def test_train_cli_refuses_repartition_flags_that_do_not_fit(
    flags: list[str], error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from zpipe.cli.train import main

    with pytest.raises(SystemExit):
        main(["--local", "2", *flags])
    assert error in capsys.readouterr().err


def test_train_flags_make_the_repartition_settings() -> None:
    from zpipe.cli.train_args import build_parser, repartition_of

    parser = build_parser()
    args = parser.parse_args(["--local", "2", "--schedule", "async-1f1b"])
    assert repartition_of(args) is None
    args = parser.parse_args(
        ["--local", "2", "--repartition-first", "4", "--repartition-gain", "0"]
    )
    assert RepartitionSettings.from_dict(repartition_of(args) or {}) == RepartitionSettings(
        first=4, gain=0.0
    )
    args = parser.parse_args(["--local", "2", "--repartition-leave-out"])
    assert RepartitionSettings.from_dict(repartition_of(args) or {}) == RepartitionSettings(
        leave_out=True
    )


def test_cluster_sync_run_repartitions_live_and_equals_plain_training(
    cluster: LocalCluster,
) -> None:
    batches = make_batches(8, 6, seed=9)
    report = cluster.fit(
        SPEC,
        batches,
        optimizer=ADAM,
        num_microbatches=1,
        schedule="1f1b",
        partition=[[0, 2], [2, 4], [4, 5]],
        repartition={"first": 3, "every": 100, "bounds": [0, 1, 2, 5]},
        progress=False,
    )
    assert report.steps == len(batches)
    [look] = report.repartitions
    assert look["at"] == 3 and look["moved"] and look["plan_epoch"] == 1
    assert look["held"] == {"s0": [0, 1], "s1": [1, 2], "s2": [2, 5]}
    model = build_full_model(SPEC).train()
    optimizer = make_optimizer(ADAM, model.parameters())
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x)[0], y)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert report.losses == pytest.approx(losses, rel=1e-5)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(report.state_dict[key], value, rtol=1e-5, atol=1e-6)
