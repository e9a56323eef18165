"""Devices: --device resolution and its errors, measured memory, tensors moved at a
shard's edges, per-device planning inputs, and the install file without torch."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests._support import REPO_ROOT
from zpipe._errors import ConfigError, ProtocolError
from zpipe.cli.profile import main as profile_main
from zpipe.cli.stage import main as stage_main
from zpipe.cluster import DeviceSpec
from zpipe.coordinator.jobs import profile_request
from zpipe.coordinator.membership import Member
from zpipe.coordinator.planning import cluster_from_members, merge_alike_memory
from zpipe.devices import (
    MIB,
    Backends,
    BoundaryMover,
    DeviceUnavailableError,
    check_device_text,
    free_memory_bytes,
    meminfo_available_bytes,
    peak_resident_bytes,
    resident_bytes,
    resolve_device,
    stage_base_bytes,
    usable_memory_mb,
)
from zpipe.models import ModelSpec
from zpipe.peak_memory import peak_bytes
from zpipe.planner.cluster import ClusterDevice, ClusterSpec
from zpipe.planner.memory import COMPUTE_RUNTIME_BYTES, DEFAULT_STAGE_BASE_BYTES
from zpipe.planner.profile import training_profile_sizes
from zpipe.planner.training_cost import TrainingCosts
from zpipe.stage.config import StageConfig
from zpipe.stage.executors.training_shard import TrainShard
from zpipe.stage.measurements import requested_batch_sizes
from zpipe.stage.profiling import profile_model
from zpipe.stage.runtime import registration_info
from zpipe.stage.shard import Shard

ROOT = REPO_ROOT
NO_GPU = Backends(cuda_devices=0, mps=False, cuda_build=None)
HAS_CUDA = torch.cuda.is_available()

# --------------------------------------------------------------------------- resolution


@pytest.mark.parametrize("text", ["auto", "cpu", "cuda", "cuda:0", "cuda:12", "mps", " CUDA:1 "])
def test_device_names_are_understood(text: str) -> None:
    assert check_device_text(text) == text.strip().lower()


@pytest.mark.parametrize("text", ["gpu", "cuda:", "cuda:-1", "cpu:0", "mps:1", "cuda:x", ""])
def test_malformed_device_names_are_refused_with_the_choices(text: str) -> None:
    with pytest.raises(ConfigError, match=re.escape("auto|cpu|cuda[:N]|mps")):
        check_device_text(text)


def test_auto_prefers_cuda_then_mps_then_cpu() -> None:
    assert resolve_device("auto", backends=Backends(cuda_devices=2, mps=True)) == torch.device(
        "cuda", 0
    )
    assert resolve_device("auto", backends=Backends(mps=True)) == torch.device("mps")
    assert resolve_device("auto", backends=NO_GPU) == torch.device("cpu")


def test_named_devices_resolve_where_they_exist() -> None:
    two_gpus = Backends(cuda_devices=2, cuda_build="12.4")
    assert resolve_device("cuda", backends=two_gpus) == torch.device("cuda", 0)
    assert resolve_device("cuda:1", backends=two_gpus) == torch.device("cuda", 1)
    assert resolve_device("cpu", backends=two_gpus) == torch.device("cpu")
    assert resolve_device("mps", backends=Backends(mps=True)) == torch.device("mps")


def test_unavailable_devices_are_refused_by_name_with_what_torch_sees() -> None:
    with pytest.raises(DeviceUnavailableError, match=r"sees 2 CUDA device\(s\), cuda:0..cuda:1"):
        resolve_device("cuda:2", backends=Backends(cuda_devices=2, cuda_build="12.4"))
    with pytest.raises(DeviceUnavailableError, match="CPU-only build"):
        resolve_device("cuda", backends=NO_GPU)
    with pytest.raises(DeviceUnavailableError, match=r"built for CUDA 12\.4 but sees no GPU"):
        resolve_device("cuda:0", backends=Backends(cuda_build="12.4"))
    with pytest.raises(DeviceUnavailableError, match="no Apple MPS"):
        resolve_device("mps", backends=NO_GPU)
    # a ConfigError: every command reports it as bad input
    assert issubclass(DeviceUnavailableError, ConfigError)


@pytest.mark.skipif(HAS_CUDA, reason="this machine has a GPU")
def test_this_machine_resolves_auto_to_what_torch_sees() -> None:
    expected = "mps" if Backends.detect().mps else "cpu"
    assert resolve_device("auto").type == expected
    assert StageConfig(name="s", coordinator="tcp://127.0.0.1:1").resolved_device.type == expected


@pytest.mark.skipif(HAS_CUDA, reason="this machine has a GPU")
def test_stage_command_refuses_an_unavailable_device_before_starting(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--coordinator", "tcp://127.0.0.1:1", "--name", "s0", "--device", "cuda:1"]
    with pytest.raises(SystemExit) as exited:
        stage_main(argv)
    assert exited.value.code == 2
    assert "--device cuda:1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        stage_main([*argv[:-1], "tpu"])
    assert "expected auto|cpu|cuda[:N]|mps" in capsys.readouterr().err


@pytest.mark.skipif(HAS_CUDA, reason="this machine has a GPU")
def test_profile_command_refuses_an_unavailable_device_before_profiling(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tmp_path / "p.json"
    with pytest.raises(SystemExit) as exited:
        profile_main(["--model", "mlp-small", "--device", "cuda:0", "-o", str(output)])
    assert exited.value.code == 2
    assert "--device cuda:0" in capsys.readouterr().err and not output.exists()


def test_stage_config_and_device_spec_check_the_name() -> None:
    with pytest.raises(ConfigError):
        StageConfig(name="s", coordinator="tcp://127.0.0.1:1", device="gpu0")
    with pytest.raises(ConfigError):
        DeviceSpec("jetson", device="cuda0")
    assert DeviceSpec("jetson", device="cuda:0").stage_flags()[-2:] == ["--device", "cuda:0"]
    assert "--device" not in DeviceSpec("laptop").stage_flags()  # the stage's default: auto


# --------------------------------------------------------------------------- memory


def test_meminfo_available_is_read_in_bytes(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  1000 kB\nMemFree:  300 kB\nMemAvailable:  512 kB\n")
    assert meminfo_available_bytes(meminfo) == 512 * 1024
    assert free_memory_bytes("cpu", meminfo=meminfo) == 512 * 1024
    meminfo.write_text("MemTotal:  1000 kB\n")  # a kernel without the line
    assert meminfo_available_bytes(meminfo) is None


def test_cuda_free_memory_comes_from_the_driver() -> None:
    asked: list[torch.device] = []

    def mem_get_info(device: torch.device) -> tuple[int, int]:
        asked.append(device)
        return 3 * 2**30, 8 * 2**30

    got = free_memory_bytes(torch.device("cuda", 1), cuda_mem_get_info=mem_get_info)
    assert got == 3 * 2**30
    assert asked == [torch.device("cuda", 1)]


def test_this_machine_reports_some_free_memory() -> None:
    free = free_memory_bytes("cpu")
    assert free is not None and free > 16 * MIB


def test_usable_memory_is_the_smaller_of_measured_and_declared() -> None:
    assert usable_memory_mb(2048 * MIB, 512.0) == 512.0
    assert usable_memory_mb(256 * MIB, 512.0) == 256.0
    assert usable_memory_mb(256 * MIB, None) == 256.0
    assert usable_memory_mb(None, 512.0) == 512.0
    assert usable_memory_mb(None, None) is None


def test_registration_reports_measured_memory_and_the_device() -> None:
    def info(**extra: Any) -> dict[str, Any]:
        config = StageConfig(name="s", coordinator="tcp://127.0.0.1:1", device="cpu", **extra)
        return registration_info(config)

    measured = info()
    free = free_memory_bytes("cpu")
    assert free is not None
    assert measured["device"]["type"] == "cpu"
    assert measured["declared_memory_mb"] is None
    # measured at start: about what is free now (other processes come and go)
    assert 0.5 * free / MIB < measured["memory_mb"] < 2 * free / MIB
    declared = info(memory_mb=64.0)
    assert declared["memory_mb"] == 64.0 and declared["declared_memory_mb"] == 64.0
    # what the process already holds counts towards its budget, as --memory-mb's does
    config = StageConfig(name="s", coordinator="tcp://127.0.0.1:1", device="cpu")
    held = registration_info(config, base=10**12)
    assert held["memory_mb"] > 10**12 / MIB


def test_the_stage_base_is_its_resident_memory_read_from_proc(tmp_path: Path) -> None:
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmHWM:\t  300000 kB\nVmRSS:\t  250000 kB\n")
    assert resident_bytes(status) == 250000 * 1024
    assert peak_resident_bytes(status) == 300000 * 1024
    assert stage_base_bytes("cpu", status=status) == 250000 * 1024
    assert stage_base_bytes("cuda", status=status) == 0  # the GPU holds none of it
    assert resident_bytes(tmp_path / "absent") is None
    own = resident_bytes()
    if own is not None:  # Linux: this process, torch imported
        assert 16 * MIB < own <= (peak_resident_bytes() or own)


# --------------------------------------------------------------------------- boundaries


class _Recorder(nn.Module):
    """Remembers the devices of its inputs; doubles them."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(()))
        self.seen: list[torch.device] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.device)
        return x * self.weight * 2


class _MetaMover(BoundaryMover):
    """Plays an accelerator with the meta device: onto it as usual, back to the host as
    zeros of the right shape (a meta tensor holds no values)."""

    def __init__(self) -> None:
        super().__init__("meta")
        self.to_host_calls: list[list[torch.device]] = []

    def _onto_host(self, t: torch.Tensor) -> torch.Tensor:
        return torch.zeros(t.shape, dtype=t.dtype)

    def to_host(self, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        self.to_host_calls.append([t.device for t in tensors])
        return super().to_host(tensors)


def test_cpu_boundaries_are_the_identity() -> None:
    mover = BoundaryMover("cpu")
    x = torch.randn(3)
    assert mover.to_device([x])[0] is x and mover.to_host([x])[0] is x


def test_an_inference_shard_computes_on_its_device_and_returns_host_tensors() -> None:
    unit = _Recorder()
    shard = Shard([unit], device="meta")
    mover = _MetaMover()
    shard.mover = mover
    assert unit.weight.device.type == "meta"  # the weights moved with the shard
    outputs, _ = shard.forward([torch.randn(2, 3)])
    assert unit.seen == [torch.device("meta")]
    assert mover.to_host_calls == [[torch.device("meta")]]
    assert [t.device.type for t in outputs] == ["cpu"] and outputs[0].shape == (2, 3)


def test_the_cpu_shard_is_unchanged() -> None:
    unit = _Recorder()
    shard = Shard([unit])
    x = torch.randn(2, 3)
    (out,), _ = shard.forward([x])
    assert unit.seen == [torch.device("cpu")]
    assert torch.equal(out, x * 2)


def test_a_training_shard_moves_activations_and_gradients_at_its_edges() -> None:
    unit = _Recorder()
    shard = TrainShard(
        [unit],
        start=0,
        first=False,
        last=False,
        loss="mse",
        optimizer={"name": "sgd", "lr": 0.1},
        device="meta",
    )
    mover = _MetaMover()
    shard.mover = mover
    sent, _, _ = shard.forward(0, [torch.randn(4, 3)])
    assert unit.seen == [torch.device("meta")]
    assert [t.device.type for t in sent] == ["cpu"]
    grads, _ = shard.backward(0, [torch.ones(4, 3)])
    assert [g.device.type for g in grads] == ["cpu"] and grads[0].shape == (4, 3)
    # what the all-reduce sends is on the host
    assert [g.device.type for g in shard.all_gradients()] == ["cpu"]
    assert mover.to_host_calls[-1] == [torch.device("meta")]


def test_reduced_gradients_are_written_back_on_the_device_only() -> None:
    unit = nn.Linear(2, 2)
    shard = TrainShard(
        [unit], start=0, first=True, last=False, loss="mse", optimizer={"name": "sgd", "lr": 0.1}
    )
    grads = shard.all_gradients()
    assert grads[0] is unit.weight.grad  # the CPU reduces the gradients themselves
    grads[0].add_(1.0)
    shard.keep_reduced(grads, shard.float_buffers())
    assert torch.equal(unit.weight.grad, torch.ones(2, 2))


# --------------------------------------------------------------------------- profiles


def test_peak_memory_follows_live_tensors() -> None:
    def step() -> torch.Tensor:
        a = torch.randn(1000)  # 4000 bytes
        b = a * 2  # 8000 live
        del a
        return b * 2  # 8000 live again, a freed

    # the tensors' part alone (resident=False): exact, where pages would round it
    assert peak_bytes(step, resident=False) == 8000
    weight = torch.randn(100, 100)
    # views of memory that existed before, and in-place results, allocate nothing
    assert peak_bytes(lambda: weight.t(), resident=False) == 0
    assert peak_bytes(lambda: weight.add_(1.0), resident=False) == 0
    assert peak_bytes(lambda: weight.t() @ weight[0], resident=False) == 100 * 4
    layer = nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 64))
    x = torch.randn(16, 64)
    with torch.inference_mode():
        # the hidden activation and its GELU are alive together: 2 x 16 x 512 floats
        assert peak_bytes(lambda: layer(x), resident=False) == 2 * 16 * 512 * 4
        # the resident figure is never below the tensors' part
        assert peak_bytes(lambda: layer(x)) >= 2 * 16 * 512 * 4


def test_the_profile_measures_forward_memory_and_records_the_device() -> None:
    spec = ModelSpec.preset("mlp-small")
    profile = profile_model(spec, batch_sizes=[2, 8], warmup=0, repeats=1, device="cpu")
    assert profile.device["kind"] == "cpu"
    for unit in profile.units:
        for k, b in enumerate(profile.batch_sizes):
            # at least its input and output, which are alive together
            estimate = profile.input_bytes_at(b) if unit is profile.units[0] else 0
            assert unit.memory_bytes[k] >= estimate + unit.output_bytes[k]
        assert unit.memory_bytes[1] > unit.memory_bytes[0]  # grows with the batch


def test_training_profiles_cover_the_shares_of_a_micro_batch() -> None:
    assert training_profile_sizes(16) == [1, 4, 8, 16]
    assert training_profile_sizes(2) == [1, 2]
    assert training_profile_sizes(1) == [1]
    assert requested_batch_sizes(8, [8, 1, 4, 2, 8]) == [1, 2, 4, 8]
    assert requested_batch_sizes(8) == [8]
    for bad in ([0], [1.5], [True], list(range(1, 40)), [2**40]):
        with pytest.raises(ProtocolError):
            requested_batch_sizes(8, bad)


def _member(name: str, **info: Any) -> Member:
    return Member(
        name=name,
        routing_id=name.encode(),
        data_endpoint="tcp://127.0.0.1:1",
        info=info,
        public_key=None,
        joined_at=0.0,
        last_seen=0.0,
    )


def test_several_batch_sizes_are_asked_only_of_stages_that_report_a_device() -> None:
    spec = ModelSpec.preset("mlp-small")
    new = _member("new", device={"type": "cpu"})
    old = _member("old")
    assert profile_request(new, spec, 16, "float32", train=True).body()["batch_sizes"] == [
        1,
        4,
        8,
        16,
    ]
    assert "batch_sizes" not in profile_request(old, spec, 16, "float32", train=True).body()
    assert "batch_sizes" not in profile_request(new, spec, 16, "float32", train=False).body()


def test_alike_devices_share_their_smallest_measured_memory() -> None:
    cpu = {"type": "cpu", "name": "cpu"}
    gpu = {"type": "cuda", "name": "Orin"}
    members = [
        _member("a", memory_mb=1000.0, declared_memory_mb=None, device=cpu),
        _member("b", memory_mb=1100.0, declared_memory_mb=None, device=cpu),
        _member("c", memory_mb=4000.0, declared_memory_mb=None, device=cpu),
        _member("g", memory_mb=1050.0, declared_memory_mb=None, device=gpu),
        _member("old", memory_mb=700.0),
    ]
    merged = merge_alike_memory(members)
    # a and b: one category, planned with the smaller; c is far off; g is another kind
    assert merged == {"a": 1000.0, "b": 1000.0, "c": 4000.0, "g": 1050.0, "old": 700.0}
    cluster = cluster_from_members(members, margin=0.0)
    # each device is its budget less its process's base (the default: none was reported)
    fixed = DEFAULT_STAGE_BASE_BYTES + COMPUTE_RUNTIME_BYTES
    assert cluster.device("b").memory_bytes == 1000 * MIB - fixed
    assert cluster.device("g").memory_bytes == 1050 * MIB - fixed


# --------------------------------------------------------------------------- install


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement.strip(), maxsplit=1)[0].lower()


def test_requirements_without_torch_match_the_declared_dependencies() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    lines = (ROOT / "requirements-without-torch.txt").read_text().splitlines()
    listed = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    # the same requirements, specifiers included, torch alone left out
    assert sorted(listed) == sorted(r for r in declared if _name(r) != "torch")
    assert "torch" in {_name(r) for r in declared}


def test_the_training_planner_reads_shares_from_the_measured_curve() -> None:
    spec = ModelSpec.preset("mlp-small")
    sizes = training_profile_sizes(8)
    profile = profile_model(spec, batch_sizes=sizes, warmup=0, repeats=1, train=True)
    cluster = ClusterSpec(devices=(ClusterDevice(name="d", profile=profile),), links={})
    costs = TrainingCosts(profile, cluster, microbatch_size=8)
    device, n = cluster.device("d"), profile.num_units
    for y in sizes:  # every measured share is the measurement, not a line through B
        assert costs.forward_s(device, 0, n, y) == pytest.approx(sum(profile.times(y)))
        assert costs.backward_s(device, 0, n, y) == pytest.approx(sum(profile.backward_times(y)))
