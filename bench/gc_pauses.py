"""Garbage-collection pauses in `egress serve` under load, with and without gc.freeze() after start-up.

Run:  .venv/bin/python bench/gc_pauses.py [--seconds 10] [--rounds 3] [--connections 16]
      Needs: wrk. Everything runs on 127.0.0.1 (ports bound as 0 and read back).

Each round starts `egress serve` twice, alternating which goes first: as built, and with
gc.freeze() made a no-op (a sitecustomize in the proxy process only; egress/ is not changed).
The same sitecustomize times every collection through gc.callbacks and writes them out at exit.
wrk -c16 sends plain-HTTP requests through the proxy to a ThreadingHTTPServer in this process.
Reported per variant (medians over rounds): wrk's req/s, p50 and p99 latency, and the
generation-2 collections: how many, the longest and the total time spent in them.
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SITECUSTOMIZE = """
import atexit, gc, json, os, signal, sys, time
_pauses, _start = [], {}
def _timer(phase, info):
    if phase == "start":
        _start["t"] = time.perf_counter()
    elif info["generation"] == 2:
        _pauses.append(time.perf_counter() - _start.pop("t", time.perf_counter()))
gc.callbacks.append(_timer)
if os.environ.get("BENCH_NO_FREEZE"):
    gc.freeze = lambda: None
def _dump():
    with open(os.environ["BENCH_GC_OUT"], "w") as f:
        json.dump(_pauses, f)
atexit.register(_dump)
"""


class Upstream(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        body = b"x" * 100
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def start_serve(tmp: Path, name: str, freeze: bool) -> tuple[subprocess.Popen, int, Path]:
    site = tmp / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    policy = tmp / "policy.toml"
    policy.write_text('allow = ["bench.test"]\nallow_private = ["bench.test"]\n')
    out = tmp / f"{name}.json"
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp), "PYTHONPATH": f"{site}:{REPO}",
           "BENCH_GC_OUT": str(out), "PYTHONSAFEPATH": "1"}
    if not freeze:
        env["BENCH_NO_FREEZE"] = "1"
    process = subprocess.Popen(
        [sys.executable, "-m", "egress.cli", "serve", "--policy", str(policy), "--listen", "127.0.0.1:0",
         "--metrics", "off", "--audit-log", "off", "--state-dir", str(tmp / "state"),
         "--resolve", "bench.test:127.0.0.1"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True)
    deadline = time.monotonic() + 60
    for line in process.stderr:
        if "proxy listening on" in line:
            return process, int(line.rsplit(":", 1)[1]), out
        if time.monotonic() > deadline:
            break
    process.kill()
    raise SystemExit(f"egress serve did not start ({name})")


def wrk(proxy_port: int, upstream_port: int, seconds: float, connections: int) -> dict:
    # wrk speaks to the proxy as to a server; the absolute-form request line makes it a proxy request.
    script = Path(tempfile.mkstemp(suffix=".lua")[1])
    script.write_text(f'wrk.path = "http://bench.test:{upstream_port}/small"\n'
                      'done = function(summary, latency, requests)\n'
                      '  io.write(string.format("JSON{\\"rps\\":%f,\\"p50\\":%f,\\"p99\\":%f}\\n",\n'
                      '    summary.requests / (summary.duration / 1e6), latency:percentile(50) / 1000,\n'
                      '    latency:percentile(99) / 1000))\nend\n')
    try:
        result = subprocess.run(["wrk", f"-c{connections}", "-t2", f"-d{int(seconds)}s", "-s", str(script),
                                 f"http://127.0.0.1:{proxy_port}"], capture_output=True, text=True,
                                timeout=seconds + 60)
    finally:
        script.unlink()
    line = next(x for x in result.stdout.splitlines() if x.startswith("JSON"))
    return json.loads(line[4:])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--connections", type=int, default=16)
    args = p.parse_args()
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is not installed (apt-get install wrk)")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    results: dict[str, list[dict]] = {"frozen": [], "not frozen": []}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for r in range(args.rounds):
            order = [("frozen", True), ("not frozen", False)]
            for name, freeze in (order if r % 2 == 0 else order[::-1]):
                process, port, out = start_serve(tmp, name.replace(" ", "-"), freeze)
                try:
                    wrk(port, server.server_port, 2, args.connections)  # warm-up: every code path seen once
                    load = wrk(port, server.server_port, args.seconds, args.connections)
                finally:
                    os.killpg(process.pid, signal.SIGTERM)
                    process.wait(30)
                pauses = json.loads(out.read_text())
                load.update(gen2=len(pauses), gen2_max=max(pauses, default=0) * 1000,
                            gen2_total=sum(pauses) * 1000)
                results[name].append(load)
                print(f"round {r + 1} {name:>10}: {json.dumps(load)}", file=sys.stderr)
    server.shutdown()
    print(f"gc pauses in egress serve under wrk -c{args.connections} ({args.seconds:g} s, {args.rounds} rounds, "
          f"medians; {os.cpu_count()} CPUs, Python {sys.version.split()[0]})")
    print(f"{'variant':>10}  {'req/s':>7}  {'p50 ms':>7}  {'p99 ms':>7}  {'p99/p50':>7}  "
          f"{'gen2 n':>6}  {'gen2 max ms':>11}  {'gen2 total ms':>13}")
    for name, rows in results.items():
        m = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
        print(f"{name:>10}  {m['rps']:7.0f}  {m['p50']:7.2f}  {m['p99']:7.2f}  {m['p99'] / m['p50']:7.2f}  "
              f"{m['gen2']:6.0f}  {m['gen2_max']:11.1f}  {m['gen2_total']:13.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
