"""Soak: 10,000 held tunnels and 1,000,000 requests through one `egress serve`, 0 errors, RSS given back.

Run:  .venv/bin/python bench/soak.py [--tunnels 10000] [--cycles 2] [--requests 1000000]
                                     [--connections 16] [--phases tunnels,requests] [--front on,off]
      Needs prlimit (util-linux); nginx and wrk for the requests phase. Run it as root (it raises its
      own hard descriptor limit to what the tunnels need), or with a hard limit of 2 x tunnels + 2000.
      Everything is on 127.0.0.1, every port bound as 0 and read back; every process started here is
      stopped by its pid and the temporary directory removed, also on errors and Ctrl-C.

One ``egress serve`` (its defaults: 256 connections per client address, 300 s idle timeout) is
started under ``prlimit --nofile=1024:HARD``, the soft limit systemd gives a service: the soak
first shows serve raised its soft limit to the hard one (/proc/PID/limits). Its policy allows
``pass.test`` (on ``passthrough``) and ``allowed.test``, both resolved to 127.0.0.1.

Phase A, tunnels (``--cycles`` times): this process opens ``--tunnels`` CONNECT tunnels to
``pass.test`` (64 opening at a time) from source addresses 127.0.0.2, .3, ... (200 per address,
under the per-client limit), each to a TCP echo server (an asyncio process of its own), and
checks a round trip of a few bytes in each as it opens. With all of them open it reads egress's
``egress_open_connections`` gauge, its descriptors and RSS, and does a second round trip in
every tunnel; then closes them all, waits for the gauge to reach 0, and reads RSS again at once
and after ``--settle`` seconds. The RSS at rest is read after a warm-up of 100 tunnels.

Phase B, requests: ``wrk --connections`` keep-alive plain-HTTP requests (absolute-form
``GET http://allowed.test:PORT/small``, 100 bytes) through egress to nginx (one worker), until
``--requests`` responses have arrived (a Lua counter stops each wrk thread at its share; ``-d``
is only an upper bound). Non-2xx responses are counted by the script, socket errors by wrk.
egress's RSS is sampled every second. Before it, a 2 s warm-up with the same load.

``--front on,off`` runs all of it once per setting, one after the other, each in a serve of its
own (``off``: ``EGRESS_PASSTHROUGH_FRONT=off``, every connection on mitmproxy's path as before
egress/proxy/fastpath.py), and prints each one's figures and then the front's against mitmproxy's.

Errors anywhere (a tunnel that did not open or echo, a non-2xx, a socket error, a connection
egress limited, egress leaving the gauge above 0) make the exit status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from proxy_bench import EGRESS_MAIN, Procs, cpu_seconds, free_port, listening_ports, status_kb  # noqa: E402

PER_ADDRESS = 200  # tunnels per client source address: under egress's default of 256 per address
OPENING = 64  # tunnels being opened at once (egress listens with asyncio's default backlog of 100)
SMALL = b"x" * 99 + b"\n"

ECHO_SERVER = r"""
import asyncio, sys
class Echo(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport = transport
    def data_received(self, data):
        self.transport.write(data)
async def main():
    server = await asyncio.get_running_loop().create_server(Echo, "127.0.0.1", 0, backlog=4096)
    print(server.sockets[0].getsockname()[1], flush=True)
    await server.serve_forever()
asyncio.run(main())
"""

WRK_LUA = r"""
-- Absolute-form request line (a proxy request); each thread stops after its share of responses.
stopped = false
wrk.path = os.getenv("SOAK_PATH")
wrk.headers["Host"] = os.getenv("SOAK_HOST")
local share = tonumber(os.getenv("SOAK_PER_THREAD"))
local threads = {}
function setup(thread) table.insert(threads, thread) end
responses, not2xx = 0, 0
function response(status, headers, body)
  responses = responses + 1
  if status < 200 or status > 299 then not2xx = not2xx + 1 end
  if responses >= share and not stopped then
    -- wrk itself waits out -d; the bench sends it SIGINT once every thread said this
    stopped = true
    io.stderr:write("SOAK thread done\n")
    wrk.thread:stop()
  end
end
function done(summary, latency, requests)
  local n, bad = 0, 0
  for _, t in ipairs(threads) do n = n + t:get("responses"); bad = bad + t:get("not2xx") end
  local e = summary.errors
  io.write(string.format(
    'SOAK {"requests": %d, "responses": %d, "not2xx": %d, "duration_us": %d, "err_connect": %d, ' ..
    '"err_read": %d, "err_write": %d, "err_status": %d, "err_timeout": %d, "p50_us": %d, "p99_us": %d}\n',
    summary.requests, n, bad, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(99)))
end
"""


class SoakError(Exception):
    pass


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def rss_mb(pid: int) -> float:
    return status_kb(pid, "VmRSS") / 1024


def children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
                found.append(int(entry))
    return sorted(found)


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def nofile_limits(pid: int) -> tuple[str, str]:
    text = Path(f"/proc/{pid}/limits").read_text()
    soft, hard = re.search(r"^Max open files\s+(\S+)\s+(\S+)", text, re.M).groups()
    return soft, hard


def raise_own_limit(tunnels: int, workers: int) -> int:
    """Soft = hard descriptor limit here (raising hard if allowed); the hard limit egress will have.

    A worker holds a client and an upstream socket per tunnel, and SO_REUSEPORT spreads the
    tunnels over the workers by a hash (within a few percent at 10,000)."""
    need = int(2 * tunnels / workers * 1.1) + 1000
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < need:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (need, need))
            hard = need
        except (ValueError, OSError):  # without CAP_SYS_RESOURCE
            raise SoakError(f"the hard descriptor limit is {hard}: {tunnels} tunnels over {workers} workers need "
                            f"{need} in each; raise it (ulimit -Hn as root), or pass more --workers") from None
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


class Soak:
    def __init__(self, args: argparse.Namespace, tmp: Path, procs: Procs, front: str = "on"):
        self.args, self.tmp, self.procs, self.front = args, tmp, procs, front
        self.results: dict = {"machine": f"{platform.node()} {os.cpu_count()} CPUs, {platform.platform()}, "
                                         f"Python {platform.python_version()}", "front": front}
        self.failures: list[str] = []

    # ------------------------------------------------------------- processes

    def start_echo(self) -> None:
        proc = self.procs.start("echo", [sys.executable, "-c", ECHO_SERVER], stdout=subprocess.PIPE, text=True)
        self.echo_proc, self.echo_port = proc, int(proc.stdout.readline())
        log(f"echo server pid {proc.pid} on 127.0.0.1:{self.echo_port}")

    def start_nginx(self) -> None:
        nginx = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx", "/sbin/nginx") if os.path.exists(p)), None)
        if nginx is None:
            raise SoakError("nginx not found (apt-get install -y nginx-light)")
        ngx = self.tmp / "nginx"
        (ngx / "temp").mkdir(parents=True)
        (self.tmp / "www").mkdir()
        (self.tmp / "www" / "small").write_bytes(SMALL)
        for _attempt in range(5):
            port = free_port()
            t = ngx / "temp"
            (ngx / "nginx.conf").write_text(f"""
daemon off;
master_process off;
worker_processes 1;
pid {ngx}/nginx.pid;
error_log {ngx}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    keepalive_requests 100000000;
    keepalive_timeout 75s;
    client_body_temp_path {t}/body; proxy_temp_path {t}/proxy; fastcgi_temp_path {t}/fastcgi;
    uwsgi_temp_path {t}/uwsgi; scgi_temp_path {t}/scgi;
    server {{ listen 127.0.0.1:{port}; root {self.tmp}/www; location / {{ }} }}
}}
""")
            proc = self.procs.start("nginx", [nginx, "-p", str(ngx), "-e", str(ngx / "error.log"),
                                              "-c", str(ngx / "nginx.conf")],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and proc.poll() is None:
                if port in listening_ports(proc.pid):
                    self.nginx_proc, self.nginx_port = proc, port
                    log(f"nginx pid {proc.pid} on 127.0.0.1:{port}")
                    return
                time.sleep(0.05)
            self.procs.stop(proc)
        raise SoakError("nginx could not be started")

    def start_egress(self, hard: int) -> None:
        if shutil.which("prlimit") is None:
            raise SoakError("prlimit not found (apt-get install -y util-linux)")
        policy = self.tmp / "policy.toml"
        policy.write_text('allow = ["allowed.test", "pass.test"]\n'
                          'allow_private = ["allowed.test", "pass.test"]\n'
                          'passthrough = ["pass.test"]\n')
        argv = ["prlimit", f"--nofile=1024:{hard}", sys.executable, "-c", EGRESS_MAIN, "serve",
                "--workers", str(self.args.workers), "--listen", "127.0.0.1:0", "--metrics", "127.0.0.1:0", "--audit-log", "off",
                "--resolve", "allowed.test:127.0.0.1", "--resolve", "pass.test:127.0.0.1",
                "--policy", str(policy), "--state-dir", str(self.tmp / "state")]
        env = {"PATH": os.environ["PATH"], "HOME": str(self.tmp), "LANG": "C.UTF-8"}
        if self.front == "off":
            env["EGRESS_PASSTHROUGH_FRONT"] = "off"
        self.egress_log = self.tmp / "egress.log"
        with open(self.egress_log, "wb") as out:
            proc = self.procs.start("egress", argv, stdout=out, stderr=out, env=env, cwd=self.tmp)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            text = self.egress_log.read_text(errors="replace")
            listen = re.search(r"proxy listening on 127\.0\.0\.1:(\d+)", text)
            metrics = re.search(r"metrics on (http://\S+)", text)
            if listen and metrics:
                self.egress_proc, self.egress_port = proc, int(listen.group(1))
                self.metrics_url = metrics.group(1)
                self.workers = children(proc.pid) if self.args.workers > 1 else [proc.pid]
                # prlimit exec()s: its pid is serve's; the proxies are serve itself or its workers
                limits = {pid: ":".join(nofile_limits(pid)) for pid in self.workers}
                self.results["nofile"] = {"started_with": f"1024:{hard}", "proxies_run_with": sorted(set(limits.values()))}
                log(f"egress serve pid {proc.pid} on 127.0.0.1:{self.egress_port}, started with nofile 1024:{hard}; "
                    f"its proxies run with {limits}")
                if len(self.workers) != self.args.workers:
                    raise SoakError(f"{len(self.workers)} worker processes, not {self.args.workers}")
                for pid, limit in limits.items():
                    if limit != f"{hard}:{hard}":
                        self.failures.append(f"egress proxy {pid} runs with the descriptor limits {limit}, not {hard}:{hard}")
                return
            if proc.poll() is not None:
                raise SoakError(f"egress serve exited with {proc.returncode}:\n{text[-2000:]}")
            time.sleep(0.05)
        raise SoakError("egress serve did not print its addresses within 60 s")

    def metric(self, name: str, labels: str = "") -> float:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(self.metrics_url, timeout=30) as r:
            text = r.read().decode()
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name) and (line[len(name)] in " {") and labels in line:
                total += float(line.rsplit(" ", 1)[1])
        return total

    def pids(self) -> list[int]:
        """serve and its workers (each worker's RSS is its own: spawned, not forked)."""
        now = children(self.egress_proc.pid) if self.args.workers > 1 else [self.egress_proc.pid]
        if now != self.workers:
            self.failures.append(f"the workers changed: {self.workers} became {now} (a worker restarted)")
            self.workers = now
        return sorted({self.egress_proc.pid, *now})

    def snapshot(self, what: str) -> dict:
        pids = self.pids()
        by_pid = {pid: round(rss_mb(pid), 1) for pid in pids}
        row = {"rss_mb": round(sum(by_pid.values()), 1), "rss_by_pid": by_pid,
               "fds": {pid: fds(pid) for pid in pids},
               "open_connections": self.metric("egress_open_connections")}
        log(f"{what}: egress RSS {row['rss_mb']} MB {by_pid}, descriptors {row['fds']}, "
            f"egress_open_connections {row['open_connections']:g}")
        return row

    def wait_closed(self, timeout: float = 120.0) -> float:
        """Seconds until egress's gauge says no connection is open (raises if it never does)."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.metric("egress_open_connections") == 0:
                return time.monotonic() - t0
            time.sleep(0.2)
        raise SoakError(f"egress still counts {self.metric('egress_open_connections'):g} open connections "
                        f"{timeout:g} s after the clients closed")

    # ------------------------------------------------------------- phase A

    async def open_tunnel(self, i: int, errors: Counter, gate: asyncio.Semaphore):
        source = f"127.0.0.{2 + i // PER_ADDRESS}"
        async with gate:
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection(
                    "127.0.0.1", self.egress_port, local_addr=(source, 0)), 60)
            except (TimeoutError, OSError) as e:
                errors[f"connect: {type(e).__name__} {getattr(e, 'strerror', '') or ''}".strip()] += 1
                return None
            try:
                target = f"pass.test:{self.echo_port}"
                writer.write(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)
                if not head.startswith(b"HTTP/1.1 200"):
                    status = head.split(b"\r\n", 1)[0].decode(errors="replace")
                    errors[f"CONNECT answered {status}"] += 1
                    writer.close()
                    return None
                if not await self.round_trip(i, reader, writer, errors, "first"):
                    writer.close()
                    return None
            except (TimeoutError, OSError, asyncio.IncompleteReadError) as e:
                errors[f"CONNECT: {type(e).__name__}"] += 1
                writer.close()
                return None
        return reader, writer

    @staticmethod
    async def round_trip(i: int, reader, writer, errors: Counter, which: str) -> bool:
        payload = f"{which}:{i};".encode()
        try:
            writer.write(payload)
            echoed = await asyncio.wait_for(reader.readexactly(len(payload)), 60)
        except (TimeoutError, OSError, asyncio.IncompleteReadError) as e:
            errors[f"{which} round trip: {type(e).__name__}"] += 1
            return False
        if echoed != payload:
            errors[f"{which} round trip: other bytes came back"] += 1
            return False
        return True

    async def tunnels_cycle(self, n: int, measure: bool) -> dict:
        errors: Counter = Counter()
        gate = asyncio.Semaphore(OPENING)
        t0 = time.monotonic()
        opened = await asyncio.gather(*(self.open_tunnel(i, errors, gate) for i in range(n)))
        held = [t for t in opened if t is not None]
        open_s = time.monotonic() - t0
        row: dict = {"tunnels": n, "opened": len(held), "open_s": round(open_s, 1),
                     "opened_per_s": round(n / open_s)}
        if measure:
            row["held"] = self.snapshot(f"{len(held)} tunnels held")
            row["echo_server_fds"] = fds(self.echo_proc.pid)
            gate = asyncio.Semaphore(1000)

            async def again(i, reader, writer):
                async with gate:
                    return await self.round_trip(i, reader, writer, errors, "second")

            t1 = time.monotonic()
            ok = await asyncio.gather(*(again(i, r, w) for i, (r, w) in enumerate(held)))
            row["second_round_trips_ok"] = sum(ok)
            row["second_round_trip_s"] = round(time.monotonic() - t1, 1)
            row["held_after_round_trips"] = self.snapshot("after a second round trip in each")
        for _reader, writer in held:
            writer.close()
        await asyncio.gather(*(w.wait_closed() for _r, w in held), return_exceptions=True)
        row["errors"] = dict(errors)
        return row

    def phase_tunnels(self) -> None:
        a = self.args
        self.start_echo()
        asyncio.run(self.tunnels_cycle(100, measure=False))  # warm-up: every code path seen once
        self.wait_closed()
        time.sleep(a.settle)
        rows = {"rest": self.snapshot("at rest after 100 warm-up tunnels"), "cycles": []}
        for c in range(a.cycles):
            log(f"cycle {c + 1}: opening {a.tunnels} tunnels")
            row = asyncio.run(self.tunnels_cycle(a.tunnels, measure=True))
            log(f"cycle {c + 1}: {row['opened']} opened in {row['open_s']} s, errors {row['errors'] or 'none'}")
            row["close_s"] = round(self.wait_closed(), 1)
            row["closed"] = self.snapshot(f"cycle {c + 1}: all closed ({row['close_s']} s)")
            time.sleep(a.settle)
            row["settled"] = self.snapshot(f"cycle {c + 1}: {a.settle:g} s later")
            rows["cycles"].append(row)
            errors = sum(row["errors"].values())
            if errors or row["opened"] != a.tunnels or row["second_round_trips_ok"] != a.tunnels:
                self.failures.append(f"tunnels cycle {c + 1}: {errors} errors {row['errors']}")
        rows["limited"] = self.metric("egress_connections_limited_total")
        if rows["limited"]:
            self.failures.append(f"egress limited {rows['limited']:g} connections")
        self.procs.stop(self.echo_proc)
        self.results["tunnels"] = rows

    # ------------------------------------------------------------- phase B

    def run_wrk(self, total: int, bound_s: float) -> dict:
        wrk = shutil.which("wrk")
        if wrk is None:
            raise SoakError("wrk not found (apt-get install -y wrk)")
        lua = self.tmp / "soak.lua"
        lua.write_text(WRK_LUA)
        threads = 2
        env = dict(os.environ, SOAK_PATH=f"http://allowed.test:{self.nginx_port}/small",
                   SOAK_HOST=f"allowed.test:{self.nginx_port}", SOAK_PER_THREAD=str(-(-total // threads)))
        argv = [wrk, f"-c{self.args.connections}", f"-t{threads}", f"-d{bound_s:g}s", "--timeout", "10s",
                "-s", str(lua), f"http://127.0.0.1:{self.egress_port}"]
        proc = self.procs.start("wrk", argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        try:
            done, err = 0, []
            for line in proc.stderr:  # ends when wrk does: at the latest after -d
                if line.startswith(b"SOAK thread done"):
                    done += 1
                    if done == threads:
                        proc.send_signal(signal.SIGINT)  # wrk then prints its summary and exits
                else:
                    err.append(line)
            out = proc.stdout.read()
            proc.wait(60)
        finally:
            self.procs.stop(proc)
        err = b"".join(err)
        m = re.search(r"^SOAK (\{.*\})$", out.decode(), re.M)
        if not m:
            raise SoakError(f"wrk gave no summary: {out.decode()[-500:]} {err.decode()[-500:]}")
        s = json.loads(m.group(1))
        s["socket_errors"] = s["err_connect"] + s["err_read"] + s["err_write"] + s["err_timeout"]
        s["rps"] = round(s["requests"] / (s["duration_us"] / 1e6))
        return s

    def phase_requests(self) -> None:
        a = self.args
        self.start_nginx()
        self.run_wrk(4000, 10)  # warm-up
        self.wait_closed()
        time.sleep(a.settle)
        rows: dict = {"before": self.snapshot("before the requests")}
        samples: list[tuple[float, float]] = []
        stop = threading.Event()

        def sample() -> None:
            t0 = time.monotonic()
            while not stop.wait(1.0):
                try:
                    rss = sum(map(rss_mb, self.pids()))
                except OSError:
                    continue
                samples.append((round(time.monotonic() - t0, 1), round(rss, 1)))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        log(f"{a.requests} requests, wrk -c{a.connections} -t2 (bound {a.request_bound:g} s)")
        cpu0 = sum(map(cpu_seconds, self.pids()))
        try:
            s = self.run_wrk(a.requests, a.request_bound)
        finally:
            stop.set()
            sampler.join()
        # egress's CPU per request: what the req/s would be on a core of its own (the machine is shared)
        s["egress_us_per_req"] = round(1e6 * (sum(map(cpu_seconds, self.pids())) - cpu0) / max(1, s["requests"]))
        rows["wrk"] = s
        log(f"wrk: {s['requests']} requests, {s['responses']} responses counted, {s['not2xx']} non-2xx, "
            f"{s['socket_errors']} socket errors, {s['rps']} req/s, p50 {s['p50_us'] / 1000:.1f} ms, "
            f"p99 {s['p99_us'] / 1000:.1f} ms")
        rows["close_s"] = round(self.wait_closed(), 1)
        rows["closed"] = self.snapshot("requests done, connections closed")
        time.sleep(a.settle)
        rows["settled"] = self.snapshot(f"{a.settle:g} s later")
        rss = [mb for _t, mb in samples]
        if rss:
            tenth = rss[max(0, len(rss) // 10 - 1)]
            rows["rss_during"] = {"peak_mb": max(rss), "at_10pct_mb": tenth, "at_end_mb": rss[-1],
                                  "samples": len(rss)}
            rows["rss_samples"] = samples  # (seconds into the load, MB): when memory moved
        rows["limited"] = self.metric("egress_connections_limited_total")
        if s["not2xx"] or s["socket_errors"] or s["err_status"] or s["responses"] < a.requests or rows["limited"]:
            self.failures.append(f"requests: {s['not2xx']} non-2xx, {s['socket_errors']} socket errors, "
                                 f"{s['responses']} of {a.requests} responses, {rows['limited']:g} limited")
        self.procs.stop(self.nginx_proc)
        self.results["requests"] = rows

    def run(self) -> None:
        hard = raise_own_limit(self.args.tunnels, self.args.workers)
        self.start_egress(hard)
        self.results["egress_started"] = self.snapshot("egress started")
        if "tunnels" in self.args.phases:
            self.phase_tunnels()
        if "requests" in self.args.phases:
            self.phase_requests()
        self.results["egress_log_lines"] = len(self.egress_log.read_text(errors="replace").splitlines())
        self.results["failures"] = self.failures
        self.procs.stop(self.egress_proc)  # before the next setting's serve


def summary(results: dict) -> list[str]:
    lines = [f"soak of egress serve (front {results.get('front', 'on')}) on {results['machine']}",
             f"descriptors: serve started with nofile {results['nofile']['started_with']}, "
             f"its proxies run with {', '.join(results['nofile']['proxies_run_with'])}"]
    if t := results.get("tunnels"):
        rest = t["rest"]["rss_mb"]
        lines.append(f"tunnels: RSS at rest {rest} MB (after 100 warm-up tunnels)")
        for c, row in enumerate(t["cycles"], 1):
            peak = max(row["held"]["rss_mb"], row["held_after_round_trips"]["rss_mb"])
            lines.append(
                f"  cycle {c}: {row['opened']}/{row['tunnels']} opened ({row['opened_per_s']}/s), "
                f"{row['second_round_trips_ok']} second round trips ok, errors {sum(row['errors'].values())}; "
                f"held {row['held']['open_connections']:g} connections, descriptors {row['held']['fds']}; "
                f"RSS held {peak} MB ({peak / rest:.2f}x rest), closed {row['closed']['rss_mb']} MB "
                f"({row['closed']['rss_mb'] / rest:.2f}x), settled {row['settled']['rss_mb']} MB "
                f"({row['settled']['rss_mb'] / rest:.2f}x rest, {row['settled']['rss_mb'] / peak:.2f}x held)")
        lines.append(f"  connections limited by egress: {t['limited']:g}")
    if r := results.get("requests"):
        s, before = r["wrk"], r["before"]["rss_mb"]
        during = r.get("rss_during", {})
        lines.append(
            f"requests: {s['responses']} responses ({s['requests']} by wrk), {s['not2xx']} non-2xx, "
            f"{s['socket_errors']} socket errors, {s['rps']} req/s, p50 {s['p50_us'] / 1000:.1f} ms, "
            f"p99 {s['p99_us'] / 1000:.1f} ms, {s['duration_us'] / 1e6:.0f} s; egress CPU {s['egress_us_per_req']} us/request "
            f"({1e6 / max(1, s['egress_us_per_req']):.0f} req/s per core)")
        if during:
            lines.append(
                f"  RSS before {before} MB, at 10% {during['at_10pct_mb']} MB, peak {during['peak_mb']} MB "
                f"({during['peak_mb'] / before:.2f}x), at end {during['at_end_mb']} MB, settled "
                f"{r['settled']['rss_mb']} MB ({r['settled']['rss_mb'] / before:.2f}x before)")
    lines.append(f"egress log: {results['egress_log_lines']} lines")
    lines.append("failures: " + ("; ".join(results["failures"]) or "none"))
    return lines


def compare(by_front: dict) -> list[str]:
    """The front's tunnel figures against mitmproxy's path (--front on,off)."""
    on, off = by_front["on"].get("tunnels"), by_front["off"].get("tunnels")
    if not on or not off:
        return []
    lines = ["tunnels, front on against off (RSS as x its own rest):"]
    for c, (a, b) in enumerate(zip(on["cycles"], off["cycles"], strict=False), 1):
        def ratios(t, row):
            rest = t["rest"]["rss_mb"]
            peak = max(row["held"]["rss_mb"], row["held_after_round_trips"]["rss_mb"])
            return (f"held {peak / rest:.2f}x, closed {row['closed']['rss_mb'] / rest:.2f}x, "
                    f"settled {row['settled']['rss_mb'] / rest:.2f}x ({peak - rest:.0f} MB taken, "
                    f"{row['settled']['rss_mb'] - rest:.0f} MB kept)")
        lines.append(f"  cycle {c}: on: {ratios(on, a)}; off: {ratios(off, b)}")
    lines.append(f"  RSS at rest: on {on['rest']['rss_mb']} MB, off {off['rest']['rss_mb']} MB")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tunnels", type=int, default=10_000)
    p.add_argument("--cycles", type=int, default=2, help="open, hold and close the tunnels this many times")
    p.add_argument("--requests", type=int, default=1_000_000)
    p.add_argument("--connections", type=int, default=16, help="wrk's keep-alive connections")
    p.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)),
                   help="serve --workers (default: serve's own, the CPUs)")
    p.add_argument("--request-bound", type=float, default=1800, help="wrk's -d: seconds at most")
    p.add_argument("--settle", type=float, default=10, help="seconds to wait after closing before reading RSS")
    p.add_argument("--phases", default="tunnels,requests")
    p.add_argument("--front", default="on", help="on, off (EGRESS_PASSTHROUGH_FRONT=off) or on,off: a serve each, in turn")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args()
    args.phases = set(args.phases.split(","))
    fronts = args.front.split(",")
    if not fronts or set(fronts) - {"on", "off"} or len(set(fronts)) != len(fronts):
        p.error(f"--front {args.front!r}: on, off or on,off")
    procs = Procs()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the processes started here are stopped
    tmp = Path(tempfile.mkdtemp(prefix="egress-soak-"))
    by_front: dict = {}
    try:
        for front in fronts:
            log(f"front {front}")
            (tmp / front).mkdir()
            soak = Soak(args, tmp / front, procs, front)
            soak.run()
            by_front[front] = soak.results
    except SoakError as e:
        print(f"soak: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        procs.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)
    for results in by_front.values():
        print("\n".join(summary(results)))
    if len(by_front) == 2:
        print("\n".join(compare(by_front)))
    if args.json:
        args.json.write_text(json.dumps(by_front[fronts[0]] if len(fronts) == 1 else by_front, indent=1))
    return 1 if any(results["failures"] for results in by_front.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
