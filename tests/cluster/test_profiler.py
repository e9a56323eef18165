"""The profiler's numbers are consistent with the model they describe."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zpipe._errors import ConfigError
from zpipe.models import ModelSpec, load_layer_sequence, run_units
from zpipe.planner.profile import ModelProfile, synthetic_profile
from zpipe.stage.profiling import profile_model, speed_score


@pytest.fixture(scope="module")
def vit_profile() -> tuple[ModelSpec, ModelProfile]:
    spec = ModelSpec.preset("vit-tiny", seed=0)
    return spec, profile_model(spec, batch_sizes=[1, 2, 4], warmup=1, repeats=3)


def test_output_and_weight_bytes_match_the_real_tensors(
    vit_profile: tuple[ModelSpec, ModelProfile],
) -> None:
    spec, profile = vit_profile
    sequence = load_layer_sequence(spec)
    units = sequence.build_units(0, sequence.num_units)
    assert profile.num_units == sequence.num_units
    assert [u.name for u in profile.units] == sequence.unit_names()
    for b in profile.batch_sizes:
        inputs = sequence.example_input(b)
        assert profile.input_bytes_at(b) == sum(t.numel() * t.element_size() for t in inputs)
        with torch.inference_mode():
            for unit, expected in zip(units, profile.output_bytes(b), strict=True):
                inputs = run_units([unit], inputs)
                assert sum(t.numel() * t.element_size() for t in inputs) == expected
    for unit, unit_profile in zip(units, profile.units, strict=True):
        weights = sum(p.numel() * p.element_size() for p in unit.parameters())
        assert unit_profile.param_bytes >= weights > 0 or unit_profile.param_bytes == weights


def test_larger_batches_are_never_reported_faster(
    vit_profile: tuple[ModelSpec, ModelProfile],
) -> None:
    _, profile = vit_profile
    for unit in profile.units:
        assert list(unit.time_s) == sorted(unit.time_s)
        assert all(t > 0 for t in unit.time_s)
    for small, large in zip(profile.batch_sizes, profile.batch_sizes[1:], strict=False):
        assert sum(profile.times(large)) >= sum(profile.times(small))
        assert sum(profile.output_bytes(large)) > sum(profile.output_bytes(small))


class FakeClock:
    """Each reading advances 10 ms: every timed step then takes exactly 10 ms."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 0.010
        return self.now


def test_slowdown_scales_the_reported_times(monkeypatch: pytest.MonkeyPatch) -> None:
    import zpipe.stage.profiling as profiler

    sleeps: list[float] = []
    monkeypatch.setattr("zpipe.transport.emulation.time.sleep", sleeps.append)
    monkeypatch.setattr(profiler, "compute_cpu_s", lambda cpu: None)  # wall time is the work
    monkeypatch.setattr(profiler.time, "perf_counter", FakeClock())
    spec = ModelSpec("mlp", {"dims": [4, 8, 2]}, seed=0)
    fast = profile_model(spec, batch_sizes=[1, 4], warmup=1, repeats=3)
    slow = profile_model(spec, batch_sizes=[1, 4], warmup=1, repeats=3, slowdown=3.0)
    assert fast.times(4) == pytest.approx([0.010, 0.010])
    assert slow.times(4) == pytest.approx([0.030, 0.030])
    assert sleeps and all(x == pytest.approx(0.020) for x in sleeps)  # 3x: 20 ms more
    assert speed_score(slowdown=4.0) == pytest.approx(speed_score() / 4)


def test_profile_file_round_trips_and_rejects_bad_content(
    tmp_path: Path, vit_profile: tuple[ModelSpec, ModelProfile]
) -> None:
    _, profile = vit_profile
    path = tmp_path / "p.json"
    profile.save(path)
    assert ModelProfile.load(path) == profile
    data = json.loads(path.read_text())
    data["units"][3]["time_s"] = [1.0]
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"unit 3 .*time_s has 1 entries"):
        ModelProfile.load(path)
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="not JSON"):
        ModelProfile.load(path)
    with pytest.raises(ConfigError, match="was not profiled"):
        profile.times(3)
    with pytest.raises(ConfigError, match="one entry per unit"):
        synthetic_profile([1.0, 2.0], [10])


def test_profile_command_writes_a_file_and_rejects_bad_flags(tmp_path: Path) -> None:
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
            "-o",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert ModelProfile.load(out).batch_sizes == (1, 2)
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "zpipe",
            "profile",
            "--model",
            "mlp-small",
            "--batch-sizes",
            "0,x",
            "-o",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "--batch-sizes" in bad.stderr
