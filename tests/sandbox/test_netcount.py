"""sandbox/netcount.py: the counters of direct attempts, read from real /proc/net texts."""

from __future__ import annotations

import pytest

from sandbox.netcount import direct_attempts

# A sandbox's namespace after node 20's fetch("https://example.com/") (two DNS queries to the
# resolver at 10.255.255.53: no route), a datagram to 127.0.0.53:53 (nothing listens) and an
# IPv6 send to 2001:db8::1 (no route); Linux 6.18.
SNMP = """\
Ip: Forwarding DefaultTTL InReceives InHdrErrors InAddrErrors ForwDatagrams InUnknownProtos InDiscards InDelivers OutRequests OutDiscards OutNoRoutes ReasmTimeout ReasmReqds ReasmOKs ReasmFails FragOKs FragFails FragCreates OutTransmits
Ip: 2 64 2 0 0 0 0 0 2 2 0 2 0 0 0 0 0 0 0 2
Icmp: InMsgs InErrors InCsumErrors InDestUnreachs InTimeExcds InParmProbs InSrcQuenchs InRedirects InEchos InEchoReps InTimestamps InTimestampReps InAddrMasks InAddrMaskReps OutMsgs OutErrors OutRateLimitGlobal OutRateLimitHost OutDestUnreachs OutTimeExcds OutParmProbs OutSrcQuenchs OutRedirects OutEchos OutEchoReps OutTimestamps OutTimestampReps OutAddrMasks OutAddrMaskReps
Icmp: 1 0 0 1 0 0 0 0 0 0 0 0 0 0 1 0 0 0 1 0 0 0 0 0 0 0 0 0 0
IcmpMsg: InType3 OutType3
IcmpMsg: 1 1
Tcp: RtoAlgorithm RtoMin RtoMax MaxConn ActiveOpens PassiveOpens AttemptFails EstabResets CurrEstab InSegs OutSegs RetransSegs InErrs OutRsts InCsumErrors
Tcp: 1 200 120000 -1 0 0 0 0 0 0 0 0 0 0 0
Udp: InDatagrams NoPorts InErrors OutDatagrams RcvbufErrors SndbufErrors InCsumErrors IgnoredMulti MemErrors
Udp: 0 1 0 1 0 0 0 0 0
UdpLite: InDatagrams NoPorts InErrors OutDatagrams RcvbufErrors SndbufErrors InCsumErrors IgnoredMulti MemErrors
UdpLite: 0 0 0 0 0 0 0 0 0
"""
SNMP6 = """\
Ip6InReceives                   \t0
Ip6OutNoRoutes                  \t1
Udp6InDatagrams                 \t0
Udp6NoPorts                     \t0
UdpLite6NoPorts                 \t0
"""
QUIET = SNMP.replace("Ip: 2 64 2 0 0 0 0 0 2 2 0 2", "Ip: 2 64 2 0 0 0 0 0 2 2 0 0").replace("Udp: 0 1 0 1", "Udp: 0 0 0 1")


@pytest.mark.parametrize("text, expected", [
    (SNMP + SNMP6, 4),                           # OutNoRoutes 2 + Udp NoPorts 1 + Ip6OutNoRoutes 1
    (SNMP, 3),                                   # no IPv6: no snmp6 file
    (SNMP6.replace("Udp6NoPorts                     \t0", "Udp6NoPorts \t5"), 6),
    (QUIET, 0),                                  # curl through the proxy: nothing around it
    (QUIET.replace("UdpLite: 0 0", "UdpLite: 0 7"), 0),  # UdpLite's NoPorts is not Udp's
    (SNMP6.replace("UdpLite6NoPorts                 \t0", "UdpLite6NoPorts \t9"), 1),
    ("", 0),
])
def test_direct_attempts_sum_the_no_route_and_no_port_counters(text, expected):
    assert direct_attempts(text) == expected
