"""How the domain policy scales: load time, decision time and memory by size.

Run:  /work/venv/bin/python bench/policy_bench.py [--sizes 1000,100000,1000000] [--lookups 100000]

For each size it writes a TOML policy of N allow entries (plain names, some
``*.`` wildcards, some ``:443`` entries, some CIDRs) plus ~N/100 deny entries
(names and CIDRs) to a temporary directory, then measures in a fresh child
process, so that peak RSS belongs to that size alone:

* load: TOML parse (tomllib on the file's text), building the tables
  (``Policy.from_mapping`` on the parsed mapping) and ``load_policy`` end to end;
* decide: mean time per ``Policy.decide`` over a mix of hits, deep subdomains,
  misses, denied names and IP literals, both from the raw string (parse + lookup,
  what the proxy does) and from an already parsed ``Host`` (lookup only);
* peak RSS of the child.

The claim under test: lookups cost O(labels), not O(rules), so decide time at 1M
entries should be about the same as at 1k (ratio ~1), and 1M entries load in
seconds. Temporary files are removed on exit.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

WILDCARD_EVERY = 10  # every 10th allow entry is "*.name"
PORT_EVERY = 7  # every 7th is "name:443"
CIDR_EVERY = 50  # every 50th is an IPv4 /24 (or /32)
DENY_EVERY = 100  # one deny entry per 100 allow entries


def allow_entry(i: int) -> str:
    if i % CIDR_EVERY == 0:
        # 11.0.0.0/8 upwards: public space, distinct networks, two prefix lengths.
        a, b, c = 11 + (i >> 16) % 200, (i >> 8) & 255, i & 255
        return f"{a}.{b}.{c}.0/24" if i % 100 else f"{a}.{b}.{c}.7"
    name = f"host{i}.svc{i % 997}.example{i % 31}.com"
    if i % WILDCARD_EVERY == 1:
        return f"*.{name}"
    if i % PORT_EVERY == 2:
        return f"{name}:443"
    return name


def deny_entry(j: int) -> str:
    if j % 5 == 0:
        return f"192.{j % 256}.{(j >> 8) % 256}.0/24"
    i = j * DENY_EVERY + 3  # an allowed name: deny must win
    return f"bad.host{i}.svc{i % 997}.example{i % 31}.com"


def write_policy(path: Path, n: int) -> None:
    with path.open("w", encoding="utf-8") as f:
        f.write(f"# generated: {n} allow entries\nallow = [\n")
        for i in range(n):
            f.write(f'  "{allow_entry(i)}",\n')
        f.write("]\ndeny = [\n")
        for j in range(max(1, n // DENY_EVERY)):
            f.write(f'  "{deny_entry(j)}",\n')
        f.write("]\n")


def lookups(n: int, count: int) -> list[tuple[str, int]]:
    """A reproducible mix of (host, port) requests against a policy of n entries."""
    rng = random.Random(1234)
    out = []
    for k in range(count):
        i = rng.randrange(n)
        name = f"host{i}.svc{i % 997}.example{i % 31}.com"
        pick = k % 8
        if pick == 0:
            out.append((name, 443))  # exact hit (or wildcard apex miss, or port entry)
        elif pick == 1:
            out.append((f"a.b.c.d.e.f.{name}", 443))  # deep subdomain
        elif pick == 2:
            out.append((f"www.{name}", 80))
        elif pick == 3:
            out.append((f"nothere{i}.example.org", 443))  # miss, few labels
        elif pick == 4:
            out.append((f"x{k}.y.z.unknown{i}.example{i % 31}.com", 443))  # miss, deep
        elif pick == 5:
            j = i // DENY_EVERY
            d = j * DENY_EVERY + 3
            out.append((f"bad.host{d}.svc{d % 997}.example{d % 31}.com", 443))  # denied
        elif pick == 6:
            out.append((f"{11 + (i >> 16) % 200}.{(i >> 8) & 255}.{i & 255}.9", 443))  # IP literal
        else:
            out.append((name.upper() + ".", 443))  # needs normalising
    return out


def measure_split(path: Path) -> dict:
    """Child process: TOML parse and table building, timed apart."""
    from egress.policy import Policy, is_public_suffix

    is_public_suffix("warm.up")  # load the public suffix list outside the timings
    text = path.read_text(encoding="utf-8")
    t0 = time.perf_counter()
    data = tomllib.loads(text)
    t1 = time.perf_counter()
    Policy.from_mapping(data, str(path))
    t2 = time.perf_counter()
    return {"parse_s": t1 - t0, "build_s": t2 - t1}


def measure_full(path: Path, n: int, count: int) -> dict:
    """Child process: load_policy end to end, then decisions, then peak RSS."""
    import gc

    from egress.hosts import parse_host
    from egress.policy import is_public_suffix, load_policy

    is_public_suffix("warm.up")
    rss_base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    policy = load_policy([str(path)])
    t1 = time.perf_counter()
    # The first full collection after loading walks every object of the policy
    # once; a server pays it once, early. Keep it out of the per-lookup figures.
    gc.collect()
    t2 = time.perf_counter()

    requests = lookups(n, count)
    hosts = [(parse_host(h), p) for h, p in requests]
    decide = policy.decide
    for h, p in requests[:1000]:  # warm up
        decide(h, p)
    t3 = time.perf_counter()
    for h, p in requests:
        decide(h, p)
    t4 = time.perf_counter()
    for h, p in hosts:
        decide(h, p)
    t5 = time.perf_counter()
    results = [decide(h, p) for h, p in requests]  # untimed: what the mix was
    return {
        "n": n,
        "rules": policy.rule_count,
        "load_s": t1 - t0,
        "gc_s": t2 - t1,
        "decide_us": (t4 - t3) / count * 1e6,
        "lookup_us": (t5 - t4) / count * 1e6,
        "allowed": sum(r.allowed for r in results),
        "denied": sum(r.reason == "denied" for r in results),
        "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_base_mb": rss_base / 1024,
    }


def child(mode: str, path: Path, n: int, count: int) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", mode, str(path), str(n), "--lookups", str(count)],
        check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--sizes", default="1000,100000,1000000")
    ap.add_argument("--lookups", type=int, default=100_000)
    ap.add_argument("--child", nargs=3, metavar=("MODE", "FILE", "N"), help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child:
        mode, file, n = args.child
        if mode == "split":
            print(json.dumps(measure_split(Path(file))))
        else:
            print(json.dumps(measure_full(Path(file), int(n), args.lookups)))
        return

    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="egress-bench-") as tmp:
        for n in sizes:
            path = Path(tmp) / f"policy-{n}.toml"
            write_policy(path, n)
            size_mb = path.stat().st_size / 1e6
            row = child("full", path, n, args.lookups)
            row.update(child("split", path, n, args.lookups))
            row["file_mb"] = size_mb
            rows.append(row)
            path.unlink()
            print(f"  measured {n:>9,} entries", file=sys.stderr)

    print(f"\nPython {sys.version.split()[0]}, {args.lookups:,} lookups per size "
          f"(hits, deep subdomains, misses, denied, IP literals)\n")
    head = (f"{'allow':>9} {'rules':>9} {'file MB':>7} {'parse s':>8} {'build s':>8} {'load s':>7} "
            f"{'1st gc s':>8} {'decide us':>9} {'lookup us':>9} {'peak RSS MB':>11}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['n']:>9,} {r['rules']:>9,} {r['file_mb']:>7.1f} {r['parse_s']:>8.3f} "
              f"{r['build_s']:>8.3f} {r['load_s']:>7.3f} {r['gc_s']:>8.3f} {r['decide_us']:>9.2f} "
              f"{r['lookup_us']:>9.2f} "
              f"{r['rss_mb']:>11.0f}")
    print("\nparse = tomllib alone; build = Policy.from_mapping on the parsed data; load = load_policy"
          " end to end\n(separate processes); 1st gc = the first full collection after loading.\n"
          "decide = decide(str, port) incl. normalisation; lookup = decide(Host, port).")
    mix = rows[-1]
    print(f"mix at {mix['n']:,}: {mix['allowed']:,} allowed, {mix['denied']:,} denied, "
          f"{args.lookups - mix['allowed'] - mix['denied']:,} not allowed")
    print(f"baseline RSS (interpreter + imports + public suffix list): {rows[0]['rss_base_mb']:.0f} MB")
    if len(rows) > 1:
        first, last = rows[0], rows[-1]
        print(f"\ndecide time ratio {last['n']:,} / {first['n']:,} entries: "
              f"{last['decide_us'] / first['decide_us']:.2f} (str), "
              f"{last['lookup_us'] / first['lookup_us']:.2f} (Host)   [~1 means O(labels), not O(rules)]")


if __name__ == "__main__":
    main()
