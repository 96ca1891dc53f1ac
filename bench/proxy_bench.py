"""egress against direct and bare mitmdump, side by side, on 127.0.0.1 only.

Run:  /work/venv/bin/python bench/proxy_bench.py [--rounds 3] [--profile auto|always|never]
                                                  [--egress-src tree|HEAD|REV] [--tests small,tunnels,bulk]
      (needs curl, nginx and trustme; wrk for the small-request tests, py-spy for the profile: what is
      missing is skipped and said so. Resetting the peak-RSS counter needs write access to
      /proc/PID/clear_refs, i.e. the same user or root. About 3-4 minutes with the defaults.)

What it starts (all on 127.0.0.1, every port picked by binding port 0; every process is
stopped by its pid and the temporary directory removed, also on errors and Ctrl-C):

* nginx, one process (``master_process off``, i.e. exactly one worker), access log off,
  serving ``/small`` (100 bytes) and ``/large.bin`` (256 MiB of random bytes) on plain HTTP
  and on HTTPS (HTTP/1.1 only, TLS 1.2/1.3) with a certificate for ``allowed.test`` and
  ``pass.test`` from a ``trustme`` test CA;
* ``egress serve --listen 127.0.0.1:0 --metrics off --audit-log off --resolve
  allowed.test:127.0.0.1 --resolve pass.test:127.0.0.1 --upstream-ca <test CA>``
  with a policy that allows both names (and ``allow_private``, since they resolve to
  loopback) and puts ``pass.test`` on ``passthrough``: ``allowed.test`` is intercepted;
* bare ``mitmdump -q`` (its ~35 default addons, no script) with the same protocol options
  as egress: ``connection_strategy=lazy``, ``http2=false``, ``stream_large_bodies=1m``,
  ``ssl_verify_upstream_trusted_ca=<test CA>``, plus ``ignore_hosts=^pass\\.test:`` so
  that it too has a passthrough mode. mitmdump has no ``--resolve``: its clients CONNECT to
  ``127.0.0.1:PORT`` (curl ``--connect-to``) while the TLS SNI and the Host header still
  say ``allowed.test``/``pass.test`` (mitmproxy verifies the upstream certificate against
  the SNI); plain-HTTP requests use ``http://127.0.0.1:PORT/small`` with
  ``Host: allowed.test:PORT``.

What it measures, in alternating rounds (each test runs every target in turn, the start
target rotating per round; medians over rounds):

1. small keep-alive requests/s, plain HTTP: ``wrk -c16 -t2`` (absolute-form request line
   set by a Lua script: ``wrk.path = "http://allowed.test:PORT/small"``), and the
   unloaded latency with ``wrk -c1 -t1`` (p50 added against direct);
2. new TLS tunnels/s: 16 parallel curl processes, each fetching its share of a fixed
   count with ``--no-sessionid`` and ``Connection: close``, so every transfer is a new
   TCP connection + CONNECT + full TLS handshake + 1 GET + close (direct: the same
   without CONNECT); intercepted and passthrough;
3. one 256 MiB download with curl (HTTPS via CONNECT: intercepted and passthrough, and
   plain HTTP), MB/s (10^6 bytes/s) and the proxy's peak RSS during it (VmHWM, reset
   through ``/proc/PID/clear_refs`` just before the transfer), once in the fresh proxies
   before the rounds and then in every round;
4. proxy CPU (utime+stime from ``/proc/PID/stat``, all threads) per request, per tunnel
   and per GB, plus client, nginx and "other" CPU (the whole machine from /proc/stat minus
   ours: other people's work on a shared box) to show what limited each figure. Before each
   measurement the script waits (bounded: 5 s each, 30 s in all) for the machine to be quiet.

If egress comes out clearly (>10%) worse than mitmdump anywhere (``--profile auto``, the
default) or with ``--profile always``, py-spy samples egress during a small-request load,
plus the bulk or tunnel loads where it lost (all of them with ``always``), and the top
self-time functions (all code, and those in ``egress/``) and the inclusive time of egress's
functions are printed. ``--policy-pad N`` puts N extra entries in egress's policy.

``--workers 1,2`` (issue 11, item 2) also starts ``egress serve --workers 2`` (target
``egress-w2``) beside the one-worker ``egress`` and runs it in the small-request tests, side by
side; the proxy CPU of a target is that of its whole process tree (supervisor and workers).
``--workers`` is passed to every egress (the first count is ``egress``'s), where the egress
measured knows the option.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")
SMALL_BYTES = 100
LARGE_BYTES = 256 * 1024 * 1024
# issue 11, item 4 (per core), and item 3 (no pauses)
TARGET_SMALL_VS_MITM = 1.5
TARGET_PASS_BULK_VS_DIRECT = 0.8
TARGET_PASS_CPU_VS_SQUID = 3.0  # egress's CPU per passthrough tunnel at most this many times squid's
TARGET_UPLOAD_VS_MITM = 0.6  # a scanned clean-text upload against mitmdump's unscanned one
TARGET_P99_VS_P50 = 3.0
TARGET_RSS_MB = 100.0
TARGET_WORKERS_2 = 1.8  # egress serve --workers 2 against --workers 1, small requests, 2 cores

EGRESS_MAIN = "import sys; from egress.cli import main; sys.argv[0] = 'egress'; sys.exit(main())"
MITMDUMP_MAIN = "import sys; from mitmproxy.tools.main import mitmdump; sys.argv[0] = 'mitmdump'; mitmdump()"

WRK_LUA = r"""
-- Absolute-form request line for proxies (BENCH_PATH) and the Host header (BENCH_HOST).
wrk.path = os.getenv("BENCH_PATH") or wrk.path
local host = os.getenv("BENCH_HOST")
if host and host ~= "" then wrk.headers["Host"] = host end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'BENCH {"requests": %d, "duration_us": %d, "bytes": %d, "err_connect": %d, "err_read": %d, ' ..
    '"err_write": %d, "err_status": %d, "err_timeout": %d, "p50_us": %d, "p90_us": %d, "p99_us": %d}\n',
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99)))
end
"""


class BenchError(Exception):
    pass


# --------------------------------------------------------------------------- processes

class Procs:
    """Every process this script starts, so that each is stopped by its pid."""

    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, argv: list[str], **kw) -> subprocess.Popen:
        kw.setdefault("stdin", subprocess.DEVNULL)
        proc = subprocess.Popen(argv, start_new_session=True, **kw)
        self.procs.append((name, proc))
        return proc

    def stop(self, proc: subprocess.Popen, sig: int = signal.SIGTERM, grace: float = 5.0) -> None:
        if proc.poll() is None:
            try:
                proc.send_signal(sig)
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
            except ProcessLookupError:
                pass
        self.forget(proc)

    def forget(self, proc: subprocess.Popen) -> None:
        """A process that has been waited for."""
        self.procs = [(n, p) for n, p in self.procs if p is not proc]

    def stop_all(self) -> None:
        for _name, proc in reversed(list(self.procs)):
            self.stop(proc)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening_ports(pid: int) -> list[int]:
    """TCP ports the process listens on (from its socket fds and /proc/net/tcp*)."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    except OSError:
        return []
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if parts[3] == "0A" and parts[9] in inodes:  # 0A: LISTEN
                ports.append(int(parts[1].rsplit(":", 1)[1], 16))
    return ports


def cpu_seconds(pid: int | None) -> float:
    """CPU of the process and of its children (egress serve --workers N: the supervisor's workers)."""
    if pid is None:
        return 0.0
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = data[data.rindex(")") + 2:].split()
    own = (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime
    return own + sum(cpu_seconds(child) for child in _children(pid))


def _children(pid: int) -> list[int]:
    found = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            found += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    except OSError:
        pass
    return found


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    total = sum(values[:8])  # user nice system idle iowait irq softirq steal
    return total - values[3] - values[4], total


def children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def status_kb(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def reset_peak_rss(pid: int) -> bool:
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class Meter:
    """CPU of the proxy, nginx, reaped children (clients) and the machine over one test."""

    def __init__(self, proxy_pid: int | None, nginx_pid: int):
        self.proxy_pid, self.nginx_pid = proxy_pid, nginx_pid

    def __enter__(self) -> Meter:
        self.t0 = time.monotonic()
        self.p0, self.n0, self.c0 = cpu_seconds(self.proxy_pid), cpu_seconds(self.nginx_pid), children_cpu()
        self.m0 = machine_busy()
        return self

    def __exit__(self, *exc) -> None:
        self.wall = time.monotonic() - self.t0
        self.proxy_cpu = cpu_seconds(self.proxy_pid) - self.p0
        self.nginx_cpu = cpu_seconds(self.nginx_pid) - self.n0
        self.client_cpu = children_cpu() - self.c0
        busy, total = machine_busy()
        ncpu = os.cpu_count() or 1
        self.machine_pct = 100.0 * ncpu * (busy - self.m0[0]) / max(1, total - self.m0[1])

    def pct(self, seconds: float) -> float:
        return 100.0 * seconds / self.wall if self.wall else 0.0

    def fields(self, proxy: bool) -> dict:
        return {"wall_s": self.wall, "proxy_cpu_s": self.proxy_cpu if proxy else None,
                "proxy_cpu_pct": self.pct(self.proxy_cpu) if proxy else None,
                "nginx_cpu_pct": self.pct(self.nginx_cpu), "client_cpu_pct": self.pct(self.client_cpu),
                "machine_cpu_pct": self.machine_pct,
                # CPU used by everything else on the machine (other users' work): contention
                "other_cpu_pct": max(0.0, self.machine_pct - self.pct(self.nginx_cpu + self.client_cpu
                                                                      + (self.proxy_cpu if proxy else 0.0)))}


# --------------------------------------------------------------------------- targets

class Target:
    def __init__(self, name: str, proxy: str | None, pid: int | None, *, http=None, https=None):
        self.name = name
        self.proxy = proxy  # "egress" / "mitmdump" / None
        self.pid = pid
        self.http = http  # (wrk URL, request path, Host header)
        self.https = https  # (curl options, URL prefix "https://host:port")


class Bench:
    def __init__(self, args: argparse.Namespace, tmp: Path, procs: Procs):
        self.args, self.tmp, self.procs = args, tmp, procs
        self.curl = shutil.which("curl")
        self.wrk = shutil.which("wrk")
        self.nginx = shutil.which("nginx") or next(
            (p for p in ("/usr/sbin/nginx", "/sbin/nginx") if os.path.exists(p)), None)
        self.skipped: list[str] = []
        self.notes: list[str] = []
        self.results: dict[str, dict[str, list[dict]]] = {}
        self.rss_reset_ok = True
        self.quiet_budget = args.quiet_budget
        self.waits: list[float] = []
        self.serving_after: dict[str, float] = {}  # egress targets: seconds from start to serving
        self.workers: dict = {}

    def log(self, msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    # ---- setup

    def setup(self) -> None:
        if not self.curl:
            raise BenchError("curl not found, so nothing was measured (the tunnel, bulk and sanity clients): "
                             "apt-get install -y curl")
        if not self.nginx:
            raise BenchError("nginx not found, so nothing was measured (every test needs the upstream): "
                             "apt-get install -y nginx-light")
        if not self.wrk:
            self.skipped.append("small keep-alive requests/s and unloaded latency (wrk not installed: "
                                "apt-get install -y wrk)")
        self.make_certs()
        self.make_content()
        self.start_nginx()
        self.egress, self.egress_port, self.egress_ca, self.egress_src = self.start_egress(
            "egress", self.args.egress_src, self.args.workers[0])
        self.workers = {n: self.start_egress(f"egress-w{n}", self.args.egress_src, n) for n in self.args.workers[1:]}
        self.base = None
        if self.args.egress_base:
            self.base, self.base_port, self.base_ca, self.base_src = self.start_egress("base", self.args.egress_base)
        self.start_mitmdump()
        self.squid = None
        if self.args.squid != "never":
            self.start_squid()
        hp, sp = self.http_port, self.https_port
        e, m = self.egress_port, self.mitm_port
        resolve = ["--resolve", f"allowed.test:{sp}:127.0.0.1", "--resolve", f"allowed.test:{hp}:127.0.0.1"]
        self.targets = {
            "direct": Target("direct", None, None,
                             http=(f"http://127.0.0.1:{hp}", "/small", f"allowed.test:{hp}"),
                             https=(resolve + ["--noproxy", "*", "--cacert", str(self.test_ca)],
                                    f"https://allowed.test:{sp}")),
            "egress": Target("egress", "egress", self.egress.pid,
                             http=(f"http://127.0.0.1:{e}", f"http://allowed.test:{hp}/small", f"allowed.test:{hp}"),
                             https=(["-x", f"http://127.0.0.1:{e}", "--cacert", str(self.egress_ca)],
                                    f"https://allowed.test:{sp}")),
            "egress-pass": Target("egress-pass", "egress", self.egress.pid,
                                  https=(["-x", f"http://127.0.0.1:{e}", "--cacert", str(self.test_ca)],
                                         f"https://pass.test:{sp}")),
            "mitmdump": Target("mitmdump", "mitmdump", self.mitm.pid,
                               http=(f"http://127.0.0.1:{m}", f"http://127.0.0.1:{hp}/small", f"allowed.test:{hp}"),
                               https=(["-x", f"http://127.0.0.1:{m}", "--connect-to",
                                       f"allowed.test:{sp}:127.0.0.1:{sp}", "--cacert", str(self.mitm_ca)],
                                      f"https://allowed.test:{sp}")),
            "mitmdump-pass": Target("mitmdump-pass", "mitmdump", self.mitm.pid,
                                    https=(["-x", f"http://127.0.0.1:{m}", "--connect-to",
                                            f"pass.test:{sp}:127.0.0.1:{sp}", "--cacert", str(self.test_ca)],
                                           f"https://pass.test:{sp}")),
        }
        for n, (proc, port, _, _) in self.workers.items():
            self.targets[f"egress-w{n}"] = Target(f"egress-w{n}", "egress", proc.pid,
                                                  http=(f"http://127.0.0.1:{port}", f"http://allowed.test:{hp}/small",
                                                        f"allowed.test:{hp}"))
        if self.base:
            b = self.base_port
            self.targets["base"] = Target("base", "egress", self.base.pid,
                                          http=(f"http://127.0.0.1:{b}", f"http://allowed.test:{hp}/small",
                                                f"allowed.test:{hp}"),
                                          https=(["-x", f"http://127.0.0.1:{b}", "--cacert", str(self.base_ca)],
                                                 f"https://allowed.test:{sp}"))
            self.targets["base-pass"] = Target("base-pass", "egress", self.base.pid,
                                               https=(["-x", f"http://127.0.0.1:{b}", "--cacert", str(self.test_ca)],
                                                      f"https://pass.test:{sp}"))
        if self.squid:
            q = self.squid_port
            self.targets["squid-pass"] = Target("squid-pass", "squid", self.squid.pid,
                                                https=(["-x", f"http://127.0.0.1:{q}", "--connect-to",
                                                        f"pass.test:{sp}:127.0.0.1:{sp}", "--cacert", str(self.test_ca)],
                                                       f"https://pass.test:{sp}"))
        self.sanity()

    def names(self, *names: str) -> list[str]:
        """The targets of a test that this run has (base and squid are optional)."""
        return [n for n in names if n in self.targets]

    def make_certs(self) -> None:
        import trustme
        ca = trustme.CA()
        cert = ca.issue_cert("allowed.test", "pass.test", "127.0.0.1")
        self.test_ca = self.tmp / "test-ca.pem"
        ca.cert_pem.write_to_path(str(self.test_ca))
        self.cert_chain = self.tmp / "server-chain.pem"
        self.cert_key = self.tmp / "server-key.pem"
        cert.private_key_pem.write_to_path(str(self.cert_key))
        with open(self.cert_chain, "wb") as f:
            for blob in cert.cert_chain_pems:
                f.write(blob.bytes())

    def make_content(self) -> None:
        www = self.tmp / "www"
        www.mkdir()
        (www / "small").write_bytes(b"x" * (SMALL_BYTES - 1) + b"\n")
        with open(www / "large.bin", "wb") as f:
            chunk = 8 * 1024 * 1024
            for _ in range(LARGE_BYTES // chunk):
                f.write(os.urandom(chunk))
        if "upload" in self.args.tests:
            # Clean text (scanner_bench's mix: JSON, prose, logs, base64 images; no credentials)
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            import scanner_bench
            self.upload_file = self.tmp / "upload.txt"
            self.upload_file.write_bytes(scanner_bench.build(self.args.upload_mib * 2**20, scanner_bench.clean_piece, 7))

    def start_nginx(self) -> None:
        ngx = self.tmp / "nginx"
        (ngx / "temp").mkdir(parents=True)
        for attempt in range(5):
            hp, sp = free_port(), free_port()
            if hp == sp:
                continue
            conf = ngx / "nginx.conf"
            t = ngx / "temp"
            conf.write_text(f"""
daemon off;
master_process off;
worker_processes 1;
pid {ngx}/nginx.pid;
error_log {ngx}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    default_type application/octet-stream;
    sendfile on;
    tcp_nopush on;
    keepalive_requests 10000000;
    keepalive_timeout 75s;
    client_body_temp_path {t}/body;
    proxy_temp_path {t}/proxy;
    fastcgi_temp_path {t}/fastcgi;
    uwsgi_temp_path {t}/uwsgi;
    scgi_temp_path {t}/scgi;
    server {{
        listen 127.0.0.1:{hp};
        listen 127.0.0.1:{sp} ssl;
        ssl_certificate {self.cert_chain};
        ssl_certificate_key {self.cert_key};
        ssl_protocols TLSv1.2 TLSv1.3;
        root {self.tmp}/www;
        client_max_body_size 0;
        location / {{ }}
        location = /upload {{ client_body_buffer_size 1m; return 200 "ok\\n"; }}
    }}
}}
""")
            log = open(ngx / "stderr.log", "wb")
            proc = self.procs.start("nginx", [self.nginx, "-p", str(ngx), "-e", str(ngx / "error.log"),
                                              "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT)
            log.close()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    break
                if set(listening_ports(proc.pid)) >= {hp, sp}:
                    self.nginx_proc, self.http_port, self.https_port = proc, hp, sp
                    self.log(f"nginx pid {proc.pid} on 127.0.0.1:{hp} (http) and :{sp} (https)")
                    return
                time.sleep(0.05)
            self.procs.stop(proc)
            err = (ngx / "error.log").read_text(errors="replace")[-500:] if (ngx / "error.log").exists() else ""
            self.log(f"nginx did not start (attempt {attempt + 1}): {err.strip()}")
        raise BenchError("nginx could not be started")

    def start_egress(self, name: str, src: str, workers: int = 1):
        """egress serve from ``src`` ('tree' or a git revision) with ``workers`` workers (where it knows
        --workers): (process, port, CA file, source line)."""
        state = self.tmp / f"{name}-state"
        policy = self.tmp / "bench-policy.toml"
        pad = "".join(f'    "host{i}.pad{i % 97}.bench.test",\n' for i in range(self.args.policy_pad))
        policy.write_text(f'allow = [\n{pad}    "allowed.test", "pass.test",\n]\n'
                          'allow_private = ["allowed.test", "pass.test"]\n'
                          'passthrough = ["pass.test"]\n')
        argv = ["serve", "--listen", "127.0.0.1:0", "--metrics", "off", "--audit-log", "off",
                "--resolve", "allowed.test:127.0.0.1", "--resolve", "pass.test:127.0.0.1",
                "--upstream-ca", str(self.test_ca), "--policy", str(policy), "--state-dir", str(state)]
        env, described = self.egress_source(src, name)
        knows = "--workers" in subprocess.run([sys.executable, "-c", EGRESS_MAIN, "serve", "--help"], env=env,
                                              cwd=self.tmp, capture_output=True, text=True, timeout=60).stdout
        if knows:
            argv += ["--workers", str(workers)]
        elif workers != 1:
            raise BenchError(f"--workers {workers}: the egress measured ({described}) has no --workers")
        if name == "egress":
            self.egress_argv = argv
        logpath = self.tmp / f"{name}.log"
        log = open(logpath, "wb")
        t0 = time.monotonic()
        proc = self.procs.start(name, [sys.executable, "-c", EGRESS_MAIN, *argv],
                                stdout=log, stderr=log, env=env, cwd=self.tmp)
        log.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            text = logpath.read_text(errors="replace")
            if (m := re.search(r"proxy listening on 127\.0\.0\.1:(\d+)", text)) and (
                    workers == 1 or not knows or "workers, pids" in text):
                self.serving_after[name] = time.monotonic() - t0
                self.log(f"{name} pid {proc.pid} on 127.0.0.1:{m.group(1)} ({workers} worker"
                         f"{'s' if workers > 1 else ''}, serving after {self.serving_after[name]:.2f} s)")
                return proc, int(m.group(1)), state / "ca" / "mitmproxy-ca-cert.pem", described
            if proc.poll() is not None:
                raise BenchError(f"egress serve exited with {proc.returncode}:\n{text[-2000:]}")
            time.sleep(0.05)
        raise BenchError("egress serve did not print its listening address within 30 s")

    def egress_source(self, src: str, name: str) -> tuple[dict, str]:
        """The environment that makes ``import egress`` load the code to measure, and what it is.
        EGRESS_DIR (for the profile) is the main egress's."""
        global EGRESS_DIR
        repo = Path(__file__).resolve().parent.parent
        def git(*a: str) -> str:
            return subprocess.run(["git", "-C", str(repo), *a], capture_output=True, text=True,
                                  timeout=30).stdout.strip()

        env = dict(os.environ)
        if src == "tree":
            _egress_dir()
            dirty = [ln for ln in git("status", "--porcelain", "--", "egress", "policies").splitlines() if ln]
            head = git("rev-parse", "--short", "HEAD") or "?"
            return env, (f"working tree {EGRESS_DIR.rstrip('/')} (HEAD {head}"
                         + (f" + {len(dirty)} uncommitted changes under egress/ and policies/)"
                            if dirty else ", clean)"))
        given = src
        rev = git("rev-parse", "--verify", "--short", given + "^{commit}")
        if not rev:
            raise BenchError(f"{given}: not a git revision in {repo}")
        src = self.tmp / f"{name}-src"
        src.mkdir()
        archive = subprocess.run(["git", "-C", str(repo), "archive", rev, "egress", "policies"],
                                 capture_output=True, timeout=60)
        if archive.returncode:
            raise BenchError(f"git archive {rev}: {archive.stderr.decode().strip()}")
        subprocess.run(["tar", "-x", "-C", str(src)], input=archive.stdout, check=True, timeout=60)
        if (src / "policies").is_dir():  # installed as the package egress.policies
            shutil.rmtree(src / "egress" / "policies", ignore_errors=True)
            (src / "policies").rename(src / "egress" / "policies")
        env["PYTHONPATH"] = str(src) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        where = subprocess.run([sys.executable, "-c", "import egress; print(egress.__file__)"], env=env, cwd=self.tmp,
                               capture_output=True, text=True, timeout=30).stdout.strip()
        if not where.startswith(str(src / "egress") + "/"):
            raise BenchError(f"{given} = {rev}: the interpreter still imports egress from {where or '?'}")
        if name == "egress":
            EGRESS_DIR = str(src / "egress") + "/"
        return env, f"git {given} = {rev} (exported with git archive, first on PYTHONPATH)"

    def start_mitmdump(self) -> None:
        confdir = self.tmp / "mitmdump-conf"
        self.mitm_opts = ["--set", "connection_strategy=lazy", "--set", "http2=false",
                          "--set", "stream_large_bodies=1m",
                          "--set", f"ssl_verify_upstream_trusted_ca={self.test_ca}",
                          "--set", r"ignore_hosts=^pass\.test:"]
        argv = ["-q", "--listen-host", "127.0.0.1", "--listen-port", "0", "--set", f"confdir={confdir}",
                *self.mitm_opts]
        log = open(self.tmp / "mitmdump.log", "wb")
        t0 = time.monotonic()
        proc = self.procs.start("mitmdump", [sys.executable, "-c", MITMDUMP_MAIN, *argv], stdout=log, stderr=log,
                                cwd=self.tmp)
        log.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise BenchError(f"mitmdump exited with {proc.returncode}:\n"
                                 + (self.tmp / "mitmdump.log").read_text(errors="replace")[-2000:])
            ports = listening_ports(proc.pid)
            if ports and (confdir / "mitmproxy-ca-cert.pem").exists():
                self.mitm, self.mitm_port = proc, ports[0]
                self.mitm_ca = confdir / "mitmproxy-ca-cert.pem"
                self.log(f"mitmdump pid {proc.pid} on 127.0.0.1:{self.mitm_port} "
                         f"(listening after {time.monotonic() - t0:.2f} s)")
                return
            time.sleep(0.05)
        raise BenchError("mitmdump did not listen within 30 s")

    def start_squid(self) -> None:
        """squid as a CONNECT-only relay (no cache, no logs): the passthrough peer."""
        squid = shutil.which("squid") or next((p for p in ("/usr/sbin/squid",) if os.path.exists(p)), None)
        if not squid:
            msg = "squid (not installed: apt-get install -y squid)"
            if self.args.squid == "always":
                raise BenchError(msg)
            self.skipped.append("passthrough against " + msg)
            return
        d = self.tmp / "squid"
        d.mkdir()
        os.chmod(self.tmp, 0o755)
        os.chmod(d, 0o777)  # squid drops to its own user (cache_effective_user)
        for attempt in range(5):
            port = free_port()
            conf = d / "squid.conf"
            conf.write_text(f"""
http_port 127.0.0.1:{port}
acl SSL_ports port 1-65535
acl CONNECT method CONNECT
http_access allow CONNECT localhost
http_access allow localhost
http_access deny all
cache deny all
cache_mem 8 MB
access_log none
cache_store_log none
cache_log {d}/cache.log
pid_filename {d}/squid.pid
coredump_dir {d}
workers 1
shutdown_lifetime 0 seconds
""")
            log = open(d / "stderr.log", "wb")
            proc = self.procs.start("squid", [squid, "-N", "-f", str(conf)], stdout=log, stderr=subprocess.STDOUT)
            log.close()
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    break
                if port in listening_ports(proc.pid):
                    self.squid, self.squid_port = proc, port
                    self.log(f"squid pid {proc.pid} on 127.0.0.1:{port}")
                    return
                time.sleep(0.05)
            self.procs.stop(proc)
            err = (d / "cache.log").read_text(errors="replace")[-500:] if (d / "cache.log").exists() else ""
            self.log(f"squid did not start (attempt {attempt + 1}): {err.strip()}")
        raise BenchError("squid could not be started (--squid never skips it)")

    def sanity(self) -> None:
        """Every road answers 200 with the right body before anything is timed."""
        for t in self.targets.values():
            checks = []
            if t.http:
                url, path, host = t.http
                if t.proxy:
                    opts = ["-x", url, "-H", f"Host: {host}"]
                    target_url = path
                else:
                    opts = ["--noproxy", "*", "-H", f"Host: {host}"]
                    target_url = url + path
                checks.append(("http", opts, target_url))
            if t.https:
                opts, prefix = t.https
                checks.append(("https", opts, prefix + "/small"))
            for kind, opts, url in checks:
                out = subprocess.run([self.curl, "-sS", "--max-time", "10", *opts, "-o", "/dev/null",
                                      "-w", "%{http_code} %{size_download}", url],
                                     capture_output=True, text=True, timeout=20)
                if out.stdout.strip() != f"200 {SMALL_BYTES}":
                    raise BenchError(f"sanity check failed for {t.name} {kind} {url}: "
                                     f"{out.stdout!r} {out.stderr.strip()!r}")
        self.log("sanity: every target answers 200 with the 100-byte body "
                 "(egress-pass/mitmdump-pass verified with the test CA only, so not intercepted)")

    # ---- measurements

    def wait_quiet(self) -> None:
        """Before a measurement, wait (bounded) while other work keeps the machine busy."""
        waited = 0.0
        while self.quiet_budget > 0:
            b0 = machine_busy()
            time.sleep(0.3)
            b1 = machine_busy()
            ncpu = os.cpu_count() or 1
            busy = 100.0 * ncpu * (b1[0] - b0[0]) / max(1, b1[1] - b0[1])
            if busy < self.args.quiet_threshold or waited >= self.args.quiet_wait:
                break
            waited += 0.3
            self.quiet_budget -= 0.3
        if waited:
            self.waits.append(waited)

    def record(self, test: str, target: str, row: dict) -> None:
        self.results.setdefault(test, {}).setdefault(target, []).append(row)

    def run_wrk(self, t: Target, conns: int, threads: int, duration: float) -> dict:
        url, path, host = t.http
        lua = self.tmp / "proxy.lua"
        if not lua.exists():
            lua.write_text(WRK_LUA)
        env = dict(os.environ, BENCH_PATH=path, BENCH_HOST=host)
        argv = [self.wrk, f"-c{conns}", f"-t{threads}", f"-d{duration:g}s", "--timeout", "5s",
                "-s", str(lua), url]
        with Meter(t.pid, self.nginx_proc.pid) as meter:
            proc = self.procs.start("wrk", argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
            try:
                out, err = proc.communicate(timeout=duration + 20)
            except subprocess.TimeoutExpired:
                self.procs.stop(proc, signal.SIGKILL)
                raise BenchError(f"wrk against {t.name} did not finish in time") from None
            self.procs.forget(proc)
        m = re.search(r"^BENCH (\{.*\})$", out.decode(), re.M)
        if not m:
            raise BenchError(f"wrk against {t.name} gave no summary: {out.decode()[-500:]} {err.decode()[-500:]}")
        s = json.loads(m.group(1))
        errors = s["err_connect"] + s["err_read"] + s["err_write"] + s["err_status"] + s["err_timeout"]
        secs = s["duration_us"] / 1e6
        row = {"rps": s["requests"] / secs, "requests": s["requests"], "errors": errors,
               "p50_ms": s["p50_us"] / 1000, "p99_ms": s["p99_us"] / 1000, **meter.fields(bool(t.proxy))}
        if t.proxy:
            row["proxy_us_per_req"] = 1e6 * meter.proxy_cpu / max(1, s["requests"])
        if errors:
            self.notes.append(f"wrk {t.name} -c{conns}: {errors} errors/non-2xx of {s['requests']} ({s})")
        return row

    def run_tunnels(self, t: Target) -> dict:
        opts, prefix = t.https
        total, parallel = self.args.tunnels, self.args.parallel
        per = max(1, total // parallel)
        base = [self.curl, "-s", "--no-sessionid", "--max-time", "10", "-H", "Connection: close",
                "-w", "%{http_code} %{num_connects} %{time_total}\\n", *opts]
        urls = []
        for _ in range(per):
            urls += ["-o", "/dev/null", prefix + "/small"]
        procs = []
        timeout = self.args.tunnel_timeout
        with Meter(t.pid, self.nginx_proc.pid) as meter:
            for _ in range(parallel):
                procs.append(self.procs.start("curl", base + urls, stdout=subprocess.PIPE,
                                              stderr=subprocess.DEVNULL))
            deadline = time.monotonic() + timeout
            outputs, timed_out = [], False
            for proc in procs:
                try:
                    out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    timed_out = True
                    self.procs.stop(proc, signal.SIGKILL)
                    out = b""
                self.procs.forget(proc)
                outputs.append(out.decode())
        ok, lat, bad = 0, [], Counter()
        for out in outputs:
            for line in out.splitlines():
                fields = line.split()
                if len(fields) != 3:  # a curl killed mid-line
                    bad[("partial", "?")] += 1
                    continue
                code, conns, secs = fields
                if code == "200" and conns == "1":
                    ok += 1
                    lat.append(float(secs) * 1000)
                else:
                    bad[(code, conns)] += 1
        if bad or timed_out:
            self.notes.append(f"tunnels {t.name}: {sum(bad.values())} failed (code, connects): {dict(bad)}"
                              + ("; timed out" if timed_out else ""))
        lat.sort()
        row = {"tps": ok / meter.wall, "ok": ok, "failed": per * parallel - ok,
               "p50_ms": _pct(lat, 50), "p99_ms": _pct(lat, 99), **meter.fields(bool(t.proxy))}
        if t.proxy:
            row["proxy_ms_per_tunnel"] = 1e3 * meter.proxy_cpu / max(1, ok)
        return row

    def run_download(self, t: Target, url: str, opts: list[str]) -> dict:
        pid = t.pid
        peak_sampled = [0]
        stop = threading.Event()
        if pid:
            self.rss_reset_ok = reset_peak_rss(pid) and self.rss_reset_ok
            rss_before = status_kb(pid, "VmRSS")

            def sample() -> None:
                while not stop.wait(0.05):
                    try:
                        peak_sampled[0] = max(peak_sampled[0], status_kb(pid, "VmRSS"))
                    except OSError:
                        return
            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
        argv = [self.curl, "-sS", "--max-time", str(self.args.bulk_timeout), *opts, "-o", "/dev/null",
                "-w", "%{http_code} %{size_download} %{time_total}", url]
        try:
            with Meter(pid, self.nginx_proc.pid) as meter:
                proc = self.procs.start("curl", argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                try:
                    out, err = proc.communicate(timeout=self.args.bulk_timeout + 10)
                except subprocess.TimeoutExpired:
                    self.procs.stop(proc, signal.SIGKILL)
                    out, err = b"", b"timeout"
                self.procs.forget(proc)
        finally:
            stop.set()
        parts = out.decode().split()
        if len(parts) != 3 or parts[0] != "200" or int(parts[1]) != LARGE_BYTES:
            self.notes.append(f"download {t.name} {url}: {out.decode()!r} {err.decode().strip()!r}")
            return {"mbps": 0.0, "failed": 1, **meter.fields(bool(t.proxy))}
        secs = float(parts[2])
        row = {"mbps": LARGE_BYTES / secs / 1e6, "failed": 0, **meter.fields(bool(t.proxy))}
        if pid:
            row["proxy_s_per_gb"] = meter.proxy_cpu / (LARGE_BYTES / 1e9)
            row["rss_before_mb"] = rss_before / 1024
            row["peak_rss_mb"] = status_kb(pid, "VmHWM") / 1024
            row["peak_rss_sampled_mb"] = peak_sampled[0] / 1024
            row["rss_growth_mb"] = row["peak_rss_mb"] - row["rss_before_mb"]
        return row

    def run_upload(self, t: Target, https: bool) -> dict:
        """POST the clean-text file (Content-Length known) and read nginx's short answer."""
        size = self.upload_file.stat().st_size
        if https:
            opts, prefix = t.https
            url = prefix + "/upload"
        else:
            url, path, host = t.http
            if t.proxy:
                opts, url = ["-x", url, "-H", f"Host: {host}"], path.replace("/small", "/upload")
            else:
                opts, url = ["--noproxy", "*", "-H", f"Host: {host}"], url + "/upload"
        # the same upload --upload-repeat times over one connection: enough CPU ticks to count
        repeat = self.args.upload_repeat
        argv = [self.curl, "-sS", "--max-time", str(self.args.bulk_timeout), *opts,
                "-H", "Content-Type: application/json", "-H", "Expect:", "--data-binary", f"@{self.upload_file}",
                "-w", "%{http_code} %{size_upload} %{time_total}\\n"]
        for _ in range(repeat):
            argv += ["-o", "/dev/null", url]
        with Meter(t.pid, self.nginx_proc.pid) as meter:
            proc = self.procs.start("curl", argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            try:
                out, err = proc.communicate(timeout=self.args.bulk_timeout + 10)
            except subprocess.TimeoutExpired:
                self.procs.stop(proc, signal.SIGKILL)
                out, err = b"", b"timeout"
            self.procs.forget(proc)
        lines = [line.split() for line in out.decode().splitlines()]
        if len(lines) != repeat or any(len(p) != 3 or p[0] != "200" or int(p[1]) != size for p in lines):
            self.notes.append(f"upload {t.name} {url}: {out.decode()!r} {err.decode().strip()!r}")
            return {"mbps": 0.0, "failed": 1, **meter.fields(bool(t.proxy))}
        row = {"mbps": size * repeat / sum(float(p[2]) for p in lines) / 1e6, "failed": 0,
               **meter.fields(bool(t.proxy))}
        if t.pid:
            row["proxy_s_per_gb"] = meter.proxy_cpu / (size * repeat / 1e9)
        return row

    def rounds(self) -> None:
        a = self.args
        small = self.names("direct", "egress", *(f"egress-w{n}" for n in self.workers), "base", "mitmdump")
        tunnel = self.names("direct", "egress", "egress-pass", "base", "base-pass", "mitmdump", "mitmdump-pass",
                            "squid-pass")
        bulk_tls = tunnel
        bulk_http = self.names("direct", "egress", "base", "mitmdump")
        self.idle_rss = {name: status_kb(pid, "VmRSS") / 1024
                         for name, pid in (("egress", self.egress.pid), ("mitmdump", self.mitm.pid),
                                           ("base", self.base.pid if self.base else None)) if pid}
        self.idle_rss.update({f"egress-w{n}": sum(status_kb(p, "VmRSS") for p in [proc.pid, *_children(proc.pid)]) / 1024
                              for n, (proc, _, _, _) in self.workers.items()})
        if "bulk" in a.tests:
            # Memory of one transfer in a fresh process (only the sanity requests before it), as
            # opposed to the in-round figures, which come after thousands of tunnels.
            for name in self.names("egress", "egress-pass", "base", "base-pass", "mitmdump", "mitmdump-pass"):
                opts, prefix = self.targets[name].https
                self.wait_quiet()
                row = self.run_download(self.targets[name], prefix + "/large.bin", opts)
                self.record("bulk_fresh", name, row)
                self.log(f"  fresh bulk   {name:14s} {row['mbps']:9.0f} MB/s, peak RSS "
                         f"{row.get('peak_rss_mb', 0):.0f} MB")
        for r in range(a.rounds):
            self.log(f"round {r + 1}/{a.rounds}")
            if self.wrk and "small" in a.tests:
                for name in _rotate(small, r):
                    self.wait_quiet()
                    row = self.run_wrk(self.targets[name], a.connections, 2, a.duration)
                    self.record("small", name, row)
                    self.log(f"  small c{a.connections} {name:14s} {row['rps']:9.0f} req/s")
                for name in _rotate(small, r):
                    self.wait_quiet()
                    row = self.run_wrk(self.targets[name], 1, 1, a.latency_duration)
                    self.record("latency", name, row)
                    self.log(f"  latency c1   {name:14s} p50 {row['p50_ms']:.3f} ms")
            for name in _rotate(tunnel, r) if "tunnels" in a.tests else ():
                self.wait_quiet()
                row = self.run_tunnels(self.targets[name])
                self.record("tunnels", name, row)
                self.log(f"  tunnels      {name:14s} {row['tps']:9.0f} /s ({row['ok']} ok)")
            for name in _rotate(bulk_tls, r) if "bulk" in a.tests else ():
                opts, prefix = self.targets[name].https
                self.wait_quiet()
                row = self.run_download(self.targets[name], prefix + "/large.bin", opts)
                self.record("bulk_https", name, row)
                self.log(f"  bulk https   {name:14s} {row['mbps']:9.0f} MB/s")
            for name in _rotate(bulk_http, r) if "bulk" in a.tests else ():
                t = self.targets[name]
                url, path, host = t.http
                if t.proxy:
                    opts, full = ["-x", url, "-H", f"Host: {host}"], path.replace("/small", "/large.bin")
                else:
                    opts, full = ["--noproxy", "*", "-H", f"Host: {host}"], url + "/large.bin"
                self.wait_quiet()
                row = self.run_download(t, full, opts)
                self.record("bulk_http", name, row)
                self.log(f"  bulk http    {name:14s} {row['mbps']:9.0f} MB/s")
            for https in (False, True) if "upload" in a.tests else ():
                for name in _rotate(small, r):
                    self.wait_quiet()
                    row = self.run_upload(self.targets[name], https)
                    key = "upload_https" if https else "upload_http"
                    self.record(key, name, row)
                    self.log(f"  {key:12s} {name:14s} {row['mbps']:9.0f} MB/s")

    # ---- profile

    def profile(self, worse: list[str]) -> list[str]:
        """py-spy on egress under the small-request load, and under the bulk loads where egress lost."""
        pyspy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        if not os.path.exists(pyspy):
            self.skipped.append("py-spy profile (py-spy not installed: /work/venv/bin/pip install py-spy)")
            return []
        loads = []
        if self.wrk:
            loads.append(("small", f"wrk -c{self.args.connections} -t2 plain HTTP /small"))
        else:
            self.skipped.append("py-spy profile of the small-request load (needs wrk)")
        if any(w.startswith("bulk_http ") for w in worse) or self.args.profile == "always":
            loads.append(("bulk_http", "repeated 256 MiB plain-HTTP downloads"))
        if any(w.startswith("bulk_https egress vs") for w in worse) or self.args.profile == "always":
            loads.append(("bulk_https", "repeated 256 MiB intercepted HTTPS downloads"))
        if any(w.startswith("tunnels ") for w in worse) or self.args.profile == "always":
            loads.append(("tunnels", "repeated batches of new intercepted and passthrough TLS tunnels"))
        if "upload" in self.args.tests and (any(w.startswith("upload") for w in worse)
                                            or self.args.profile == "always"):
            loads.append(("upload", f"repeated {self.args.upload_mib} MiB clean-text uploads, plain HTTP"))
        if "small" not in self.args.tests:
            loads = [load for load in loads if load[0] != "small"]
        lines = []
        for load, title in loads:
            out_file = self.tmp / f"pyspy-{load}.txt"
            # --gil: only the thread holding the GIL, i.e. the event loop's work (idle threads
            # blocked in select() were counted as busy without it)
            spy = self.procs.start("py-spy", [pyspy, "record", "--pid", str(self.egress.pid), "--rate", "250", "--gil",
                                              "--full-filenames", "--nolineno", "--format", "raw",
                                              "--output", str(out_file)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            time.sleep(0.5)
            secs = self.args.profile_seconds
            t0, n = time.monotonic(), 0
            if load == "small":
                row = self.run_wrk(self.targets["egress"], self.args.connections, 2, secs)
                rate = f"{row['rps']:.0f} req/s while sampled"
            elif load == "upload":
                mbps = []
                while time.monotonic() - t0 < secs and n < 40:
                    n += 1
                    mbps.append(self.run_upload(self.targets["egress"], False)["mbps"])
                rate = f"{statistics.median(mbps):.0f} MB/s while sampled, {n} uploads"
            elif load == "tunnels":
                tps = []
                while time.monotonic() - t0 < secs and n < 20:
                    n += 1
                    tps.append(self.run_tunnels(self.targets["egress" if n % 2 else "egress-pass"])["tps"])
                rate = f"{n} batches, {statistics.median(tps):.0f} tunnels/s median"
            else:
                t = self.targets["egress"]
                mbps = []
                while time.monotonic() - t0 < secs and n < 20:
                    n += 1
                    if load == "bulk_http":
                        url, path, host = t.http
                        row = self.run_download(t, path.replace("/small", "/large.bin"),
                                                ["-x", url, "-H", f"Host: {host}"])
                    else:
                        opts, prefix = t.https
                        row = self.run_download(t, prefix + "/large.bin", opts)
                    mbps.append(row["mbps"])
                rate = f"{statistics.median(mbps):.0f} MB/s while sampled, {n} downloads"
            try:
                spy.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
                _, err = spy.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                self.procs.stop(spy, signal.SIGKILL)
                err = b"py-spy did not stop"
            self.procs.forget(spy)
            if not out_file.exists():
                self.skipped.append(f"py-spy profile of {load} (py-spy failed: {err.decode().strip()[-300:]})")
                continue
            if self.args.profile_out:
                self.args.profile_out.mkdir(parents=True, exist_ok=True)
                shutil.copy(out_file, self.args.profile_out / out_file.name)
            lines += summarize_pyspy(out_file.read_text(), f"{title} ({rate})", self.args.profile_top)
            lines.append("")
        return lines


EGRESS_DIR = None


def _egress_dir() -> str:
    global EGRESS_DIR
    if EGRESS_DIR is None:
        import importlib.util
        spec = importlib.util.find_spec("egress")
        EGRESS_DIR = (os.path.realpath(list(spec.submodule_search_locations)[0])
                      if spec and spec.submodule_search_locations else "/nonexistent") + "/"
    return EGRESS_DIR


def summarize_pyspy(text: str, title: str, top: int) -> list[str]:
    self_time, egress_self, egress_incl = Counter(), Counter(), Counter()
    total = in_egress = 0
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [_frame_key(fr) for fr in stack.split(";")[1:]]  # first item: the process/thread
        if not frames:
            continue
        total += n
        self_time[frames[-1]] += n
        # egress code called back from the event loop (addon hooks, stream functions, timers), not the
        # serve()/run loop frames below it that are on every stack
        loop = max((i for i, fr in enumerate(frames) if fr.startswith("_run_once (asyncio/")), default=-1)
        seen = {fr for fr in frames[loop + 1:] if " (egress/" in fr and not fr.endswith("(egress/cli.py)")}
        if seen:
            in_egress += n
        for fr in seen:
            egress_incl[fr] += n
        if frames[-1] in seen:
            egress_self[frames[-1]] += n
    if not total:
        return [f"py-spy, {title}: no samples"]
    def pct(n):
        return f"{100 * n / total:5.1f}%"

    lines = [f"py-spy on egress, {title}: {total} samples of busy threads (idle waits excluded)",
             f"  share of samples inside egress/ code called from the event loop (hooks, stream functions): "
             f"{100 * in_egress / total:.1f}%",
             "  top self time, all code:"]
    lines += [f"    {pct(n)}  {fr}" for fr, n in self_time.most_common(top)]
    lines.append("  top self time in egress/:")
    lines += [f"    {pct(n)}  {fr}" for fr, n in egress_self.most_common(top)] or ["    (none)"]
    lines.append("  top inclusive time of egress/ functions:")
    lines += [f"    {pct(n)}  {fr}" for fr, n in egress_incl.most_common(top)] or ["    (none)"]
    return lines


def _frame_key(frame: str) -> str:
    """'func (/full/path/pkg/file.py[:123])' -> 'func (pkg/file.py)': aggregate by function."""
    m = re.match(r"(.*) \((.*?)(?::\d+)?\)$", frame)
    if not m:
        return frame
    func, path = m.groups()
    if path.startswith(_egress_dir()):
        path = "egress/" + path[len(_egress_dir()):]
    elif "/site-packages/" in path:
        path = path.split("/site-packages/", 1)[1]
    elif mm := re.search(r"/lib/python3\.\d+/", path):
        path = path[mm.end():]
    return f"{func} ({path})"


def _rotate(items: list[str], r: int) -> list[str]:
    k = r % len(items)
    return items[k:] + items[:k]


def _pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    k = min(len(values) - 1, max(0, round(p / 100 * (len(values) - 1))))
    return values[k]


# --------------------------------------------------------------------------- report

def med(rows: list[dict] | None, key: str) -> float | None:
    vals = [r[key] for r in rows or [] if r.get(key) is not None
            and not (key == "mbps" and r.get("failed"))]  # a failed download has no rate
    vals = [v for v in vals if v == v]  # drop NaN
    return statistics.median(vals) if vals else None


def rng(rows: list[dict] | None, key: str, fmt: str) -> str:
    vals = [r[key] for r in rows or [] if r.get(key) is not None]
    return "–" if not vals else (format(min(vals), fmt) + "–" + format(max(vals), fmt))


def f(v, fmt: str) -> str:
    return "–" if v is None else format(v, fmt)


def ratio(a, b) -> str:
    return "–" if a is None or not b else f"{a / b:.2f}"


def report(b: Bench, profile_lines: list[str], started: float) -> str:
    a, R = b.args, b.results
    out = []
    w = out.append
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    cpu = _cpu_model()
    w(f"egress proxy benchmark, {now}; machine: {os.cpu_count()} vCPU ({cpu}), "
      f"Linux {platform.release()}, Python {platform.python_version()}")
    w(f"rounds: {a.rounds} (targets alternate within each test, start rotating per round); "
      f"figures are medians over rounds, ranges are min–max; total run {time.monotonic() - started:.0f} s")
    w(f"upstream: nginx {_version([b.nginx, '-v'])}, one process, /small = {SMALL_BYTES} B, "
      f"/large.bin = 256 MiB; HTTPS is TLS1.2/1.3, HTTP/1.1 only")
    w(f"egress source: {b.egress_src}")
    if b.base:
        w(f"base source:   {b.base_src} (the same command line; targets base, base-pass)")
    if b.squid:
        w(f"squid:    squid {_version([shutil.which('squid') or '/usr/sbin/squid', '-v'])} -N, one worker, "
          "no cache, no logs; CONNECT only (curl --connect-to, like mitmdump); target squid-pass")
    w("egress:   egress " + " ".join(b.egress_argv).replace(str(b.tmp), "$TMP"))
    w(f"          policy: allow (+{a.policy_pad} padding entries) and allow_private allowed.test, pass.test; "
      "passthrough pass.test")
    w("mitmdump: mitmdump -q (default addons, no script) " + " ".join(b.mitm_opts).replace(str(b.tmp), "$TMP"))
    w("          mitmdump clients CONNECT to 127.0.0.1:PORT (curl --connect-to), SNI/Host allowed.test or pass.test")
    w("")

    if "small" in R:
        s = R["small"]
        d, e, m = (med(s.get(k), "rps") for k in ("direct", "egress", "mitmdump"))
        w(f"1. Small requests, plain HTTP keep-alive: wrk -c{a.connections} -t2 -d{a.duration:g}s, absolute-form "
          f"request line through the proxy")
        hdr = ("target", "req/s", "range", "p50 ms", "p99 ms", "proxy µs/req", "req/s per core", "proxy CPU%",
               "client CPU%", "nginx CPU%", "other CPU%", "×direct", "×mitmdump")
        rows = []
        for name in b.names("direct", "egress", *(f"egress-w{n}" for n in b.workers), "base", "mitmdump"):
            rs = s.get(name)
            v = med(rs, "rps")
            us = med(rs, "proxy_us_per_req")
            rows.append((name, f(v, ".0f"), rng(rs, "rps", ".0f"), f(med(rs, "p50_ms"), ".2f"),
                         f(med(rs, "p99_ms"), ".2f"), f(us, ".0f"), f(1e6 / us if us else None, ".0f"),
                         f(med(rs, "proxy_cpu_pct"), ".0f"), f(med(rs, "client_cpu_pct"), ".0f"),
                         f(med(rs, "nginx_cpu_pct"), ".0f"), f(med(rs, "other_cpu_pct"), ".0f"),
                         ratio(v, d), ratio(v, m)))
        out.extend(_table(hdr, rows))
        w("   (req/s per core = 1e6 / proxy µs per request: the rate at 100% of the one core a mitmproxy "
          "process can use; robust to contention)")
        for n in b.workers:
            name, first = f"egress-w{n}", b.args.workers[0]
            w(f"   {name}: the same egress with --workers {n}: {ratio(med(s.get(name), 'rps'), e)}× egress's "
              f"req/s (--workers {first}); proxy CPU is the supervisor's and its workers'; idle RSS "
              f"{b.idle_rss[name]:.0f} MiB in all (egress {b.idle_rss['egress']:.0f}); serving "
              f"{b.serving_after[name]:.2f} s after start (egress {b.serving_after['egress']:.2f} s)")
        lat = R["latency"]
        dl = med(lat.get("direct"), "p50_ms")
        w(f"   Unloaded: wrk -c1 -t1 -d{a.latency_duration:g}s")
        hdr = ("target", "req/s", "p50 ms", "p99 ms", "added p50 ms", "proxy µs/req", "×direct p50",
               "×mitmdump p50")
        ml = med(lat.get("mitmdump"), "p50_ms")
        rows = []
        for name in b.names("direct", "egress", *(f"egress-w{n}" for n in b.workers), "base", "mitmdump"):
            rs = lat.get(name)
            p50 = med(rs, "p50_ms")
            rows.append((name, f(med(rs, "rps"), ".0f"), f(p50, ".3f"), f(med(rs, "p99_ms"), ".3f"),
                         "–" if name == "direct" or p50 is None else f"+{p50 - dl:.3f}",
                         f(med(rs, "proxy_us_per_req"), ".0f"), ratio(p50, dl), ratio(p50, ml)))
        out.extend(_table(hdr, rows))
        w("")

    t = R.get("tunnels", {})
    if t:
        w(f"2. New TLS tunnels: {a.parallel} parallel curl, {a.tunnels // a.parallel * a.parallel} transfers, "
          f"each new TCP + CONNECT + full TLS handshake (--no-sessionid) + GET /small + close")
        hdr = ("target", "tunnels/s", "range", "p50 ms", "p99 ms", "proxy ms/tunnel", "proxy CPU%", "client CPU%",
               "nginx CPU%", "other CPU%", "×direct", "×mitmdump")
        rows = []
        d = med(t.get("direct"), "tps")
        for name, peer in (("direct", None), ("egress", "mitmdump"), ("egress-pass", "mitmdump-pass"),
                           ("base", "mitmdump"), ("base-pass", "mitmdump-pass"),
                           ("mitmdump", None), ("mitmdump-pass", None), ("squid-pass", None)):
            if name not in b.targets:
                continue
            rs = t.get(name)
            v = med(rs, "tps")
            rows.append((name, f(v, ".0f"), rng(rs, "tps", ".0f"), f(med(rs, "p50_ms"), ".1f"),
                         f(med(rs, "p99_ms"), ".1f"), f(med(rs, "proxy_ms_per_tunnel"), ".2f"),
                         f(med(rs, "proxy_cpu_pct"), ".0f"), f(med(rs, "client_cpu_pct"), ".0f"),
                         f(med(rs, "nginx_cpu_pct"), ".0f"), f(med(rs, "other_cpu_pct"), ".0f"),
                         ratio(v, d), ratio(v, med(t.get(peer), "tps")) if peer else "–"))
        out.extend(_table(hdr, rows))
        w("   (egress = intercepted, egress-pass = passthrough; ×mitmdump compares the same mode)")
        w("")

    for key, title, names in (
            ("bulk_https", "3. One 256 MiB download, HTTPS through CONNECT (curl -o /dev/null)",
             (("direct", None), ("egress", "mitmdump"), ("egress-pass", "mitmdump-pass"),
              ("base", "mitmdump"), ("base-pass", "mitmdump-pass"),
              ("mitmdump", None), ("mitmdump-pass", None), ("squid-pass", None))),
            ("bulk_http", "   Same download, plain HTTP", (("direct", None), ("egress", "mitmdump"),
                                                          ("base", "mitmdump"), ("mitmdump", None))),
            ("upload_http", f"4. A {a.upload_mib} MiB clean-text upload (POST, Content-Length; {a.upload_repeat} in a "
                            "row on one connection), plain HTTP; egress scans it for credentials, mitmdump does not",
             (("direct", None), ("egress", "mitmdump"), ("base", "mitmdump"), ("mitmdump", None))),
            ("upload_https", "   Same upload, HTTPS intercepted",
             (("direct", None), ("egress", "mitmdump"), ("base", "mitmdump"), ("mitmdump", None)))):
        bk = R.get(key, {})
        if not bk:
            continue
        w(title)
        hdr = ("target", "MB/s", "range", "proxy CPU s/GB", "peak RSS MiB", "RSS before MiB", "growth MiB",
               "proxy CPU%",
               "client CPU%", "nginx CPU%", "other CPU%", "×direct", "×mitmdump")
        rows = []
        d = med(bk.get("direct"), "mbps")
        for name, peer in names:
            if name not in b.targets:
                continue
            rs = bk.get(name)
            v = med(rs, "mbps")
            peak = max((r["peak_rss_mb"] for r in rs or [] if "peak_rss_mb" in r), default=None)
            rows.append((name, f(v, ".0f"), rng(rs, "mbps", ".0f"), f(med(rs, "proxy_s_per_gb"), ".2f"),
                         f(peak, ".0f"), f(med(rs, "rss_before_mb"), ".0f"), f(med(rs, "rss_growth_mb"), ".1f"),
                         f(med(rs, "proxy_cpu_pct"), ".0f"), f(med(rs, "client_cpu_pct"), ".0f"),
                         f(med(rs, "nginx_cpu_pct"), ".0f"), f(med(rs, "other_cpu_pct"), ".0f"),
                         ratio(v, d), ratio(v, med(bk.get(peer), "mbps")) if peer else "–"))
        out.extend(_table(hdr, rows))
    if "bulk_fresh" in R:
        fr = R["bulk_fresh"]
        w("   Memory of one 256 MiB HTTPS download in a fresh proxy (started, sanity requests only; "
          "in this order, before the rounds)")
        hdr = ("target", "idle RSS after start MiB", "RSS before MiB", "peak RSS during MiB", "growth MiB", "MB/s")
        rows = []
        for name in b.names("egress", "egress-pass", "base", "base-pass", "mitmdump", "mitmdump-pass"):
            r0 = (fr.get(name) or [{}])[0]
            rows.append((name, f(b.idle_rss.get(name.split("-")[0]), ".0f"), f(r0.get("rss_before_mb"), ".0f"),
                         f(r0.get("peak_rss_mb"), ".0f"), f(r0.get("rss_growth_mb"), ".1f"),
                         f(r0.get("mbps"), ".0f")))
        out.extend(_table(hdr, rows))
    if "bulk_https" in R:
        w("   (MB = 10^6 bytes; peak RSS = VmHWM after resetting it just before "
          "the transfer, max over rounds; growth = peak - RSS before, median"
          + ("" if b.rss_reset_ok else "; NOTE: clear_refs failed, so VmHWM is the peak since start") + ")")
        w("")

    w("Targets")
    checks = []
    s = R.get("small", {})
    if s:
        r_ = (med(s.get("egress"), "rps") or 0) / (med(s.get("mitmdump"), "rps") or float("inf"))
        checks.append((f"small req/s, egress ≥ {TARGET_SMALL_VS_MITM}× mitmdump", f"{r_:.2f}×",
                       r_ >= TARGET_SMALL_VS_MITM))
        eu, mu = med(s.get("egress"), "proxy_us_per_req"), med(s.get("mitmdump"), "proxy_us_per_req")
        if eu and mu:
            checks.append(("  same, by CPU per request (mitmdump µs / egress µs)", f"{mu / eu:.2f}×",
                           mu / eu >= TARGET_SMALL_VS_MITM))
        for n in b.workers:  # the same requests, N worker processes against one
            r_ = (med(s.get(f"egress-w{n}"), "rps") or 0) / (med(s.get("egress"), "rps") or float("inf"))
            target = TARGET_WORKERS_2 if n == 2 and b.args.workers[0] == 1 else None
            checks.append((f"small req/s, egress --workers {n} vs --workers {b.args.workers[0]}"
                           + (f" ≥ {target}×" if target else ""), f"{r_:.2f}×", r_ >= target if target else None))
        p50, p99 = med(s.get("egress"), "p50_ms"), med(s.get("egress"), "p99_ms")
        if p50 and p99:
            checks.append((f"small c{a.connections}: egress p99 ≤ {TARGET_P99_VS_P50:g}× p50", f"{p99 / p50:.2f}×",
                           p99 / p50 <= TARGET_P99_VS_P50))
    else:
        checks.append((f"small req/s, egress ≥ {TARGET_SMALL_VS_MITM}× mitmdump", "not measured", None))
    bk = R.get("bulk_https", {})
    if bk:
        r_ = (med(bk.get("egress-pass"), "mbps") or 0) / (med(bk.get("direct"), "mbps") or float("inf"))
        checks.append((f"passthrough bulk ≥ {TARGET_PASS_BULK_VS_DIRECT}× direct", f"{r_:.2f}×",
                       r_ >= TARGET_PASS_BULK_VS_DIRECT))
    tn = R.get("tunnels", {})
    ec, sc = med(tn.get("egress-pass"), "proxy_ms_per_tunnel"), med(tn.get("squid-pass"), "proxy_ms_per_tunnel")
    if ec and sc:
        checks.append((f"passthrough tunnel CPU ≤ {TARGET_PASS_CPU_VS_SQUID:g}× squid's (egress ms / squid ms)",
                       f"{ec / sc:.2f}×", ec / sc <= TARGET_PASS_CPU_VS_SQUID))
    for key, what in (("upload_http", "plain HTTP"), ("upload_https", "HTTPS")):
        up = R.get(key, {})
        ev, mv = med(up.get("egress"), "mbps"), med(up.get("mitmdump"), "mbps")
        if ev is not None and mv:
            checks.append((f"scanned upload ≥ {TARGET_UPLOAD_VS_MITM}× mitmdump's unscanned, {what}",
                           f"{ev / mv:.2f}×", ev / mv >= TARGET_UPLOAD_VS_MITM))
    for keys, what in ((("bulk_fresh",), "fresh process"), (("bulk_https", "bulk_http"), "in the rounds")):
        peaks = [r["peak_rss_mb"] for k in keys for n in ("egress", "egress-pass")
                 for r in R.get(k, {}).get(n, []) if "peak_rss_mb" in r]
        if peaks:
            checks.append((f"egress peak RSS < {TARGET_RSS_MB:.0f} MiB during a 256 MiB transfer, {what}",
                           f"{max(peaks):.0f} MiB", max(peaks) < TARGET_RSS_MB))
    for name, value, ok in checks:
        w(f"  {name:68s} {value:>10s}  {'PASS' if ok else ('FAIL' if ok is False else '-')}")
    w("")
    if b.base:
        w("Side by side: egress (this source) against base, same run (>1 is better for egress unless noted)")
        side = []
        for test, name, key, higher in (
                ("small", "egress", "rps", True), ("small", "egress", "proxy_us_per_req", False),
                ("small", "egress", "p99_ms", False), ("latency", "egress", "p50_ms", False),
                ("tunnels", "egress", "proxy_ms_per_tunnel", False),
                ("tunnels", "egress-pass", "tps", True), ("tunnels", "egress-pass", "proxy_ms_per_tunnel", False),
                ("bulk_https", "egress", "mbps", True), ("bulk_https", "egress-pass", "mbps", True),
                ("bulk_https", "egress-pass", "proxy_s_per_gb", False), ("bulk_http", "egress", "mbps", True),
                ("bulk_http", "egress", "proxy_s_per_gb", False),
                ("upload_http", "egress", "mbps", True), ("upload_http", "egress", "proxy_s_per_gb", False),
                ("upload_https", "egress", "mbps", True), ("upload_https", "egress", "proxy_s_per_gb", False)):
            base_name = name.replace("egress", "base")
            ev, bv = med(R.get(test, {}).get(name), key), med(R.get(test, {}).get(base_name), key)
            if ev is None or not bv:
                continue
            better = ev / bv if higher else bv / ev
            side.append((f"{test} {name} {key}", f(bv, ".2f"), f(ev, ".2f"), f"{better:.2f}×"))
        out.extend(_table(("figure", "base", "egress", "egress better by"), side))
        w("")
    if b.waits:
        b.notes.append(f"other work kept the machine busy before {len(b.waits)} measurements; waited "
                       f"{sum(b.waits):.0f} s in all (see the other-CPU% columns for contention during them)")
    if b.notes:
        w("Notes")
        out.extend("  " + n for n in b.notes)
        w("")
    if b.skipped:
        w("Skipped")
        out.extend("  " + s_ for s_ in b.skipped)
        w("")
    if profile_lines:
        out.extend(profile_lines)
        w("")
    return "\n".join(out)


def _table(hdr, rows) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(hdr, *rows, strict=False)]

    def line(cells):
        return "   " + "  ".join(str(c).rjust(wd) if i else str(c).ljust(wd)
                                 for i, (c, wd) in enumerate(zip(cells, widths, strict=False)))

    return [line(hdr)] + [line(r) for r in rows]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _version(argv) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=5)
        m = re.search(r"(?:/|Version )(\d\S*)", out.stderr + out.stdout)
        return m.group(1) if m else "?"
    except Exception:
        return "?"


def egress_worse(results: dict) -> list[str]:
    """Where egress is clearly (over 10%) worse than mitmdump in the same mode."""
    worse = []
    pairs = [("small", "rps", "egress", "mitmdump", True), ("latency", "p50_ms", "egress", "mitmdump", False),
             ("tunnels", "tps", "egress", "mitmdump", True), ("tunnels", "tps", "egress-pass", "mitmdump-pass", True),
             ("bulk_https", "mbps", "egress", "mitmdump", True),
             ("bulk_https", "mbps", "egress-pass", "mitmdump-pass", True),
             ("bulk_http", "mbps", "egress", "mitmdump", True),
             ("upload_http", "mbps", "egress", "mitmdump", True), ("upload_https", "mbps", "egress", "mitmdump", True)]
    for test, key, e, m, higher_better in pairs:
        ev, mv = med(results.get(test, {}).get(e), key), med(results.get(test, {}).get(m), key)
        if ev is None or not mv:
            continue
        r = ev / mv
        if (higher_better and r < 0.9) or (not higher_better and r > 1.1):
            worse.append(f"{test} {e} vs {m}: {r:.2f}×")
    return worse


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=5, help="seconds per wrk -c16 run")
    p.add_argument("--latency-duration", type=float, default=3, help="seconds per wrk -c1 run")
    p.add_argument("--connections", type=int, default=16)
    p.add_argument("--tunnels", type=int, default=400, help="new TLS tunnels per target and round")
    p.add_argument("--parallel", type=int, default=16, help="parallel tunnel clients")
    p.add_argument("--tunnel-timeout", type=float, default=30, help="time bound per tunnel batch")
    p.add_argument("--bulk-timeout", type=int, default=60, help="time bound per download")
    p.add_argument("--quiet-threshold", type=float, default=30,
                   help="before each measurement wait while the machine is busier than this (%% of one CPU)")
    p.add_argument("--quiet-wait", type=float, default=5, help="longest wait before one measurement (s)")
    p.add_argument("--quiet-budget", type=float, default=30, help="longest total wait for a quiet machine (s)")
    p.add_argument("--tests", default="small,tunnels,bulk,upload",
                   help="comma-separated subset of: small (with unloaded latency), tunnels, bulk, upload")
    p.add_argument("--egress-base", metavar="REV",
                   help="also run egress from this git revision (targets base, base-pass), side by side")
    p.add_argument("--squid", choices=("auto", "always", "never"), default="auto",
                   help="squid as the passthrough peer (target squid-pass): if installed (auto), required, or not")
    p.add_argument("--upload-mib", type=int, default=8, help="size of the clean-text upload (MiB)")
    p.add_argument("--upload-repeat", type=int, default=4, help="uploads per measurement, one connection")
    p.add_argument("--egress-src", default="tree",
                   help="'tree': the egress that the interpreter imports (the working tree, editable install); "
                        "or a git revision (e.g. HEAD) of this repository, exported to the temporary directory")
    p.add_argument("--workers", default="1",
                   help="egress serve --workers for the egress targets, comma-separated: the first is 'egress' "
                        "(compared with mitmdump), each other N an extra target egress-wN in the small-request "
                        "tests (e.g. 1,2)")
    p.add_argument("--policy-pad", type=int, default=0,
                   help="put N extra allow entries before allowed.test in egress's policy (a large policy)")
    p.add_argument("--profile", choices=("auto", "always", "never"), default="auto",
                   help="py-spy egress under small-request load: when egress is >10%% worse than mitmdump "
                        "somewhere (auto), always, or never")
    p.add_argument("--profile-seconds", type=int, default=8)
    p.add_argument("--profile-top", type=int, default=15)
    p.add_argument("--profile-out", type=Path, help="keep the raw py-spy output (collapsed stacks) here")
    p.add_argument("--json", type=Path, help="also write the raw per-round results here")
    p.add_argument("--quick", action="store_true", help="1 round, short runs (a smoke test, not a measurement)")
    args = p.parse_args()
    args.tests = {t.strip() for t in args.tests.split(",") if t.strip()}
    try:
        args.workers = [int(n) for n in args.workers.split(",")]
        assert args.workers and min(args.workers) >= 1 and len(set(args.workers)) == len(args.workers)
    except (ValueError, AssertionError):
        p.error("--workers: distinct counts of 1 or more, comma-separated (e.g. 1,2)")
    if not args.tests <= {"small", "tunnels", "bulk", "upload"}:
        p.error("--tests: choose from small, tunnels, bulk, upload")
    if args.quick:
        args.rounds, args.duration, args.latency_duration, args.tunnels = 1, 2, 1, 96
    started = time.monotonic()
    procs = Procs()
    tmp = Path(tempfile.mkdtemp(prefix="egress-bench-"))

    def on_signal(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_signal)
    bench = Bench(args, tmp, procs)
    try:
        bench.setup()
        bench.rounds()
        worse = egress_worse(bench.results)
        profile_lines: list[str] = []
        if args.profile == "always" or (args.profile == "auto" and worse):
            if worse:
                bench.notes.append("egress clearly worse than mitmdump: " + "; ".join(worse))
            bench.log("profiling egress with py-spy under the small-request load")
            profile_lines = bench.profile(worse)
        text = report(bench, profile_lines, started)
        print(text, flush=True)
        if args.json:
            args.json.write_text(json.dumps({"results": bench.results, "notes": bench.notes,
                                             "skipped": bench.skipped}, indent=1))
        return 0
    except BenchError as e:
        print(f"proxy_bench: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("proxy_bench: interrupted", file=sys.stderr)
        return 130
    finally:
        procs.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
