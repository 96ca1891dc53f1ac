"""`egress run -- true` (and `-- curl`) of the working tree against a commit, side by side in one run.

Run:  .venv/bin/python bench/launcher_compare.py [--ref 985ba3d] [--new HEAD] [--rounds 40]

Both versions run from this interpreter through the same small entry point (the source
tree first on sys.path, then the `main` the console script calls: `egress.entry.main` where
it exists, else `egress.cli.main`), so neither pays for a console script or an editable
finder the other does not. A version with the warm proxy starts one in the temporary state
folder (during the warm-up rounds); it is stopped by its pid at the end. Rounds are interleaved and the starting variant
rotates each round; medians and the new/old ratio are printed. Each command gets the same
clean environment (PATH, HOME, EGRESS_STATE_DIR, TMPDIR in a temporary folder, removed at
the end) and runs `true`: what a command that opens no connection costs.

--new REF compares a commit instead of the working tree; both are then unpacked side by side
in the same temporary folder. Use it for figures: where the code lies matters here (the
working tree against an archive of its own HEAD, identical code, ran 1.055x).
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


def entry(source: Path, *args: str) -> list[str]:
    """The console script's entry point of that version: egress.entry (no click for `run`) where it
    exists, else egress.cli."""
    module = "egress.entry" if (source / "egress" / "entry.py").exists() else "egress.cli"
    code = (f"import sys; sys.path.insert(0, {str(source)!r}); from {module} import main; "
            f"sys.argv[0] = 'egress'; main()")
    return [sys.executable, "-c", code, *args]


def stop_warm_servers(state: Path) -> None:
    """Versions with a warm proxy start one per installation in the state folder: stop them by pid."""
    import json
    import signal

    for record in (state / "warm").glob("*.json") if (state / "warm").is_dir() else []:
        try:
            os.kill(json.loads(record.read_text())["pid"], signal.SIGTERM)
        except (OSError, ValueError, KeyError):
            pass


def unpack(ref: str, where: Path) -> Path:
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref], capture_output=True, check=True)
    where.mkdir()
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive.stdout, check=True)
    return where


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ref", default="HEAD", help="the commit to compare against (default HEAD)")
    parser.add_argument("--new", help="a commit to measure instead of the working tree")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--state-in-project", action="store_true",
                        help="the state folder at project/.local/state/egress (a project at $HOME): "
                             "the folders on its way are pinned as mount points")
    parser.add_argument("--no-curl", action="store_true",
                        help="leave out egress run -- curl: the warm proxy's work for it, still going when the "
                             "next variant starts, weighs on that one (2 CPUs)")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="egress-launcher-compare-"))
    state = tmp / "project" / ".local" / "state" / "egress" if args.state_in_project else tmp / "state"
    try:
        old = unpack(args.ref, tmp / "old")
        new = unpack(args.new, tmp / "new") if args.new else REPO
        name = args.new or "working tree"
        project, scratch = tmp / "project", tmp / "tmp"
        project.mkdir()
        scratch.mkdir()
        env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp), "EGRESS_STATE_DIR": str(state),
               "TMPDIR": str(scratch), "EGRESS_WARM_IDLE": "600"}
        subprocess.run(entry(new, "ca", "path"), env=env, cwd=project, capture_output=True, check=True)
        # `egress run -- curl`: one request to an upstream of this run's own on 127.0.0.1 (a name
        # resolved there by the proxy), through the warm proxy, as a command that uses the network.
        upstream = _upstream()
        policy = tmp / "policy.toml"
        policy.write_text('allow = ["bench.test"]\nallow_private = ["bench.test"]\n')
        curl = ["--policy", str(policy), "--resolve", "bench.test:127.0.0.1", "--",
                "curl", "-sS", "-o", "/dev/null", f"http://bench.test:{upstream.server_address[1]}/"]
        variants = {
            f"{args.ref}: egress run -- true": entry(old, "run", "--", "true"),
            f"{name}: egress run -- true": entry(new, "run", "--", "true"),
            f"{args.ref}: egress run --network off -- true": entry(old, "run", "--network", "off", "--", "true"),
            f"{name}: egress run --network off -- true": entry(new, "run", "--network", "off", "--", "true"),
        }
        if shutil.which("curl") and not args.no_curl:
            variants[f"{args.ref}: egress run -- curl"] = entry(old, "run", *curl)
            variants[f"{name}: egress run -- curl"] = entry(new, "run", *curl)
        times: dict[str, list[float]] = {label: [] for label in variants}
        order = list(variants.items())
        # A new order each round: rotating one order had each variant always run just after the
        # same one, and a warm proxy still closing the previous run's session (2 CPUs) then
        # charged one version: an A/A comparison (one commit against a copy of
        # itself) read 1.16 and 0.82; shuffled, 0.96 and 1.04.
        shuffle = random.Random(0).shuffle
        for round_ in range(args.rounds + 2):  # two warm-up rounds
            shuffle(order)
            for label, argv in order:
                started = time.perf_counter()
                done = subprocess.run(argv, env=env, cwd=project, capture_output=True, timeout=30)
                elapsed = time.perf_counter() - started
                if done.returncode != 0:
                    raise SystemExit(f"{label} failed ({done.returncode}): {done.stderr.decode()[-500:]}")
                if round_ >= 2:
                    times[label].append(elapsed)
        medians = {label: statistics.median(values) for label, values in times.items()}
        for label, value in medians.items():
            print(f"{label:<55} {value * 1000:7.1f} ms")
        for mode in ("egress run -- true", "egress run --network off -- true", "egress run -- curl"):
            if f"{name}: {mode}" not in medians:
                continue
            ratio = medians[f"{name}: {mode}"] / medians[f"{args.ref}: {mode}"]
            print(f"ratio {name} / {args.ref}, {mode}: {ratio:.3f}")
        print(f"{args.rounds} interleaved rounds, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}")
    finally:
        stop_warm_servers(state)
        shutil.rmtree(tmp, ignore_errors=True)


def _upstream():
    """A small HTTP server on 127.0.0.1 (port 0), answering in a thread for the whole run."""
    import http.server
    import threading

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def do_GET(self):
            body = b"ok\n"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


if __name__ == "__main__":
    main()
