"""A stage's sockets and keys: control (to the coordinator), data in, probes in.

- control: a DEALER to the coordinator, named by the stage's name and a suffix of
  this process's own;
- data: a PULL where the assigned upstream (and, training, the neighbours and
  the client) send; with keys, only the keys the current assignment names may
  connect (until then, nobody);
- probe: a ROUTER where cluster members measure links, keep backups and fetch
  units; with keys, every member the coordinator names (``link_peers``).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import zmq
import zmq.asyncio

from zpipe.log import get_logger
from zpipe.stage.config import StageConfig
from zpipe.stage.linkprobe import PROBE_DOMAIN
from zpipe.transport import security
from zpipe.transport.sockets import (
    ReceiveLimits,
    advertised_endpoint,
    bind_endpoint,
    open_socket,
)

log = get_logger("zpipe.stage")


@dataclass
class StageKeys:
    keypair: security.KeyPair | None = None
    authenticator: security.CurveAuthenticator | None = None
    # who may send data (the assignment's senders) and probes (cluster members)
    data_allow: security.PeerAllowList | None = None
    probe_allow: security.PeerAllowList | None = None
    coordinator_key: bytes | None = None

    @classmethod
    def load(cls, context: zmq.asyncio.Context, config: StageConfig) -> StageKeys:
        keys_dir = config.keys_dir
        if keys_dir is None:
            security.warn_open_cluster(log, f"stage {config.name}")
            return cls()
        keys = cls(
            keypair=security.load_keypair(keys_dir, config.name),
            coordinator_key=security.load_keypair_public(keys_dir, "coordinator"),
            # Until the coordinator assigns an upstream peer, nobody may send data.
            data_allow=security.PeerAllowList(),
            # Link probes come from any cluster member the coordinator names (link_peers).
            probe_allow=security.PeerAllowList(),
        )
        assert keys.data_allow is not None and keys.probe_allow is not None
        keys.authenticator = security.CurveAuthenticator(context, keys.data_allow)
        keys.authenticator.add_domain(PROBE_DOMAIN, keys.probe_allow)
        keys.authenticator.start()
        return keys

    def stop(self) -> None:
        if self.authenticator is not None:
            self.authenticator.stop()


@dataclass
class StagePorts:
    control: zmq.asyncio.Socket
    data_in: zmq.asyncio.Socket
    probe_in: zmq.asyncio.Socket
    data_endpoint: str
    probe_endpoint: str
    # what the data socket is bound to (port resolved): rebound when a plan raises its limits
    data_bound: str = ""

    @classmethod
    def open(cls, context: zmq.asyncio.Context, config: StageConfig, keys: StageKeys) -> StagePorts:
        opts = config.socket_options
        # Small limits until an assignment: nothing may queue megabytes at an idle stage.
        data_in = open_socket(context, zmq.PULL, opts, limits=ReceiveLimits.before_plan())
        if keys.keypair is not None:
            security.secure_server(data_in, keys.keypair)
        bound = bind_endpoint(data_in, config.data_bind)
        data_endpoint = advertised_endpoint(
            bound, advertise_host=config.advertise_host, toward=config.coordinator
        )
        probe_in = open_socket(context, zmq.ROUTER, opts)
        if keys.keypair is not None:
            security.secure_server(probe_in, keys.keypair, domain=PROBE_DOMAIN)
        probe_bound = bind_endpoint(probe_in, config.probe_endpoint_to_bind)
        probe_endpoint = advertised_endpoint(
            probe_bound, advertise_host=config.advertise_host, toward=config.coordinator
        )
        control = open_socket(context, zmq.DEALER, opts)
        # This process's own routing id: a second process under the same name is then a
        # registration the coordinator can judge (refuse, or let take over a dead one),
        # where one routing id would have the coordinator's ROUTER silently drop it.
        control.setsockopt(zmq.ROUTING_ID, f"{config.name}#{uuid.uuid4().hex[:12]}".encode())
        if keys.keypair is not None and keys.coordinator_key is not None:
            security.secure_client(control, keys.keypair, keys.coordinator_key)
        control.connect(config.coordinator)
        return cls(control, data_in, probe_in, data_endpoint, probe_endpoint, bound)

    def close(self) -> None:
        for sock in (self.data_in, self.probe_in, self.control):
            sock.close(linger=0)
