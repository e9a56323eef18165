"""libsodium's own speed for what CurveZMQ does to each message frame: the limit
that ``bench/transport.py`` prints beside the ``zpipe_curve`` path.

libzmq 4.3.5 (built with libsodium, as pyzmq's wheels are) encrypts every frame
of a CURVE connection with ``crypto_box_easy_afternm`` (XSalsa20-Poly1305 under
the connection's precomputed key) in the sending context's I/O thread, and the
receiving I/O thread opens it in place with ``crypto_box_open_easy_afternm``.
The plaintext is a flags byte + the frame; the box adds a 16-byte MAC
(``src/curve_mechanism_base.cpp``). This module times those two calls
on one core (``time.thread_time``: CPU of this thread only) through ctypes on
the libsodium that pyzmq's libzmq is linked against (the wheel bundles it in
``pyzmq.libs``), else the system's; no extra dependency. If neither loads,
:func:`load` returns None and the bench prints nulls for the limit.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import zmq

MAC_BYTES = 16  # crypto_box_MACBYTES
FLAGS_BYTES = 1  # libzmq's per-frame flags byte, encrypted with the frame
NONCE_BYTES = 24
KEY_BYTES = 32


def _candidates() -> Iterator[str]:
    bundled = Path(zmq.__file__).resolve().parent.parent / "pyzmq.libs"
    if bundled.is_dir():
        yield from sorted(str(p) for p in bundled.glob("libsodium*.so*"))
    # Only when the bundled one is missing: find_library runs ldconfig.
    system = ctypes.util.find_library("sodium")
    if system:
        yield system


@dataclass(frozen=True)
class BoxTiming:
    """CPU seconds of one encrypt and one decrypt of a ``size``-byte frame."""

    size: int
    encrypt_s: float
    decrypt_s: float

    def gbps(self) -> float:
        """What one I/O thread per end can move (1e9 B/s): libzmq encrypts a
        connection's frames in one thread and decrypts them in one thread, so the
        slower of the two bounds a link, even with a free core for each."""
        return self.size / max(self.encrypt_s, self.decrypt_s) / 1e9

    def both_us(self) -> float:
        """Encrypt plus decrypt, microseconds: the crypto's CPU per message."""
        return (self.encrypt_s + self.decrypt_s) * 1e6


class Sodium:
    """``crypto_box_easy_afternm`` / ``crypto_box_open_easy_afternm`` through ctypes."""

    def __init__(self, lib: ctypes.CDLL, path: str) -> None:
        self.lib = lib
        self.path = path
        buf = ctypes.c_char_p
        for name in ("crypto_box_easy_afternm", "crypto_box_open_easy_afternm"):
            fn = getattr(lib, name)
            fn.argtypes = [buf, buf, ctypes.c_ulonglong, buf, buf]
            fn.restype = ctypes.c_int
        public = ctypes.create_string_buffer(KEY_BYTES)
        secret = ctypes.create_string_buffer(KEY_BYTES)
        lib.crypto_box_keypair(public, secret)
        self.key = ctypes.create_string_buffer(KEY_BYTES)
        lib.crypto_box_beforenm(self.key, public, secret)
        self.nonce = ctypes.create_string_buffer(NONCE_BYTES)

    def time_box(self, size: int, budget_s: float = 0.1, batches: int = 3) -> BoxTiming:
        """Median over ``batches`` of the CPU per encrypt and per decrypt of a frame
        of ``size`` bytes; each batch runs about ``budget_s / batches``."""
        n = FLAGS_BYTES + size
        plain = ctypes.create_string_buffer(n)
        box = ctypes.create_string_buffer(n + MAC_BYTES)
        encrypt = self.lib.crypto_box_easy_afternm
        decrypt = self.lib.crypto_box_open_easy_afternm
        encrypt(box, plain, n, self.nonce, self.key)  # warm: pages touched, caches
        # Opened in place, as libzmq does (it then moves the frame down a byte).
        if decrypt(plain, box, n + MAC_BYTES, self.nonce, self.key) != 0:
            raise RuntimeError("libsodium failed to open its own box")
        # About 1.5 GB/s per core here: pick a repeat count for the budget.
        reps = max(1, int(budget_s / batches * 1.5e9 / 2 / max(size, 1)))
        enc: list[float] = []
        dec: list[float] = []
        for _ in range(batches):
            started = time.thread_time()
            for _ in range(reps):
                encrypt(box, plain, n, self.nonce, self.key)
            enc.append((time.thread_time() - started) / reps)
            started = time.thread_time()
            for _ in range(reps):
                decrypt(plain, box, n + MAC_BYTES, self.nonce, self.key)
            dec.append((time.thread_time() - started) / reps)
        return BoxTiming(size, statistics.median(enc), statistics.median(dec))


def load() -> Sodium | None:
    """The libsodium libzmq uses (bundled with pyzmq), else the system's, else None."""
    for path in _candidates():
        try:
            lib = ctypes.CDLL(path)
            if lib.sodium_init() < 0:
                continue
            return Sodium(lib, path)
        except (OSError, AttributeError):
            continue
    return None
