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
from collections.abc import Callable, Iterator
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
    """CPU seconds of one encrypt and one decrypt of a ``size``-byte frame: the
    cipher's calls alone (``encrypt_s``, ``decrypt_s``) and with the copies libzmq
    makes around them (``frame_encrypt_s``, ``frame_decrypt_s``, see
    :meth:`Sodium.time_box`; 0.0 where not timed)."""

    size: int
    encrypt_s: float
    decrypt_s: float
    frame_encrypt_s: float = 0.0
    frame_decrypt_s: float = 0.0

    def gbps(self) -> float:
        """What one I/O thread per end can move (1e9 B/s): libzmq encrypts a
        connection's frames in one thread and decrypts them in one thread, so the
        slower of the two bounds a link, even with a free core for each."""
        return self.size / max(self.encrypt_s, self.decrypt_s) / 1e9

    def both_us(self) -> float:
        """Encrypt plus decrypt, microseconds: the crypto's CPU per message."""
        return (self.encrypt_s + self.decrypt_s) * 1e6

    def frame_gbps(self) -> float | None:
        """As :meth:`gbps`, with libzmq's copies: all of CURVE's work per frame."""
        slower = max(self.frame_encrypt_s, self.frame_decrypt_s)
        return self.size / slower / 1e9 if slower > 0 else None

    def frame_both_us(self) -> float | None:
        """libzmq's whole CURVE work for one frame, both ends, microseconds."""
        both = self.frame_encrypt_s + self.frame_decrypt_s
        return both * 1e6 if both > 0 else None


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
        of ``size`` bytes; each batch runs about ``budget_s / batches``.

        Timed twice: the cipher's two calls alone, and libzmq 4.3.5's whole work
        per frame (``curve_encoding_t::encode``/``decode``): on sending, a zeroed
        plaintext buffer (``std::vector``), the flags byte and the frame copied in,
        then boxed into a new message; on receiving, the box opened in place (the
        output overlaps the input by the MAC, so libsodium first moves the whole
        ciphertext, ``crypto_secretbox_open_detached``), then the plaintext moved
        down over the flags byte (``memmove``)."""
        n = FLAGS_BYTES + size
        frame = ctypes.create_string_buffer(max(size, 1))
        plain = ctypes.create_string_buffer(n)
        box = ctypes.create_string_buffer(n + MAC_BYTES)
        inplace = ctypes.create_string_buffer(n + MAC_BYTES)
        encrypt = self.lib.crypto_box_easy_afternm
        decrypt = self.lib.crypto_box_open_easy_afternm
        encrypt(box, plain, n, self.nonce, self.key)  # warm: pages touched, caches
        if decrypt(plain, box, n + MAC_BYTES, self.nonce, self.key) != 0:
            raise RuntimeError("libsodium failed to open its own box")
        plain_at = ctypes.addressof(plain)
        inplace_at = ctypes.addressof(inplace)

        def cipher_encrypt() -> None:
            encrypt(box, plain, n, self.nonce, self.key)

        def cipher_decrypt() -> None:
            decrypt(plain, box, n + MAC_BYTES, self.nonce, self.key)

        def frame_encrypt() -> None:
            ctypes.memset(plain, 0, n)  # std::vector<uint8_t>(mlen) zero-fills
            ctypes.memmove(plain_at + FLAGS_BYTES, frame, size)
            encrypt(box, plain, n, self.nonce, self.key)

        def receive_box() -> None:  # stands in for the box arriving (taken out below)
            ctypes.memmove(inplace, box, n + MAC_BYTES)

        def frame_decrypt() -> None:
            receive_box()
            if decrypt(inplace, inplace, n + MAC_BYTES, self.nonce, self.key) != 0:
                raise RuntimeError("libsodium failed to open its box in place")
            ctypes.memmove(inplace_at, inplace_at + FLAGS_BYTES, size)

        # About 1.5 GB/s per core here: pick a repeat count for the budget.
        reps = max(1, int(budget_s / batches / 2 * 1.5e9 / 2 / max(size, 1)))
        steps = (cipher_encrypt, cipher_decrypt, frame_encrypt, frame_decrypt, receive_box)
        timed: dict[Callable[[], None], list[float]] = {step: [] for step in steps}
        for _ in range(batches):
            for step, runs in timed.items():
                started = time.thread_time()
                for _ in range(reps):
                    step()
                runs.append((time.thread_time() - started) / reps)
        med = {step: statistics.median(runs) for step, runs in timed.items()}
        return BoxTiming(
            size,
            med[cipher_encrypt],
            med[cipher_decrypt],
            med[frame_encrypt],
            max(med[frame_decrypt] - med[receive_box], med[cipher_decrypt]),
        )


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
