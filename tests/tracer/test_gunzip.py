"""The fast gzip path of the Kineto reader returns exactly what gzip.decompress returns, and
fails where it fails: single member (ISA-L), several members, trailing bytes, corrupt data."""
from __future__ import annotations

import gzip
import os
import zlib

import pytest

from tracer.ingest.kineto_split import _gunzip


def _payload(n: int) -> bytes:
    return b'{"traceEvents": [' + b",".join(b'{"ph": "X", "ts": %d}' % i for i in range(n)) + b"]}"


@pytest.mark.parametrize("n", [0, 1, 5000])
def test_single_member_equals_stdlib(n: int) -> None:
    data = gzip.compress(_payload(n) + os.urandom(64))
    assert _gunzip(data) == gzip.decompress(data)


def test_several_members_equal_stdlib() -> None:
    data = gzip.compress(_payload(100)) + gzip.compress(_payload(7))
    assert _gunzip(data) == gzip.decompress(data) == _payload(100) + _payload(7)


def test_trailing_zero_padding_equals_stdlib() -> None:
    data = gzip.compress(_payload(50)) + b"\0" * 16
    assert _gunzip(data) == gzip.decompress(data)


@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_corrupt_stream_fails_like_stdlib(damage: str) -> None:
    good = gzip.compress(_payload(2000))
    bad = good[: len(good) // 2] if damage == "truncated" else good[:-6] + bytes([good[-6] ^ 0xFF]) + good[-5:]
    with pytest.raises((EOFError, OSError, zlib.error)) as stdlib_exc:
        gzip.decompress(bad)
    with pytest.raises(type(stdlib_exc.value)):
        _gunzip(bad)


def test_single_member_does_not_use_stdlib(monkeypatch: pytest.MonkeyPatch) -> None:
    """The speed-up is real: with isal installed a profiler's one-member file never reaches gzip."""
    pytest.importorskip("isal")
    data = gzip.compress(_payload(300))

    def refuse(_: bytes) -> bytes:
        raise AssertionError("stdlib gzip used for a single-member stream")

    monkeypatch.setattr(gzip, "decompress", refuse)
    assert _gunzip(data) == _payload(300)
