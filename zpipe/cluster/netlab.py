"""Real kernel links for tests and benchmarks: network namespaces, veth pairs, ``tc tbf``.

A lab is a bridge in the root namespace and one network namespace per node, each
joined to the bridge by a veth pair::

        root namespace (the client, 10.A.B.1 on the bridge)
     ┌──────────── bridge zpl<id>br ─────────────┐
     │ zpl<id>v0          zpl<id>v1         ...  │   outer ends: set down to cut a node off
     └────┬──────────────────┬───────────────────┘
          │ eth0 10.A.B.2    │ eth0 10.A.B.3          inner ends: tbf caps the node's uplink
     zpl<id>-coord       zpl<id>-s0  ...              one namespace per node

Every name carries a random lab id, so labs of concurrent test runs never collide,
and a file in :data:`REGISTRY_DIR` names the process that owns the lab; a lab whose
owner is gone (a run that was SIGKILLed) is deleted by the next lab that starts.

The pure half (names, addresses, caps, every ``ip``/``tc`` command, which labs are
stale) is :mod:`zpipe.cluster.netlayout`; :class:`NetLab` runs the commands.
It needs Linux, root, ``ip`` and ``tc``; :func:`unavailable_reason` says why a lab
cannot be made here (tests skip with it).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import ipaddress
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import IO, Any

import zpipe
from zpipe._errors import ZpipeError
from zpipe.cluster.netlayout import (
    LabLayout,
    LayoutError,
    Node,
    TbfCap,
    choose_subnet,
    stale_objects,
)

REGISTRY_DIR = Path("/run/zpipe-netlab")
COMMAND_TIMEOUT_S = 30.0


class NetLabError(ZpipeError):
    """A lab command failed (names the command and what it printed)."""


class NetLabUnavailable(NetLabError):
    """This machine cannot make a lab: not Linux, not root, no ``ip``/``tc``, no namespaces."""


def lab_environment(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a process started in a lab: ``base`` (this process's by
    default), this zpipe's source tree first on PYTHONPATH, unbuffered output."""
    env = dict(os.environ if base is None else base)
    root = str(Path(zpipe.__file__).resolve().parents[1])
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != root]
    env["PYTHONPATH"] = os.pathsep.join([root, *rest])
    env["PYTHONUNBUFFERED"] = "1"
    return env


# ------------------------------------------------------------------ the shell


def _run(command: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(
            list(command), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetLabError(f"`{' '.join(command)}` could not run: {exc}") from None
    if check and done.returncode != 0:
        raise NetLabError(
            f"`{' '.join(command)}` exited with {done.returncode}: {done.stderr.strip()}"
        )
    return done


def _json_names(command: Sequence[str], key: str) -> list[str]:
    text = _run(command).stdout.strip()
    return [str(entry[key]) for entry in json.loads(text)] if text else []


def _process_start(pid: int) -> str | None:
    """The process's start time in clock ticks (field 22 of /proc/PID/stat), None if gone:
    with the pid, it names one process even after its pid is reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _taken_networks() -> list[ipaddress.IPv4Network]:
    text = _run(["ip", "-j", "-4", "addr"]).stdout.strip()
    taken = []
    for link in json.loads(text) if text else []:
        for info in link.get("addr_info", []):
            taken.append(
                ipaddress.IPv4Network(f"{info['local']}/{info['prefixlen']}", strict=False)
            )
    return taken


@contextlib.contextmanager
def _registry_lock(directory: Path) -> Iterator[None]:
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _registry(directory: Path) -> dict[str, dict[str, Any]]:
    entries = {}
    for path in directory.glob("*.json"):
        try:
            entries[path.stem] = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # half-written or unreadable: its lab counts as stale
    return entries


def _alive(entry: Mapping[str, Any]) -> bool:
    pid = entry.get("pid")
    return isinstance(pid, int) and _process_start(pid) == entry.get("started")


def remove_stale_labs(registry_dir: Path = REGISTRY_DIR) -> list[str]:
    """Delete what labs of dead owners left behind; returns the names deleted."""
    with _registry_lock(registry_dir):
        return _remove_stale_locked(registry_dir)


def _remove_stale_locked(registry_dir: Path) -> list[str]:
    namespaces = _json_names(["ip", "-j", "netns", "list"], "name")
    links = _json_names(["ip", "-j", "link", "show"], "ifname")
    entries = _registry(registry_dir)
    live = [lab for lab, entry in entries.items() if _alive(entry)]
    stale_ns, stale_links = stale_objects(namespaces, links, live)
    # Processes a dead owner left in its namespaces are not killed here (they are not
    # this process's); without their links they are cut off, and stages exit on their
    # own once the coordinator is silent.
    for link in stale_links:
        _run(["ip", "link", "delete", link], check=False)
    for ns in stale_ns:
        _run(["ip", "netns", "delete", ns], check=False)
    for lab in set(entries) - set(live):
        (registry_dir / f"{lab}.json").unlink(missing_ok=True)
    return stale_ns + stale_links


@cache
def unavailable_reason() -> str | None:
    """Why no lab can be made on this machine, or None when one can (tried once per
    process: a one-node lab with a capped link is made and deleted)."""
    if not sys.platform.startswith("linux"):
        return "real-link tests need Linux network namespaces"
    if os.geteuid() != 0:
        return "real-link tests need root (network namespaces, veth pairs, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"real-link tests need `{tool}` (iproute2) on PATH"
    try:
        with NetLab([Node("probe", uplink=TbfCap.at(100.0))]):
            pass
    except (NetLabError, OSError) as exc:
        return f"cannot make network namespaces with capped veth links here: {exc}"
    return None


@dataclass
class LinkCut:
    """A cut made by :meth:`NetLab.cut_for`: ``restored`` is set once the link is up again."""

    node: str
    seconds: float
    restored: threading.Event = field(default_factory=threading.Event)


_OPEN_LABS: set[NetLab] = set()


@atexit.register
def _close_open_labs() -> None:
    for lab in list(_OPEN_LABS):
        lab.close()


class NetLab:
    """``with NetLab([Node("coord"), Node("s0", uplink=TbfCap.at(20))]) as lab:``

    Makes the lab on entry and deletes it on exit, also on an exception or Ctrl-C
    (and at interpreter exit for a lab never closed); processes it started that
    are still running are killed first. A lab left by a killed run is removed by
    the next one that starts (:func:`remove_stale_labs`).
    """

    def __init__(
        self,
        nodes: Sequence[Node | str],
        *,
        registry_dir: Path = REGISTRY_DIR,
        rng: random.Random | None = None,
    ) -> None:
        self._nodes = tuple(n if isinstance(n, Node) else Node(n) for n in nodes)
        self._registry_dir = registry_dir
        self._rng = rng or random.SystemRandom()
        self._layout: LabLayout | None = None
        self._processes: list[subprocess.Popen[bytes]] = []
        self._timers: list[threading.Timer] = []
        self._lock = threading.Lock()
        self._next_port = 5550

    def __enter__(self) -> NetLab:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def layout(self) -> LabLayout:
        if self._layout is None:
            raise NetLabError("the lab is not started")
        return self._layout

    @property
    def host_address(self) -> str:
        return self.layout.host_address

    def address(self, node: str) -> str:
        return self.layout.address(node)

    def namespace(self, node: str) -> str:
        return self.layout.namespace(node)

    def next_port(self) -> int:
        """A port no earlier caller of this lab got (each namespace's ports are its own)."""
        with self._lock:
            self._next_port += 1
            return self._next_port

    def start(self) -> None:
        if self._layout is not None:
            raise NetLabError("the lab is already started")
        if not sys.platform.startswith("linux") or os.geteuid() != 0:
            raise NetLabUnavailable("a lab needs Linux and root")
        try:
            layout = self._claim()
        except OSError as exc:
            raise NetLabError(
                f"cannot keep the lab registry in {self._registry_dir}: {exc}"
            ) from None
        self._layout = layout
        _OPEN_LABS.add(self)
        try:
            for command in layout.setup_commands():
                _run(command)
        except BaseException:
            self.close()
            raise

    def _claim(self) -> LabLayout:
        """Remove stale labs, then choose this lab's id and subnet and register it."""
        with _registry_lock(self._registry_dir):
            _remove_stale_locked(self._registry_dir)
            entries = _registry(self._registry_dir)
            taken = _taken_networks() + [
                ipaddress.IPv4Network(e["subnet"]) for e in entries.values() if "subnet" in e
            ]
            lab_id = f"{self._rng.randrange(16**5):05x}"
            while lab_id in entries:
                lab_id = f"{self._rng.randrange(16**5):05x}"
            try:
                layout = LabLayout(lab_id, choose_subnet(self._rng, taken), self._nodes)
            except LayoutError as exc:
                raise NetLabError(str(exc)) from None
            entry = {
                "pid": os.getpid(),
                "started": _process_start(os.getpid()),
                "subnet": str(layout.subnet),
            }
            (self._registry_dir / f"{lab_id}.json").write_text(json.dumps(entry))
        return layout

    def set_link(self, node: str, *, up: bool) -> None:
        _run(self.layout.link_command(node, up=up))

    def cut_for(self, node: str, seconds: float) -> LinkCut:
        """Cut ``node`` off now and restore its link after ``seconds`` (on a timer
        thread, so the caller's event loop runs on); :meth:`close` cancels it."""
        self.set_link(node, up=False)
        cut = LinkCut(node, seconds)
        timer = threading.Timer(seconds, self._restore, args=(node, cut))
        timer.daemon = True
        with self._lock:
            self._timers.append(timer)
        timer.start()
        return cut

    def _restore(self, node: str, cut: LinkCut | None = None) -> None:
        if self._layout is not None:
            _run(self.layout.link_command(node, up=True), check=False)
        if cut is not None:
            cut.restored.set()

    def restore_links(self) -> None:
        """Cancel pending restores and bring every node's link up now."""
        self._cancel_timers()
        for node in self._nodes:
            self._restore(node.name)

    def _cancel_timers(self) -> None:
        with self._lock:
            timers, self._timers = self._timers, []
        for timer in timers:
            timer.cancel()

    def popen(
        self,
        node: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        stdout: IO[bytes] | int | None = None,
        stderr: IO[bytes] | int | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` in ``node``'s namespace with :func:`lab_environment` (its
        pid is the command's own; the lab kills it on close if it still runs)."""
        process = subprocess.Popen(
            self.layout.exec_command(node, argv),
            env=lab_environment(env),
            stdout=stdout,
            stderr=stderr,
            stdin=subprocess.DEVNULL,
        )
        with self._lock:
            self._processes.append(process)
        return process

    def run(self, node: str, argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` in ``node``'s namespace to its end (it must exit 0)."""
        return _run(self.layout.exec_command(node, argv))

    def _kill_processes_in(self, node: str) -> None:
        """SIGKILL what still runs in ``node``'s namespace: only this lab starts
        processes there."""
        done = _run(["ip", "netns", "pids", self.layout.namespace(node)], check=False)
        for pid in done.stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)

    def close(self) -> None:
        if self._layout is None:
            return
        self._cancel_timers()
        with self._lock:
            processes, self._processes = self._processes, []
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGKILL)
        for process in processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)
        for node in self._nodes:  # what those processes started in the lab, if anything
            self._kill_processes_in(node.name)
        for command in self._layout.teardown_commands():
            _run(command, check=False)
        (self._registry_dir / f"{self._layout.lab_id}.json").unlink(missing_ok=True)
        self._layout = None
        _OPEN_LABS.discard(self)
