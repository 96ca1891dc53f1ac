"""What the garbage collector costs egress under load, and what makes the garbage.

Run:  /work/venv/bin/python bench/gc_bench.py [--egress-base REV] [--seconds 10] [--rounds 2]
      (needs what bench/proxy_bench.py needs for its small-request test: nginx, curl, wrk, trustme)

It starts nginx and egress serve exactly as proxy_bench.py does (its Bench class, on
127.0.0.1, every port from binding port 0), but egress runs under a small wrapper that
times every collection (gc.callbacks) and, on SIGUSR1, writes what it saw. Then, per
egress (the tree, and --egress-base REV side by side, interleaved per round):

1. a wrk -c16 -t2 load of small plain-HTTP requests for --seconds: collections of each
   generation per 1,000 requests, their pause (median, max, total) and the objects each
   collected per request, with the load's p50/p99 and the proxy's CPU per request;
2. a short load with gc.DEBUG_SAVEALL: the unreachable objects (reference cycles) per
   request, by type, and the exceptions among them by where they were raised. Objects
   only in cycles are what makes young collections run; exceptions with tracebacks hold
   their frames, a cycle each.

Every process is stopped by its pid and the temporary directory removed (proxy_bench's
Procs), also on errors and Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import proxy_bench as pb  # noqa: E402

# The wrapper egress runs under: gc timing always; on SIGUSR1 a report (and, in saveall
# mode, the first signal starts keeping the garbage, the second reports it).
WRAPPER = r'''
import collections, gc, json, os, signal, sys, time, traceback
MODE, OUT = os.environ["GC_BENCH_MODE"], os.environ["GC_BENCH_OUT"]
pauses = {0: [], 1: [], 2: []}
started = [0.0]

def timer(phase, info):
    if phase == "start":
        started[0] = time.perf_counter()
    else:
        pauses[info["generation"]].append((time.perf_counter() - started[0], info.get("collected", 0)))

gc.callbacks.append(timer)
signals = [0]

def report(*_):
    signals[0] += 1
    out = {}
    if MODE == "saveall":
        if signals[0] == 1:
            gc.collect()
            gc.garbage.clear()
            gc.set_debug(gc.DEBUG_SAVEALL)
            return
        gc.collect()
        gc.set_debug(0)
        types = collections.Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage)
        raised = collections.Counter()
        for o in gc.garbage:
            if isinstance(o, BaseException) and o.__traceback__ is not None:
                frame = traceback.extract_tb(o.__traceback__)[-1]
                raised[f"{type(o).__name__} at {frame.name} ({frame.filename.rsplit('/', 2)[-1]}:{frame.lineno})"] += 1
        out = {"garbage": len(gc.garbage), "types": types.most_common(12), "raised": raised.most_common(6)}
        gc.garbage.clear()
    out["pauses"] = {g: list(p) for g, p in pauses.items()}
    with open(OUT, "w") as f:
        json.dump(out, f)
    for p in pauses.values():
        p.clear()

signal.signal(signal.SIGUSR1, report)
from egress.cli import main
sys.argv[0] = "egress"
sys.exit(main())
'''


def _signal(pid: int, out: Path, before: float = 0.0) -> dict:
    out.unlink(missing_ok=True)
    os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if out.exists() and out.stat().st_size:
            time.sleep(0.1)
            return json.loads(out.read_text())
        time.sleep(0.05)
    raise pb.BenchError("egress did not write its gc report within 30 s")


def measure(args, src: str, name: str, mode: str, tmp: Path, procs: pb.Procs) -> dict:
    out = tmp / f"{name}-{mode}.json"
    os.environ["GC_BENCH_MODE"], os.environ["GC_BENCH_OUT"] = mode, str(out)
    ns = argparse.Namespace(egress_src=src, egress_base=None, squid="never", tests={"small"}, policy_pad=0,
                            tunnels=400, parallel=16, tunnel_timeout=60, bulk_timeout=60, quiet_budget=10,
                            quiet_threshold=30, quiet_wait=2, upload_mib=8, upload_repeat=4,
                            workers=[1])  # one process: the collector it reports on is the proxy's
    pb.EGRESS_MAIN = WRAPPER
    bench = pb.Bench(ns, tmp / f"{name}-{mode}", procs)
    bench.tmp.mkdir()
    try:
        bench.setup()
        target = bench.targets["egress"]
        bench.run_wrk(target, 16, 2, 2)  # warm
        if mode == "saveall":
            os.kill(bench.egress.pid, signal.SIGUSR1)  # start keeping the garbage
            time.sleep(0.5)
            row = bench.run_wrk(target, 16, 2, 2)
        else:
            _signal(bench.egress.pid, out)  # forget the warm-up's collections
            bench.wait_quiet()
            row = bench.run_wrk(target, 16, 2, args.seconds)
        report = _signal(bench.egress.pid, out)
        report["load"] = row
        report["source"] = bench.egress_src
        return report
    finally:
        procs.stop_all()


def summary(report: dict) -> list[str]:
    row = report["load"]
    n = row["requests"]
    lines = [f"   load: {row['rps']:.0f} req/s, {n} requests, p50 {row['p50_ms']:.1f} ms, p99 {row['p99_ms']:.1f} ms, "
             f"proxy {row.get('proxy_us_per_req', 0):.0f} µs CPU/request, other CPU {row['other_cpu_pct']:.0f}%"]
    total = 0.0
    for g in ("0", "1", "2"):
        ps = report["pauses"].get(g, [])
        if not ps:
            lines.append(f"   gen{g}: none")
            continue
        ms = sorted(p[0] * 1000 for p in ps)
        total += sum(ms)
        lines.append(f"   gen{g}: {1000 * len(ps) / n:6.1f} per 1k requests, pause median {ms[len(ms) // 2]:.2f} ms, "
                     f"max {ms[-1]:.1f} ms; collected {sum(p[1] for p in ps) / n:.1f} objects/request")
    lines.append(f"   all collections: {1000 * total / n:.0f} ms per 1k requests")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--egress-src", default="tree")
    ap.add_argument("--egress-base", metavar="REV", help="also measure egress at this git revision, side by side")
    ap.add_argument("--seconds", type=float, default=10, help="length of the timed load (default 10)")
    ap.add_argument("--rounds", type=int, default=2, help="timed loads per egress, interleaved (default 2)")
    args = ap.parse_args()
    sources = [("egress", args.egress_src)] + ([("base", args.egress_base)] if args.egress_base else [])
    tmp = Path(tempfile.mkdtemp(prefix="egress-gc-bench-"))
    procs = pb.Procs()
    def on_signal(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_signal)
    pb.LARGE_BYTES = 8 * 2**20  # only /small is used: no need for proxy_bench's 256 MiB file
    try:
        results: dict[str, list[dict]] = {name: [] for name, _ in sources}
        for r in range(args.rounds):
            for name, src in pb._rotate(sources, r):
                print(f"[{time.strftime('%H:%M:%S')}] round {r + 1}: {name} timed load", file=sys.stderr)
                results[name].append(measure(args, src, f"{name}{r}", "gc", tmp, procs))
        saved = {}
        for name, src in sources:
            print(f"[{time.strftime('%H:%M:%S')}] {name}: cycles", file=sys.stderr)
            saved[name] = measure(args, src, name, "saveall", tmp, procs)
        print(f"egress gc benchmark, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
              f"{os.cpu_count()} vCPU ({pb._cpu_model()}); wrk -c16 -t2 -d{args.seconds:g}s small plain-HTTP requests")
        for name, _ in sources:
            print(f"\n{name}: {results[name][0]['source']}")
            for i, report in enumerate(results[name]):
                print(f"  round {i + 1}")
                print("\n".join(summary(report)))
            s = saved[name]
            n = s["load"]["requests"]
            print(f"  reference cycles (gc.DEBUG_SAVEALL over {n} requests): {s['garbage'] / n:.1f} objects/request")
            print("    by type: " + ", ".join(f"{t.rsplit('.', 1)[-1]} {c / n:.1f}" for t, c in s["types"]))
            if s["raised"]:
                print("    exceptions among them: " + "; ".join(f"{c} ({c / n:.2f}/request) {w}" for w, c in s["raised"]))
        return 0
    except pb.BenchError as e:
        print(f"gc_bench: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        procs.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
