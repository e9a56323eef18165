"""Which sockets take the non-blocking shadow fast paths (zpipe.transport.sockets)."""

from __future__ import annotations

import zmq

from zpipe.transport import sockets
from zpipe.transport.sockets import SocketOptions, new_context, open_socket


def test_only_one_way_sockets_take_the_shadow_fast_paths() -> None:
    # A shadow send on a socket that also receives can swallow the edge that announces
    # queued input, leaving the pending asyncio receive asleep: such sockets must
    # always go through zmq.asyncio.
    context = new_context()
    made = {kind: open_socket(context, kind, SocketOptions()) for kind in
            (zmq.PUSH, zmq.PULL, zmq.ROUTER, zmq.DEALER)}  # fmt: skip
    try:
        assert sockets._shadow(made[zmq.PUSH], sockets._SEND_ONLY) is not None
        assert sockets._shadow(made[zmq.PULL], sockets._RECEIVE_ONLY) is not None
        for kind in (zmq.ROUTER, zmq.DEALER):
            assert sockets._shadow(made[kind], sockets._SEND_ONLY) is None
            assert sockets._shadow(made[kind], sockets._RECEIVE_ONLY) is None
        assert sockets._shadow(made[zmq.PULL], sockets._SEND_ONLY) is None
    finally:
        for sock in made.values():
            sock.close(linger=0)
        context.term()
