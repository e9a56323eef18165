"""Backups and unit fetches on the probe port: who may plant, who may read (pure)."""

from __future__ import annotations

import pytest
import torch

from zpipe._errors import ProtocolError
from zpipe.stage.peer_policy import (
    UNAUTHENTICATED,
    BackupOffer,
    BackupPlan,
    FetchGrant,
    FetchRequest,
    PeerIdentity,
    backup_refusal,
    fetch_grants,
    fetch_refusal,
    foreign_units,
    is_state_key,
)
from zpipe.stage.replicas import ReplicaStore

PLAN = BackupPlan(run=7, backup_from=("a",))
OWNER = PeerIdentity(True, "a")
KEYS = ("units.3.linear.weight", "units.3.linear.weight#opt.exp_avg")


def offer(
    owner: str = "a", run: int = 7, keys: tuple[str, ...] = KEYS, nbytes: int = 64
) -> BackupOffer:
    return BackupOffer(owner, run, keys, len(keys), nbytes)


def refusal(o: BackupOffer, sender: PeerIdentity = OWNER, *, held: int = 64) -> str | None:
    return backup_refusal(o, sender, PLAN, held_after_bytes=held, budget_bytes=1000)


def test_the_plans_owner_sending_its_own_state_is_kept() -> None:
    assert refusal(offer()) is None
    assert refusal(offer(), UNAUTHENTICATED) is None  # an open cluster: names cannot be checked


def test_a_backup_outside_the_plan_is_refused() -> None:
    assert "does not back up to this stage" in str(refusal(offer(owner="mallory")))
    assert "not training run 8" in str(refusal(offer(run=8)))
    no_run = backup_refusal(
        offer(), UNAUTHENTICATED, BackupPlan(None), held_after_bytes=0, budget_bytes=1000
    )
    assert "not training run 7" in str(no_run)


def test_with_keys_only_the_owner_itself_may_send_its_backup() -> None:
    # b is a cluster member allowed on the probe port, claiming to be a
    assert "sent by b, not by its owner" in str(refusal(offer(), PeerIdentity(True, "b")))
    assert "an unnamed key" in str(refusal(offer(), PeerIdentity(True, None)))


def test_only_unit_state_and_only_what_the_device_can_hold() -> None:
    bad = offer(keys=("units.3.w", "../../etc/passwd"))
    assert "not unit state" in str(refusal(bad))
    assert "keys and tensors" in str(refusal(BackupOffer("a", 7, KEYS, 5, 64)))
    assert "more than it can (1000)" in str(refusal(offer(nbytes=600), held=1001))


def test_state_keys_are_units_with_optional_optimizer_state() -> None:
    assert all(is_state_key(k) for k in KEYS)
    assert not any(is_state_key(k) for k in ("weight", "units.x.w", "units.3", "units.10000000.w"))


def test_fetches_go_only_to_named_devices_for_ranges_of_the_newest_run() -> None:
    ok = FetchRequest("a", run=7, step=3, start=2, end=5)
    grants = (FetchGrant("c", "a", 7, 3, 0, 5),)
    assert fetch_refusal(ok, PeerIdentity(True, "c"), newest_run=7, grants=grants) is None
    assert fetch_refusal(ok, UNAUTHENTICATED, newest_run=None, grants=grants) is None
    assert "named" in str(fetch_refusal(ok, PeerIdentity(True, None), newest_run=7, grants=grants))
    assert "no longer served" in str(
        fetch_refusal(ok, PeerIdentity(True, "c"), newest_run=8, grants=grants)
    )
    for start, end in ((5, 5), (-1, 2), (0, 10**9)):
        bad = FetchRequest("a", 7, 3, start, end)
        assert "not a range" in str(fetch_refusal(bad, UNAUTHENTICATED, newest_run=7))


def test_fetches_are_answered_only_as_the_coordinator_granted_them() -> None:
    # c takes units [0, 5) of a's snapshot in the new plan; d takes [5, 8)
    grants = (FetchGrant("c", "a", 7, 3, 0, 5), FetchGrant("d", "a", 7, 3, 5, 8))
    c, d = PeerIdentity(True, "c"), PeerIdentity(True, "d")

    def refusal(request: FetchRequest, sender: PeerIdentity) -> str | None:
        return fetch_refusal(request, sender, newest_run=7, grants=grants)

    assert refusal(FetchRequest("a", 7, 3, 5, 8), d) is None
    assert refusal(FetchRequest("a", 7, 3, 1, 3), c) is None  # within the grant
    stolen = refusal(FetchRequest("a", 7, 3, 0, 5), d)
    assert stolen is not None and "go to c in the current plan, not to d" in stolen
    for other in (
        FetchRequest("a", 7, 3, 0, 6),  # beyond c's range, across two grants
        FetchRequest("b", 7, 3, 0, 5),  # another owner's snapshot
        FetchRequest("a", 7, 2, 0, 5),  # another step
    ):
        assert "did not name anyone" in str(refusal(other, c))
        # without keys the sender is unknown, but the grants still bound what is read
        assert "did not name anyone" in str(
            fetch_refusal(other, UNAUTHENTICATED, newest_run=7, grants=grants)
        )
    assert "did not name anyone" in str(
        fetch_refusal(FetchRequest("a", 7, 3, 0, 5), c, newest_run=7)
    )


def test_grants_from_the_wire_are_checked() -> None:
    entry = {"peer": "c", "owner": "a", "run": 7, "step": 3, "start": 0, "end": 5}
    assert fetch_grants([entry]) == (FetchGrant("c", "a", 7, 3, 0, 5),)
    for bad in ([1], [{**entry, "run": "x"}], [{"peer": "c"}]):
        with pytest.raises(ProtocolError, match="fetch grant"):
            fetch_grants(bad)


def test_a_fetcher_refuses_units_it_did_not_ask_for() -> None:
    keys = ["units.2.w", "units.4.w#opt.step", "units.5.w", "extra"]
    assert foreign_units(keys, 2, 5) == ["units.5.w", "extra"]


def test_the_store_counts_what_it_would_hold_for_peers_after_a_put() -> None:
    store = ReplicaStore(keep_per_owner=2)
    four = {"units.0.w": torch.zeros(1)}  # 4 bytes
    store.put("me", 1, 1, {"units.0.w": torch.zeros(100)})  # own snapshots do not count
    store.put("a", 1, 1, four)
    store.put("a", 1, 2, four)
    store.put("b", 1, 1, four)
    assert store.peer_bytes_if_put("a", 1, 3, 40, me="me") == 4 + 4 + 40  # a's step 1 goes
    assert store.peer_bytes_if_put("a", 1, 2, 40, me="me") == 4 + 4 + 40  # replaces step 2
    assert store.peer_bytes_if_put("c", 1, 1, 40, me="me") == 12 + 40
    assert store.newest_run() == 1
