"""How device processes carry partials and wait for them: the choices a user
makes, kept apart from :mod:`zpipe.lossy.wire` so that command lines can offer
them without importing torch (the codec's tensors).

- wait modes: ``emulated`` (a receiver computes the sender's seeded drop
  decisions, so it stops waiting once every partial that can come has) and
  ``deadline`` (it waits for every partial until its timeslot's deadline);
  see :mod:`zpipe.lossy.device`;
- link transports: ``tcp`` (ZeroMQ over TCP, loss emulated per message) is the
  one built. ``udp`` would use ZeroMQ's draft RADIO/DISH sockets for real
  datagram loss; stock pyzmq wheels are built without draft support, and
  zpipe does not drive UDP links, so asking for it is a clear error.
"""

from __future__ import annotations

from typing import Literal

import zmq

from zpipe._errors import ConfigError

WaitMode = Literal["emulated", "deadline"]
WAIT_MODES: tuple[WaitMode, ...] = ("emulated", "deadline")
LINK_TRANSPORTS = ("tcp", "udp")


def udp_available() -> bool:
    """Whether this pyzmq/libzmq has the draft RADIO/DISH (UDP) sockets."""
    return bool(zmq.has("draft")) and hasattr(zmq, "RADIO") and hasattr(zmq, "DISH")


def check_link_transport(name: str) -> str:
    """``tcp`` (message-level emulated loss over ZeroMQ TCP) is the only one built.

    Real UDP loss would need ZeroMQ's draft RADIO/DISH sockets, which stock
    pyzmq wheels do not enable; say so rather than fall back silently.
    """
    if name == "tcp":
        return name
    if name == "udp":
        if not udp_available():
            raise ConfigError(
                "UDP links need ZeroMQ's draft RADIO/DISH sockets, which this pyzmq "
                f"{zmq.__version__} / libzmq {zmq.zmq_version()} build lacks "
                "(zmq.has('draft') is False); use --link-transport tcp, whose loss is "
                "emulated per message with the same seeded decisions"
            )
        raise ConfigError(
            "this pyzmq has draft RADIO/DISH sockets, but zpipe does not drive UDP links "
            "yet; use --link-transport tcp"
        )
    raise ConfigError(f"unknown link transport {name!r}; choose one of {LINK_TRANSPORTS}")
