"""Transparent capture inside the command's network namespace: every road out leads to egress.

Run by the sandbox's helper once `lo` is up (while init builds its view), with the namespace's
own capabilities (its user namespace owns the network namespace, root caller or not). Three netlink
exchanges, written here as bytes (stdlib only: this runs in a forked copy of the caller):

* routes: ``default dev lo`` for IPv4 and IPv6 (source 127.0.0.1 / ::1), so a connect() to
  any address finds a route instead of failing with ENETUNREACH;
* nftables: two tables, ``ip egress`` and ``ip6 egress``, each with
    - a nat output chain: UDP to port 53 -> redirect to the DNS stub (port 53 of loopback);
      any other TCP not to loopback -> redirect to the capture port (CAPTURE_PORT), where
      egress reads the original destination with SO_ORIGINAL_DST;
    - a filter output chain: anything still not addressed to loopback after nat (UDP other
      than DNS, ICMP, SCTP, ...) is logged to the NFLOG group and refused with an ICMP port
      unreachable (a connected UDP socket sees ECONNREFUSED at once, not a timeout);
* an NFLOG socket bound to that group, copying the first 128 bytes of each refused packet:
  egress reads the destination there and names it.

The sockets (capture listener, DNS stub, NFLOG) are made here, inside, and handed to the
proxy, which lives outside, like the explicit proxy's listening socket. Nothing the command
can do reaches another namespace: the routes lead to `lo`, the rules only rewrite to
loopback, and the command holds no capability to change them (linux.py empties its bounding set).

Cost, measured in the helper (2 shared vCPUs): ~0.3 ms for all of it (see docs/architecture.md).
Why not pyroute2: its import costs several times a whole run, and the rules would still be
built by hand (docs/decisions/pyroute2.md); why not the `nft` binary: a fork+exec per command
(~2-3 ms) and a package.
"""

from __future__ import annotations

import os
import socket
import struct

CAPTURE_PORT = 3129  # every captured TCP connection arrives here, on 127.0.0.1 and ::1
DNS_PORT = 53
NFLOG_GROUP = 7
SNAPLEN = 128  # bytes of each refused packet egress reads: IP and transport headers

_NETLINK_NETFILTER = 12
_NLM_F_REQUEST, _NLM_F_ACK, _NLM_F_EXCL, _NLM_F_CREATE, _NLM_F_APPEND = 0x1, 0x4, 0x200, 0x400, 0x800
_NLMSG_ERROR = 2
_NLA_F_NESTED = 0x8000

# --- netlink attribute encoding --------------------------------------------------------------


def _attr(kind: int, payload: bytes) -> bytes:
    head = struct.pack("=HH", 4 + len(payload), kind)
    return head + payload + b"\0" * (-len(payload) % 4)


def _nest(kind: int, *attrs: bytes) -> bytes:
    return _attr(kind | _NLA_F_NESTED, b"".join(attrs))


def _str(kind: int, text: str) -> bytes:
    return _attr(kind, text.encode() + b"\0")


def _be32(kind: int, value: int) -> bytes:
    return _attr(kind, struct.pack("!I", value))


def _msg(kind: int, flags: int, seq: int, body: bytes) -> bytes:
    return struct.pack("=IHHII", 16 + len(body), kind, flags, seq, 0) + body


# --- routes (rtnetlink) ----------------------------------------------------------------------

_RTM_NEWROUTE = 24
_RT_TABLE_MAIN, _RTPROT_BOOT, _RT_SCOPE_UNIVERSE, _RTN_UNICAST = 254, 3, 0, 1
_RTA_OIF, _RTA_PREFSRC = 4, 7


def _route(seq: int, family: int, source: bytes) -> bytes:
    rtmsg = struct.pack("=BBBBBBBBI", family, 0, 0, 0, _RT_TABLE_MAIN, _RTPROT_BOOT,
                        _RT_SCOPE_UNIVERSE, _RTN_UNICAST, 0)
    attrs = _attr(_RTA_OIF, struct.pack("=i", socket.if_nametoindex("lo"))) + _attr(_RTA_PREFSRC, source)
    return _msg(_RTM_NEWROUTE, _NLM_F_REQUEST | _NLM_F_ACK | _NLM_F_CREATE | _NLM_F_EXCL, seq, rtmsg + attrs)


# --- nftables (nfnetlink) --------------------------------------------------------------------

_NFNL_SUBSYS_NFTABLES = 10
_NFNL_MSG_BATCH_BEGIN, _NFNL_MSG_BATCH_END = 0x10, 0x11
_NFT_MSG_NEWTABLE, _NFT_MSG_NEWCHAIN, _NFT_MSG_NEWRULE = 0, 3, 6
_NFPROTO_IPV4, _NFPROTO_IPV6 = 2, 10
_NF_INET_LOCAL_OUT = 3
_NF_ACCEPT = 1
_NFT_REG_VERDICT, _NFT_REG_1 = 0, 1
_NFT_CMP_EQ = 0
_NFT_META_L4PROTO = 16
_NFT_PAYLOAD_NETWORK, _NFT_PAYLOAD_TRANSPORT = 1, 2
_NFT_REJECT_ICMP_UNREACH = 0


def _nfgen(family: int, res_id: int = 0) -> bytes:
    return struct.pack("=BBH", family, 0, socket.htons(res_id))


def _nft(kind: int, family: int, seq: int, *attrs: bytes) -> bytes:
    flags = _NLM_F_REQUEST | _NLM_F_ACK | _NLM_F_CREATE | (_NLM_F_APPEND if kind == _NFT_MSG_NEWRULE else 0)
    return _msg((_NFNL_SUBSYS_NFTABLES << 8) | kind, flags, seq, _nfgen(family) + b"".join(attrs))


def _expr(name: str, *data: bytes) -> bytes:
    return _nest(1, _str(1, name), _nest(2, *data))  # NFTA_LIST_ELEM{NFTA_EXPR_NAME, NFTA_EXPR_DATA}


def _value(kind: int, value: bytes) -> bytes:
    return _nest(kind, _attr(1, value))  # NFTA_DATA_VALUE


def _meta_l4proto_is(proto: int) -> list[bytes]:
    return [_expr("meta", _be32(1, _NFT_REG_1), _be32(2, _NFT_META_L4PROTO)),  # DREG, KEY
            _expr("cmp", _be32(1, _NFT_REG_1), _be32(2, _NFT_CMP_EQ), _value(3, bytes([proto])))]


def _payload(base: int, offset: int, length: int) -> bytes:
    return _expr("payload", _be32(1, _NFT_REG_1), _be32(2, base), _be32(3, offset), _be32(4, length))


def _daddr_is_loopback(family: int) -> list[bytes]:
    if family == _NFPROTO_IPV4:  # ip daddr 127.0.0.0/8
        return [_payload(_NFT_PAYLOAD_NETWORK, 16, 4),
                _expr("bitwise", _be32(1, _NFT_REG_1), _be32(2, _NFT_REG_1), _be32(3, 4),
                      _value(4, b"\xff\0\0\0"), _value(5, b"\0\0\0\0")),
                _expr("cmp", _be32(1, _NFT_REG_1), _be32(2, _NFT_CMP_EQ), _value(3, b"\x7f\0\0\0"))]
    return [_payload(_NFT_PAYLOAD_NETWORK, 24, 16),  # ip6 daddr ::1
            _expr("cmp", _be32(1, _NFT_REG_1), _be32(2, _NFT_CMP_EQ), _value(3, b"\0" * 15 + b"\1"))]


def _accept() -> bytes:
    verdict = _nest(2, _be32(1, _NF_ACCEPT))  # NFTA_DATA_VERDICT{NFTA_VERDICT_CODE}
    return _expr("immediate", _be32(1, _NFT_REG_VERDICT), _nest(2, verdict))


def _redirect(port: int) -> list[bytes]:
    return [_expr("immediate", _be32(1, _NFT_REG_1), _value(2, struct.pack("!H", port))),
            _expr("redir", _be32(1, _NFT_REG_1), _be32(2, _NFT_REG_1))]  # REG_PROTO_MIN, _MAX


def _rule(family: int, seq: int, chain: str, exprs: list[bytes]) -> bytes:
    return _nft(_NFT_MSG_NEWRULE, family, seq, _str(1, "egress"), _str(2, chain),
                _nest(4, *exprs))  # NFTA_RULE_TABLE, _CHAIN, _EXPRESSIONS


def _chain(family: int, seq: int, name: str, kind: str, priority: int) -> bytes:
    hook = _nest(4, _be32(1, _NF_INET_LOCAL_OUT), _be32(2, priority & 0xFFFFFFFF))
    return _nft(_NFT_MSG_NEWCHAIN, family, seq, _str(1, "egress"), _str(3, name), hook,
                _be32(5, _NF_ACCEPT), _str(7, kind))  # TABLE, NAME, HOOK, POLICY, TYPE


def _family_rules(family: int, seq: int) -> list[bytes]:
    unreachable = 3 if family == _NFPROTO_IPV4 else 4  # ICMP port unreachable / ICMPv6 code 4
    msgs = [
        _nft(_NFT_MSG_NEWTABLE, family, seq, _str(1, "egress")),
        _chain(family, seq + 1, "nat", "nat", -100),
        _chain(family, seq + 2, "out", "filter", 0),
        # DNS to any address (an /etc/resolv.conf server, 8.8.8.8, 127.0.0.53) -> the stub
        _rule(family, seq + 3, "nat", [*_meta_l4proto_is(socket.IPPROTO_UDP),
                                      _payload(_NFT_PAYLOAD_TRANSPORT, 2, 2),
                                      _expr("cmp", _be32(1, _NFT_REG_1), _be32(2, _NFT_CMP_EQ),
                                            _value(3, struct.pack("!H", 53))),
                                      *_redirect(DNS_PORT)]),
        _rule(family, seq + 4, "nat", [*_daddr_is_loopback(family), _accept()]),
        _rule(family, seq + 5, "nat", [*_meta_l4proto_is(socket.IPPROTO_TCP), *_redirect(CAPTURE_PORT)]),
        # after nat: whatever is still not for loopback is named (NFLOG) and refused
        _rule(family, seq + 6, "out", [*_daddr_is_loopback(family), _accept()]),
        _rule(family, seq + 7, "out", [
            _expr("log", _attr(1, struct.pack("!H", NFLOG_GROUP)), _be32(3, SNAPLEN)),  # GROUP, SNAPLEN
            _expr("reject", _be32(1, _NFT_REJECT_ICMP_UNREACH), _attr(2, bytes([unreachable])))]),
    ]
    return msgs


def _ruleset(families: list[int]) -> bytes:
    seq = 1
    batch = [_msg(_NFNL_MSG_BATCH_BEGIN, _NLM_F_REQUEST, seq, _nfgen(0, _NFNL_SUBSYS_NFTABLES))]
    for family in families:
        batch += _family_rules(family, seq + 1)
        seq += 10
    batch.append(_msg(_NFNL_MSG_BATCH_END, _NLM_F_REQUEST, seq + 1, _nfgen(0, _NFNL_SUBSYS_NFTABLES)))
    return b"".join(batch)


# --- NFLOG (nfnetlink_log) -------------------------------------------------------------------

_NFNL_SUBSYS_ULOG = 4
_NFULNL_MSG_CONFIG = 1
_NFULA_CFG_CMD, _NFULA_CFG_MODE, _NFULA_CFG_QTHRESH = 1, 2, 4
_NFULNL_CFG_CMD_BIND = 1
_NFULNL_COPY_PACKET = 2


def _nflog_bind(seq: int) -> bytes:
    kind = (_NFNL_SUBSYS_ULOG << 8) | _NFULNL_MSG_CONFIG
    body = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(NFLOG_GROUP))
    bind = _msg(kind, _NLM_F_REQUEST | _NLM_F_ACK, seq, body + _attr(_NFULA_CFG_CMD, bytes([_NFULNL_CFG_CMD_BIND])))
    mode = _msg(kind, _NLM_F_REQUEST | _NLM_F_ACK, seq + 1,
                body + _attr(_NFULA_CFG_MODE, struct.pack("!IBx", SNAPLEN, _NFULNL_COPY_PACKET))
                # each packet at once: by default the kernel batches them for up to a second
                + _attr(_NFULA_CFG_QTHRESH, struct.pack("!I", 1)))
    return bind + mode


# --- the exchanges ---------------------------------------------------------------------------


def _exchange(sock: socket.socket, data: bytes, acks: int) -> None:
    """Send ``data`` (``acks`` messages asking for an ACK) and raise the first error."""
    sock.send(data)
    while acks > 0:
        reply = sock.recv(65536)
        offset = 0
        while offset + 16 <= len(reply):
            length, kind = struct.unpack_from("=IH", reply, offset)
            if kind == _NLMSG_ERROR:
                code = -struct.unpack_from("=i", reply, offset + 16)[0]
                if code:
                    raise OSError(code, os.strerror(code))
                acks -= 1
            offset += (length + 3) & ~3
            if length == 0:
                break


def _has_ipv6() -> bool:
    """IPv6 on `lo` (::1 listed): Docker turns IPv6 off in a container's namespace (disable_ipv6),
    which leaves the file but no ::1 to bind, and the command nothing to reach over IPv6."""
    try:
        with open("/proc/net/if_inet6") as f:
            return any(line.split()[:1] == ["0" * 31 + "1"] for line in f)
    except OSError:
        return False


def setup(backlog: int) -> list[tuple[bytes, socket.socket]]:
    """Rules, routes and sockets; the sockets to hand out, each with its tag: b"T" the TCP
    capture listener (IPv4, then b"t" IPv6), b"D" the DNS stub (b"d" IPv6), b"N" NFLOG.

    Raises OSError. The namespace is then as without capture (no route out: clients that
    ignore the proxy variables see "Network is unreachable"), and the launcher says so."""
    ipv6 = _has_ipv6()
    families = [socket.AF_INET] + ([socket.AF_INET6] if ipv6 else [])
    made: list[tuple[bytes, socket.socket]] = []
    try:
        # Rules first: routes without them would only lead to `lo`, where nothing answers (no
        # leak either way), but the rules are what can be missing (a kernel without nf_tables).
        nfams = [_NFPROTO_IPV4] + ([_NFPROTO_IPV6] if ipv6 else [])
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, _NETLINK_NETFILTER) as nf:
            nf.bind((0, 0))
            _exchange(nf, _ruleset(nfams), 8 * len(nfams))
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, socket.NETLINK_ROUTE) as rt:
            rt.bind((0, 0))
            _exchange(rt, b"".join(_route(i + 1, f, socket.inet_pton(f, "127.0.0.1" if f == socket.AF_INET else "::1"))
                                    for i, f in enumerate(families)), len(families))
        for family, tcp_tag, dns_tag, where in ((socket.AF_INET, b"T", b"D", "127.0.0.1"),
                                                (socket.AF_INET6, b"t", b"d", "::1")):
            if family not in families:
                continue
            listener = socket.socket(family, socket.SOCK_STREAM)
            made.append((tcp_tag, listener))
            if family == socket.AF_INET6:
                listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            listener.bind((where, CAPTURE_PORT))
            listener.listen(backlog)
            stub = socket.socket(family, socket.SOCK_DGRAM)
            made.append((dns_tag, stub))
            if family == socket.AF_INET6:
                stub.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            stub.bind((where, DNS_PORT))
        log = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, _NETLINK_NETFILTER)
        made.append((b"N", log))
        log.bind((0, 0))
        _exchange(log, _nflog_bind(1), 2)
    except BaseException:
        for _, s in made:
            s.close()
        raise
    return made
