"""Output caps: how fast a command's output goes through `egress run --max-output`, against plain.

Run:  .venv/bin/python bench/output_cap_bench.py [--size 256] [--rounds 5]

One `egress run --network off -- cat FILE` per variant and round, interleaved round-robin (the
starting variant rotates), FILE a text log of --size MiB made once (lines of words, numbers,
paths and hex ids, so the redactor's prefilter has things to look at). Its stdout is drained
by this script through a pipe, as an agent harness would read it. Variants:

- plain: no cap, no redaction: the command writes straight into the pipe, egress relays nothing;
- cap: --max-output 256K: the output runs through egress's relay and the cap (head passed on,
  tail kept in a bounded buffer, the rest dropped);
- redact: --redact, no cap: every byte through the relay and the redactor;
- cap+redact: --max-output 256K --redact (what --agent does): the cap first, then redaction on
  the bounded head and tail.

MB/s = FILE's size / (median wall time - median wall time of `egress run --network off -- true`),
so the launcher's fixed cost is taken out; the run's peak RSS (ru_maxrss of this script's
children, measured in a child per variant) shows the memory bound. Everything lives in a temporary
folder removed at the end.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = {
    "plain": [],
    "cap": ["--max-output", "256K"],
    "redact": ["--redact"],
    "cap+redact": ["--max-output", "256K", "--redact"],
}


def make_log(path: Path, size: int) -> None:
    rng = random.Random(7)
    words = ["building", "compiling", "test", "passed", "warning:", "src/main.rs", "/usr/lib/x86_64-linux-gnu",
             "GET", "200", "ms", "npm", "http://registry.test/pkg", "INFO", "DEBUG", "error[E0308]:", "=>"]
    with path.open("wb") as out:
        written = 0
        while written < size:
            lines = []
            for _ in range(2000):
                lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) +
                             f" {rng.getrandbits(64):016x} {rng.randint(0, 10 ** 6)}\n")
            block = "".join(lines).encode()
            out.write(block)
            written += len(block)


def egress_run(args: list[str], env: dict, cwd: Path) -> float:
    command = [sys.executable, "-m", "egress", "run", "--network", "off", *args]
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, env=env, cwd=cwd, start_new_session=True)
    while process.stdout.read(1 << 20):
        pass
    status = process.wait(timeout=600)
    elapsed = time.perf_counter() - start
    if status != 0:
        raise SystemExit(f"{' '.join(command)}: status {status}")
    return elapsed


def peak_rss(args: list[str], env: dict, cwd: Path) -> int:
    probe = ("import resource, subprocess, sys; p = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE)\n"
             "while p.stdout.read(1 << 20): pass\n"
             "p.wait(); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    command = [sys.executable, "-c", probe, sys.executable, "-m", "egress", "run", "--network", "off", *args]
    return int(subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd, timeout=600).stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=256, help="MiB the command prints (default 256)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--skip", action="append", default=[], choices=list(VARIANTS),
                        help="leave a variant out (redact alone runs at the redactor's few MB/s); repeatable")
    options = parser.parse_args()
    for name in options.skip:
        del VARIANTS[name]
    root = Path(tempfile.mkdtemp(prefix="egress-cap-bench-"))
    try:
        (root / "project").mkdir()
        (root / "tmp").mkdir()
        log = root / "project" / "build.log"
        make_log(log, options.size << 20)
        size = log.stat().st_size
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(root), "LANG": "C.UTF-8",
               "EGRESS_STATE_DIR": str(root / "state"), "TMPDIR": str(root / "tmp"), "PYTHONPATH": str(REPO)}
        times: dict[str, list[float]] = {name: [] for name in ["true", *VARIANTS]}
        names = list(times)
        for round_ in range(options.rounds + 1):
            order = names[round_ % len(names):] + names[:round_ % len(names)]
            for name in order:
                args = ["--", "true"] if name == "true" else [*VARIANTS[name], "--", "cat", str(log)]
                elapsed = egress_run(args, env, root / "project")
                if round_:  # the first round warms caches
                    times[name].append(elapsed)
        base = statistics.median(times["true"])
        print(f"egress run --network off -- cat {size / 2 ** 20:.0f} MiB log, {options.rounds} rounds interleaved; "
              f"`egress run -- true` {base * 1000:.0f} ms taken out")
        print(f"{'variant':12} {'median s':>9} {'MB/s':>8} {'vs plain':>9} {'peak RSS':>10}")
        plain = None
        for name in VARIANTS:
            median = statistics.median(times[name])
            rate = size / 1e6 / max(median - base, 1e-6)
            plain = plain or rate
            rss = peak_rss([*VARIANTS[name], "--", "cat", str(log)], env, root / "project")
            print(f"{name:12} {median:9.2f} {rate:8.0f} {rate / plain:8.2f}x {rss / 1024:8.0f} MiB")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
