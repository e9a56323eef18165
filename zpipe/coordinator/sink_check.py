"""Whether the run's last stages can reach the client's sink at the address it advertised.

A client that reaches the coordinator at ``tcp://127.0.0.1:...`` advertises a
loopback sink (the address its host uses toward the coordinator). A last stage
on another host would send its results to its *own* loopback, and the client
would wait for results that can never come, with no hint why. The run is
refused at its start instead, with the address and the fix. Pure: the
coordinator's own host addresses come from the shell.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Collection, Mapping
from urllib.parse import urlsplit

from zpipe._errors import ConfigError

_LOCAL_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost")


def _host(endpoint: str) -> str | None:
    """The host of a tcp endpoint (None: not tcp, or malformed)."""
    parts = urlsplit(endpoint)
    if parts.scheme != "tcp":
        return None
    return parts.hostname


def is_local_only(host: str) -> bool:
    """Whether ``host`` means "this machine" wherever it is used (loopback, unspecified)."""
    if host.lower() in _LOCAL_NAMES:
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return address.is_loopback or address.is_unspecified


def check_sink_reachable(
    sink_endpoint: str, last_stages: Mapping[str, str], local_hosts: Collection[str] = ()
) -> None:
    """Refuse (:class:`ConfigError`) a sink that only this host can reach when one of
    ``last_stages`` (name -> its advertised data endpoint) runs on another host.

    A stage is on the coordinator's host when it advertises a loopback address or one of
    ``local_hosts`` (the coordinator host's own addresses and names); a client with a
    loopback sink reached the coordinator through loopback, so it is on that host too.
    """
    scheme = urlsplit(sink_endpoint).scheme
    sink_host = _host(sink_endpoint)
    if scheme == "tcp" and (sink_host is None or not is_local_only(sink_host)):
        return
    if scheme not in ("tcp", "ipc"):
        return  # inproc: a test in one process
    local = {h.lower() for h in local_hosts}
    for name, endpoint in last_stages.items():
        host = _host(endpoint)
        if host is None or is_local_only(host) or host.lower() in local:
            continue
        raise ConfigError(
            f"the client's sink {sink_endpoint} is reachable only on the client's own host, "
            f"but the last stage {name!r} runs at {host} (another host): its results would "
            f"never arrive. Give the client the address the stages reach this machine at: "
            f"PipelineClient(..., advertise_host=HOST) or python -m zpipe train "
            f"--advertise-host HOST (or connect to the coordinator at a non-loopback address)"
        )
