"""FTPipeHD's fast recovery of an asynchronous run with live copies, at the coordinator
(zpipe.coordinator.runs.async_fast_recovery): the survivors asked to keep their state
(they send its keys and their update counts, never the tensors), the plan of
zpipe.recovery.fast_recovery carried out (each dead unit from its nearest copy: the
chain copy a live stage holds, else the global copy here, with the assignment; each
survivor's unit fetched by its new holder, from its own snapshot or peer to peer,
the holder granted that fetch alone), every unit at the acknowledged version, and
the plan's summary in ``run_ready``. In-process, no sockets: events fed, commands
read."""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import torch

from tests._support.coordinator_harness import SPEC, Harness
from zpipe.coordinator.commands import AllowPeers, AwaitSettled
from zpipe.coordinator.events import StallReported
from zpipe.coordinator.runs.async_fast_recovery import this_fits_copies
from zpipe.coordinator.runs.async_repartition import LiveRepartitioning
from zpipe.planner import ClusterLink
from zpipe.planner.ftpipehd import ftpipehd_partition
from zpipe.protocol.client_control import Stalled
from zpipe.recovery.fast_recovery_inputs import UNMEASURED
from zpipe.recovery.live_copies import CopyLedger, CopyRecord, state_digest
from zpipe.training.repartition import RepartitionController, RepartitionSettings
from zpipe.transport.codec import Message

NAMES = ["a", "b", "c", "d"]
PARTITION = [[0, 2], [2, 3], [3, 4], [4, 6]]
TRAIN = {
    "schedule": "async-1f1b",
    "num_microbatches": 1,
    "optimizer": {"name": "sgd", "lr": 0.1},
    "async": {"chain_every": 2, "global_every": 4},
}


def _request(h: Harness, **request: Any) -> None:
    h.client(
        "run_request", model=SPEC.to_dict(), dtype="float32", sink_endpoint="tcp://client:9",
        wait_for_stages_s=0.0, mode="train", recover=True, planner="straight", **request,
    )  # fmt: skip


def _start(h: Harness) -> int:
    for name in NAMES:
        h.register(name)
    _request(h, train=TRAIN, stage_names=NAMES, partition=PARTITION)
    run = h.core.run
    assert run is not None, h.events("run_failed")
    h.answer_all("ready", list(run.devices), run=run.run, build_s=0.01)
    h.client("run_go", run=run.run)
    h.answer_all("connected", list(run.devices), run=run.run)
    return run.run


def _units(start: int, end: int, value: float) -> dict[str, torch.Tensor]:
    return {f"units.{u}.weight": torch.full((2,), value + u) for u in range(start, end)}


def _copy(h: Harness, name: str, run: int, kind: str, step: int, state: dict[str, Any],
          **extra: Any) -> None:  # fmt: skip
    start, end = PARTITION[NAMES.index(name)]
    body = {"run": run, "name": name, "kind": kind, "step": step, "start": start, "end": end,
            "keys": list(state), "digest": state_digest(state), **extra}  # fmt: skip
    h.feed_message(name, Message("async_copy", body, tensors=tuple(state.values())))  # type: ignore[attr-defined]


def _copies(h: Harness, run: int) -> None:
    """Global copies of every stage after mini-batch 4 (held here), chain copies after 6:
    a's at b, b's at c, c's at d (announced), d's here."""
    for name in NAMES:
        start, end = PARTITION[NAMES.index(name)]
        _copy(h, name, run, "global", 4, _units(start, end, 40.0))
    for name, holder in (("a", "b"), ("b", "c"), ("c", "d")):
        _copy(h, name, run, "chain", 6, {}, holder=holder, digest="0")
    _copy(h, "d", run, "chain", 6, _units(4, 6, 60.0))


def _resume(h: Harness, run: int, dead: list[str], acknowledged: int) -> None:
    survivors = [n for n in NAMES if n not in dead]
    train = {**TRAIN, "async": {**TRAIN["async"], "depth": 4}}
    resume = {"run": run, "step": acknowledged, "dead": dead, "consistency": "fast", "live": True}
    _request(h, train=train, stage_names=survivors, resume=resume)


def _kept_state(h: Harness, run: int, name: str, start: int, end: int, count: int) -> None:
    """``name`` kept its state of units ``[start, end)`` after ``count`` updates: only
    the keys and the count come back."""
    (ask,) = h.to(name, "weights_request")[-1:]
    assert ask.body["latest"] is True and ask.body["optimizer"] is True
    assert ask.body["keep"] is True
    keys = list(_units(start, end, 100.0))
    body = {"name": name, "keys": keys, "error": "", "step": 0, "run": run,
            "completed": count, "updates": count}  # fmt: skip
    h.feed_message(name, Message("weights", body))  # type: ignore[attr-defined]


def _confirm(
    h: Harness, holder: str, owner: str, run: int, step: int, units: tuple[int, int]
) -> None:
    """``holder`` says it holds ``owner``'s chain copy of ``units`` (asked with ``keep``:
    only the keys come back; the new holder fetches the tensors from there)."""
    (ask,) = h.to(holder, "weights_request")[-1:]
    start, end = units
    assert ask.body["snapshot"] == [
        {"owner": owner, "run": run, "step": step, "start": start, "end": end}
    ]
    assert ask.body["keep"] is True
    body = {"name": holder, "keys": list(_units(start, end, 0.0)), "error": "", "step": 0,
            "run": 0}  # fmt: skip
    h.feed_message(holder, Message("weights", body))  # type: ignore[attr-defined]


def _survivors_answer(h: Harness, run: int, updates: dict[str, int]) -> None:
    for name, count in updates.items():
        start, end = PARTITION[NAMES.index(name)]
        _kept_state(h, run, name, start, end, count)


def _assigned(h: Harness, names: list[str]) -> dict[str, dict[str, Any]]:
    """What each stage's assignment carries (the dead's units, from their copies) and
    fetches (the survivors' units, by unit: (from, owner, step, restart))."""
    out = {}
    for name in names:
        assign = h.to(name, "assign")[-1]
        state = dict(zip(assign.body["state_keys"], assign.tensors, strict=True))
        fetched = {}
        for e in assign.body.get("fetch") or []:
            for u in range(e["start"], e["end"]):
                fetched[u] = (e["from"], e["owner"], e["step"], e["restart"])
        out[name] = {
            "range": (assign.body["start"], assign.body["end"]),
            "weights": {k: float(t[0]) for k, t in state.items() if "#" not in k},
            "versions": {k: t.tolist() for k, t in state.items() if k.endswith("#live_versions")},
            "fetch": assign.body.get("fetch"),
            "fetched": fetched,
        }
    return out


def _fetched(got: dict[str, dict[str, Any]]) -> dict[int, tuple[str, str, int]]:
    """Every fetched unit: (its new holder, where from, the survivor's update count);
    each at the acknowledged version ``restart`` names (checked by the caller)."""
    return {u: (n, f[0], f[2]) for n, g in got.items() for u, f in g["fetched"].items()}


def _restarts(got: dict[str, dict[str, Any]]) -> list[Any]:
    return [f[3] for g in got.values() for f in g["fetched"].values()]


def _grants(h: Harness) -> list[dict[str, Any]]:
    """The fetch grants the stages were given (by holder) before the assignments."""
    return [dict(j.fetches) for j in h.jobs if isinstance(j, AllowPeers) and j.fetches]


def _ready(h: Harness, names: list[str]) -> dict[str, Any]:
    run = h.core.run
    assert run is not None
    h.answer_all("ready", names, run=run.run, build_s=0.01)
    ready = h.to_client("run_ready")[-1]
    assert ready.body["run"] == run.run
    fast = ready.body["fast_recovery"]
    assert isinstance(fast, dict)
    return fast


def test_one_death_restores_the_dead_units_from_the_chain_copy_the_next_stage_holds() -> None:
    h = Harness()
    run = _start(h)
    _copies(h, run)
    h.advance(8.0, alive=("a", "c", "d"))  # b dies; c holds its chain copy of 6
    _resume(h, run, ["b"], acknowledged=7)
    _survivors_answer(h, run, {"a": 8, "c": 9, "d": 9})
    # c confirms it holds b's chain copy (by owner, run and mini-batch): keys only
    _confirm(h, "c", "b", run, 6, (2, 3))
    got = _assigned(h, ["a", "c", "d"])
    # eq. 5 over three survivors with no measurements: two units each
    assert [got[n]["range"] for n in ("a", "c", "d")] == [(0, 2), (2, 4), (4, 6)]
    # nothing comes with an assignment: b's unit 2 goes to c, which holds its chain
    # copy (6) and loads it in place
    assert all(not g["weights"] and not g["versions"] for g in got.values())
    (chain,) = [e for e in got["c"]["fetch"] if e["owner"] == "b"]
    assert (chain["from"], chain["run"], chain["step"], chain["start"], chain["end"]) == (
        "c",
        run,
        6,
        2,
        3,
    )
    # each survivor loads the units it keeps from its own snapshot (its update count):
    # every unit put at version 7 where it is loaded; nothing travels
    assert _fetched(got) == {0: ("a", "a", 8), 1: ("a", "a", 8), 2: ("c", "c", 6),
                             3: ("c", "c", 9), 4: ("d", "d", 9), 5: ("d", "d", 9)}  # fmt: skip
    assert all(r == {"version": 7, "depth": 4} for r in _restarts(got))
    assert _grants(h) == []  # no stage fetches from another
    fast = _ready(h, ["a", "c", "d"])
    assert fast["resume_at"] == 7 and fast["dead"] == ["b"]
    assert fast["copies_used"] == {"chain@c": [2]}
    assert fast["max_lost"] == 1  # unit 2 misses the update of mini-batch 6
    kinds = {s["unit"]: (s["kind"], s["source"]) for s in fast["sources"]}
    assert kinds == {0: ("kept", "a"), 1: ("kept", "a"), 2: ("chain", "c"), 3: ("kept", "c"),
                     4: ("kept", "d"), 5: ("kept", "d")}  # fmt: skip
    (logged,) = h.events("async_fast_recovery")
    assert logged["resume_at"] == 7


def test_two_adjacent_deaths_take_the_first_ones_units_from_the_global_copy() -> None:
    h = Harness()
    run = _start(h)
    _copies(h, run)
    h.advance(8.0, alive=("a", "d"))  # b and c die: b's chain copy died with c
    _resume(h, run, ["b", "c"], acknowledged=7)
    _survivors_answer(h, run, {"a": 8, "d": 9})
    # c's units from its chain copy at d (6), confirmed by d after its own state
    _confirm(h, "d", "c", run, 6, (3, 4))
    got = _assigned(h, ["a", "d"])
    assert [got[n]["range"] for n in ("a", "d")] == [(0, 3), (3, 6)]
    weights = {k: v for g in got.values() for k, v in g["weights"].items()}
    # b's unit 2 from the global copy of mini-batch 4, held here; c's from its chain
    # copy, which d loads in place
    assert weights == {"units.2.weight": 42.0}
    assert _fetched(got) == {0: ("a", "a", 8), 1: ("a", "a", 8), 3: ("d", "d", 6),
                             4: ("d", "d", 9), 5: ("d", "d", 9)}  # fmt: skip
    fast = _ready(h, ["a", "d"])
    assert fast["copies_used"] == {"global": [2], "chain@d": [3]}
    assert fast["max_lost"] == 3 and fast["lost"] == {"2": 3, "3": 1}
    assert fast["dead"] == ["b", "c"]


def test_a_dead_stage_without_any_copy_restarts_its_units_from_the_initial_weights() -> None:
    h = Harness()
    run = _start(h)
    h.advance(8.0, alive=("a", "c", "d"))  # b dies before its first copy was made
    _resume(h, run, ["b"], acknowledged=1)
    _survivors_answer(h, run, {"a": 1, "c": 2, "d": 3})
    assert not h.to_client("run_failed")
    # nobody is asked for a copy: there is none
    assert not [m for n in "acd" for m in h.to(n, "weights_request") if m.body.get("snapshot")]
    got = _assigned(h, ["a", "c", "d"])
    assert [got[n]["range"] for n in ("a", "c", "d")] == [(0, 2), (2, 4), (4, 6)]
    # nothing comes with an assignment: b's unit 2 is built by its new holder c from
    # the model spec (version 0), put at the acknowledged version like the rest
    assert all(not g["weights"] and not g["versions"] for g in got.values())
    (entry,) = [e for e in got["c"]["fetch"] if e.get("initial")]
    assert (entry["from"], entry["owner"], entry["step"], entry["start"], entry["end"]) == (
        "c",
        "b",
        0,
        2,
        3,
    )
    assert _fetched(got)[2] == ("c", "c", 0)
    assert all(r == {"version": 1, "depth": 4} for r in _restarts(got))
    assert _grants(h) == []  # built in place: no fetch from a peer
    fast = _ready(h, ["a", "c", "d"])
    assert fast["copies_used"] == {"initial": [2]}
    assert fast["max_lost"] == 1 and fast["lost"] == {"2": 1}
    kinds = {s["unit"]: (s["kind"], s["source"], s["version"]) for s in fast["sources"]}
    assert kinds[2] == ("initial", "c", 0)
    (warned,) = h.events("fast_initial_weights")
    assert warned["units"] == [2] and warned["progress_lost"] == 1


def test_a_fast_resume_of_a_run_the_coordinator_does_not_hold_is_refused() -> None:
    h = Harness()
    run = _start(h)
    h.advance(8.0, alive=("a", "c", "d"))
    _resume(h, run + 5, ["b"], acknowledged=3)
    (failed,) = h.to_client("run_failed")
    assert "no broken asynchronous run" in failed.body["error"]


def test_the_last_stages_units_come_from_its_chain_copy_at_the_coordinator() -> None:
    h = Harness()
    run = _start(h)
    _copies(h, run)
    h.advance(8.0, alive=("a", "b", "c"))  # d dies: the coordinator holds its chain copy
    _resume(h, run, ["d"], acknowledged=8)
    _survivors_answer(h, run, {"a": 6, "b": 7, "c": 8})
    assert not [m for n in "abc" for m in h.to(n, "weights_request") if m.body.get("snapshot")]
    got = _assigned(h, ["a", "b", "c"])
    weights = {k: v for g in got.values() for k, v in g["weights"].items()}
    assert weights["units.4.weight"] == 64.0 and weights["units.5.weight"] == 65.0
    fast = _ready(h, ["a", "b", "c"])
    assert fast["copies_used"] == {"chain@coordinator": [4, 5]}
    # a survivor behind the acknowledged count loses the updates it had not applied
    assert fast["lost"] == {"0": 2, "1": 2, "2": 1, "4": 2, "5": 2}


def test_a_unit_the_recut_moves_between_survivors_goes_peer_to_peer() -> None:
    h = Harness()
    run = _start(h)
    _copies(h, run)
    h.advance(8.0, alive=("a", "b", "c"))  # d dies: the coordinator holds its chain copy
    _resume(h, run, ["d"], acknowledged=8)
    _survivors_answer(h, run, {"a": 8, "b": 9, "c": 8})
    got = _assigned(h, ["a", "b", "c"])
    assert [got[n]["range"] for n in "abc"] == [(0, 2), (2, 4), (4, 6)]
    # c's unit 3 goes to b, fetched from c's snapshot (after c's 8 updates) at c's
    # probe socket; b keeps unit 2 from its own
    assert _fetched(got) == {0: ("a", "a", 8), 1: ("a", "a", 8), 2: ("b", "b", 9),
                             3: ("b", "c", 8)}  # fmt: skip
    (moved,) = [e for e in got["b"]["fetch"] if e["from"] == "c"]
    assert (moved["start"], moved["end"], moved["endpoint"]) == (3, 4, "tcp://c:2")
    assert moved["restart"] == {"version": 8, "depth": 4}
    # c answers that fetch, and only it: granted before any stage was assigned
    (grants,) = _grants(h)
    assert grants == {"c": [{"peer": "b", "owner": "c", "run": run, "step": 8,
                             "start": 3, "end": 4}]}  # fmt: skip
    # the coordinator carries the dead d's units (its chain copy here) and nothing else
    carried = {k: v for g in got.values() for k, v in g["weights"].items()}
    assert carried == {"units.4.weight": 64.0, "units.5.weight": 65.0}
    (planned,) = h.events("restore_planned")
    assert (planned["local"], planned["from_peers"], planned["from_coordinator"]) == (3, 1, 2)
    fast = _ready(h, ["a", "b", "c"])
    kinds = {s["unit"]: (s["kind"], s["source"]) for s in fast["sources"]}
    assert kinds[3] == ("peer", "c") and fast["units_moved"] == 3  # unit 3 and d's two


def _measured(h: Harness, per_batch_s: dict[str, float], **links: Any) -> None:
    """The run's live re-partition controller after one look, as a repartition request
    leaves it: each stage took ``per_batch_s`` a batch on its units."""
    current = h.state.current
    flows = LiveRepartitioning(current)  # type: ignore[arg-type]
    controller = RepartitionController(
        RepartitionSettings(first=1, every=1, gain=0.99),  # measures, never moves
        devices=NAMES,
        bounds=[0, 2, 3, 4, 6],
        reference_unit_s=[1.0] * 6,
        **links,
    )
    counters = {d: {"forward_s": 10 * t, "backward_s": 0.0, "step_s": 0.0, "microbatches": 10}
                for d, t in per_batch_s.items()}  # fmt: skip
    assert not controller.look(10, counters).moves
    flows.controller = controller
    current._repartitioning = flows  # type: ignore[union-attr]


def test_the_survivors_are_recut_by_eq5_over_the_capacities_the_run_measured() -> None:
    h = Harness()
    run = _start(h)
    _copies(h, run)
    # c is three times slower per unit than a and d (b, one unit, as fast as a)
    _measured(h, {"a": 2.0, "b": 1.0, "c": 3.0, "d": 2.0})
    h.advance(8.0, alive=("a", "c", "d"))
    _resume(h, run, ["b"], acknowledged=7)
    _survivors_answer(h, run, {"a": 8, "c": 9, "d": 9})
    # b's unit 2 from its chain copy at c, confirmed by c
    _confirm(h, "c", "b", run, 6, (2, 3))
    got = _assigned(h, ["a", "c", "d"])
    assert _fetched(got)[2][1:] == ("c", 6)
    # without measurements every survivor takes two units (the test above); measured,
    # the slow c keeps one: eq. 5 over C = 1, 3, 1
    ranges = [got[n]["range"] for n in ("a", "c", "d")]
    assert ranges[1][1] - ranges[1][0] == 1, ranges
    cut = ftpipehd_partition([1.0] * 6, capacities=[1.0, 3.0, 1.0]).bounds
    assert ranges == list(pairwise(cut))
    fast = _ready(h, ["a", "c", "d"])
    eq5 = fast["eq5"]
    assert eq5["capacities"] == {"a": 1.0, "c": 3.0, "d": 1.0}
    assert "after mini-batch 10" in eq5["capacities_from"]
    assert fast["abandoned_move"] is False  # its looks never moved
    assert eq5["links_mbit_s"] is None  # the controller costs no links here
    (logged,) = h.events("async_fast_recovery")
    assert logged["eq5"]["capacities"] == eq5["capacities"]


def test_without_a_look_the_survivors_are_recut_one_capacity_each() -> None:
    h = Harness()
    run = _start(h)
    _copies(h, run)
    h.advance(8.0, alive=("a", "c", "d"))
    _resume(h, run, ["b"], acknowledged=7)
    _survivors_answer(h, run, {"a": 8, "c": 9, "d": 9})
    _confirm(h, "c", "b", run, 6, (2, 3))
    _assigned(h, ["a", "c", "d"])
    fast = _ready(h, ["a", "c", "d"])
    assert fast["bounds"] == [0, 2, 4, 6]
    assert fast["eq5"]["capacities"] is None
    assert fast["eq5"]["capacities_from"] == UNMEASURED


def test_a_slow_link_the_run_measured_moves_the_survivors_cut() -> None:
    h = Harness()
    run = _start(h)
    _copies(h, run)
    # equal compute; unit 1's output is big and the a-c link (new neighbours) slow
    sizes = [1e3, 4e6, 1e3, 1e3, 1e3, 1e3]
    _measured(h, {"a": 2.0, "b": 1.0, "c": 1.0, "d": 2.0}, output_bytes=sizes,
              bandwidths_bps=[1e9] * 3)  # fmt: skip
    h.state.measured_links = lambda members: {  # type: ignore[assignment]
        (a, b): ClusterLink(bandwidth_mbps=8.0)
        for a, b in (("a", "c"), ("c", "a"))
        if {a, b} <= {m.name for m in members}
    }
    h.advance(8.0, alive=("a", "c", "d"))
    _resume(h, run, ["b"], acknowledged=7)
    _survivors_answer(h, run, {"a": 8, "c": 9, "d": 9})
    _confirm(h, "c", "b", run, 6, (2, 3))  # b's unit 2, from its chain copy at c
    _assigned(h, ["a", "c", "d"])
    fast = _ready(h, ["a", "c", "d"])
    # 2 x 4 MB over 1 MB/s at a cut after unit 1: the cut moves off it (free, it is
    # 0, 2, 4, 6: the test without a look)
    assert fast["bounds"][1] != 2, fast["bounds"]
    assert fast["eq5"]["capacities"] == {"a": 1.0, "c": 1.0, "d": 1.0}
    eq5 = fast["eq5"]
    assert eq5["links_mbit_s"]["a>c"] == 8.0
    assert eq5["links_from"]["a>c"] == "measured"
    assert eq5["links_from"]["c>d"] == "the live re-partition's last look"


def test_a_holder_that_cannot_give_the_chain_copy_is_planned_around() -> None:
    h = Harness()
    run = _start(h)
    _copies(h, run)
    h.advance(8.0, alive=("a", "c", "d"))  # b dies; the ledger says c holds its copy
    _resume(h, run, ["b"], acknowledged=7)
    _survivors_answer(h, run, {"a": 8, "c": 9, "d": 9})
    # c restarted meanwhile (or dropped the copy): it cannot give it
    body = {"name": "c", "keys": [], "error": "no snapshot of 'b' after mini-batch 6 here",
            "step": 0, "run": 0}  # fmt: skip
    h.feed_message("c", Message("weights", body))  # type: ignore[attr-defined]
    got = _assigned(h, ["a", "c", "d"])
    weights = {k: v for g in got.values() for k, v in g["weights"].items()}
    assert weights["units.2.weight"] == 42.0  # b's global copy of mini-batch 4, held here
    fast = _ready(h, ["a", "c", "d"])
    assert fast["copies_used"] == {"global": [2]} and fast["lost"] == {"2": 3}
    (logged,) = h.events("fast_copy_unavailable")
    assert logged["copies"][0]["owner"] == "b" and "c:" in logged["copies"][0]["error"]
    # asked once: the plan never names the copy again
    assert len([m for m in h.to("c", "weights_request") if m.body.get("snapshot")]) == 1


def test_a_death_during_a_moves_commit_keeps_what_each_survivor_holds() -> None:
    h = Harness()
    run = _start(h)
    _copies(h, run)
    # a live re-partition was moving a's unit 1 to b (cuts 0, 1, 3, 4, 6): a got the
    # commit and switched; b died before answering it, so the run's plan is the old one
    current = h.state.current
    flows = LiveRepartitioning(current)  # type: ignore[arg-type]
    controller = RepartitionController(
        RepartitionSettings(first=1, every=1, bounds=(0, 1, 3, 4, 6)),
        devices=NAMES,
        bounds=[0, 2, 3, 4, 6],
        reference_unit_s=[1.0] * 6,
    )
    assert controller.look(6, {}).moves
    flows.controller = controller
    current._repartitioning = flows  # type: ignore[union-attr]
    h.advance(8.0, alive=("a", "c", "d"))
    _resume(h, run, ["b"], acknowledged=7)
    held = {"a": (0, 1), "c": (3, 4), "d": (4, 6)}
    for name, (start, end) in held.items():
        _kept_state(h, run, name, start, end, 7)
    # b's unit 2 from its chain copy at c; unit 1, which a gave away, from a's copies:
    # its chain copy died with b, so the global copy (4) held here
    _confirm(h, "c", "b", run, 6, (2, 3))
    got = _assigned(h, ["a", "c", "d"])
    weights = {k: v for g in got.values() for k, v in g["weights"].items()}
    assert weights == {"units.1.weight": 41.0}
    # a's snapshot holds unit 0 only (it switched): that is all a loads of it; c
    # loads b's copy in place
    fetched = {u: (f[0], f[1]) for u, f in _fetched(got).items()}
    assert fetched == {0: ("a", "a"), 2: ("c", "c"), 3: ("c", "c"), 4: ("d", "d"),
                       5: ("d", "d")}  # fmt: skip
    fast = _ready(h, ["a", "c", "d"])
    assert fast["switched"] == ["a"] and fast["abandoned_move"] is True
    assert fast["copies_used"] == {"global": [1], "chain@c": [2]}


def test_a_holder_that_dies_while_it_sends_the_chain_copy_is_planned_around() -> None:
    h = Harness()
    run = _start(h)
    _copies(h, run)
    h.advance(8.0, alive=("a", "c", "d"))  # b dies; c holds its chain copy
    _resume(h, run, ["b"], acknowledged=7)
    _survivors_answer(h, run, {"a": 8, "c": 9, "d": 9})
    (ask,) = h.to("c", "weights_request")[-1:]
    assert ask.body["snapshot"] == [{"owner": "b", "run": run, "step": 6, "start": 2, "end": 3}]
    h.advance(8.0, alive=("a", "d"))  # c dies before it answers: b's copy at c with it
    # planned again on a and d: b's unit from the global copy here, c's from its
    # chain copy at d, confirmed by d (which loads it in place)
    _confirm(h, "d", "c", run, 6, (3, 4))
    got = _assigned(h, ["a", "d"])
    weights = {k: v for g in got.values() for k, v in g["weights"].items()}
    assert weights == {"units.2.weight": 42.0}
    assert _fetched(got)[3] == ("d", "d", 6)
    fast = _ready(h, ["a", "d"])
    assert fast["dead"] == ["b", "c"] and fast["order"] == ["a", "d"]
    assert fast["copies_used"] == {"global": [2], "chain@d": [3]}
    (lost,) = h.events("fast_holder_lost")
    assert lost["stages"] == ["c"]


def test_a_chain_copy_goes_from_its_holder_to_the_new_holder_peer_to_peer() -> None:
    h = Harness()
    run = _start(h)
    _copies(h, run)
    h.advance(8.0, alive=("a", "b", "d"))  # c dies; d holds its chain copy of 6
    _resume(h, run, ["c"], acknowledged=7)
    _survivors_answer(h, run, {"a": 8, "b": 8, "d": 9})
    _confirm(h, "d", "c", run, 6, (3, 4))  # keys only: the tensors stay at d
    got = _assigned(h, ["a", "b", "d"])
    assert [got[n]["range"] for n in "abd"] == [(0, 2), (2, 4), (4, 6)]
    # c's unit 3 goes to b: b fetches it from d's chain copy (owner c, mini-batch 6)
    # at d's probe socket, and puts it at version 7 itself
    assert _fetched(got)[3] == ("b", "d", 6)
    (moved,) = [e for e in got["b"]["fetch"] if e["from"] == "d"]
    assert (moved["owner"], moved["run"], moved["endpoint"]) == ("c", run, "tcp://d:2")
    assert moved["restart"] == {"version": 7, "depth": 4}
    # d answers that fetch, and only it: granted before any stage was assigned
    (grants,) = _grants(h)
    assert grants == {"d": [{"peer": "b", "owner": "c", "run": run, "step": 6,
                             "start": 3, "end": 4}]}  # fmt: skip
    # the coordinator carries no unit at all
    assert not any(g["weights"] or g["versions"] for g in got.values())
    (planned,) = h.events("restore_planned")
    assert (planned["from_peers"], planned["from_coordinator"]) == (1, 0)
    (confirmed,) = h.events("chain_copies_confirmed")
    assert confirmed["holders"] == ["d"]
    fast = _ready(h, ["a", "b", "d"])
    assert fast["copies_used"] == {"chain@d": [3]} and fast["lost"] == {"3": 1}


def test_a_fast_recovery_restores_only_from_copies_of_its_own_fit() -> None:
    ledger = CopyLedger()
    older = CopyRecord("b", "global", "coordinator", run=3, step=40, start=1, end=3)
    chain = CopyRecord("b", "chain", "c", run=7, step=10, start=1, end=3)
    other = CopyRecord("c", "chain", "d", run=8, step=20, start=3, end=4)
    for record in (older, chain, other):
        assert ledger.record(record)
    # a client that names its fit's first run (7): run 3's copy is another fit's
    mine = this_fits_copies(ledger, 7, set())
    assert set(mine.copies.values()) == {chain, other}
    # a copy a holder could not give is left out too; an older client keeps them all
    assert set(this_fits_copies(ledger, 7, {("b", "chain")}).copies.values()) == {other}
    assert set(this_fits_copies(ledger, None, set()).copies.values()) == {older, chain, other}


def test_a_chain_copy_its_owner_died_before_announcing_is_known_from_its_holder() -> None:
    """b dies after c kept the whole of its chain copy of 6 but before b's own notice
    left: c's notice (sent by the holder, naming b) put the copy in the ledger, so the
    recovery restores b's unit from it, not from the older global copy of 4."""
    h = Harness()
    run = _start(h)
    for name in NAMES:
        start, end = PARTITION[NAMES.index(name)]
        _copy(h, name, run, "global", 4, _units(start, end, 40.0))
    # the holder's notice: b's copy, sent by c, no tensors (b's own never came)
    body = {"run": run, "name": "b", "kind": "chain", "step": 6, "start": 2, "end": 3,
            "keys": [], "digest": "0", "holder": "c"}  # fmt: skip
    h.feed_message("c", Message("async_copy", body))  # type: ignore[attr-defined]
    (kept,) = [e for e in h.events("async_copy_kept") if e["kind"] == "chain"]
    assert (kept["owner"], kept["holder"], kept["step"], kept["from"]) == ("b", "c", 6, "c")
    h.advance(8.0, alive=("a", "c", "d"))
    _resume(h, run, ["b"], acknowledged=7)
    _survivors_answer(h, run, {"a": 8, "c": 9, "d": 9})
    _confirm(h, "c", "b", run, 6, (2, 3))
    _assigned(h, ["a", "c", "d"])
    fast = _ready(h, ["a", "c", "d"])
    assert fast["copies_used"] == {"chain@c": [2]}
    assert fast["max_lost"] == 1  # from the global copy of 4 it would be 3


def test_survivors_suspected_by_the_clients_stall_report_are_waited_for_not_planned_out() -> None:
    h = Harness()
    run = _start(h)
    _copies(h, run)
    h.advance(8.0, alive=("a", "d"))  # b and c die
    # the client's results stalled: every stage of the run is probed, a and d suspect
    h.feed(StallReported(Stalled(run=run, waited_s=8.1, deadline_s=0.25)))
    states = {n: h.state.membership.get(n).state.value for n in ("a", "d")}  # type: ignore[union-attr]
    assert states == {"a": "suspect", "d": "suspect"}
    _resume(h, run, ["b", "c"], acknowledged=7)
    # the resume waited for their answers: they are the survivors, not the dead
    (settled,) = [j for j in h.jobs if isinstance(j, AwaitSettled)]
    assert {"a", "d"} <= set(settled.names)
    assert not h.events("run_failed")
    _survivors_answer(h, run, {"a": 8, "d": 9})
    _confirm(h, "d", "c", run, 6, (3, 4))
    got = _assigned(h, ["a", "d"])
    assert [got[n]["range"] for n in ("a", "d")] == [(0, 3), (3, 6)]
    assert _ready(h, ["a", "d"])["dead"] == ["b", "c"]


def test_a_suspect_that_never_answers_is_left_out_of_the_fast_resume() -> None:
    h = Harness()
    run = _start(h)
    _copies(h, run)
    h.advance(8.0, alive=("a", "c", "d"))  # b dies
    h.feed(StallReported(Stalled(run=run, waited_s=8.1, deadline_s=0.25)))
    h.silent = {"c"}  # c answers no probe: the wait ends by its deadline, c counted out
    _resume(h, run, ["b"], acknowledged=7)
    _survivors_answer(h, run, {"a": 8, "d": 9})
    _confirm(h, "d", "c", run, 6, (3, 4))  # c's units from its chain copy at d
    got = _assigned(h, ["a", "d"])
    assert [got[n]["range"] for n in ("a", "d")] == [(0, 3), (3, 6)]
    assert _ready(h, ["a", "d"])["dead"] == ["b", "c"]
