"""The network lab harness: its pure layout without root, its shell with root.

The layout (names, addresses, caps, every ip/tc command, which labs are stale) is
checked anywhere; making, cutting and removing real namespaces needs root, ``ip``
and ``tc`` and is skipped with the reason otherwise.
"""

from __future__ import annotations

import ipaddress
import json
import os
import random
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests._support import REPO_ROOT
from zpipe.cluster.netcluster import log_events
from zpipe.cluster.netlab import NetLab, lab_environment, remove_stale_labs, unavailable_reason
from zpipe.cluster.netlayout import (
    LabLayout,
    LayoutError,
    Node,
    TbfCap,
    choose_subnet,
    lab_id_of,
    stale_objects,
)

CAP = TbfCap.at(20.0)
LAYOUT = LabLayout(
    "0a1b2",
    ipaddress.IPv4Network("10.9.8.0/24"),
    (Node("coord"), Node("s0", uplink=CAP), Node("s1", uplink=CAP, downlink=CAP)),
)


def test_a_token_bucket_holds_4_ms_of_its_rate_and_at_least_32_kib() -> None:
    assert TbfCap.at(20.0).tc_args() == [
        "tbf", "rate", "20000kbit", "burst", "32768", "latency", "100ms"
    ]  # fmt: skip
    assert TbfCap.at(1000.0).burst_bytes == 500_000
    assert TbfCap.at(2.5, latency_ms=40).tc_args()[1:3] == ["rate", "2500kbit"]
    for bad in (0.0, float("nan"), float("inf"), -5.0):
        with pytest.raises(LayoutError, match="rate_mbit"):
            TbfCap.at(bad)
    with pytest.raises(LayoutError, match="burst_bytes"):
        TbfCap(20.0, 100, 100.0)


def test_every_name_carries_the_lab_id_and_fits_an_interface_name() -> None:
    assert LAYOUT.bridge == "zpl0a1b2br"
    assert LAYOUT.namespace("s0") == "zpl0a1b2-s0"
    assert [LAYOUT.outer_link(n.name) for n in LAYOUT.nodes] == [
        "zpl0a1b2v0", "zpl0a1b2v1", "zpl0a1b2v2"
    ]  # fmt: skip
    many = LabLayout("fffff", LAYOUT.subnet, tuple(Node(f"n{i}") for i in range(200)))
    assert max(len(many.outer_link(n.name)) for n in many.nodes) <= 15  # IFNAMSIZ - 1
    assert (LAYOUT.host_address, LAYOUT.address("coord"), LAYOUT.address("s1")) == (
        "10.9.8.1", "10.9.8.2", "10.9.8.4"
    )  # fmt: skip
    with pytest.raises(KeyError, match="no node 's9'"):
        LAYOUT.address("s9")


def test_bad_layouts_are_refused() -> None:
    net = LAYOUT.subnet
    for make, problem in [
        (lambda: Node("a b"), "node name"),
        (lambda: LabLayout("0A1B2", net, (Node("a"),)), "five hex digits"),
        (lambda: LabLayout("0a1b2", ipaddress.IPv4Network("10.0.0.0/16"), (Node("a"),)), "/24"),
        (lambda: LabLayout("0a1b2", net, (Node("a"), Node("a"))), "unique"),
        (lambda: LabLayout("0a1b2", net, ()), "1 to 200 nodes"),
    ]:
        with pytest.raises(LayoutError, match=problem):
            make()


def test_setup_makes_each_namespace_before_its_link_and_caps_before_links_come_up() -> None:
    commands = LAYOUT.setup_commands()
    assert commands[0] == ["ip", "link", "add", "zpl0a1b2br", "type", "bridge"]
    text = [" ".join(c) for c in commands]
    s1 = text.index("ip netns add zpl0a1b2-s1")
    assert text[s1 + 1] == ("ip link add zpl0a1b2v2 type veth peer name eth0 netns zpl0a1b2-s1")
    assert "ip -n zpl0a1b2-s1 addr add 10.9.8.4/24 dev eth0" in text
    uplink = "tc -n zpl0a1b2-s1 qdisc replace dev eth0 root tbf rate 20000kbit"
    downlink = "tc qdisc replace dev zpl0a1b2v2 root tbf rate 20000kbit"
    up = text.index("ip link set zpl0a1b2v2 up")
    assert [i for i, t in enumerate(text) if t.startswith((uplink, downlink))] == [up - 2, up - 1]
    # the coordinator's node is not capped
    assert not any(t.startswith("tc -n zpl0a1b2-coord") for t in text)


def test_teardown_deletes_each_veth_pair_then_its_namespace_and_the_bridge_last() -> None:
    assert LAYOUT.teardown_commands()[:2] == [
        ["ip", "link", "delete", "zpl0a1b2v0"],
        ["ip", "netns", "delete", "zpl0a1b2-coord"],
    ]
    assert LAYOUT.teardown_commands()[-1] == ["ip", "link", "delete", "zpl0a1b2br"]


def test_a_cut_sets_the_outer_end_down_and_commands_run_inside_a_namespace() -> None:
    assert LAYOUT.link_command("s0", up=False) == ["ip", "link", "set", "zpl0a1b2v1", "down"]
    assert LAYOUT.link_command("s0", up=True)[-1] == "up"
    assert LAYOUT.exec_command("s0", ["python", "-m", "zpipe.stage"]) == [
        "ip", "netns", "exec", "zpl0a1b2-s0", "python", "-m", "zpipe.stage"
    ]  # fmt: skip


def test_only_objects_of_labs_without_a_live_owner_are_stale() -> None:
    assert lab_id_of("zpl0a1b2-s0") == lab_id_of("zpl0a1b2br") == lab_id_of("zpl0a1b2v17")
    assert lab_id_of("zpl0a1b2v17") == "0a1b2"
    for other in ("eth0", "zpl0a1b2", "zpl0a1b2x", "zpl0A1B2-s0", "xzpl0a1b2-s0", "zpl0a1b2vx"):
        assert lab_id_of(other) is None, other
    namespaces = ["zpl0a1b2-s0", "zplfffff-coord", "other"]
    links = ["eth0", "zpl0a1b2br", "zpl0a1b2v0", "zplfffffbr"]
    assert stale_objects(namespaces, links, live_ids=["fffff"]) == (
        ["zpl0a1b2-s0"], ["zpl0a1b2br", "zpl0a1b2v0"]
    )  # fmt: skip
    assert stale_objects(namespaces, links, live_ids=["fffff", "0a1b2"]) == ([], [])


def test_a_subnet_overlaps_nothing_taken() -> None:
    taken = [ipaddress.IPv4Network("10.0.0.0/9")]  # half of 10/8
    for seed in range(50):
        subnet = choose_subnet(random.Random(seed), taken)
        assert subnet.prefixlen == 24 and not subnet.overlaps(taken[0])
        assert subnet.subnet_of(ipaddress.IPv4Network("10.0.0.0/8"))
    with pytest.raises(LayoutError, match="no free"):
        choose_subnet(random.Random(0), [ipaddress.IPv4Network("10.0.0.0/8")])


def test_processes_in_a_lab_import_this_zpipe_first() -> None:
    root = str(REPO_ROOT)
    env = lab_environment({"PYTHONPATH": f"/elsewhere{os.pathsep}{root}", "HOME": "/h"})
    assert env["PYTHONPATH"].split(os.pathsep) == [root, "/elsewhere"]
    assert (env["HOME"], env["PYTHONUNBUFFERED"]) == ("/h", "1")
    assert lab_environment({})["PYTHONPATH"] == root


def test_log_events_reads_the_records_of_one_event_from_a_json_log() -> None:
    log = "\n".join(
        [
            json.dumps({"event": "stage_dead", "stage": "s1"}),
            json.dumps({"event": "stage_suspect", "stage": "s1", "note": "stage_dead"}),
            'Traceback ... "stage_dead"',
            json.dumps({"event": "stage_dead", "stage": "s0"}),
        ]
    )
    assert [e["stage"] for e in log_events(log, "stage_dead")] == ["s1", "s0"]


# ------------------------------------------------------------ with root


@pytest.fixture
def root_only() -> Iterator[None]:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    yield


def _names() -> tuple[list[str], list[str]]:
    def names(command: list[str], key: str) -> list[str]:
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        return [e[key] for e in json.loads(out)] if out.strip() else []

    return names(["ip", "-j", "netns", "list"], "name"), names(["ip", "-j", "link"], "ifname")


def _objects_of(lab_id: str) -> list[str]:
    namespaces, links = _names()
    return [n for n in namespaces + links if lab_id_of(n) == lab_id]


def _connects(lab: NetLab, node: str, address: str, *, within_s: float) -> bool:
    """Whether a TCP connection from ``node`` to ``address``:7070 opens within ``within_s``."""
    probe = textwrap.dedent(
        f"""
        import socket, sys, time
        deadline = time.monotonic() + {within_s}
        while time.monotonic() < deadline:
            try:
                socket.create_connection(({address!r}, 7070), timeout=1).close()
                sys.exit(0)
            except OSError:
                time.sleep(0.1)
        sys.exit(1)
        """
    )
    done = subprocess.run(lab.layout.exec_command(node, [sys.executable, "-c", probe]))
    return done.returncode == 0


@pytest.mark.usefixtures("root_only")
def test_a_lab_caps_cuts_restores_and_leaves_nothing_behind() -> None:
    with NetLab([Node("a", uplink=CAP), Node("b")]) as lab:
        lab_id = lab.layout.lab_id
        assert len(_objects_of(lab_id)) == 2 + 3  # namespaces, bridge and outer ends
        qdisc = lab.run("a", ["tc", "qdisc", "show", "dev", "eth0"]).stdout
        assert "tbf" in qdisc and "rate 20Mbit" in qdisc
        listen = f"import socket; s = socket.create_server(({lab.address('b')!r}, 7070))\n"
        server = lab.popen("b", [sys.executable, "-c", listen + _ACCEPT])
        assert _connects(lab, "a", lab.address("b"), within_s=30)
        cut = lab.cut_for("a", 60.0)
        assert "NO-CARRIER" in lab.run("a", ["ip", "link", "show", "eth0"]).stdout
        assert not _connects(lab, "a", lab.address("b"), within_s=2)
        lab.restore_links()  # early: the timer is cancelled
        assert not cut.restored.is_set()
        assert _connects(lab, "a", lab.address("b"), within_s=30)
        # a process the lab did not start itself (a child's child) goes with it too
        lab.popen("a", ["sh", "-c", "sleep 300 & sleep 300"])
        ns_pids = _pids_in(lab.namespace("a"), count=3)  # sh and its two sleeps
    assert server.poll() is not None  # killed with its lab
    assert _objects_of(lab_id) == []
    assert not any(_running(pid) for pid in ns_pids)


def _pids_in(namespace: str, *, count: int) -> list[int]:
    """The processes in ``namespace`` once there are ``count`` of them."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        out = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
        pids = [int(pid) for pid in out.stdout.split()]
        if len(pids) >= count:
            return pids
        time.sleep(0.05)
    raise AssertionError(f"{namespace} holds {pids}, not {count} processes")


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie waits only to be reaped


_ACCEPT = "while True: s.accept()[0].close()"


@pytest.mark.usefixtures("root_only")
def test_a_lab_is_removed_on_ctrl_c_and_one_left_by_a_killed_run_by_the_next() -> None:
    with pytest.raises(KeyboardInterrupt), NetLab(["a"]) as lab:
        lab_id = lab.layout.lab_id
        raise KeyboardInterrupt
    assert _objects_of(lab_id) == []
    # a run killed with its lab up leaves it behind, and its registry entry
    crashed = "\n".join(
        [
            "import os, signal",
            "from zpipe.cluster.netlab import NetLab",
            "lab = NetLab(['a', 'b']); lab.start()",
            "print(lab.layout.lab_id, flush=True)",
            "os.kill(os.getpid(), signal.SIGKILL)",
        ]
    )
    done = subprocess.run(
        [sys.executable, "-c", crashed], capture_output=True, text=True, env=lab_environment()
    )
    stale_id = done.stdout.strip()
    assert len(_objects_of(stale_id)) == 2 + 3, done.stderr
    removed = remove_stale_labs()
    assert set(_objects_of(stale_id)) == set()
    assert stale_id in {lab_id_of(n) for n in removed}


def test_without_root_or_iproute2_the_reason_to_skip_says_what_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from zpipe.cluster import netlab

    reason = netlab.unavailable_reason.__wrapped__  # uncached
    monkeypatch.setattr(netlab.sys, "platform", "linux")
    monkeypatch.setattr(netlab.os, "geteuid", lambda: 1000)
    assert reason() == "real-link tests need root (network namespaces, veth pairs, tc)"
    monkeypatch.setattr(netlab.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netlab.shutil, "which", lambda tool: None if tool == "tc" else "/bin/x")
    assert reason() == "real-link tests need `tc` (iproute2) on PATH"
    with pytest.raises(netlab.NetLabUnavailable, match="root"):
        monkeypatch.setattr(netlab.os, "geteuid", lambda: 1000)
        NetLab(["a"]).start()
