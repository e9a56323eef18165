"""A local cluster on real kernel links: the coordinator and each stage in a namespace.

:class:`LabCluster` is a :class:`~zpipe.cluster.LocalCluster` (same ``fit``,
``infer``, ``kill``, ``logs``, ``stop``) whose processes run in the namespaces of
a :class:`~zpipe.cluster.netlab.NetLab`: the coordinator in the lab node
``coordinator_node``, each stage in the node of its own name, the client in the
root namespace (on the bridge). Every control and data message crosses a veth
pair and the tbf caps the lab put on it, and :meth:`LabCluster.cut_for` pulls a
process's cable.
"""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from zpipe.client import PipelineClient
from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.cluster.netlab import LinkCut, NetLab
from zpipe.log import read_events

COORDINATOR = "coordinator"


class LabCluster(LocalCluster):
    """``with LabCluster(lab, [DeviceSpec("s0"), DeviceSpec("s1")]) as cluster: ...``

    Each device's name must be a node of ``lab``; the coordinator runs in the node
    ``coordinator_node`` and listens on a port of its own there. The other settings
    are :class:`~zpipe.cluster.LocalCluster`'s.
    """

    def __init__(
        self,
        lab: NetLab,
        devices: Sequence[DeviceSpec],
        *,
        coordinator_node: str = "coord",
        **settings: Any,
    ) -> None:
        super().__init__(devices, **settings)
        for node in [coordinator_node, *(d.name for d in self.devices)]:
            lab.address(node)  # a KeyError naming the lab's nodes if it has no such node
        self.lab = lab
        self.coordinator_node = coordinator_node

    def node_of(self, name: str) -> str:
        """The lab node that process ``name`` (a stage, or "coordinator") runs in."""
        return self.coordinator_node if name == COORDINATOR else name

    def start(self) -> None:
        # LocalCluster.start with the coordinator bound on its node's address
        if self.log_dir is None:
            self._make_log_dir()
        assert self.log_dir is not None
        self.log_dir.mkdir(parents=True, exist_ok=True)
        address = self.lab.address(self.coordinator_node)
        self.coordinator_endpoint = f"tcp://{address}:{self.lab.next_port()}"
        self._coordinator_args = [
            "-m",
            "zpipe.coordinator",
            "--bind",
            self.coordinator_endpoint,
            "--suspect-after",
            str(self.suspect_after),
            "--probe-intervals",
            str(self.probe_intervals),
            *([] if self.measure_links else ["--no-measure-links"]),
            *(["--state-dir", str(self.state_dir)] if self.state_dir is not None else []),
            *self._common_flags(),
        ]
        self._spawn(COORDINATOR, self._coordinator_args)
        for device in self.devices:
            self.start_stage(device)
        try:
            self.wait_for_stages(len(self.devices), timeout_s=self.start_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _make_log_dir(self) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="zpipe-labcluster-")
        self.log_dir = Path(self._tmp.name)

    def start_stage(self, device: DeviceSpec, *extra: str) -> subprocess.Popen[bytes]:
        return self._spawn(
            device.name,
            [
                "-m",
                "zpipe.stage",
                "--coordinator",
                self.coordinator_endpoint,
                "--bind",
                f"tcp://{self.lab.address(device.name)}:0",
                *device.stage_flags(),
                *self._common_flags(),
                *extra,
            ],
        )

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        assert self.log_dir is not None
        with open(self.log_dir / f"{name}.log", "ab") as log_file:
            process = self.lab.popen(
                self.node_of(name),
                [self.python, *args],
                stdout=log_file,
                stderr=subprocess.STDOUT,
            )
        self.processes[name] = process
        return process

    def client(self, **kwargs: Any) -> PipelineClient:
        # the client runs in the root namespace: its sink listens on the bridge
        kwargs.setdefault("sink_bind", f"tcp://{self.lab.host_address}:0")
        return super().client(**kwargs)

    def cut_for(self, name: str, seconds: float) -> LinkCut:
        """Pull process ``name``'s cable (a stage, or "coordinator") for ``seconds``."""
        return self.lab.cut_for(self.node_of(name), seconds)

    def events(self, name: str, event: str) -> list[dict[str, Any]]:
        """The ``event`` records of process ``name``'s JSON log."""
        return log_events(self.logs(name), event)

    def still_running(self) -> list[str]:
        return [name for name, p in self.processes.items() if p.poll() is None]


def log_events(log: str, event: str) -> list[dict[str, Any]]:
    """The records named ``event`` in a JSON-lines log (other lines are skipped)."""
    return read_events(log, event)
