"""A zstd body whose window is over RFC 9659's 8 MiB is refused before it takes memory (red
team 2026-12-07, P9), end to end through a real `egress serve`, with a raw client and a real
upstream on 127.0.0.1.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from conftest import DEFAULT_POLICY

STORED = "a" + "".join(chr(ord("a") + (i * 7) % 26) for i in range(31))  # an install's own secret


@pytest.fixture
def guarded(proxy_factory):
    return proxy_factory(DEFAULT_POLICY, env={"MY_SERVICE_TOKEN": STORED})


# ------------------------------------------------------------ the zstd window (P9)


def _zstd_window_frame() -> bytes:
    """One zstd frame (~2 KB) with a 64 MiB window that decodes to 60 MiB of zeros."""
    zstandard = pytest.importorskip("zstandard", reason="zstandard is needed to write zstd frames")
    params = zstandard.ZstdCompressionParameters(window_log=26, compression_level=3, write_content_size=False)
    writer = zstandard.ZstdCompressor(compression_params=params).compressobj()
    return writer.compress(b"\0" * (60 * 2**20)) + writer.flush()


def _status(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field}")


def test_a_zstd_body_with_a_window_over_8_mib_is_refused_and_pins_no_memory(guarded, http_upstream):
    # Before: each such upload, sent without its last bytes so that it never ends, held its
    # 64 MiB window (six: +359 MiB, kept after the connections closed). Now the frame is
    # refused at its header, for every one of them, and the proxy's peak RSS barely moves.
    frame = _zstd_window_frame()
    pid = guarded.process.pid
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # the peak (VmHWM) starts again from now
    before = _status(pid, "VmRSS")
    port = http_upstream.port
    socks = []
    try:
        for _ in range(4):
            sock = socket.create_connection(("127.0.0.1", guarded.port), timeout=20)
            socks.append(sock)
            head = (f"POST http://allowed.test:{port}/echo HTTP/1.1\r\nHost: allowed.test:{port}\r\n"
                    f"Content-Encoding: zstd\r\nTransfer-Encoding: chunked\r\n\r\n").encode()
            piece = frame[:-8]  # never finished: a decoder would hold its window for as long as the upload lasts
            sock.sendall(head + b"%x\r\n%s\r\n" % (len(piece), piece))
        events = guarded.wait_for_audit(lambda e: len([x for x in guarded.audit() if x["reason"] == "credential"]) >= 4,
                                        timeout=60)
        details = [e["detail"] for e in events if e["reason"] == "credential"]
        assert details == ["an unreadable body (a zstd window of 64 MiB, over the 8 MiB RFC 9659 allows the zstd "
                           "content coding)"] * 4, details
        grown = (_status(pid, "VmHWM") - before) / 1024
        assert grown < 48, f"peak RSS grew {grown:.0f} MiB for 4 uploads of {len(frame)} bytes"
    finally:
        for sock in socks:
            sock.close()
    assert all(not r.get("body") for r in http_upstream.requests)
