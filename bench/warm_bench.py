"""The warm proxy, side by side: `egress run` with its proxy warm, lazy (in-process), and srt.

Run:  .venv/bin/python bench/warm_bench.py [--rounds 20] [--latency-rounds 15] [--ref REV]
                                            [--editable] [--srt PATH | --no-srt]
      chrt -f 20 .venv/bin/python bench/warm_bench.py ...   # on a machine shared with other jobs
      Needs: curl, user namespaces; for the peer, `apt-get install -y bubblewrap socat ripgrep`
      and npm (@anthropic-ai/sandbox-runtime is installed into the temporary folder unless --srt
      names an `srt` bin).

egress runs as a regular install would: a throw-away venv (no pip) whose site-packages has one
plain .pth naming the source (the working tree, or `git archive REV` with --ref) and this
interpreter's site-packages (mitmproxy and the rest), and an `egress` script like pip's. With
--editable the dev venv's own `egress` runs instead (setuptools' editable finder, ~15 ms more
per start).

What it measures, in ONE run, interleaved round-robin (the starting variant rotates each round,
two untimed warm-up rounds), medians and p90 of the wall time (spawn to exit) and the CPU time
of everything the command made (this script's RUSAGE_CHILDREN, plus, for warm runs, the CPU
the warm server's children used: its cutime+cstime):

  true | python -c pass | egress run --proxy lazy -- true | egress run -- true (warm) | srt true
  egress run --proxy lazy -- curl -sf URL | egress run -- curl -sf URL | srt curl -sf URL
  (`egress run -- true` with no option, as a command that never connects; the curl runs with
  --policy P --resolve bench.test:127.0.0.1, P allowing bench.test)

then the first proxied request: `sh -c 'curl; curl'`, curl's time_total of the first (for lazy:
the proxy starts then) and the second request, warm, lazy, srt and direct.

URL is a local http.server (a thread of this script, port 0) named bench.test, which egress
resolves with --resolve; srt's proxy resolves names itself and refuses loopback unless the
literal is allowed, so srt gets `allowedDomains: ["127.0.0.1:PORT"]` and curl `--noproxy ''`
to the literal. The warm server is started (and waited for) before timing, and stopped by its
pid at the end; the temporary folder goes too, on errors and Ctrl-C as well.
"""

from __future__ import annotations

import argparse
import datetime as dt
import http.server
import json
import math
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CMD_TIMEOUT = 60.0
SRT_PACKAGE = "@anthropic-ai/sandbox-runtime"


class BenchError(Exception):
    pass


class Quiet(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802
        body = b"ok\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def reaped_cpu(pid: int) -> float:
    """CPU seconds of the children ``pid`` has reaped (cutime + cstime)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")


def run_cmd(argv, env, cwd, warm_pid: int | None = None) -> tuple[int, float, float, str, str]:
    """(status, wall s, CPU s, stdout, stderr); on timeout its process group is killed by its id."""
    cpu0, reaped0 = children_cpu(), reaped_cpu(warm_pid) if warm_pid else 0.0
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=CMD_TIMEOUT)
    except BaseException:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.communicate()
        raise
    wall = time.perf_counter() - t0
    if warm_pid:  # the run's child is reaped by the server just after the run ends
        deadline = time.monotonic() + 1.0
        while reaped_cpu(warm_pid) == reaped0 and time.monotonic() < deadline:
            time.sleep(0.002)
    cpu = children_cpu() - cpu0 + (reaped_cpu(warm_pid) - reaped0 if warm_pid else 0.0)
    return proc.returncode, wall, cpu, out.decode(errors="replace"), err.decode(errors="replace")


def pct(values, p):
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def regular_install(tmp: Path, source: Path) -> Path:
    """A venv that sees egress as a regular install would: plain sys.path entries, no finder."""
    venv = tmp / "venv"
    tmp.mkdir(exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, capture_output=True)
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "egress-bench.pth").write_text(f"{source}\n{sysconfig.get_paths()['purelib']}\n")
    script = venv / "bin" / "egress"
    entry = "egress.entry" if (source / "egress" / "entry.py").exists() else "egress.cli"  # as pyproject says
    script.write_text(f"#!{venv / 'bin' / 'python'}\nimport sys\nfrom {entry} import main\nsys.exit(main())\n")
    script.chmod(0o755)
    # pip's own console script (pip 23's template) also imports re and runs a re.sub: what a
    # `pip install` user's egress starts with (uv's script does not)
    pip_script = venv / "bin" / "egress-pip"
    pip_script.write_text(f"#!{venv / 'bin' / 'python'}\n# -*- coding: utf-8 -*-\nimport re\nimport sys\n"
                          f"from {entry} import main\nif __name__ == '__main__':\n"
                          f"    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])\n"
                          f"    sys.exit(main())\n")
    pip_script.chmod(0o755)
    subprocess.run([str(venv / "bin" / "python"), "-m", "compileall", "-q", str(source)], capture_output=True)
    return script


def install_srt(tmp: Path, notes: list[str]) -> str | None:
    missing = [tool for tool in ("bwrap", "socat", "rg", "npm") if shutil.which(tool) is None]
    if missing:
        notes.append(f"srt: skipped, missing {', '.join(missing)}")
        return None
    prefix = tmp / "srt"
    try:
        done = subprocess.run(["npm", "install", "--prefix", str(prefix), "--no-audit", "--no-fund", SRT_PACKAGE],
                              capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        notes.append("srt: skipped, npm install took over 120 s")
        return None
    srt = prefix / "node_modules" / ".bin" / "srt"
    if done.returncode != 0 or not srt.exists():
        notes.append(f"srt: skipped, npm install failed: {(done.stderr or done.stdout).strip()[-300:]}")
        return None
    return str(srt)


def warm_server(state: Path) -> dict | None:
    for record in (state / "warm").glob("*.json"):
        try:
            return json.loads(record.read_text())
        except (OSError, ValueError):
            pass
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--latency-rounds", type=int, default=15)
    parser.add_argument("--ref", help="measure this commit (git archive) instead of the working tree")
    parser.add_argument("--editable", action="store_true", help="run the dev venv's editable egress")
    parser.add_argument("--compare", metavar="REV", help="also time `egress run [--proxy lazy] -- true` of this commit (a regular "
                                                         "install of its git archive) in the same rounds")
    parser.add_argument("--srt", help="an installed srt bin")
    parser.add_argument("--no-srt", action="store_true")
    args = parser.parse_args()

    notes: list[str] = []
    tmp = Path(tempfile.mkdtemp(prefix="egress-warm-bench-"))
    server = warm_pid = None
    try:
        if args.ref:
            source = tmp / "src"
            source.mkdir()
            archive = subprocess.run(["git", "-C", str(REPO), "archive", args.ref], capture_output=True, check=True)
            subprocess.run(["tar", "-x", "-C", str(source)], input=archive.stdout, check=True)
        else:
            source = REPO
        if args.editable:
            egress = str(Path(sys.executable).parent / "egress")
        else:
            egress = str(regular_install(tmp, source))
        older = None
        if args.compare:
            old_source = tmp / "compare-src"
            old_source.mkdir()
            archive = subprocess.run(["git", "-C", str(REPO), "archive", args.compare], capture_output=True, check=True)
            subprocess.run(["tar", "-x", "-C", str(old_source)], input=archive.stdout, check=True)
            older = (str(regular_install(tmp / "compare", old_source)),)
        srt = None if args.no_srt else (args.srt or install_srt(tmp, notes))
        for name in ("home", "state", "tmp", "project"):
            (tmp / name).mkdir()
        project = tmp / "project"
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(tmp / "home"), "LANG": "C.UTF-8",
               "EGRESS_STATE_DIR": str(tmp / "state"), "TMPDIR": str(tmp / "tmp"), "EGRESS_WARM_IDLE": "900"}
        subprocess.run([egress, "ca", "path"], env=env, cwd=project, check=True, capture_output=True)

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        port = server.server_address[1]
        (project / "policy.toml").write_text('allow = ["bench.test"]\nallow_private = ["bench.test"]\n')
        url, literal = f"http://bench.test:{port}/", f"http://127.0.0.1:{port}/"
        run = [egress, "run", "--policy", "policy.toml", "--resolve", "bench.test:127.0.0.1"]
        srt_settings = tmp / "srt.json"
        srt_settings.write_text(json.dumps({
            "network": {"allowedDomains": [f"127.0.0.1:{port}"], "deniedDomains": []},
            "filesystem": {"denyRead": [], "allowWrite": ["."], "denyWrite": []}}))

        # the warm server, started and ready before anything is timed
        status, _, _, out, err = run_cmd([*run, "--", "curl", "-sf", url], env, project)
        if status != 0 or out != "ok\n":
            raise BenchError(f"egress run -- curl failed ({status}): {err[-500:]}")
        deadline = time.monotonic() + 30
        while (record := warm_server(tmp / "state")) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if record is None:
            raise BenchError("the warm server never wrote its record")
        warm_pid = record["pid"]

        python = str(Path(egress).parent / "python")  # the interpreter egress runs on
        variants = [
            ("true", ["true"], None),
            ("python -c pass (egress's interpreter)", [python, "-c", "pass"], None),
            ("egress run --proxy lazy -- true", [egress, "run", "--proxy", "lazy", "--", "true"], None),
            ("egress run -- true (warm)", [egress, "run", "--", "true"], warm_pid),
            ("  the same, pip's console script", [egress + "-pip", "run", "--", "true"], warm_pid),
            ("egress run --proxy lazy -- curl -sf URL", [*run, "--proxy", "lazy", "--", "curl", "-sf", url], None),
            ("egress run -- curl -sf URL (warm)", [*run, "--", "curl", "-sf", url], warm_pid),
        ]
        if older:
            variants += [(f"{args.compare}: egress run --proxy lazy -- true", [older[0], "run", "--proxy", "lazy", "--",
                                                                            "true"], None),
                         (f"{args.compare}: egress run -- true (warm)", [older[0], "run", "--", "true"], None)]
        if srt:
            variants += [("srt true", [srt, "--settings", str(srt_settings), "--", "true"], None),
                         ("srt curl -sf URL", [srt, "--settings", str(srt_settings), "--", "curl", "-sf", "--noproxy",
                                              "", literal], None)]
        times = {label: [] for label, _, _ in variants}
        cpus = {label: [] for label, _, _ in variants}
        failures: dict[str, list[str]] = {}
        started = time.monotonic()
        for round_ in range(args.rounds + 2):
            shift = round_ % len(variants)
            for label, argv, pid in variants[shift:] + variants[:shift]:
                status, wall, cpu, out, err = run_cmd(argv, env, project, pid)
                if status != 0:
                    failures.setdefault(label, []).append(f"status {status}: {err.strip()[-200:]!r}")
                    continue
                if round_ >= 2:
                    times[label].append(wall)
                    cpus[label].append(cpu)
        walls_s = time.monotonic() - started

        fmt = "%{http_code}:%{time_total} "
        curl2 = f"curl -s -o /dev/null -w '{fmt}' {url}; curl -s -o /dev/null -w '{fmt}' {url}"
        direct2 = f"curl -s -o /dev/null -w '{fmt}' {literal}; curl -s -o /dev/null -w '{fmt}' {literal}"
        latency = [("direct (no proxy)", ["sh", "-c", direct2]),
                   ("egress run --proxy lazy", [*run, "--proxy", "lazy", "--", "sh", "-c", curl2]),
                   ("egress run (warm)", [*run, "--", "sh", "-c", curl2])]
        if srt:
            srt2 = (f"curl -s --noproxy '' -o /dev/null -w '{fmt}' {literal}; "
                    f"curl -s --noproxy '' -o /dev/null -w '{fmt}' {literal}")
            latency.append(("srt", [srt, "--settings", str(srt_settings), "--", "sh", "-c", srt2]))
        first = {label: [] for label, _ in latency}
        second = {label: [] for label, _ in latency}
        for round_ in range(args.latency_rounds):
            shift = round_ % len(latency)
            for label, argv in latency[shift:] + latency[:shift]:
                status, _, _, out, err = run_cmd(argv, env, project)
                fields = out.split()
                if status != 0 or len(fields) != 2 or not all(f.startswith("200:") for f in fields):
                    failures.setdefault(f"first request, {label}", []).append(f"{out.strip()!r} {err.strip()[-200:]!r}")
                    continue
                first[label].append(float(fields[0].split(":")[1]))
                second[label].append(float(fields[1].split(":")[1]))

        # ------------------------------------------------------------ report
        cpu_name = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                         if line.startswith("model name")), platform.processor())
        print("egress warm proxy benchmark (bench/warm_bench.py)")
        print(f"machine: {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC; Linux {platform.release()}; "
              f"{os.cpu_count()} CPU ({cpu_name}); Python {platform.python_version()}")
        print(f"egress: {'git archive ' + args.ref if args.ref else 'working tree'} of {REPO}, "
              f"{'editable (dev venv)' if args.editable else 'regular install (a venv with a plain .pth)'}")
        if srt:
            print(f"srt: {srt}")
        print(f"{args.rounds} interleaved rounds (+2 warm-up) in {walls_s:.0f} s; load at end "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        if os.sched_getscheduler(0) in (os.SCHED_FIFO, os.SCHED_RR):  # chrt -f N: ahead of the machine's other jobs
            print(f"scheduling: real-time (chrt), priority {os.sched_getparam(0).sched_priority}, inherited by "
                  f"every process measured, the warm server included")
        print()
        reference = "srt curl -sf URL" if srt else None
        header = f"{'command':<44} {'median ms':>9} {'p90 ms':>8} {'CPU ms':>7}"
        print(header + (f" {'/srt':>6}" if srt else ""))
        print("-" * (len(header) + (7 if srt else 0)))
        for label, _, _ in variants:
            if not times[label]:
                print(f"{label:<44} {'failed':>9}")
                continue
            median = statistics.median(times[label])
            ref = None
            if srt and times.get("srt true") and times.get(reference):
                ref = times["srt true"] if "true" in label and "curl" not in label else times[reference]
            ratio = f" x{median / statistics.median(ref):5.2f}" if ref else ""
            print(f"{label:<44} {median * 1000:9.1f} {pct(times[label], 90) * 1000:8.1f} "
                  f"{statistics.median(cpus[label]) * 1000:7.1f}{ratio}")
        print()
        print("first proxied request: curl time_total, ms, median / p90")
        print(f"{'path':<30} {'1st':>17} {'2nd':>17}")
        for label, _ in latency:
            if first[label]:
                print(f"{label:<30} {statistics.median(first[label]) * 1000:8.1f} / {pct(first[label], 90) * 1000:6.1f} "
                      f"{statistics.median(second[label]) * 1000:8.1f} / {pct(second[label], 90) * 1000:6.1f}")
            else:
                print(f"{label:<30} failed")
        for label, errors in failures.items():
            notes.append(f"{label}: {len(errors)} run(s) failed, not in the figures; first: {errors[0]}")
        for note in notes:
            print(f"note: {note}")
        return 0
    except BenchError as e:
        print(f"warm_bench: {e}", file=sys.stderr)
        return 1
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
        pids = {warm_pid} if warm_pid is not None else set()
        for record in (tmp / "state" / "warm").glob("*.json"):  # --compare's server too
            try:
                pids.add(json.loads(record.read_text())["pid"])
            except (OSError, ValueError, KeyError):
                pass
        for pid in pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
