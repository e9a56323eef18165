"""What a stage measures for the planner: its compute (a profile) and its links.

Both run as jobs beside the control loop (they take seconds) and return the
reply body for the coordinator; a failure is reported in the reply's
``error``, and the coordinator plans without the number.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import zmq
import zmq.asyncio

from zpipe._errors import ProtocolError
from zpipe.log import get_logger
from zpipe.models import ModelSpec
from zpipe.protocol.stage_control import (
    LinkProbeReply,
    LinkProbeRequest,
    ProfileReply,
    ProfileRequest,
)
from zpipe.stage.linkprobe import measure_link
from zpipe.stage.profiling import profile_model
from zpipe.stage.supervision import describe_error
from zpipe.transport import security
from zpipe.transport.emulation import LinkSpec
from zpipe.transport.sockets import SocketOptions

log = get_logger("zpipe.stage")


# The most batch sizes one request may ask for, and the largest: a profile request
# makes this device compute, so a malformed one must not make it compute for hours.
MAX_PROFILED_SIZES = 16
MAX_PROFILED_BATCH = 2**20


def requested_batch_sizes(batch_size: int, batch_sizes: list[Any] | None = None) -> list[int]:
    """The batch sizes a ``profile_request`` asks for: its ``batch_sizes`` (several, so
    training planners see how time grows with the batch), else its one ``batch_size``."""
    sizes = batch_sizes or [batch_size]
    if len(sizes) > MAX_PROFILED_SIZES or not all(
        isinstance(b, int) and not isinstance(b, bool) and 1 <= b <= MAX_PROFILED_BATCH
        for b in sizes
    ):
        raise ProtocolError(
            f"profile_request: batch sizes must be at most {MAX_PROFILED_SIZES} integers in "
            f"1..{MAX_PROFILED_BATCH}, got {sizes[: MAX_PROFILED_SIZES + 1]!r}"
        )
    return sorted(set(sizes))


async def profile_reply(
    request: ProfileRequest,
    *,
    name: str,
    slowdown: float,
    compute: ThreadPoolExecutor,
    device: torch.device | str = "cpu",
) -> ProfileReply:
    """Profile the requested model on this device (its threads, its slowdown, its
    ``--device``)."""
    try:
        spec = ModelSpec.from_dict(request.model)
        sizes = requested_batch_sizes(request.batch_size, request.batch_sizes)
        loop = asyncio.get_running_loop()
        profile = await loop.run_in_executor(
            compute,
            lambda: profile_model(
                spec,
                batch_sizes=sizes,
                dtype=request.dtype,
                warmup=1,
                repeats=max(1, request.repeats),
                slowdown=slowdown,
                device_name=name,
                train=bool(request.train),
                device=device,
            ),
        )
        log.info(
            "profiled",
            stage=name,
            units=profile.num_units,
            batch_sizes=sizes,
            forward_s=[round(sum(profile.times(b)), 4) for b in sizes],
        )
        return ProfileReply(name=name, profile=profile.to_dict(), error="")
    except Exception as exc:  # reported to the coordinator, which plans without us
        error = describe_error(exc)
        log.error("profile_failed", stage=name, error=error)
        return ProfileReply(name=name, profile=None, error=error)


async def link_probe_reply(
    request: LinkProbeRequest,
    *,
    name: str,
    context: zmq.asyncio.Context,
    link: LinkSpec,
    socket_options: SocketOptions,
    timeout_s: float,
    keypair: security.KeyPair | None,
) -> LinkProbeReply:
    """Measure the link from this stage to another one."""
    target, key = request.target, request.key
    try:
        measured = await measure_link(
            context=context,
            endpoint=request.endpoint,
            target=target,
            link=link,
            socket_options=socket_options,
            timeout_s=timeout_s,
            keypair=keypair,
            server_key=str(key).encode() if key else None,
        )
        log.info(
            "link_measured",
            stage=name,
            target=target,
            bandwidth_mbps=round(measured.bandwidth_mbps, 1),
            rtt_ms=round(measured.rtt_s * 1e3, 3),
            took_s=round(measured.took_s, 3),
        )
    except Exception as exc:  # reported; the coordinator falls back to its default
        log.warning("link_probe_failed", stage=name, target=target, error=str(exc))
        return LinkProbeReply(
            name=name, target=target, bandwidth_bps=None, rtt_s=None, error=describe_error(exc)
        )
    return LinkProbeReply(
        name=name,
        target=target,
        bandwidth_bps=measured.bandwidth_bps,
        rtt_s=measured.rtt_s,
        error="",
    )
