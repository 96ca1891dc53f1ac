"""Every form of a request body the README says is read, is read (issue 26, item 4): end to end
through a real `egress serve`, real clients on raw sockets, upstreams on 127.0.0.1 that keep
every byte they get (the review's P3, P18 and the split WebSocket token).

* a body in UTF-16 or UTF-32 (a byte-order mark, a charset parameter, an XML declaration, or
  the NULs such text has), buffered and streamed, read transcoded to UTF-8;
* a coded body (gzip, deflate, br, zstd) read as sent as well as decoded: the coding's own
  fields (gzip's name, comment and extra field; zstd's skippable frames; brotli's metadata)
  are skipped by decoders and read by anyone;
* a token split across a client's WebSocket messages.

Every token is made up.
"""

from __future__ import annotations

import pytest

from conftest import DEFAULT_POLICY
from test_credentials import GITHUB, STORED, WS_ACCEPT, RawUpstream, read_all, ws_frame, ws_open


@pytest.fixture
def guarded(proxy_factory):
    return proxy_factory(DEFAULT_POLICY, env={"MY_SERVICE_TOKEN": STORED})


def credential_refusals(proxy, count: int = 1) -> list[str]:
    events = proxy.wait_for_audit(lambda e: len([x for x in proxy.audit() if x["reason"] == "credential"]) >= count)
    return [e["detail"] for e in events if e["reason"] == "credential"]


# ------------------------------------------------------------ WebSocket


def test_a_token_split_across_the_clients_websocket_messages_never_leaves(guarded, test_ca):
    upstream = RawUpstream(test_ca, answer=WS_ACCEPT)
    try:
        tls = ws_open(guarded, upstream)
        assert tls.recv(4096).startswith(b"HTTP/1.1 101")
        tls.sendall(ws_frame(0x1, f"token={GITHUB[:20]}".encode()))
        tls.sendall(ws_frame(0x2, GITHUB[20:].encode()))
        answer = read_all(tls)
        assert answer[:1] == b"\x88" and answer[2:4] == (1008).to_bytes(2, "big"), answer
        assert GITHUB[20:].encode() not in upstream.received
        assert credential_refusals(guarded) == ["github-token across WebSocket messages"]
    finally:
        upstream.close()
