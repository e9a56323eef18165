"""The experiment command line, its outputs and its local data loaders."""

from __future__ import annotations

import builtins
import gzip
import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from zpipe._errors import ConfigError
from zpipe.cli import lossy as experiment
from zpipe.lossy.data import load_dataset, load_digits_dataset, load_idx_dataset

TINY = ["--hidden", "16,16", "--steps", "12", "--eval-points", "2", "--test-repeats", "1",
        "--batch-size", "20", "--limit-train", "200"]  # fmt: skip


def test_runs_write_json_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "run"
    argv = ["--allocation", "hybrid", "naive", "--seeds", "2", "--out", str(out), *TINY]
    assert experiment.main(argv) == 0
    payload = json.loads((out / "results.json").read_text())
    assert payload["dataset"] == "digits"
    assert len(payload["runs"]) == 4
    assert {row["label"] for row in payload["summary"]} == {"hybrid", "naive"}
    run = payload["runs"][0]
    for key in ("curve", "allocation", "topology", "final_test_acc", "propagation_rate", "traffic"):
        assert key in run
    assert (out / "training.png").stat().st_size > 1000
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(printed) == 2


def test_sweep_runs_every_value(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    argv = ["--allocation", "vertical", "--seeds", "1", "--sweep", "devices",
            "--sweep-values", "4,6", "--no-plots", "--out", str(out), *TINY]  # fmt: skip
    assert experiment.main(argv) == 0
    payload = json.loads((out / "results.json").read_text())
    assert [r["config"]["n_devices"] for r in payload["runs"]] == [4, 6]
    assert [r["sweep_value"] for r in payload["runs"]] == [4.0, 6.0]
    assert not (out / "training.png").exists()


def test_exponent_sweep_keeps_the_placement() -> None:
    args = experiment.build_parser().parse_args(
        ["--out", "x", "--sweep", "exponent", "--sweep-values", "2.9,3.7", "--seeds", "1"]
    )
    configs = experiment.configs_from_args(args)
    assert [c.radio.path_loss_exponent for c, _ in configs] == [2.9, 3.7]
    assert {c.seed for c, _ in configs} == {0}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--allocation", "diagonal"], "invalid choice"),
        (["--devices", "0"], "'0' must be >= 1"),
        (["--region", "-5"], "'-5' must be > 0"),
        (["--steps", "10", "--budget-s", "5"], "not allowed with"),
        (["--sweep", "region"], "go together"),
        (["--sweep", "devices", "--sweep-values", "2.5"], "positive integers"),
        (["--hidden", "16,x"], "'x' is not an integer"),
        (["--dataset", "fashion-mnist"], "--idx-dir"),
        (["--idx-dir", "/nonexistent/idx"], "does not exist"),
    ],
)
def test_argument_errors_are_clear(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        experiment.main([*argv, "--out", str(tmp_path / "o"), "--no-plots"])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_infeasible_partition_is_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--allocation", "horizontal", "--devices", "12", "--seeds", "1", "--no-plots",
            "--out", str(tmp_path / "o"), *TINY]  # fmt: skip
    with pytest.raises(SystemExit):
        experiment.main(argv)  # 12 devices cannot share the 10 output neurons
    assert "without a neuron" in capsys.readouterr().err


def test_missing_matplotlib_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from zpipe.lossy import plots

    real_import = builtins.__import__

    def no_matplotlib(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(ConfigError, match=r"zpipe\[lossy\].*--no-plots"):
        plots.require_matplotlib()


def _write_idx(path: Path, array: np.ndarray, *, compress: bool) -> None:
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    raw = header + array.astype(np.uint8).tobytes()
    if compress:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(raw))
    else:
        path.write_bytes(raw)


def _fake_fashion(root: Path) -> None:
    rng = np.random.default_rng(0)
    _write_idx(root / "train-images-idx3-ubyte", rng.integers(0, 256, (60, 4, 4)), compress=True)
    _write_idx(root / "train-labels-idx1-ubyte", rng.integers(0, 10, 60), compress=True)
    _write_idx(root / "t10k-images-idx3-ubyte", rng.integers(0, 256, (20, 4, 4)), compress=False)
    _write_idx(root / "t10k-labels-idx1-ubyte", np.arange(20) % 10, compress=False)


def test_idx_files_load_and_run(tmp_path: Path) -> None:
    _fake_fashion(tmp_path)
    data = load_idx_dataset(tmp_path)
    assert data.x_train.shape == (60, 16) and data.x_test.shape == (20, 16)
    assert 0.0 <= data.x_train.min() and data.x_train.max() <= 1.0
    assert data.n_classes == 10
    out = tmp_path / "out"
    argv = ["--idx-dir", str(tmp_path), "--allocation", "hybrid", "--seeds", "1", "--no-plots",
            "--out", str(out), "--hidden", "12,12", "--steps", "4", "--batch-size", "10",
            "--eval-points", "1", "--test-repeats", "1"]  # fmt: skip
    assert experiment.main(argv) == 0
    assert json.loads((out / "results.json").read_text())["dataset"] == "fashion-mnist"


def test_bad_idx_files_are_config_errors(tmp_path: Path) -> None:
    _fake_fashion(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(b"\x00\x00\x08\x01\x00\x00\x00\x05ab")
    with pytest.raises(ConfigError, match="header says 5 bytes"):
        load_idx_dataset(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(ConfigError, match="missing IDX file"):
        load_idx_dataset(tmp_path)
    with pytest.raises(ConfigError, match="--idx-dir"):
        load_dataset("fashion-mnist")


def test_digits_split_is_fixed_and_stratified() -> None:
    a, b = load_digits_dataset(), load_digits_dataset()
    np.testing.assert_array_equal(a.y_test, b.y_test)
    assert len(a.x_train) + len(a.x_test) == 1797
    assert a.n_features == 64 and a.n_classes == 10
    assert np.bincount(a.y_test).min() >= 35
