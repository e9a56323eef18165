"""The copies asynchronous stages make without draining, at the coordinator: routed
at the start, checked and kept when they come, saved, and held again after a
restart (zpipe.coordinator.runs.async_copies). Pure: the in-process coordinator and
a real state directory, no sockets."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch

from tests._support.coordinator_harness import SPEC, Harness
from zpipe.coordinator.persistence import StateStore
from zpipe.coordinator.runs.async_copies import HeldCopy, SaveCopy
from zpipe.recovery.live_copies import CopyRecord, state_digest
from zpipe.transport.codec import Message

NAMES = ["a", "b", "c"]
PARTITION = [[0, 2], [2, 4], [4, 6]]
TRAIN = {
    "schedule": "async-1f1b",
    "num_microbatches": 1,
    "optimizer": {"name": "sgd", "lr": 0.1},
    "async": {"chain_every": 2, "global_every": 4},
}


class SavingHarness(Harness):
    """A coordinator whose copies go to a real state directory."""

    def __init__(self, store: StateStore) -> None:
        super().__init__()
        self.store = store
        self.state.saves_replicas = True

    def _job(self, job: Any) -> Any:
        if isinstance(job, SaveCopy):
            return self.store.save_copy(job.copy.record, job.copy.state)
        return super()._job(job)


def _start(h: Harness) -> int:
    for name in NAMES:
        h.register(name)
    h.client(
        "run_request", model=SPEC.to_dict(), dtype="float32", sink_endpoint="tcp://client:9",
        wait_for_stages_s=0.0, mode="train", train=TRAIN, stage_names=NAMES,
        partition=PARTITION, planner="straight",
    )  # fmt: skip
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


def test_each_stage_is_told_where_its_chain_copies_go_and_whose_it_keeps() -> None:
    h = Harness()
    _start(h)
    trains = {n: h.to(n, "assign")[-1].body["train"] for n in NAMES}
    assert trains["a"]["chain_to"] == {"name": "b", "endpoint": "tcp://b:2", "key": None}
    assert trains["b"]["chain_to"]["name"] == "c" and trains["b"]["backup_from"] == ["a"]
    # the last stage's chain copy goes to the coordinator
    assert "chain_to" not in trains["c"] and trains["c"]["backup_from"] == ["b"]
    assert trains["a"]["async"]["chain_every"] == 2 and trains["a"]["async"]["global_every"] == 4


def test_copies_are_kept_saved_and_held_again_after_a_restart(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state")
    h = SavingHarness(store)
    run = _start(h)
    for name in NAMES:
        start, end = PARTITION[NAMES.index(name)]
        _copy(h, name, run, "global", 4, _units(start, end, 4.0))
    _copy(h, "c", run, "chain", 6, _units(4, 6, 6.0))
    # a chain copy another stage keeps is announced without its tensors
    _copy(h, "a", run, "chain", 6, {}, holder="b", digest="abc")
    kept = h.events("async_copy_kept")
    assert [(e["owner"], e["kind"], e["step"]) for e in kept] == [
        ("a", "global", 4), ("b", "global", 4), ("c", "global", 4), ("c", "chain", 6),
        ("a", "chain", 6),
    ]  # fmt: skip
    ledger = h.state.async_copies.ledger
    a_chain = ledger.newest("a", "chain")
    assert a_chain is not None and (a_chain.holder, a_chain.digest) == ("b", "abc")
    b_global = h.state.async_copies.state_of("b", "global")
    assert b_global is not None and torch.equal(b_global["units.2.weight"], torch.full((2,), 6.0))
    # an older copy that arrives late changes nothing
    _copy(h, "b", run, "global", 2, _units(2, 4, 2.0))
    assert ledger.newest("b", "global").step == 4  # type: ignore[union-attr]

    # a restarted coordinator reads them back: the same ledger, the same bits
    again = Harness()
    again.core.restore(None, None, 0.0, None, [HeldCopy(r, s) for r, s in store.load_copies()])
    assert again.state.async_copies.ledger == ledger
    for name in NAMES:
        before = h.state.async_copies.state_of(name, "global")
        after = again.state.async_copies.state_of(name, "global")
        assert before is not None and after is not None and before.keys() == after.keys()
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert state_digest(after) == ledger.newest(name, "global").digest  # type: ignore[union-attr]


def test_a_copy_that_does_not_fit_the_plan_is_dropped_and_the_coordinator_goes_on() -> None:
    h = Harness()
    run = _start(h)
    _copy(h, "a", run, "global", 4, _units(2, 4, 1.0))  # b's units, not a's
    _copy(h, "b", run, "chain", 2, _units(2, 4, 1.0))  # b's chain copy belongs at c
    _copy(h, "a", run, "bogus", 2, _units(0, 2, 1.0))
    good = _units(0, 2, 1.0)
    _copy(h, "a", run, "global", 4, good, digest=state_digest(_units(0, 2, 9.0)))  # damaged
    _copy(h, "a", run + 1, "global", 4, good)  # another run: late
    errors = [e["error"] for e in h.events("dropped_message")]
    assert len(errors) == 4, errors
    assert "not state of its units" in errors[0] and "not held by 'coordinator'" in errors[1]
    assert "unknown copy kind" in errors[2] and "damaged" in errors[3]
    assert h.state.async_copies.ledger.copies == {}
    _copy(h, "a", run, "global", 4, good)
    assert h.state.async_copies.ledger.newest("a", "global") is not None


def _holder_notice(h: Harness, sender: str, owner: str, run: int, step: int, **extra: Any) -> None:
    """``sender`` says it kept ``owner``'s whole chain copy of ``step`` (no tensors; its
    range the units of the keys it received)."""
    start, end = PARTITION[NAMES.index(owner)]
    body = {"run": run, "name": owner, "kind": "chain", "step": step, "start": start,
            "end": end, "keys": [], "digest": "d6", "holder": sender, **extra}  # fmt: skip
    h.feed_message(sender, Message("async_copy", body))  # type: ignore[attr-defined]


def test_a_chain_copy_is_known_from_its_holders_notice_or_its_owners_whichever_comes_first() -> (
    None
):
    h = Harness()
    run = _start(h)
    ledger = h.state.async_copies.ledger
    # the holder's notice first (the owner's may never come: it can die in between)
    _holder_notice(h, "b", "a", run, 6)
    record = ledger.newest("a", "chain")
    assert record is not None
    assert (record.holder, record.step, record.start, record.end) == ("b", 6, 0, 2)
    # the owner's notice of the same copy: nothing new, kept once
    _copy(h, "a", run, "chain", 6, {}, holder="b", digest="d6")
    assert [(e["owner"], e["step"], e["from"]) for e in h.events("async_copy_kept")] == [
        ("a", 6, "b")
    ]
    assert h.events("async_copy_known")[-1]["owner"] == "a"
    # the owner's first, then the holder's: the same; a later copy is kept again
    _copy(h, "b", run, "chain", 8, {}, holder="c", digest="d8")
    _holder_notice(h, "c", "b", run, 8, digest="d8", start=3, end=4)  # b's keys: unit 3 only
    _holder_notice(h, "b", "a", run, 8)
    assert [(e["owner"], e["step"], e["from"]) for e in h.events("async_copy_kept")] == [
        ("a", 6, "b"), ("b", 8, "b"), ("a", 8, "b"),
    ]  # fmt: skip
    b_chain = ledger.newest("b", "chain")
    assert b_chain is not None and (b_chain.start, b_chain.end, b_chain.digest) == (2, 4, "d8")
    assert h.events("dropped_message") == []
    # bytes the holder hashed that are not those the owner sent: said, not kept twice
    _holder_notice(h, "b", "a", run, 8, digest="other")
    (differ,) = h.events("async_copy_digests_differ")
    assert differ["digests"] == ["d6", "other"] and len(h.events("async_copy_kept")) == 3


def test_a_notice_for_another_stage_from_anyone_but_its_chain_holder_is_dropped() -> None:
    h = Harness()
    run = _start(h)
    _holder_notice(h, "c", "a", run, 6)  # a's chain copies are held by b
    _holder_notice(h, "b", "a", run, 6, holder="c")  # b names another holder
    _holder_notice(h, "b", "a", run, 6, kind="global")  # a global copy is a's own to send
    _holder_notice(h, "a", "c", run, 6)  # the last stage's chain copy goes to the coordinator
    _holder_notice(h, "b", "a", run, 6, start=1, end=3)  # units a does not run
    body = {"run": run, "name": "a", "kind": "chain", "step": 6, "start": 0, "end": 2,
            "keys": ["units.0.weight"], "digest": "x", "holder": "b"}  # fmt: skip
    # with tensors: a holder announces, it never sends the copy here
    h.feed_message("b", Message("async_copy", body, tensors=(torch.zeros(2),)))  # type: ignore[attr-defined]
    errors = [e["error"] for e in h.events("dropped_message")]
    assert len(errors) == 6, errors
    assert all("sent by" in e for e in errors[:4] + errors[5:]), errors
    assert "but 'a' runs [0, 2)" in errors[4]
    assert h.state.async_copies.ledger.copies == {}


def test_copies_of_one_stage_saved_on_several_threads_at_once_all_reach_disk(
    tmp_path: Path,
) -> None:
    """The coordinator saves live copies on a thread pool: two saves of the same
    owner's copy may overlap. Each must land whole (one temporary name per thread:
    with one per process a save's rename found its file gone, or renamed the other
    save's half-written one), and the file holds one of the copies, never a mix."""
    store = StateStore(tmp_path / "state")
    barrier = threading.Barrier(4)
    failures: list[BaseException] = []

    def save(step: int) -> None:
        record = CopyRecord(
            owner="b", kind="chain", holder="coordinator", run=1, step=step, start=2, end=4
        )
        barrier.wait(timeout=30)
        for _ in range(15):
            try:
                store.save_copy(record, _units(2, 4, float(step)))
            except BaseException as exc:
                failures.append(exc)

    threads = [threading.Thread(target=save, args=(step,)) for step in (1, 2, 3, 4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert failures == []
    ((record, state),) = store.load_copies()
    expected = _units(2, 4, float(record.step))
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[k], expected[k]) for k in expected)
    assert not list((tmp_path / "state").rglob("*.tmp"))
