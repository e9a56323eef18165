"""The coordinator's side of a re-mapped death (zpipe.coordinator.runs.lossy_remap) and of a
request sent again (zpipe.coordinator.runs.lossy.start_lossy_run), pure:
a flow driven by feeding events, as h11's tests feed bytes."""

from __future__ import annotations

from typing import Any, TypeVar

import numpy as np
import torch

from zpipe._errors import ConfigError
from zpipe.client.runs.lossy import lossy_request
from zpipe.config import Timeouts
from zpipe.coordinator.commands import AwaitStages, Command, RunJob, Send
from zpipe.coordinator.flows import Flow
from zpipe.coordinator.membership import Member, Membership
from zpipe.coordinator.runs.lossy import start_lossy_run
from zpipe.coordinator.runs.lossy_remap import RemapRun, keep_replica, results_remapping
from zpipe.coordinator.state import ControlState
from zpipe.lossy.data import Dataset
from zpipe.lossy.partial import init_mlp
from zpipe.lossy.partition import partition
from zpipe.lossy.shard import Topology
from zpipe.lossy.simulate import RunConfig, prepare_run
from zpipe.protocol import WireMessage
from zpipe.protocol.client_control import RunFailed
from zpipe.protocol.lossy import LossyDead, LossyHold, LossyRemap, LossyReplica, LossyResult

SIZES = [6, 8, 8, 3]
N_DATA = 50


def _state() -> tuple[ControlState, dict[int, Member]]:
    timeouts = Timeouts(heartbeat_interval_s=1.0, suspect_after_intervals=3, probe_intervals=2)
    membership = Membership(heartbeat_interval_s=1.0, suspect_after_intervals=3, probe_intervals=2)
    state = ControlState(timeouts=timeouts, membership=membership)
    members = {
        d: membership.register(
            name=n,
            routing_id=n.encode(),
            data_endpoint=f"tcp://h:{d}",
            info={},
            public_key=None,
            now=0.0,
        )
        for d, n in enumerate("abcd")
    }
    return state, members


def _run(alloc: Any) -> RemapRun:
    rng = np.random.default_rng(0)
    prr = rng.uniform(0.5, 1.0, size=(4, 4))
    np.fill_diagonal(prr, 1.0)
    return RemapRun(
        run=7,
        epoch=3,
        n_data=N_DATA,
        prr=prr,
        params=init_mlp(SIZES, seed=0),
        inputs=np.zeros((N_DATA, 2, 6)),
        labels=np.zeros((N_DATA, 2), dtype=np.int64),
        x_test=None,
        alloc=alloc,
    )


def _result() -> LossyResult:
    """A survivor's result, as the coordinator's shell hands it on (parsed)."""
    return LossyResult(
        run=7, device=0, error="", layers=[], losses=[], propagation={}, traffic={},
        arrivals=[], waits=[], late=0, protocol_errors=0, wall_s=0.0,
    )  # fmt: skip


_W = TypeVar("_W", bound=WireMessage)


def _sent(commands: list[Command], kind: type[_W]) -> dict[str, _W]:
    sends = [c for c in commands if isinstance(c, Send)]
    return {c.peer: c.message for c in sends if isinstance(c.message, kind)}


def _start(state: ControlState, remap: RemapRun, members: dict[int, Member]) -> list[Any]:
    got: list[Any] = []

    def flow() -> Flow:
        got.append((yield from results_remapping(state, remap, dict(members), 100.0)))

    state.flows.start(flow(), now=0.0)
    return got


def _die(state: ControlState, name: str, now: float) -> list[Command]:
    state.membership.declare_dead(name, "test", now)
    return state.flows.stage_lost(name, RuntimeError("dead"), now)


def test_a_death_holds_the_survivors_and_switches_after_the_furthest() -> None:
    state, members = _state()
    alloc = partition("hybrid", SIZES, 4)
    remap = _run(alloc)
    got = _start(state, remap, members)
    notices = _die(state, "b", 1.0)
    dead = _sent(notices, LossyDead)
    assert sorted(dead) == ["a", "c", "d"] and all(m.remap for m in dead.values())
    assert all(m.device == 1 and m.epoch == 3 for m in dead.values())
    # nothing is decided before every survivor said how far it got
    frontiers = {"a": 12, "c": 15, "d": 9}
    out: list[Command] = []
    for name, frontier in frontiers.items():
        hold = LossyHold(run=7, device=0, frontier=frontier)
        out += state.flows.reply(name, hold, now=2.0) or []
    remapped = _sent(out, LossyRemap)
    assert sorted(remapped) == ["a", "c", "d"]
    bodies = remapped
    assert {b.switch_at for b in bodies.values()} == {16}
    after = remap.alloc
    assert 1 not in after.device_of and bodies["a"].alloc == after.to_dict()
    # the taker gets b's rows at their run-start values; the others nothing
    topo = Topology(alloc)
    takers = [n for n, b in bodies.items() if b.pieces]
    assert len(takers) == 1
    taker = bodies[takers[0]]
    for (layer, a, z), w in zip(taker.pieces or [], remapped[takers[0]].tensors[::2], strict=False):
        sl = topo.slice_of(layer, 1)
        assert sl is not None and (sl.start, sl.stop) == (a, z)
        assert np.array_equal(w.numpy(), remap.params[layer - 1][0][a:z])
    assert remap.remaps == [[1, "b", 16, after.to_dict(), None]]  # no replica: run start
    # the run then waits for the survivors' results only
    for name in ("a", "c"):
        state.flows.reply(name, _result(), now=3.0)
    assert not got
    state.flows.reply("d", _result(), now=3.0)
    assert sorted(got[0]) == ["a", "c", "d"]


def test_the_taken_over_rows_come_from_the_dead_devices_latest_replica() -> None:
    state, members = _state()
    alloc = partition("hybrid", SIZES, 4)
    remap = _run(alloc)
    _start(state, remap, members)
    topo = Topology(alloc)
    mine = [(n, topo.slice_of(n, 1)) for n in range(1, len(SIZES))]
    slices = [[n, sl.start, sl.stop] for n, sl in mine if sl is not None]

    def replica(step: int, value: float, sender: str = "b") -> list[Command]:
        tensors = []
        for n, a, z in slices:
            tensors += [
                torch.full((z - a, SIZES[n - 1]), value, dtype=torch.float64),
                torch.full((z - a,), value, dtype=torch.float64),
            ]
        message = LossyReplica(run=7, device=1, step=step, slices=slices, tensors=tuple(tensors))
        return keep_replica(state, sender, message)

    assert replica(10, 1.0) == [] and replica(20, 2.0) == [] and replica(15, 3.0) == []
    assert replica(30, 9.0, sender="c")  # another stage's word for b: dropped, logged
    _die(state, "b", 1.0)
    out: list[Command] = []
    for name in ("a", "c", "d"):
        hold = LossyHold(run=7, device=0, frontier=25)
        out += state.flows.reply(name, hold, now=2.0) or []
    remapped = _sent(out, LossyRemap)
    taker = next(n for n, m in remapped.items() if m.pieces)
    rows = remapped[taker].tensors[: 2 * len(remapped[taker].pieces or [])]
    assert rows and all(bool((t == 2.0).all()) for t in rows)  # step 20's, the newest
    assert remap.remaps[0][4] == 20
    assert 7 not in state.lossy_runs or state.lossy_runs[7] is remap


def test_no_switch_when_a_survivor_is_past_training() -> None:
    state, members = _state()
    remap = _run(partition("hybrid", SIZES, 4))
    before = remap.alloc
    _start(state, remap, members)
    _die(state, "c", 1.0)
    out: list[Command] = []
    for name, frontier in {"a": 20, "b": N_DATA + 1, "d": 30}.items():
        hold = LossyHold(run=7, device=0, frontier=frontier)
        out += state.flows.reply(name, hold, now=2.0) or []
    remapped = _sent(out, LossyRemap)
    assert sorted(remapped) == ["a", "b", "d"]
    assert all(m.switch_at is None for m in remapped.values())
    assert remap.alloc is before and remap.remaps == []


def test_the_taker_of_the_input_or_output_layer_gets_the_inputs_or_labels() -> None:
    state, members = _state()
    remap = _run(partition("vertical", SIZES, 4))  # device k owns layer k alone
    _start(state, remap, members)
    _die(state, "a", 1.0)  # the input layer's only owner
    out: list[Command] = []
    for name in ("b", "c", "d"):
        hold = LossyHold(run=7, device=0, frontier=5)
        out += state.flows.reply(name, hold, now=2.0) or []
    bodies = _sent(out, LossyRemap)
    owners = {d for d, _ in remap.alloc.owners(0)}
    assert len(owners) == 1 and 0 not in owners
    taker = "abcd"[owners.pop()]
    assert bodies[taker].inputs and not bodies[taker].pieces  # the input layer has no weights
    (inputs,) = bodies[taker].tensors
    assert tuple(inputs.shape) == (N_DATA, 2, 6)
    assert all(not b.inputs and not b.tensors for n, b in bodies.items() if n != taker)


def test_a_request_sent_again_shares_the_run_being_made() -> None:
    # The client sends its lossy_run_request again when its connection is made again:
    # a coordinator still running it must not start a second run over the same stages.
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(40, 6)), rng.integers(0, 3, size=40)
    data = Dataset("random", x, y, x[:4], y[:4])
    cfg = RunConfig(
        allocation="hybrid", n_devices=2, hidden=(4,), batch_size=4, n_data=3, mapping="identity"
    )
    request = lossy_request(prepare_run(cfg, data), data, stages=2, request_id=99)
    state, _ = _state()
    first = start_lossy_run(state, b"route-1", request, now=0.0)
    jobs = [c for c in first if isinstance(c, RunJob) and isinstance(c.job, AwaitStages)]
    assert len(jobs) == 1
    assert start_lossy_run(state, b"route-2", request, now=1.0) == []  # shares the first
    out = state.flows.job_failed(jobs[0].tag, ConfigError("no stages"), now=2.0)
    answers = [c for c in out if isinstance(c, Send) and isinstance(c.message, RunFailed)]
    assert sorted(c.to for c in answers) == [b"route-1", b"route-2"]
    # once answered, the same id starts a run again (a restarted coordinator's case)
    again = start_lossy_run(state, b"route-3", request, now=3.0)
    assert any(isinstance(c, RunJob) for c in again)
