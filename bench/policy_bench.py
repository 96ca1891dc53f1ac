"""How the domain policy scales: load time, memory, decisions, rule locations, and a live reload under load.

Run:  .venv/bin/python bench/policy_bench.py [--sizes 1000,100000,1000000] [--lookups 100000] [--base REV]
      .venv/bin/python bench/policy_bench.py --reload [--entries 1000000] [--reloads 3] [--base REV]
      (--reload needs wrk and nginx: apt-get install -y wrk nginx-light)

``--base REV`` measures a commit of this repository (``git archive`` into the temporary
directory, first on PYTHONPATH) beside the working tree, interleaved in one run (the order
alternates every round), and prints both side by side with the tree/base ratio.

Sizes (the default mode): for each size it writes a TOML policy of N allow entries (plain
names, some ``*.`` wildcards, some ``:443`` entries, some CIDRs) plus ~N/100 deny entries
(names and CIDRs) to a temporary directory, then measures in a fresh child process, so that
peak RSS belongs to that size alone:

* load: ``load_policy`` end to end, wall and CPU seconds;
* memory: the child's peak RSS, and its RSS after loading (what the policy keeps);
* decide: mean time per ``Policy.decide`` over a mix of hits, deep subdomains, misses,
  denied names and IP literals, from the raw string (parse + lookup, what the proxy does)
  and from an already parsed ``Host`` (lookup only);
* locate: the first ``str(decision.rule)`` (what the proxy writes in each event: the
  entry with its file:line) of 100 rules spread over the file, mean and longest.

Reload (``--reload``): ``egress serve`` (one process: ``--workers 1`` where it has workers)
with an N-entry policy (and ``allowed.test``) in front of nginx, under ``wrk -c C`` plain-HTTP
load run in back-to-back 1-second slices; SIGHUP makes it reload the same policy ``--reloads``
times, 3 s apart (a SIGHUP with no reload after ``--resend`` seconds is counted and sent
again: lost, or a reload slower than that). Reported: start-up (process start to its
listening line), each reload's time (SIGHUP to the ``policy reloaded`` line), req/s of the
slices during a reload against the quiet ones, p50/p99/max latency of every request in them
(wrk's histograms pooled), and the proxy's RSS after start, after each reload and at its peak.
Everything listens on 127.0.0.1, on ports bound as 0 (nginx on ports it was just given); every
process is stopped by its pid and the temporary directory removed, also on errors and Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from proxy_bench import EGRESS_MAIN, WRK_LUA, Procs, free_port, listening_ports, status_kb  # noqa: E402

# proxy_bench's script, plus every latency wrk recorded (its histogram: microseconds, count), so
# that the percentiles of all requests during a reload can be computed, not only per slice.
SLICE_LUA = WRK_LUA + r"""
local summary_done = done
function done(summary, latency, requests)
  summary_done(summary, latency, requests)
  local out = {}
  for i = 1, #latency do  -- wrk 4: #latency distinct values, latency(i) = value, count
    local v, n = latency(i)
    out[#out + 1] = string.format("%d:%d", v, n)
  end
  io.write("HIST " .. table.concat(out, ",") .. "\n")
end
"""

REPO = Path(__file__).resolve().parent.parent
WILDCARD_EVERY = 10  # every 10th allow entry is "*.name"
PORT_EVERY = 7  # every 7th is "name:443"
CIDR_EVERY = 50  # every 50th is an IPv4 /24 (or /32)
DENY_EVERY = 100  # one deny entry per 100 allow entries
LOCATE = 100  # rules whose first location is timed


def host_name(i: int) -> str:
    return f"host{i}.svc{i % 997}.example{i % 31}.com"


def allow_entry(i: int) -> str:
    if i % CIDR_EVERY == 0:
        # 11.0.0.0/8 upwards: public space, distinct networks, two prefix lengths.
        a, b, c = 11 + (i >> 16) % 200, (i >> 8) & 255, i & 255
        return f"{a}.{b}.{c}.0/24" if i % 100 else f"{a}.{b}.{c}.7"
    name = host_name(i)
    if i % WILDCARD_EVERY == 1:
        return f"*.{name}"
    if i % PORT_EVERY == 2:
        return f"{name}:443"
    return name


def deny_entry(j: int) -> str:
    if j % 5 == 0:
        return f"192.{j % 256}.{(j >> 8) % 256}.0/24"
    i = j * DENY_EVERY + 3  # an allowed name: deny must win
    return f"bad.{host_name(i)}"


def write_policy(path: Path, n: int, allow_also: tuple[str, ...] = ()) -> None:
    with path.open("w", encoding="utf-8") as f:
        f.write(f"# generated: {n} allow entries\nallow = [\n")
        for i in range(n):
            f.write(f'  "{allow_entry(i)}",\n')
        for name in allow_also:
            f.write(f'  "{name}",\n')
        f.write("]\ndeny = [\n")
        for j in range(max(1, n // DENY_EVERY)):
            f.write(f'  "{deny_entry(j)}",\n')
        f.write("]\n")
        if allow_also:
            f.write(f"allow_private = {json.dumps(list(allow_also))}\n")


def lookups(n: int, count: int) -> list[tuple[str, int]]:
    """A reproducible mix of (host, port) requests against a policy of n entries."""
    rng = random.Random(1234)
    out = []
    for k in range(count):
        i = rng.randrange(n)
        name = host_name(i)
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
            out.append((f"bad.{host_name(d)}", 443))  # denied
        elif pick == 6:
            out.append((f"{11 + (i >> 16) % 200}.{(i >> 8) & 255}.{i & 255}.9", 443))  # IP literal
        else:
            out.append((name.upper() + ".", 443))  # needs normalising
    return out


def rss_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def measure(path: Path, n: int, count: int) -> dict:
    """Child process: load_policy end to end, memory, decisions, first locations."""
    import gc

    from egress.core.hosts import parse_host
    from egress.core.public_suffix import is_public_suffix
    from egress.policy.loader import load_policy

    is_public_suffix("warm.up")
    rss_base = rss_kb()
    c0, t0 = time.process_time(), time.perf_counter()
    policy = load_policy([str(path)])
    t1, c1 = time.perf_counter(), time.process_time()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # The first full collection after loading walks every object the policy made;
    # a server pays it once, early. Keep it out of the per-lookup figures.
    gc.collect()
    t2 = time.perf_counter()
    rss_kept = rss_kb() - rss_base

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

    # First use of rules spread over the file: www.<name> matches plain, wildcard and :443 entries.
    located = []
    for k in range(LOCATE):
        i = (k * n) // LOCATE + 1
        i += i % CIDR_EVERY == 0
        rule = decide(f"www.{host_name(i)}", 443).rule
        s = time.perf_counter()
        text = str(rule)
        located.append(time.perf_counter() - s)
        assert ":" in text.rsplit("(", 1)[1], text  # the line is known
    return {
        "n": n,
        "rules": policy.rule_count,
        "load_s": t1 - t0,
        "load_cpu_s": c1 - c0,
        "gc_s": t2 - t1,
        "decide_us": (t4 - t3) / count * 1e6,
        "lookup_us": (t5 - t4) / count * 1e6,
        "locate_ms": 1e3 * sum(located) / len(located),
        "locate_max_ms": 1e3 * max(located),
        "allowed": sum(r.allowed for r in results),
        "denied": sum(r.reason == "denied" for r in results),
        "peak_mb": peak / 1024,
        "kept_mb": rss_kept / 1024,
        "rss_base_mb": rss_base / 1024,
    }


# ------------------------------------------------------------------ versions


class Version:
    """A version of egress to measure: the working tree, or a commit exported beside it."""

    def __init__(self, label: str, env: dict, describe: str):
        self.label, self.env, self.describe = label, env, describe


def versions(base: str | None, tmp: Path) -> list[Version]:
    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True, timeout=60).stdout.strip()

    dirty = [ln for ln in git("status", "--porcelain", "--", "egress", "policies").splitlines() if ln]
    tree = Version("tree", dict(os.environ), f"working tree at {git('rev-parse', '--short', 'HEAD')}"
                   + (f" + {len(dirty)} uncommitted changes" if dirty else ""))
    if base is None:
        return [tree]
    rev = git("rev-parse", "--verify", "--short", base + "^{commit}")
    if not rev:
        raise SystemExit(f"--base {base}: not a git revision in {REPO}")
    src = tmp / f"base-{rev}"
    src.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "egress", "policies"],
                             capture_output=True, timeout=60, check=True)
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive.stdout, check=True, timeout=60)
    if (src / "policies").is_dir():  # installed as the package egress.policies
        shutil.rmtree(src / "egress" / "policies", ignore_errors=True)
        (src / "policies").rename(src / "egress" / "policies")
    env = dict(os.environ)
    env["PYTHONPATH"] = str(src) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    where = subprocess.run([sys.executable, "-c", "import egress; print(egress.__file__)"], env=env, cwd=tmp,
                           capture_output=True, text=True, timeout=30).stdout.strip()
    if not where.startswith(str(src)):
        raise SystemExit(f"--base {rev}: the interpreter still imports egress from {where or '?'}")
    return [Version(f"base {rev}", env, f"git {base} = {rev}"), tree]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def machine() -> str:
    cpu = "?"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{os.cpu_count()} CPUs ({cpu}), Python {platform.python_version()}, "
            f"load average at the end {os.getloadavg()[0]:.1f}")


def ratio(new: float, old: float) -> str:
    return f"{new / old:.2f}x" if old else "-"


# ------------------------------------------------------------------ sizes


def sizes_bench(args, tmp: Path, vers: list[Version]) -> None:
    sizes = [int(s) for s in args.sizes.split(",")]
    rows: dict[tuple[int, str], list[dict]] = {}
    for n in sizes:
        path = tmp / f"policy-{n}.toml"
        write_policy(path, n)
        for r in range(args.rounds):
            order = vers if r % 2 == 0 else vers[::-1]
            for v in order:
                out = subprocess.run([sys.executable, __file__, "--child", str(path), str(n),
                                      "--lookups", str(args.lookups)],
                                     check=True, capture_output=True, text=True, env=v.env, cwd=tmp)
                row = json.loads(out.stdout)
                row["file_mb"] = path.stat().st_size / 1e6
                rows.setdefault((n, v.label), []).append(row)
                log(f"{n:>9,} entries, {v.label}: load {row['load_s']:.2f} s, peak {row['peak_mb']:.0f} MB")
        path.unlink()

    def med(n, label, key):
        return statistics.median(r[key] for r in rows[(n, label)])

    print(f"\n{machine()}\n{args.lookups:,} lookups per size (hits, deep subdomains, misses, denied, IP "
          f"literals); medians of {args.rounds} round(s)")
    for v in vers:
        print(f"  {v.label}: {v.describe}")
    cols = [("load s", "load_s", ".2f"), ("load cpu s", "load_cpu_s", ".2f"), ("peak MB", "peak_mb", ".0f"),
            ("kept MB", "kept_mb", ".0f"), ("1st gc s", "gc_s", ".3f"), ("decide us", "decide_us", ".2f"),
            ("lookup us", "lookup_us", ".2f"), ("locate ms", "locate_ms", ".3f"),
            ("locate max", "locate_max_ms", ".3f")]
    head = f"\n{'entries':>9} {'version':>13} " + " ".join(f"{c[0]:>10}" for c in cols)
    print(head)
    print("-" * len(head))
    for n in sizes:
        for v in vers:
            print(f"{n:>9,} {v.label:>13} " + " ".join(f"{med(n, v.label, k):>10{fmt}}" for _, k, fmt in cols))
        if len(vers) == 2:
            old, new = vers[0].label, vers[1].label
            print(f"{'':>9} {'tree/base':>13} " + " ".join(
                f"{ratio(med(n, new, k), med(n, old, k)):>10}" for _, k, _ in cols))
    print("\nload = load_policy end to end (wall; cpu = the process's CPU time); peak = the child's peak RSS;"
          "\nkept = RSS after loading minus before; 1st gc = the first full collection after loading;"
          "\ndecide = decide(str, port) incl. normalisation; lookup = decide(Host, port);"
          f"\nlocate = the first str(rule) (entry and file:line) of {LOCATE} rules spread over the file.")
    last = sizes[-1]
    mix = rows[(last, vers[-1].label)][0]
    print(f"mix at {last:,}: {mix['allowed']:,} allowed, {mix['denied']:,} denied, "
          f"{args.lookups - mix['allowed'] - mix['denied']:,} not allowed")
    print(f"baseline RSS (interpreter + imports + public suffix list): {mix['rss_base_mb']:.0f} MB")
    if len(sizes) > 1:
        first = sizes[0]
        for v in vers:
            print(f"{v.label}: decide time ratio {last:,} / {first:,} entries: "
                  f"{med(last, v.label, 'decide_us') / med(first, v.label, 'decide_us'):.2f} (str), "
                  f"{med(last, v.label, 'lookup_us') / med(first, v.label, 'lookup_us'):.2f} (Host)"
                  "   [~1 means O(labels), not O(rules)]")


# ------------------------------------------------------------------ reload under load


NGINX_CONF = """
daemon off;
master_process off;
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    keepalive_requests 10000000;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    server {{
        listen 127.0.0.1:{port};
        location /small {{ return 200 "{body}"; }}
    }}
}}
"""


def start_nginx(procs: Procs, tmp: Path) -> tuple[subprocess.Popen, int]:
    nginx = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx", "/sbin/nginx") if os.path.exists(p)),
                                          None)
    if nginx is None:
        raise SystemExit("--reload needs nginx: apt-get install -y nginx-light")
    d = tmp / "nginx"
    d.mkdir()
    for _ in range(5):
        port = free_port()
        (d / "nginx.conf").write_text(NGINX_CONF.format(dir=d, port=port, body="x" * 99))
        proc = procs.start("nginx", [nginx, "-p", str(d), "-e", str(d / "error.log"), "-c", str(d / "nginx.conf")],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and proc.poll() is None:
            if port in listening_ports(proc.pid):
                return proc, port
            time.sleep(0.05)
        procs.stop(proc)
    raise SystemExit("nginx did not start")


class Slices(threading.Thread):
    """wrk runs of one second each, back to back, until stopped: (start, end, figures) per slice."""

    def __init__(self, procs: Procs, tmp: Path, proxy_port: int, upstream_port: int, conns: int):
        super().__init__(daemon=True)
        self.procs, self.conns = procs, conns
        self.lua = tmp / "slice.lua"
        self.lua.write_text(SLICE_LUA)
        self.url = f"http://127.0.0.1:{proxy_port}"
        self.env = dict(os.environ, BENCH_PATH=f"http://allowed.test:{upstream_port}/small",
                        BENCH_HOST=f"allowed.test:{upstream_port}")
        self.stopping = threading.Event()
        self.slices: list[tuple[float, float, dict]] = []

    def run(self) -> None:
        wrk = shutil.which("wrk")
        while not self.stopping.is_set():
            t0 = time.monotonic()
            proc = self.procs.start("wrk", [wrk, f"-c{self.conns}", f"-t{min(2, self.conns)}", "-d1s",
                                            "--timeout", "10s", "-s", str(self.lua), self.url],
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=self.env)
            try:
                out, _ = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                self.procs.stop(proc, signal.SIGKILL)
                continue
            self.procs.forget(proc)
            m = re.search(r"^BENCH (\{.*\})$", out.decode(), re.M)
            if m:
                s = json.loads(m.group(1))
                s["errors"] = sum(s[k] for k in ("err_connect", "err_read", "err_write", "err_status", "err_timeout"))
                hist = re.search(r"^HIST (.*)$", out.decode(), re.M)
                s["hist"] = [tuple(map(int, pair.split(":"))) for pair in hist.group(1).split(",") if pair] \
                    if hist else []
                self.slices.append((t0, time.monotonic(), s))


def reload_round(args, procs: Procs, tmp: Path, v: Version, policy: Path, upstream: int) -> dict:
    state = tmp / "state"
    logpath = tmp / f"egress-{v.label.replace(' ', '-')}.log"
    argv = [sys.executable, "-c", EGRESS_MAIN, "serve", "--listen", "127.0.0.1:0", "--metrics", "off",
            "--audit-log", "off", "--resolve", "allowed.test:127.0.0.1", "--policy", str(policy),
            "--state-dir", str(state)]
    # one process (serve runs a worker per CPU since --workers came): its RSS is the proxy's
    help_text = subprocess.run(argv[:4] + ["--help"], env=v.env, cwd=tmp, capture_output=True, text=True,
                               timeout=60).stdout
    if "--workers" in help_text:
        argv += ["--workers", "1"]
    with open(logpath, "wb") as out:
        t0 = time.monotonic()
        proc = procs.start("egress", argv, stdout=out, stderr=out, env=v.env, cwd=tmp)
    try:
        deadline = time.monotonic() + args.timeout
        while True:
            text = logpath.read_text(errors="replace")
            if m := re.search(r"proxy listening on 127\.0\.0\.1:(\d+)", text):
                port, start_s = int(m.group(1)), time.monotonic() - t0
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"egress serve ({v.label}) did not start:\n{text[-2000:]}")
            time.sleep(0.02)
        row = {"start_s": start_s, "rss_start_mb": status_kb(proc.pid, "VmRSS") / 1024, "reloads": [],
               "rss_after_mb": [], "lost": 0}
        slicer = Slices(procs, tmp, port, upstream, args.connections)
        slicer.start()
        windows = []
        try:
            time.sleep(args.quiet)
            for _ in range(args.reloads):
                done = logpath.read_text(errors="replace").count("policy reloaded")
                t_first = t_sig = time.monotonic()
                os.kill(proc.pid, signal.SIGHUP)
                while logpath.read_text(errors="replace").count("policy reloaded") == done:
                    if proc.poll() is not None or time.monotonic() > t_first + args.timeout:
                        raise SystemExit(f"egress serve ({v.label}) did not reload (exit status "
                                         f"{proc.poll()}):\n{logpath.read_text(errors='replace')[-2000:]}")
                    if time.monotonic() > t_sig + args.resend:  # lost (main before b8b7833 lost some)
                        row["lost"] += 1
                        t_sig = time.monotonic()
                        os.kill(proc.pid, signal.SIGHUP)
                    time.sleep(0.02)
                t_done = time.monotonic()
                windows.append((t_sig, t_done))
                row["reloads"].append(t_done - t_sig)
                time.sleep(args.quiet)
                row["rss_after_mb"].append(status_kb(proc.pid, "VmRSS") / 1024)
        finally:
            slicer.stopping.set()
            slicer.join()
        row["hwm_mb"] = status_kb(proc.pid, "VmHWM") / 1024
    finally:
        procs.stop(proc)
    shutil.rmtree(state, ignore_errors=True)

    during, quiet = [], []
    for s0, s1, fig in slicer.slices[1:]:  # the first slice warms up the connections
        (during if any(s0 < w1 and w0 < s1 for w0, w1 in windows) else quiet).append(fig)
    def rate(f):
        return f["requests"] / (f["duration_us"] / 1e6)

    row.update({
        "quiet_rps": statistics.median(map(rate, quiet)) if quiet else 0,
        "quiet_p50_ms": percentile(quiet, 50), "quiet_p99_ms": percentile(quiet, 99),
        "reload_rps": statistics.median(map(rate, during)) if during else 0,
        "reload_p50_ms": percentile(during, 50), "reload_p99_ms": percentile(during, 99),
        "reload_max_ms": max((f["hist"][-1][0] for f in during if f["hist"]), default=0) / 1e3,
        "reload_slice_p99_ms": max((f["p99_us"] for f in during), default=0) / 1e3,
        "errors": sum(f["errors"] for _, _, f in slicer.slices),
        "slices": [(round(s0 - t0, 2), round(s1 - t0, 2), {k: v for k, v in f.items() if k != "hist"})
                   for s0, s1, f in slicer.slices],
        "windows": [(round(w0 - t0, 2), round(w1 - t0, 2)) for w0, w1 in windows],
    })
    return row


def percentile(slices: list[dict], p: float) -> float:
    """The p-th percentile (ms) of every request of these wrk slices together."""
    counts: dict[int, int] = {}
    for fig in slices:
        for value, n in fig["hist"]:
            counts[value] = counts.get(value, 0) + n
    total = sum(counts.values())
    if not total:
        return 0.0
    seen = 0
    for value in sorted(counts):
        seen += counts[value]
        if seen >= total * p / 100:
            return value / 1e3
    return max(counts) / 1e3


def reload_bench(args, procs: Procs, tmp: Path, vers: list[Version]) -> None:
    if not shutil.which("wrk"):
        raise SystemExit("--reload needs wrk: apt-get install -y wrk")
    nginx, upstream = start_nginx(procs, tmp)
    policy = tmp / "reload-policy.toml"
    write_policy(policy, args.entries, allow_also=("allowed.test",))
    rows: dict[str, list[dict]] = {}
    for r in range(args.rounds):
        for v in (vers if r % 2 == 0 else vers[::-1]):
            log(f"round {r + 1}: {v.label}, {args.entries:,} entries")
            row = reload_round(args, procs, tmp, v, policy, upstream)
            rows.setdefault(v.label, []).append(row)
            log(f"  start {row['start_s']:.1f} s, reloads {', '.join(f'{x:.1f}' for x in row['reloads'])} s, "
                f"p99 quiet {row['quiet_p99_ms']:.0f} ms / reload {row['reload_p99_ms']:.0f} ms "
                f"(worst slice {row['reload_slice_p99_ms']:.0f}, max {row['reload_max_ms']:.0f}), "
                f"rss {row['rss_start_mb']:.0f} -> {', '.join(f'{x:.0f}' for x in row['rss_after_mb'])} MB, "
                f"peak {row['hwm_mb']:.0f} MB")
    procs.stop(nginx)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))

    def med(label, f):
        return statistics.median(f(row) for row in rows[label])

    cols = [
        ("start s", lambda r: r["start_s"], ".1f"),
        ("reload s", lambda r: statistics.median(r["reloads"]), ".1f"),
        ("req/s quiet", lambda r: r["quiet_rps"], ".0f"),
        ("req/s reload", lambda r: r["reload_rps"], ".0f"),
        ("p50 quiet", lambda r: r["quiet_p50_ms"], ".1f"),
        ("p50 reload", lambda r: r["reload_p50_ms"], ".1f"),
        ("p99 quiet", lambda r: r["quiet_p99_ms"], ".1f"),
        ("p99 reload", lambda r: r["reload_p99_ms"], ".1f"),
        ("max reload", lambda r: r["reload_max_ms"], ".0f"),
        ("RSS start", lambda r: r["rss_start_mb"], ".0f"),
        ("RSS 1st", lambda r: r["rss_after_mb"][0], ".0f"),
        ("RSS last", lambda r: r["rss_after_mb"][-1], ".0f"),
        ("RSS peak", lambda r: r["hwm_mb"], ".0f"),
    ]
    print(f"\n{machine()}\negress serve, {args.entries:,}-entry policy (+1% deny), wrk -c{args.connections} "
          f"in 1 s slices, {args.reloads} SIGHUP reloads {args.quiet:g} s apart; medians of {args.rounds} "
          f"round(s)\n(latency: of every request in the slices overlapping a reload, or in the others; ms)")
    for v in vers:
        print(f"  {v.label}: {v.describe}")
    head = f"\n{'version':>13} " + " ".join(f"{c[0]:>11}" for c in cols)
    print(head)
    print("-" * len(head))
    for v in vers:
        print(f"{v.label:>13} " + " ".join(f"{med(v.label, f):>11{fmt}}" for _, f, fmt in cols))
    if len(vers) == 2:
        print(f"{'tree/base':>13} " + " ".join(f"{ratio(med(vers[1].label, f), med(vers[0].label, f)):>11}"
                                                  for _, f, _ in cols))
    print("\nstart = process start to its listening line (the load included); reload = SIGHUP to the "
          "'policy reloaded' line;\nRSS (MB): after start, after the first and the last reload, peak (VmHWM).")
    errors = {label: sum(r["errors"] for r in rs) for label, rs in rows.items()}
    lost = {label: sum(r["lost"] for r in rs) for label, rs in rows.items()}
    print(f"wrk errors: {errors}\nSIGHUPs sent again (no reload --resend {args.resend:g} s after one: lost, or a "
          f"slower reload; the reload timed from the last): {lost}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--sizes", default="1000,100000,1000000")
    ap.add_argument("--lookups", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default: 1 for sizes, 2 for --reload)")
    ap.add_argument("--base", help="also measure this git revision, interleaved, side by side")
    ap.add_argument("--reload", action="store_true", help="the reload-under-load test instead of the sizes")
    ap.add_argument("--entries", type=int, default=1_000_000, help="--reload: entries in the policy")
    ap.add_argument("--reloads", type=int, default=3, help="--reload: reloads per round")
    ap.add_argument("--quiet", type=float, default=3.0, help="--reload: seconds of load before and after each reload")
    ap.add_argument("--connections", type=int, default=4, help="--reload: wrk connections")
    ap.add_argument("--timeout", type=float, default=300, help="--reload: longest start-up or reload (s)")
    ap.add_argument("--resend", type=float, default=60,
                    help="--reload: SIGHUP again if no reload was reported this long after one (s)")
    ap.add_argument("--json", type=Path, help="--reload: write every round's figures (and wrk slices) here")
    ap.add_argument("--child", nargs=2, metavar=("FILE", "N"), help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child:
        file, n = args.child
        print(json.dumps(measure(Path(file), int(n), args.lookups)))
        return
    if args.rounds is None:
        args.rounds = 2 if args.reload else 1

    procs = Procs()
    tmp = Path(tempfile.mkdtemp(prefix="egress-policy-bench-"))

    def on_signal(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_signal)
    try:
        vers = versions(args.base, tmp)
        if args.reload:
            reload_bench(args, procs, tmp, vers)
        else:
            sizes_bench(args, tmp, vers)
    except KeyboardInterrupt:
        print("policy_bench: interrupted", file=sys.stderr)
        sys.exit(130)
    finally:
        procs.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
