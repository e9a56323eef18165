"""The experiment command refuses bad input clearly and writes strict JSON."""

from __future__ import annotations

import json
import math
import resource
from pathlib import Path

import numpy as np
import pytest

from zpipe.cli import lossy as experiment
from zpipe.lossy.data import load_dataset
from zpipe.lossy.partition import partition
from zpipe.lossy.results_json import dumps_strict
from zpipe.lossy.schedule import data_within, timeslot_ms, total_timeslots
from zpipe.lossy.simulate import RunConfig, prepare_run

TINY = ["--hidden", "16,16", "--eval-points", "2", "--test-repeats", "1",
        "--batch-size", "20", "--limit-train", "200"]  # fmt: skip


def _strict_loads(text: str) -> object:
    def refuse(name: str) -> object:
        raise ValueError(f"bare {name} in JSON")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--region", "inf"], "finite"),
        (["--lr", "nan"], "finite"),
        (["--budget-s", "inf"], "finite"),
        (["--sweep", "region", "--sweep-values", "25,nan"], "finite"),
        (["--path-loss-exponent=-inf"], "finite"),
        (["--seed-base", "-3"], "'-3' must be >= 0"),
        (["--seeds", "-1"], "must be >= 1"),
        (["--seeds", "1000000000"], "at most"),
        (["--seed-base", str(1 << 40)], "at most"),
        (["--steps", "1000000000000"], "at most"),
        (["--devices", "100000"], "at most"),
        (["--sweep", "devices", "--sweep-values", "4,1e9"], "up to"),
        (["--eval-points", "1000000000"], "at most"),
        (["--test-repeats", "1000000000"], "at most"),
        (["--rtx-copies", "1000000000"], "at most"),
        (["--hidden", "60000,60000"], "weights"),
        (["--on-death", "remap", "--wait-mode", "deadline", "--multiprocess"], "emulated"),
        (["--replica-every", "5", "--multiprocess"], "--on-death remap"),
        (["--on-death", "remap", "--replica-every", "0"], "must be >= 1"),
        (["--model", "cnn", "--on-death", "remap", "--multiprocess"], "not with --model cnn"),
        (["--on-death", "remap"], "--coordinator or --multiprocess"),
    ],
)
def test_bad_values_are_refused_without_traceback(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    seeds = [] if "--seeds" in argv else ["--seeds", "1"]
    with pytest.raises(SystemExit) as exc:
        experiment.main([*argv, *seeds, "--out", str(tmp_path / "o"), "--no-plots"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    # refused before allocating: peak memory grows by well under a gigabyte (KiB)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 500_000


def test_a_budget_that_fits_too_many_steps_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        experiment.main(["--budget-s", "1e12", "--seeds", "1", "--no-plots",
                         "--out", str(tmp_path / "o"), *TINY])  # fmt: skip
    assert exc.value.code == 2
    assert "give a shorter budget" in capsys.readouterr().err


def test_an_out_path_that_is_a_file_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    existing = tmp_path / "results"
    existing.write_text("keep me")
    with pytest.raises(SystemExit) as exc:
        experiment.main(["--out", str(existing), "--steps", "2", "--no-plots", *TINY])
    assert exc.value.code == 2
    assert "not a directory" in capsys.readouterr().err
    assert existing.read_text() == "keep me"


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the overflow is the point
def test_results_json_is_strict_even_when_a_run_diverges(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "o"
    # a learning rate this large overflows to NaN losses within a few steps
    argv = ["--allocation", "naive", "--lr", "1e100", "--seeds", "1", "--steps", "8",
            "--no-plots", "--out", str(out), *TINY]  # fmt: skip
    assert experiment.main(argv) == 0
    text = (out / "results.json").read_text()
    payload = _strict_loads(text)
    assert isinstance(payload, dict)
    assert payload["runs"][0]["final_train_loss"] is None
    for line in capsys.readouterr().out.splitlines():
        _strict_loads(line)


def test_strict_dump_replaces_every_non_finite_number() -> None:
    text = dumps_strict({"a": [1.0, math.nan, {"b": np.float64("inf")}], "c": np.int64(3)})
    assert _strict_loads(text) == {"a": [1.0, None, {"b": None}], "c": 3}


def test_a_budget_of_exactly_n_naive_steps_gives_n_steps() -> None:
    data = load_dataset("digits")
    naive = partition("naive", [64, 128, 128, 128, 128, 10], 1)
    slot_s = timeslot_ms(naive) / 1000.0
    for n in (1, 7, 600, 2400, 26400):
        budget = total_timeslots(naive, n) * slot_s  # how bench/lossy.py computes it
        assert data_within(naive, slot_s, budget) == n
        assert prepare_run(RunConfig(allocation="naive", budget_s=budget), data).n_data == n


def test_plots_name_seeds_error_bars_simulated_time_and_keep_sweeps_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")
    from zpipe.lossy import plots

    texts: list[str] = []
    plt = plots.require_matplotlib()
    real_savefig = plt.Figure.savefig

    def capture(fig: object, *args: object, **kwargs: object) -> None:
        for ax in fig.axes:  # type: ignore[attr-defined]
            texts.extend([ax.get_title(), ax.get_xlabel()])
            legend = ax.get_legend()
            if legend is not None:
                texts.extend(t.get_text() for t in legend.get_texts())
        if fig._suptitle is not None:  # type: ignore[attr-defined]
            texts.append(fig._suptitle.get_text())  # type: ignore[attr-defined]
        real_savefig(fig, *args, **kwargs)

    monkeypatch.setattr(plt.Figure, "savefig", capture)
    out = tmp_path / "o"
    argv = ["--allocation", "hybrid", "--seeds", "2", "--steps", "6", "--sweep", "region",
            "--sweep-values", "25,75", "--out", str(out), *TINY]  # fmt: skip
    assert experiment.main(argv) == 0
    joined = "\n".join(texts)
    assert "2 seeds" in joined and "±1 std" in joined and "simulated" in joined
    # one line per sweep value, not one "hybrid" averaged over both
    assert "hybrid (region=25) [2]" in joined and "hybrid (region=75) [2]" in joined
    assert (out / "training.png").exists() and (out / "sweep_region.png").exists()
