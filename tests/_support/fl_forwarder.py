"""A TCP forwarder on loopback whose connections a test can cut (an fl-client's link drop).

Every connection accepted on :attr:`Forwarder.endpoint` is relayed to the target port;
:meth:`Forwarder.cut` closes every relayed pair (both sides, as a dropped link or a
restarted middlebox would), and connections made afterwards are relayed again.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading

_CHUNK = 1 << 16


class Forwarder:
    def __init__(self, target_port: int) -> None:
        self._target = ("127.0.0.1", target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.setblocking(False)
        self.endpoint = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self._peers: dict[socket.socket, socket.socket] = {}
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._cut_wanted = threading.Event()
        self._cut_done = threading.Event()
        self._stop = threading.Event()
        self.accepted = 0
        self.cuts = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def cut(self, timeout_s: float = 30.0) -> int:
        """Close every relayed connection; how many pairs were cut."""
        before = len(self._peers) // 2
        self._cut_done.clear()
        self._cut_wanted.set()
        if not self._cut_done.wait(timeout_s):
            raise AssertionError("the forwarder did not cut its connections")
        return before

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10.0)
        for sock in list(self._peers):
            self._drop(sock)
        self._listener.close()
        self._selector.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(0.05):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is self._listener:
                    self._accept()
                else:
                    self._relay(sock)
            if self._cut_wanted.is_set():
                for sock in list(self._peers):
                    self._drop(sock)
                self.cuts += 1
                self._cut_wanted.clear()
                self._cut_done.set()

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except BlockingIOError:
            return
        try:
            upstream = socket.create_connection(self._target, timeout=5.0)
        except OSError:
            client.close()
            return
        self.accepted += 1
        for sock, peer in ((client, upstream), (upstream, client)):
            sock.setblocking(True)
            sock.settimeout(5.0)
            self._peers[sock] = peer
            self._selector.register(sock, selectors.EVENT_READ)

    def _relay(self, sock: socket.socket) -> None:
        peer = self._peers.get(sock)
        if peer is None:
            return
        try:
            data = sock.recv(_CHUNK)
            if data:
                peer.sendall(data)
                return
        except OSError:
            pass
        self._drop(sock)

    def _drop(self, sock: socket.socket) -> None:
        peer = self._peers.pop(sock, None)
        for one in (sock, peer):
            if one is None:
                continue
            self._peers.pop(one, None)
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(one)
            one.close()
