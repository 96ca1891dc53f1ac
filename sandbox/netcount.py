"""How often the command tried to leave its network namespace other than through the proxy.

The namespace holds only `lo`, so a client that ignores the proxy variables fails without a
byte leaving: its DNS query to the resolver in /etc/resolv.conf, and any connect() or
sendto() to an address outside, finds no route (ENETUNREACH), which the kernel counts in the
namespace's `Ip: OutNoRoutes` (`Ip6OutNoRoutes` for IPv6). With a local stub resolver
(systemd's 127.0.0.53) the query goes to a loopback port where nothing listens inside:
`Udp: NoPorts` (`Udp6NoPorts`). Measured in `egress run`: node 20's
`fetch("https://example.com/")` (it ignores HTTPS_PROXY) took OutNoRoutes from 0 to 2 (its
getaddrinfo asked the resolver at 10.255.255.53 twice) and failed with EAI_AGAIN; curl
through the proxy, and a refused connection to a port on the sandbox's own loopback, leave
all four at 0.

The files are opened while the namespace lives (through the helper, which is in it) and read
after the command ended: an open /proc/PID/net file keeps its namespace (seq_open_net takes a
reference), so the counts survive the processes. Opening both costs ~40 us.
"""

from __future__ import annotations

import os

FILES = ("snmp", "snmp6")
COUNTERS = {("Ip", "OutNoRoutes"), ("Udp", "NoPorts"), ("Ip6OutNoRoutes", None), ("Udp6NoPorts", None)}


def open_files(pid: int) -> list[int]:
    """Descriptors of /proc/PID/net/snmp and snmp6 (those that exist: no IPv6, no snmp6)."""
    fds = []
    for name in FILES:
        try:
            fds.append(os.open(f"/proc/{pid}/net/{name}", os.O_RDONLY | os.O_CLOEXEC))
        except OSError:
            pass
    return fds


def read(fds: list[int]) -> int | None:
    """Direct attempts counted in the files behind ``fds``; None if there is nothing to read."""
    texts = []
    for fd in fds:
        try:
            texts.append(os.pread(fd, 1 << 16, 0).decode("ascii", "replace"))
        except OSError:
            continue
    return direct_attempts("\n".join(texts)) if texts else None


def direct_attempts(text: str) -> int:
    """The sum of the counters above in the text of /proc/net/snmp and/or /proc/net/snmp6.

    snmp has pairs of lines, names then values (`Ip: Forwarding ... OutNoRoutes ...`);
    snmp6 has one `Name value` per line.
    """
    total = 0
    lines = text.splitlines()
    for names, values in zip(lines, lines[1:]):
        head, _, rest = names.partition(": ")
        if not rest or not values.startswith(head + ": "):
            continue
        for name, value in zip(rest.split(), values[len(head) + 2:].split()):
            if (head, name) in COUNTERS:
                total += int(value)
    for line in lines:
        fields = line.split()
        if len(fields) == 2 and (fields[0], None) in COUNTERS:
            total += int(fields[1])
    return total
