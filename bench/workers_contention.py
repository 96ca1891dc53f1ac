"""Is the extra CPU per request of `serve --workers 2` egress's, or two busy processes sharing the machine?

Run:  .venv/bin/python bench/workers_contention.py [--rounds 4] [--seconds 5]     (needs wrk, nginx, curl)

proxy_bench.py's set-up (nginx, egress serve --workers 1 and --workers 2), plus a second
independent `egress serve --workers 1`. Each round, interleaved, with the proxy's CPU per request
(its whole process tree) as the figure:

* alone: wrk -c16 against one single-process serve;
* two at once: wrk -c8 against each of the two single-process serves, at the same time (the same
  two busy processes as two workers, each with exactly 8 connections, nothing shared);
* w2: wrk -c16 against `--workers 2` (the kernel spreads the 16 connections by a hash).

If "two at once" costs as much more than "alone" as w2 does, the extra is the machine's.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import proxy_bench as pb  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--seconds", type=float, default=5)
    a = p.parse_args()
    args = argparse.Namespace(rounds=a.rounds, duration=a.seconds, latency_duration=1, connections=16, tunnels=96,
                              parallel=16, tunnel_timeout=30, bulk_timeout=60, quiet_threshold=30, quiet_wait=2,
                              quiet_budget=20, tests={"small"}, egress_src="tree", policy_pad=0, profile="never",
                              profile_seconds=1, profile_top=1, profile_out=None, json=None, quick=False,
                              workers=[1, 2])
    tmp = Path(tempfile.mkdtemp(prefix="egress-contention-"))
    procs = pb.Procs()
    bench = pb.Bench(args, tmp, procs)
    try:
        bench.setup()
        process, port, _ = bench.start_egress("egress-b", 1)
        hp = bench.http_port
        second = pb.Target("egress-b", "egress", process.pid,
                           http=(f"http://127.0.0.1:{port}", f"http://allowed.test:{hp}/small", f"allowed.test:{hp}"))
        results: dict[str, list[float]] = {"alone": [], "two at once": [], "w2": []}
        for r in range(a.rounds):
            bench.wait_quiet()
            alone = bench.run_wrk(bench.targets["egress"], 16, 2, a.seconds)
            pair: dict[str, dict] = {}
            threads = [threading.Thread(target=lambda n=n, t=t, pair=pair: pair.__setitem__(n, bench.run_wrk(t, 8, 1, a.seconds)))
                       for n, t in (("a", bench.targets["egress"]), ("b", second))]
            bench.wait_quiet()
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            bench.wait_quiet()
            w2 = bench.run_wrk(bench.targets["egress-w2"], 16, 2, a.seconds)
            results["alone"].append(alone["proxy_us_per_req"])
            results["two at once"].append(statistics.mean(row["proxy_us_per_req"] for row in pair.values()))
            results["w2"].append(w2["proxy_us_per_req"])
            bench.log(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in results.items())
                      + f" µs/req (other CPU {alone['other_cpu_pct']:.0f}% / {w2['other_cpu_pct']:.0f}%)")
        base = statistics.median(results["alone"])
        print(f"workers_contention: proxy CPU µs per request, medians of {a.rounds} rounds")
        for name, values in results.items():
            print(f"  {name:12s} {statistics.median(values):6.0f}  {statistics.median(values) / base:.3f}x alone"
                  f"   (rounds: {', '.join(f'{v:.0f}' for v in values)})")
        return 0
    except pb.BenchError as e:
        print(f"workers_contention: {e}", file=sys.stderr)
        return 1
    finally:
        procs.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
