"""What a person sees: progress on stderr only, JSON alone on stdout, the plan first,
rates that leave out the start-up, and a clean run that ends without warnings."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

from zpipe.cli import demo
from zpipe.cli import plan as plan_cli
from zpipe.cli import profile as profiler
from zpipe.cli import train as train_cli
from zpipe.client.batches import microbatch_count
from zpipe.cluster import LocalCluster
from zpipe.models import ModelSpec
from zpipe.planner.profile import synthetic_profile
from zpipe.planner.training_plan import TrainingPlan
from zpipe.progress import ResultBar, TerminalProgress, shown


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class _FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# -- progress --------------------------------------------------------------------------


def test_progress_shows_only_on_a_terminal_unless_told() -> None:
    assert shown(None, io.StringIO()) is False
    assert shown(None, _Terminal()) is True
    assert shown(False, _Terminal()) is False and shown(True, io.StringIO()) is True
    quiet, loud = io.StringIO(), _Terminal()
    for stream in (quiet, loud):
        progress = TerminalProgress(stream=stream)
        with progress.phase("profiling"):
            pass
        bar = progress.bar(total=2, unit="mb", desc="streaming")
        bar.update(2)
        bar.close()
    assert quiet.getvalue() == ""
    text = loud.getvalue()
    assert "profiling ..." in text and "profiling: done in" in text and "2/2" in text


async def test_a_waiting_line_names_what_is_awaited() -> None:
    stream = io.StringIO()
    async with TerminalProgress(True, stream=stream).waiting("planning"):
        pass
    assert stream.getvalue().splitlines() == ["planning ...", stream.getvalue().splitlines()[1]]
    assert stream.getvalue().splitlines()[1].startswith("planning: ")
    silent = io.StringIO()
    async with TerminalProgress(False, stream=silent).waiting("planning"):
        pass
    assert silent.getvalue() == ""


def test_the_stream_rate_leaves_out_the_time_before_the_first_result(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = _FakeClock()
    monkeypatch.setattr("tqdm.std.time", clock)
    stream = _Terminal()
    bar = ResultBar(TerminalProgress(stream=stream), total=9)
    clock.now += 30.0  # starting, profiling, planning: no result yet
    bar(1, 4)
    assert bar.rate is None  # one result is no rate yet
    for received in range(2, 10):
        clock.now += 0.5
        bar(received, received + 3)
    # 8 results in the 4 s after the first: 2/s (counting from the bar's making, as the
    # demo's hand-written bar did, would say 9 / 34 s)
    assert bar.rate == pytest.approx(2.0)
    bar.close()
    assert "9/9" in stream.getvalue()


def test_every_long_running_command_has_quiet() -> None:
    assert demo.build_parser().parse_args(["--quiet"]).quiet
    assert train_cli.build_parser().parse_args(["--quiet"]).quiet
    assert profiler.build_parser().parse_args(["--model", "mlp-small", "-o", "p", "--quiet"]).quiet
    assert plan_cli.build_parser().parse_args(["--profile", "p", "--cluster", "c", "--quiet"]).quiet
    assert demo.build_parser().parse_args([]).trace == Path(demo.DEMO_TRACE)


# -- plan --json - ---------------------------------------------------------------------


@pytest.mark.parametrize("mode", [[], ["--train", "--planner", "straight"]], ids=["infer", "train"])
def test_plan_json_to_stdout_is_json_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], mode: list[str]
) -> None:
    data = synthetic_profile([1.0, 2.0, 1.0, 2.0], [10, 10, 10, 10]).to_dict()
    for unit in data["units"]:
        unit["backward_time_s"] = [2 * t for t in unit["time_s"]]
        unit["activation_bytes"] = [100 for _ in unit["time_s"]]
    profile, cluster = tmp_path / "p.json", tmp_path / "c.json"
    profile.write_text(json.dumps(data))
    cluster.write_text(
        json.dumps({"format": "zpipe-cluster/1", "devices": [{"name": "d", "count": 2}]})
    )
    argv = ["--profile", str(profile), "--cluster", str(cluster), *mode]
    assert plan_cli.main([*argv, "--json", "-"]) == 0
    out, err = capsys.readouterr()
    plan = json.loads(out)  # nothing else on stdout
    assert plan["stages"]
    assert err.strip()  # the table went to stderr
    assert plan_cli.main(argv) == 0  # without --json the table is the output
    out, err = capsys.readouterr()
    assert out.strip() and err == ""


# -- the plan before the work, a bar with a total ---------------------------------------


def test_fit_hears_the_plan_before_the_first_step_and_its_bar_has_a_total(
    cluster: LocalCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = ModelSpec("mlp", {"dims": [6, 8, 8, 3]}, seed=5)
    batches = [(torch.randn(4, 6), torch.randint(0, 3, (4,))) for _ in range(3)]
    heard: list[object] = []
    capsys.readouterr()
    cluster.fit(
        spec,
        batches,
        optimizer={"name": "sgd", "lr": 0.1},
        num_microbatches=2,
        partition=[[0, 1], [1, 2], [2, 3]],
        progress=True,
        on_plan=heard.append,
        on_step=lambda step, loss: heard.append(step),
    )
    assert isinstance(heard[0], TrainingPlan) and heard[1:] == [0, 1, 2]
    assert list(heard[0].devices) == [d.name for d in cluster.devices]
    err = capsys.readouterr().err
    assert "3/3" in err  # the bar knew how many mini-batches there were
    assert "planning:" in err  # the wait for the plan was named


def test_infer_names_the_wait_and_counts_microbatches_against_a_total(
    cluster: LocalCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = ModelSpec("mlp", {"dims": [6, 8, 3]}, seed=2)
    batches = [(torch.randn(5, 6),), (torch.randn(2, 6),)]
    assert microbatch_count(batches, 2) == 4 and microbatch_count(batches, None) == 2
    assert microbatch_count(iter(batches), 2) is None  # not known before the end
    plans: list[object] = []
    capsys.readouterr()
    cluster.infer(
        spec, batches, microbatch_size=2, planner="even", phases=True, on_plan=plans.append
    )
    err = capsys.readouterr().err
    assert "planning:" in err and "4/4" in err  # 3 + 1 micro-batches
    assert len(plans) == 1 and plans[0].devices[:2] == ["s0", "s1"]  # type: ignore[attr-defined]


def test_train_prints_the_plan_before_training(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    seen: dict[str, object] = {}

    def fake_fit(self: LocalCluster, spec: ModelSpec, batches: object, **settings: object) -> None:
        seen.update(settings)
        plan = TrainingPlan.from_dict(
            {
                "algo": "straight",
                "schedule": "1f1b",
                "num_units": 2,
                "microbatch_size": 2,
                "num_microbatches": 2,
                "stages": [
                    {"devices": ["laptop"], "start": 0, "end": 1, "shares": [2], "warmup": 2},
                    {"devices": ["phone"], "start": 1, "end": 2, "shares": [2], "warmup": 1},
                ],
            }
        )
        settings["on_plan"](plan)  # type: ignore[operator]
        print("TRAINING")
        raise SystemExit(0)

    monkeypatch.setattr(LocalCluster, "start", lambda self: None)
    monkeypatch.setattr(LocalCluster, "fit", fake_fit)
    trace = tmp_path / "t.json"
    with pytest.raises(SystemExit):
        train_cli.main(["--model", "mlp-small", "--steps", "1", "--trace", str(trace), "--quiet"])
    out = capsys.readouterr().out
    assert out.index("plan (straight), schedule 1f1b") < out.index("TRAINING")
    assert seen["trace"] == trace and seen["progress"] is False


def test_a_trace_in_a_missing_directory_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with pytest.raises(SystemExit) as exited:
        train_cli.main(["--trace", str(tmp_path / "nowhere" / "t.json")])
    assert exited.value.code == 2
    assert "--trace" in capsys.readouterr().err
