"""What a stage measures for the planner: its compute (a profile) and its links.

Both run as jobs beside the control loop (they take seconds) and return the
reply body for the coordinator; a failure is reported in the reply's
``error``, and the coordinator plans without the number.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import zmq
import zmq.asyncio

from zpipe.log import get_logger
from zpipe.models import ModelSpec
from zpipe.profiler import profile_model
from zpipe.stage.linkprobe import measure_link
from zpipe.stage.supervision import describe_error
from zpipe.transport import security
from zpipe.transport.codec import Message
from zpipe.transport.emulation import LinkSpec
from zpipe.transport.sockets import SocketOptions

log = get_logger("zpipe.stage")


async def profile_reply(
    message: Message, *, name: str, slowdown: float, compute: ThreadPoolExecutor
) -> dict[str, Any]:
    """Profile the requested model on this device (its threads, its slowdown)."""
    body = message.body
    reply: dict[str, Any] = {"name": name, "profile": None, "error": ""}
    try:
        spec = ModelSpec.from_dict(body["model"])
        loop = asyncio.get_running_loop()
        profile = await loop.run_in_executor(
            compute,
            lambda: profile_model(
                spec,
                batch_sizes=[int(body["batch_size"])],
                dtype=str(body["dtype"]),
                warmup=1,
                repeats=max(1, int(body["repeats"])),
                slowdown=slowdown,
                device_name=name,
                train=bool(body.get("train", False)),
            ),
        )
        reply["profile"] = profile.to_dict()
        log.info(
            "profiled",
            stage=name,
            units=profile.num_units,
            forward_s=round(sum(profile.times(int(body["batch_size"]))), 4),
        )
    except Exception as exc:  # reported to the coordinator, which plans without us
        reply["error"] = describe_error(exc)
        log.error("profile_failed", stage=name, error=reply["error"])
    return reply


async def link_probe_reply(
    message: Message,
    *,
    name: str,
    context: zmq.asyncio.Context,
    link: LinkSpec,
    socket_options: SocketOptions,
    timeout_s: float,
    keypair: security.KeyPair | None,
) -> dict[str, Any]:
    """Measure the link from this stage to another one."""
    target = str(message["target"])
    reply: dict[str, Any] = {
        "name": name,
        "target": target,
        "bandwidth_bps": None,
        "rtt_s": None,
        "error": "",
    }
    try:
        key = message.get("key")
        measured = await measure_link(
            context=context,
            endpoint=str(message["endpoint"]),
            target=target,
            link=link,
            socket_options=socket_options,
            timeout_s=timeout_s,
            keypair=keypair,
            server_key=str(key).encode() if key else None,
        )
        reply["bandwidth_bps"] = measured.bandwidth_bps
        reply["rtt_s"] = measured.rtt_s
        log.info(
            "link_measured",
            stage=name,
            target=target,
            bandwidth_mbps=round(measured.bandwidth_mbps, 1),
            rtt_ms=round(measured.rtt_s * 1e3, 3),
            took_s=round(measured.took_s, 3),
        )
    except Exception as exc:  # reported; the coordinator falls back to its default
        reply["error"] = describe_error(exc)
        log.warning("link_probe_failed", stage=name, target=target, error=str(exc))
    return reply
