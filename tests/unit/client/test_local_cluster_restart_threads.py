"""A stage a LocalCluster starts again (after a kill) gets the cluster's share of the
cores, as the stages it started with did, unless its DeviceSpec names its own
threads. Pure: the spawn is caught, no process starts."""

from __future__ import annotations

from typing import Any

from zpipe.cluster import DeviceSpec, LocalCluster


def _started(cluster: LocalCluster, device: DeviceSpec) -> list[str]:
    caught: list[list[str]] = []

    def spawn(name: str, args: list[str]) -> Any:
        caught.append(args)
        return None

    cluster._spawn = spawn  # type: ignore[method-assign]
    cluster.start_stage(device)
    (args,) = caught
    return args


def _threads(args: list[str]) -> str | None:
    return args[args.index("--threads") + 1] if "--threads" in args else None


def test_a_stage_started_again_gets_the_clusters_threads_unless_it_names_its_own() -> None:
    cluster = LocalCluster([DeviceSpec("a", slowdown=3.0), DeviceSpec("b", slowdown=3.0)])
    share = cluster.stage_threads
    assert share >= 1
    assert [d.threads for d in cluster.devices] == [share, share]
    # b killed and started again from the spec the caller kept (no threads in it)
    args = _started(cluster, DeviceSpec("b", slowdown=3.0))
    assert _threads(args) == str(share)
    assert args[args.index("--slowdown") + 1] == "3.0"
    assert _threads(_started(cluster, DeviceSpec("b", threads=3))) == "3"
