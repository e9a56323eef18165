"""Training measurements in a profile: what ``profile --train`` records, and old files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from zpipe._errors import ConfigError
from zpipe.models import ModelSpec
from zpipe.planner.profile import ModelProfile, UnitProfile, synthetic_profile
from zpipe.stage.profiling import profile_model

SIZES = [1, 2, 4]


@pytest.fixture(scope="module")
def mlp_profile() -> ModelProfile:
    spec = ModelSpec.preset("mlp-small", seed=0)
    return profile_model(spec, batch_sizes=SIZES, warmup=1, repeats=3, train=True)


@pytest.fixture(scope="module")
def cnn_profile() -> ModelProfile:
    spec = ModelSpec.preset("cnn-small", seed=0)
    return profile_model(spec, batch_sizes=SIZES, warmup=1, repeats=2, train=True)


def test_linear_relu_units_save_their_input_and_output(mlp_profile: ModelProfile) -> None:
    # mlp-small: Linear + ReLU units, then a plain Linear. A Linear saves its input for
    # the weight gradient (its weight is a parameter, not counted) and ReLU its output.
    assert mlp_profile.has_training
    dims = [784, 512, 256, 128, 10]
    last = len(dims) - 2
    for b in SIZES:
        saved = mlp_profile.activation_bytes(b)
        for k in range(last + 1):
            input_bytes = dims[k] * b * 4
            output_bytes = dims[k + 1] * b * 4 if k < last else 0
            assert saved[k] == input_bytes + output_bytes, (b, k)


def test_training_numbers_are_positive_and_grow_with_the_batch(
    mlp_profile: ModelProfile, cnn_profile: ModelProfile
) -> None:
    for profile in (mlp_profile, cnn_profile):
        for unit in profile.units:
            assert unit.backward_time_s is not None and unit.activation_bytes is not None
            assert all(t > 0 for t in unit.backward_time_s)
            assert list(unit.backward_time_s) == sorted(unit.backward_time_s)
            assert all(a > 0 for a in unit.activation_bytes)
            assert list(unit.activation_bytes) == sorted(set(unit.activation_bytes))
        small, large = profile.batch_sizes[0], profile.batch_sizes[-1]
        assert sum(profile.backward_times(large)) >= sum(profile.backward_times(small))
        assert sum(profile.activation_bytes(large)) > sum(profile.activation_bytes(small))
        # The forward-only numbers are measured as before.
        assert all(t > 0 for t in profile.times(small))


def test_cnn_units_save_more_than_their_output(cnn_profile: ModelProfile) -> None:
    # conv + BatchNorm + ReLU keeps the conv output, the normalised tensor and the input.
    for b in SIZES:
        saved = cnn_profile.activation_bytes(b)
        outputs = cnn_profile.output_bytes(b)
        for k in range(cnn_profile.num_units - 1):
            assert saved[k] > outputs[k]


class FakeClock:
    """Each reading advances 10 ms: every timed step then takes exactly 10 ms."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 0.010
        return self.now


def test_slowdown_stretches_backward_times(monkeypatch: pytest.MonkeyPatch) -> None:
    import zpipe.stage.profiling as profiler

    monkeypatch.setattr("zpipe.transport.emulation.time.sleep", lambda s: None)
    monkeypatch.setattr(profiler, "compute_cpu_s", lambda cpu: None)
    monkeypatch.setattr(profiler.time, "perf_counter", FakeClock())
    spec = ModelSpec("mlp", {"dims": [4, 8, 2]}, seed=0)
    slow = profile_model(spec, batch_sizes=[1, 4], warmup=1, repeats=3, slowdown=3.0, train=True)
    assert slow.backward_times(4) == pytest.approx([0.030, 0.030])
    assert slow.times(4) == pytest.approx([0.030, 0.030])


def test_training_fields_round_trip(tmp_path: Path, mlp_profile: ModelProfile) -> None:
    path = tmp_path / "p.json"
    mlp_profile.save(path)
    data = json.loads(path.read_text())
    assert data["format"] == "zpipe-profile/1"
    assert "backward_time_s" in data["units"][0] and "activation_bytes" in data["units"][0]
    assert ModelProfile.load(path) == mlp_profile


def test_a_forward_only_profile_loads_and_says_how_to_get_training_numbers(
    tmp_path: Path,
) -> None:
    # A file as the profiler wrote it before --train existed.
    old = {
        "format": "zpipe-profile/1",
        "model": {},
        "device": {"name": "old"},
        "batch_sizes": [1, 2],
        "input_bytes": [8, 16],
        "units": [
            {
                "name": "fc0",
                "param_bytes": 40,
                "time_s": [0.1, 0.2],
                "output_bytes": [8, 16],
                "memory_bytes": [16, 32],
            }
        ],
    }
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    profile = ModelProfile.load(path)
    assert not profile.has_training
    assert profile.times(2) == [0.2]
    with pytest.raises(ConfigError, match="no training measurements; profile with --train"):
        profile.backward_times(1)
    with pytest.raises(ConfigError, match="profile with --train"):
        profile.activation_bytes(1)
    profile.save(path)  # and saves without inventing training fields
    assert "backward_time_s" not in json.loads(path.read_text())["units"][0]


def test_malformed_training_fields_are_refused(tmp_path: Path) -> None:
    profile = synthetic_profile(
        [1.0, 2.0], [10, 20], backward_times_s=[2.0, 4.0], activation_bytes=[30, 40]
    )
    assert profile.backward_times(1) == [2.0, 4.0]
    assert profile.activation_bytes(1) == [30, 40]
    data = profile.to_dict()
    del data["units"][1]["backward_time_s"]
    with pytest.raises(ConfigError, match="every unit or for none"):
        ModelProfile.from_dict(data)
    data = profile.to_dict()
    data["units"][0]["activation_bytes"] = [1, 2]
    with pytest.raises(ConfigError, match="activation_bytes has 2 entries"):
        ModelProfile.from_dict(data)
    data = profile.to_dict()
    data["units"][0]["backward_time_s"] = [-1.0]
    with pytest.raises(ConfigError, match="backward_time_s must be finite and >= 0"):
        ModelProfile.from_dict(data)
    with pytest.raises(ConfigError, match="together"):
        synthetic_profile([1.0], [10], backward_times_s=[1.0])
    with pytest.raises(ConfigError, match="every unit or for none"):
        ModelProfile(
            batch_sizes=(1,),
            units=(
                UnitProfile("a", 0, (1.0,), (1,), (1,), (1.0,), (1,)),
                UnitProfile("b", 0, (1.0,), (1,), (1,)),
            ),
            input_bytes=(1,),
        )


def test_profile_command_measures_training_with_train(tmp_path: Path) -> None:
    out = tmp_path / "mlp.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "zpipe",
            "profile",
            "--model",
            "mlp-small",
            "--batch-sizes",
            "1,2",
            "--repeats",
            "1",
            "--train",
            "-o",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "backward" in result.stdout and "saved for backward" in result.stdout
    profile = ModelProfile.load(out)
    assert profile.has_training and profile.batch_sizes == (1, 2)
