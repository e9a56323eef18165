"""bench/transport.py's CURVE limit: libsodium's own timing and the summary it yields."""

from __future__ import annotations

import ctypes

import pytest

from bench._sodium import BoxTiming, load
from bench._transport_results import Result, curve_limits


def test_libsodium_boxes_and_opens_a_frame_and_times_both() -> None:
    sodium = load()
    if sodium is None:
        pytest.skip("no libsodium loads here (pyzmq's bundled one nor the system's)")
    timing = sodium.time_box(4096, budget_s=0.003, batches=1)
    assert timing.encrypt_s > 0 and timing.decrypt_s > 0
    assert timing.gbps() == pytest.approx(4096 / max(timing.encrypt_s, timing.decrypt_s) / 1e9)
    # A tampered box must not open: the call really authenticates.
    n = 1 + 64
    plain = ctypes.create_string_buffer(n)
    box = ctypes.create_string_buffer(n + 16)
    sodium.lib.crypto_box_easy_afternm(box, plain, n, sodium.nonce, sodium.key)
    box[5] = bytes([box.raw[5] ^ 1])
    assert sodium.lib.crypto_box_open_easy_afternm(plain, box, n + 16, sodium.nonce, sodium.key)


def _result(path: str, gbps: float, cpu_us: float) -> Result:
    size = 1 << 20
    result = Result(path, size, count=100)
    result.seconds.append(100 * size / (gbps * 1e9))
    result.cpu_seconds.append(cpu_us * 100 / 1e6)
    return result


def test_the_limits_compare_the_curve_path_with_the_cipher_alone() -> None:
    box = BoxTiming(1 << 20, encrypt_s=700e-6, decrypt_s=800e-6)  # 1.31 GB/s
    plain = _result("zpipe", gbps=5.0, cpu_us=300.0)
    curve = _result("zpipe_curve", gbps=1.0, cpu_us=2100.0)
    out = curve_limits("1mb", box, plain, curve)
    limit = (1 << 20) / 800e-6 / 1e9
    assert out["libsodium_gbps_1mb"] == pytest.approx(limit, rel=1e-3)
    assert out["curve_over_libsodium_1mb"] == pytest.approx(1.0 / limit, rel=1e-3)
    assert out["curve_limit_over_plain_1mb"] == pytest.approx(limit / 5.0, rel=1e-3)
    assert out["curve_cpu_limit_over_plain_1mb"] == pytest.approx(300 / 1800, rel=1e-3)
    assert out["crypto_cpu_us_1mb"] == pytest.approx(1500.0)
    assert out["curve_extra_cpu_us_1mb"] == pytest.approx(1800.0)
    assert out["curve_extra_over_crypto_1mb"] == pytest.approx(1.2)


def test_without_libsodium_every_limit_is_null() -> None:
    out = curve_limits("1mb", None, _result("zpipe", 5.0, 300.0), None)
    assert out and all(value is None for value in out.values())


def test_libzmqs_copies_around_the_cipher_are_timed_and_compared_too() -> None:
    box = BoxTiming(
        1 << 20,
        encrypt_s=700e-6,
        decrypt_s=800e-6,
        frame_encrypt_s=800e-6,
        frame_decrypt_s=1000e-6,
    )
    plain = _result("zpipe", gbps=5.0, cpu_us=300.0)
    curve = _result("zpipe_curve", gbps=1.0, cpu_us=2100.0)
    out = curve_limits("1mb", box, plain, curve)
    assert out["libzmq_curve_gbps_1mb"] == pytest.approx((1 << 20) / 1000e-6 / 1e9, rel=1e-3)
    assert out["curve_frame_cpu_us_1mb"] == pytest.approx(1800.0)
    assert out["curve_extra_over_frame_1mb"] == pytest.approx(1.0)
    # never timed with the copies: those keys stay null, the cipher's are kept
    bare = curve_limits("1mb", BoxTiming(1 << 20, 700e-6, 800e-6), plain, curve)
    assert bare["libzmq_curve_gbps_1mb"] is None and bare["curve_extra_over_frame_1mb"] is None
    assert bare["crypto_cpu_us_1mb"] == pytest.approx(1500.0)


def test_the_frame_timing_includes_libzmqs_copies() -> None:
    sodium = load()
    if sodium is None:
        pytest.skip("no libsodium loads here (pyzmq's bundled one nor the system's)")
    timing = sodium.time_box(1 << 16, budget_s=0.01, batches=1)
    assert timing.frame_encrypt_s > 0 and timing.frame_decrypt_s >= timing.decrypt_s
    assert timing.frame_gbps() is not None and timing.frame_both_us() is not None
