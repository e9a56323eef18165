"""The coordinator's state files: exact round trips, atomic writes, clear refusals."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zpipe._errors import ConfigError
from zpipe.coordinator import persistence
from zpipe.coordinator.current_run import Run
from zpipe.coordinator.persistence import StateFileError, StateStore
from zpipe.coordinator.records import SavedMember, SavedReplica, SavedState
from zpipe.planner import Plan
from zpipe.planner.plan import StagePlan
from zpipe.planner.training_plan import TrainingPlan, TrainStage
from zpipe.protocol import storage
from zpipe.protocol.client_control import RunRequest
from zpipe.transport import codec

TPLAN = TrainingPlan(
    algo="hpp",
    schedule="1f1b",
    num_units=4,
    microbatch_size=3,
    num_microbatches=3,
    stages=(TrainStage(("a", "b"), 0, 2, (2, 1), 3), TrainStage(("c",), 2, 4, (3,), 1)),
    predicted={"round_s": 0.25},
)


def _run() -> Run:
    return Run(
        run=7,
        epoch=12,
        client=b"client-0123456789ab",
        plan=Plan("hpp", 4, (StagePlan("a", 0, 2), StagePlan("c", 2, 4)), {"round_s": 0.25}),
        client_key=None,
        failed={"b"},
        devices=["a", "b", "c"],
        ring_endpoints={"a": "tcp://127.0.0.1:1", "b": "tcp://127.0.0.1:2"},
        groups=[["a", "b"], ["c"]],
        request=RunRequest(
            model={"family": "mlp"},
            mode="train",
            dtype="float32",
            sink_endpoint="tcp://127.0.0.1:9",
            wait_for_stages_s=0.0,
        ),
        recover=True,
        streaming=True,
        training_plan=TPLAN,
        rebalance=0.2,
    )


def test_state_round_trips_with_its_run(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "new" / "dir")  # created, parents included
    assert store.load_state() is None and store.load_replica() is None
    member = SavedMember("a", b"a", "tcp://127.0.0.1:5", {"slowdown": 2.0, "cores": 4}, None)
    store.save_state(SavedState(12, 7, (member,), _run().to_saved()))
    loaded = store.load_state()
    assert loaded is not None
    assert (loaded.epoch, loaded.run_counter, loaded.members) == (12, 7, (member,))
    assert loaded.run is not None
    run = Run.from_saved(loaded.run)
    want = _run()
    for name in (
        "run", "epoch", "client", "plan", "client_key", "failed", "devices",
        "ring_endpoints", "groups", "recover", "streaming", "training_plan", "rebalance",
    ):  # fmt: skip
        assert getattr(run, name) == getattr(want, name), name
    assert run.request is not None and want.request is not None
    assert run.request.body() == want.request.body()


def test_a_replica_round_trips_bit_for_bit_even_past_one_messages_tensor_limit(
    tmp_path: Path,
) -> None:
    generator = torch.Generator().manual_seed(0)
    state = {f"{i}.w": torch.randn(2, 3, generator=generator) for i in range(codec.MAX_TENSORS)}
    state["0.w#opt.momentum_buffer"] = torch.randn(2, 3, generator=generator)
    state["bn.num_batches_tracked"] = torch.tensor(5, dtype=torch.int64)
    state["half"] = torch.randn(4, generator=generator).to(torch.bfloat16)
    state["empty"] = torch.empty(0, 3)
    store = StateStore(tmp_path)
    store.save_replica(SavedReplica(3, 40, TPLAN.to_dict(), state))
    loaded = store.load_replica()
    assert loaded is not None
    assert (loaded.run, loaded.step) == (3, 40)
    assert TrainingPlan.from_dict(loaded.plan) == TPLAN
    assert list(loaded.state) == list(state)  # order kept
    for key, tensor in state.items():
        got = loaded.state[key]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape
        assert torch.equal(got, tensor), key
    # writable, as tensors decoded from the wire are: a stage may step them in place
    loaded.state["0.w"].add_(1.0)


def _saved(tmp_path: Path) -> Path:
    store = StateStore(tmp_path)
    store.save_replica(SavedReplica(1, 2, TPLAN.to_dict(), {"w": torch.ones(64)}))
    return store.replica_path


def test_a_damaged_file_is_refused_with_its_name(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    data = bytearray(path.read_bytes())
    store = StateStore(tmp_path)

    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(StateFileError, match=f"{path}.*(checksum|truncated)"):
        store.load_replica()

    flipped = bytearray(data)
    flipped[len(flipped) // 2] ^= 0xFF
    path.write_bytes(flipped)
    with pytest.raises(StateFileError, match="checksum mismatch"):
        store.load_replica()

    path.write_bytes(b"PK\x03\x04 not ours at all")
    with pytest.raises(StateFileError, match="not a zpipe coordinator state file"):
        store.load_replica()

    # the wrong kind of state file where a replica belongs
    store.save_state(SavedState(1, 1, (), None))
    path.write_bytes(store.state_path.read_bytes())
    with pytest.raises(StateFileError, match="holds no replica"):
        store.load_replica()


def test_a_write_that_fails_midway_leaves_the_previous_file_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _saved(tmp_path)
    before = path.read_bytes()

    def crash(*_: object) -> None:
        raise OSError("disk pulled out")

    monkeypatch.setattr(persistence.os, "replace", crash)
    store = StateStore(tmp_path)
    with pytest.raises(OSError, match="disk pulled out"):
        store.save_replica(SavedReplica(1, 9, TPLAN.to_dict(), {"w": torch.zeros(64)}))
    assert path.read_bytes() == before
    # no temporary left (a replica with every unit is also the newest global copy's file)
    assert sorted(os.listdir(tmp_path)) == [persistence.GLOBAL_FILE, persistence.REPLICA_FILE]
    loaded = store.load_replica()
    assert loaded is not None and loaded.step == 2


def test_a_state_dir_that_cannot_be_made_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="cannot create the state directory"):
        StateStore(blocker / "state")
    result = subprocess.run(
        [sys.executable, "-m", "zpipe.coordinator", "--bind", "tcp://127.0.0.1:0",
         "--state-dir", str(blocker / "state")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "cannot create the state directory" in result.stderr


def test_a_state_file_with_a_valid_checksum_but_a_bad_run_is_refused(tmp_path: Path) -> None:
    from zpipe.config import Timeouts
    from zpipe.coordinator.core import CoordinatorCore
    from zpipe.coordinator.membership import Membership
    from zpipe.coordinator.state import ControlState

    store = StateStore(tmp_path)
    store.save_state(SavedState(3, 2, (), {"run": 1, "plan": "not a plan"}))
    store.save_replica(SavedReplica(1, 2, {"stages": "none"}, {}, {}))
    state = ControlState(
        timeouts=Timeouts(),
        membership=Membership(
            heartbeat_interval_s=1.0, suspect_after_intervals=3, probe_intervals=2
        ),
    )
    core = CoordinatorCore(state)
    with pytest.raises(StateFileError, match="the saved run does not parse"):
        core.restore(store.load_state(), None, 0.0)
    with pytest.raises(StateFileError, match="the saved replica's plan does not parse"):
        core.restore(None, store.load_replica(), 0.0)


def _write_replica_file(store: StateStore, **fields: object) -> None:
    """A replica file whose checksum is valid but whose record has the fields given."""
    record = {
        "run": 1, "step": 2, "plan": TPLAN.to_dict(), "keys": ["w"], "chunk": 0,
        "chunks": 1, "holders": {"a": "c", "b": "", "c": "a"}, "global_copy": False,
        "tensors": (torch.ones(4),),
    }  # fmt: skip
    record.update(fields)
    persistence.write_messages(
        store.replica_path,
        [storage.ReplicaFile(**record).to_message()],  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"holders": {"a": [1, 2]}}, "'holders' must map device names to holder names"),
        ({"holders": {"a": None}}, "'holders' must map device names to holder names"),
        ({"holders": {"a": 3}}, "'holders' must map device names to holder names"),
        ({"keys": [5]}, "'keys' must be unit state names"),
    ],
)
def test_a_replica_record_of_the_wrong_shape_is_refused_by_name(
    tmp_path: Path, fields: dict[str, object], named: str
) -> None:
    """A record that passes the checksum but holds other types than the coordinator
    wrote is refused, naming the file and the field (it was turned into strings and
    restored: a holder named "[1, 2]")."""
    store = StateStore(tmp_path)
    _write_replica_file(store)
    loaded = store.load_replica()  # the well-formed record loads as written
    assert loaded is not None and dict(loaded.holders) == {"a": "c", "b": "", "c": "a"}
    _write_replica_file(store, **fields)
    with pytest.raises(StateFileError, match=f"{store.replica_path}: {named}"):
        store.load_replica()


def test_a_coordinator_with_a_damaged_replica_exits_1_and_says_what_to_do(
    tmp_path: Path,
) -> None:
    store = StateStore(tmp_path)
    _write_replica_file(store, holders={"a": [1, 2]})
    result = subprocess.run(
        [sys.executable, "-m", "zpipe.coordinator", "--bind", "tcp://127.0.0.1:0",
         "--state-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert f"{store.replica_path}: 'holders' must map" in result.stderr
    assert f"move it out of {tmp_path}" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_pure_core_imports_no_file_io() -> None:
    """The core and the run controllers take plain records (records.py); the files
    they become are the shell's (persistence.py), which the core never imports."""
    code = (
        "import sys; import zpipe.coordinator.core, zpipe.coordinator.starting; "
        "assert 'zpipe.coordinator.persistence' not in sys.modules, 'persistence imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
