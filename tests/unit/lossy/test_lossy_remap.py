"""Re-mapping a dead device's super neurons (zpipe.lossy.remap) and the simulation of a
death (zpipe.lossy.death_sim), pure."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from zpipe._errors import ConfigError, TransportTimeout
from zpipe.lossy.data import Dataset
from zpipe.lossy.death_sim import (
    DeviceDeath,
    evaluate_after,
    evaluate_with_death,
    heard_from_arrivals,
    train_with_death,
)
from zpipe.lossy.device_run import Switch
from zpipe.lossy.evaluation import EvalSpec, eval_steps
from zpipe.lossy.mapping import mapping_score, pass_counts
from zpipe.lossy.partition import Allocation, partition
from zpipe.lossy.remap import assemble_slices, initial_pieces, merge_super_neurons, remap_dead
from zpipe.lossy.shard import Topology
from zpipe.lossy.simulate import PreparedRun, RunConfig, prepare_run
from zpipe.lossy.trace import evaluate_in_process, same_run, train_in_process
from zpipe.stage.executors.lossy_passes import SharedInbox


def _data() -> Dataset:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(120, 12))
    y = rng.integers(0, 5, size=120)
    return Dataset("random", x, y, x[:20], y[:20])


def _prepared(allocation: str = "hybrid", n_devices: int = 4, n_data: int = 24) -> PreparedRun:
    cfg = RunConfig(
        allocation=allocation,
        n_devices=n_devices,
        region_m=30.0,
        seed=5,
        hidden=(8, 6),
        lr=0.1,
        batch_size=5,
        n_data=n_data,
        mapping="exhaustive",
    )
    return prepare_run(cfg, _data())


@pytest.mark.parametrize(
    ("allocation", "n_devices"), [("hybrid", 4), ("horizontal", 3), ("vertical", 4), ("hybrid", 6)]
)
def test_the_survivors_keep_their_neurons_and_the_best_placement_wins(
    allocation: str, n_devices: int
) -> None:
    prepared = _prepared(allocation, n_devices)
    alloc, prr = prepared.alloc, prepared.topology.prr_measured
    for dead in alloc.device_of:
        after = remap_dead(alloc, prr, dead)
        assert after is not None
        assert dead not in after.device_of and set(after.device_of) == set(alloc.device_of) - {dead}
        before_topo, after_topo = Topology(alloc), Topology(after)
        for device in after.device_of:
            for layer in range(alloc.n_layers):
                old = before_topo.slice_of(layer, device)
                new = after_topo.slice_of(layer, device)
                assert old is None or (
                    new is not None and new.start <= old.start < old.stop <= new.stop
                )
        # the chosen placement scores best among every survivor that can take them
        orphan_k = alloc.device_of.index(dead)
        orphan = alloc.super_neurons[orphan_k]
        chosen = mapping_score(pass_counts(after).astype(float), prr, after.device_of)
        scores = []
        for k, device in enumerate(alloc.device_of):
            merged = merge_super_neurons(alloc.super_neurons[k], orphan)
            if device == dead or merged is None:
                continue
            sns = [merged if j == k else sn for j, sn in enumerate(alloc.super_neurons)]
            trial = Allocation(
                alloc.kind,
                alloc.layer_sizes,
                alloc.groups,
                tuple(sn for j, sn in enumerate(sns) if j != orphan_k),
                tuple(d for j, d in enumerate(alloc.device_of) if j != orphan_k),
            )
            scores.append(mapping_score(pass_counts(trial).astype(float), prr, trial.device_of))
        assert scores and chosen == max(scores)


def test_a_taker_must_keep_one_contiguous_range_per_layer() -> None:
    alloc = partition("horizontal", [12, 8, 8, 5], 4)  # slots 0..3 of every layer
    prr = np.full((4, 4), 0.1) + 0.9 * np.eye(4)
    prr[1, 3] = prr[3, 1] = 1.0  # device 3 has the best links to device 1, but is not adjacent
    after = remap_dead(alloc, prr, 1)
    assert after is not None
    taker = [d for d in after.device_of if Topology(after).slice_of(1, d).width > 2]  # type: ignore[union-attr]
    assert taker and taker[0] in (0, 2)
    assert merge_super_neurons(alloc.super_neurons[3], alloc.super_neurons[1]) is None
    with pytest.raises(ConfigError):
        remap_dead(alloc, prr, 7)


def test_taken_over_rows_come_at_their_run_start_values_and_must_fit() -> None:
    prepared = _prepared()
    alloc = prepared.alloc
    dead = alloc.device_of[0]
    after = remap_dead(alloc, prepared.topology.prr_measured, dead)
    assert after is not None
    before_topo = Topology(alloc)
    takers = [d for d in after.device_of if initial_pieces(alloc, after, d, prepared.params)]
    assert len(takers) == 1
    pieces = initial_pieces(alloc, after, takers[0], prepared.params)
    for layer, a, b, w, _ in pieces:
        sl = before_topo.slice_of(layer, dead)
        assert sl is not None and (sl.start, sl.stop) == (a, b)
        assert np.array_equal(w, prepared.params[layer - 1][0][a:b])
    own = {
        layer: (sl, np.ones((sl.width, alloc.layer_sizes[layer - 1])), np.ones(sl.width))
        for layer in range(1, alloc.n_layers)
        if (sl := before_topo.slice_of(layer, takers[0])) is not None
    }
    weights = assemble_slices(after, takers[0], own, pieces)
    after_topo = Topology(after)
    for layer, (w, _) in weights.items():
        sl = after_topo.slice_of(layer, takers[0])
        assert sl is not None and w.shape[0] == sl.width
    with pytest.raises(ConfigError):
        assemble_slices(after, takers[0], own, pieces[1:] if len(pieces) > 1 else [])


def test_a_death_heard_to_the_end_changes_only_the_dead_devices_counts_and_slices() -> None:
    prepared = _prepared()
    data = _data()
    plain = train_in_process(prepared, data)
    dead = prepared.alloc.device_of[1]
    survivors = set(prepared.alloc.device_of) - {dead}
    trace = train_with_death(prepared, data, DeviceDeath(dead, dict.fromkeys(survivors, 10**9)))
    topo = Topology(prepared.alloc)
    for layer, ((w, b), (w2, b2)) in enumerate(zip(plain.params, trace.params, strict=True), 1):
        keep = np.ones(len(b), dtype=bool)
        sl = topo.slice_of(layer, dead)
        if sl is not None:
            keep[sl.start : sl.stop] = False
            assert not w2[~keep].any() and not b2[~keep].any()
        assert np.array_equal(w[keep], w2[keep]) and np.array_equal(b[keep], b2[keep])
    assert {k: v for k, v in plain.arrivals.items() if k[3] != dead} == trace.arrivals
    assert heard_from_arrivals(prepared.alloc, prepared.n_data, dead, trace.arrivals)
    # heard only until its first pass: the survivors' weights now differ
    cut = train_with_death(prepared, data, DeviceDeath(dead, dict.fromkeys(survivors, 0)))
    assert not same_run(trace, cut)


def test_a_remap_at_the_first_mini_batch_is_the_new_allocation_from_the_start() -> None:
    prepared = _prepared()
    data = _data()
    dead = prepared.alloc.device_of[2]
    after = remap_dead(prepared.alloc, prepared.topology.prr_measured, dead)
    assert after is not None
    remapped = train_with_death(prepared, data, DeviceDeath(dead, {}, 1, after))
    fresh = train_in_process(replace(prepared, alloc=after, period=0), data)
    assert same_run(remapped, fresh, rtol=0.0)
    with pytest.raises(ConfigError):
        DeviceDeath(dead, {}, 1, None)


def test_a_stage_holds_at_its_frontier_until_the_coordinator_decides() -> None:
    st = SimpleNamespace(
        spec=SimpleNamespace(n_data=10, wait_s=60.0), inbox={}, consumed=set(), late=0
    )
    inbox = SharedInbox(st)  # type: ignore[arg-type]
    assert [inbox.begin(d) for d in (1, 2, 3)] == [True, True, True]
    assert inbox.hold(2) == 3 and inbox.is_dead(2)
    assert inbox.begin(3)  # at the frontier: goes on
    assert (inbox.route(3, False), inbox.route(4, False), inbox.route(1, True)) == (
        "now",
        "hold",
        "hold",
    )
    with ThreadPoolExecutor(1) as pool:
        later = pool.submit(inbox.begin, 4)
        assert not later.done()  # held until the decision
        alloc = partition("hybrid", [6, 4, 3], 2)
        switch = Switch(4, alloc, Topology(alloc), ())
        inbox.decide(switch)
        assert later.result(timeout=30) is False  # mini-batch 4 belongs to the new allocation
    assert (inbox.route(3, False), inbox.route(4, False), inbox.route(1, True)) == (
        "now",
        "next",
        "next",
    )
    assert inbox.next_switch() is switch
    inbox.switched()
    assert inbox.begin(4) and inbox.route(4, False) == "now"
    # a second death, declined: the passes go on as they were
    assert inbox.hold(0) == 4
    inbox.decide(None)
    assert inbox.begin(5) and inbox.next_switch() is None and inbox.past_training
    assert inbox.hold(1) == 11  # past training: nothing left to switch


def test_a_hold_the_coordinator_never_decides_ends_the_run_with_a_timeout() -> None:
    st = SimpleNamespace(
        spec=SimpleNamespace(n_data=10, wait_s=0.05), inbox={}, consumed=set(), late=0
    )
    inbox = SharedInbox(st)  # type: ignore[arg-type]
    assert inbox.begin(1) and inbox.hold(2) == 1
    with pytest.raises(TransportTimeout, match="lossy_remap"):
        inbox.begin(2)
    with pytest.raises(TransportTimeout):
        inbox.finish()


@pytest.mark.parametrize("dead_at", [0, 1, 2])
def test_test_passes_after_a_null_filled_death_are_those_of_a_silent_device(dead_at: int) -> None:
    # A null-filled partial is zeros: so a device that sends nothing is, for the others'
    # predictions, a device whose slices (and input columns) are zero and whose sends
    # all arrive. Only the traffic differs: the dead device's own sends are not counted.
    prepared = _prepared()
    data = _data()
    params = train_in_process(prepared, data).params
    topo = Topology(prepared.alloc)
    dead = prepared.alloc.device_of[dead_at]
    silent = [(w.copy(), b.copy()) for w, b in params]
    for layer, (w, b) in enumerate(silent, 1):
        sl = topo.slice_of(layer, dead)
        if sl is not None:
            w[sl.start : sl.stop], b[sl.start : sl.stop] = 0.0, 0.0
    x = data.x_test.copy()
    sl0 = topo.slice_of(0, dead)
    if sl0 is not None:
        x[:, sl0.start : sl0.stop] = 0.0
    spec = EvalSpec(len(x), 5, repeats=2)
    alive = evaluate_in_process(prepared, silent, x, spec)
    died = evaluate_with_death(prepared, silent, x, spec, dead)
    owners = [d for d, _ in topo.owners[topo.last]]
    assert died.predictions.keys() == alive.predictions.keys()
    for step, views in alive.predictions.items():
        want = [v for d, v in zip(owners, views, strict=True) if d != dead]
        assert len(died.predictions[step]) == len(want)
        assert all(np.array_equal(a, b) for a, b in zip(died.predictions[step], want, strict=True))
    # the dead device's sends: one per (pass, receiver) it would have sent to
    sends = sum(
        1
        for layer in range(topo.n_layers)
        if topo.slice_of(layer, dead) is not None
        for dst in _test_receivers(topo, layer, dead)
    ) * len(eval_steps(spec))
    assert sends > 0 and died.traffic.messages == alive.traffic.messages - sends
    # and the dead device's weights do not matter: it sends nothing
    assert died.same_as(evaluate_with_death(prepared, params, x, spec, dead))
    # the test passes a death asks for: nobody's, the null-filled run's, the remapped one's
    assert evaluate_after(prepared, silent, x, spec, None).same_as(alive)
    assert evaluate_after(prepared, silent, x, spec, DeviceDeath(dead, {})).same_as(died)
    after = remap_dead(prepared.alloc, prepared.topology.prr_measured, dead)
    assert after is not None
    remapped = evaluate_after(prepared, params, x, spec, DeviceDeath(dead, {}, 5, after))
    on_after = evaluate_in_process(replace(prepared, alloc=after, period=0), params, x, spec)
    assert remapped.same_as(on_after) and not remapped.same_as(died)
    assert not died.same_as(evaluate_in_process(prepared, params, data.x_test, spec))
    with pytest.raises(ConfigError):
        evaluate_with_death(prepared, params, x, spec, 9)


def _test_receivers(topo: Topology, layer: int, device: int) -> set[int]:
    """Whom ``device`` sends its forward partial of ``layer`` in a test pass."""
    if layer == topo.last:
        return {d for d, _ in topo.owners[layer]} - {device}
    return {d for d, _ in topo.owners[layer + 1]} - {device}
