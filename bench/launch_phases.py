"""Where `egress run -- true` spends its time, step by step (issue 11, target 1).

Run:  chrt -f 20 .venv/bin/python bench/launch_phases.py [--rounds 20] [--proxy warm|lazy] [--children]

A throw-away venv sees the working tree as a regular install would (bench/warm_bench.py's). Each
round runs the real `egress run -- true` once, then a wrapper process that imports the launcher's
modules one at a time (timing each), wraps its steps with timers (in the wrapper process only:
egress/ and sandbox/ are not changed) and calls egress.entry.main(["run", "--", "true"]). With
--children the sandbox's helper and init time their own steps too, written to their stderr (the
wrapper's functions are inherited by the forks). Printed: medians of the rounds, each step with when
it started (ms since the wrapper's first line) and how long it took; "spawn -> first line" and
"last line -> exit seen" against CLOCK_MONOTONIC, which this script and the wrapper share. Every
process's stdout and stderr are pipes, as in warm_bench.py; the warm server is stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import warm_bench  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODULES = ("egress.entry,egress.run.launcher,egress.run.plan,egress.run.prepare,egress.run.execute,sandbox.providers,egress.run.snapshot,egress.proxy.ca,egress.proxy.build,"
           "egress.proxy.trust,sandbox.spec,sandbox.paths,sandbox.linux,egress.run.warm.client,egress.host.control,egress.run.session,egress.run.ask")

WRAPPER = r'''
import os, sys, time
T_FIRST = time.monotonic()
spawned, out, children = float(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
imports, phases = [], []
for name in sys.argv[4].split(","):
    t = time.monotonic()
    __import__(name)
    imports.append((name, time.monotonic() - t))
m = sys.modules

def timed(owner, attr, label, child=False):
    fn = getattr(owner, attr)
    def wrapper(*a, **k):
        t = time.monotonic()
        try:
            return fn(*a, **k)
        finally:
            took = time.monotonic() - t
            if child:
                os.write(2, f"@@ {label} {(t - T_FIRST) * 1000:.3f} {took * 1000:.3f}\n".encode())
            else:
                phases.append((label, t - T_FIRST, took))
    setattr(owner, attr, wrapper)

L, E, W, K, S, X = (m[n] for n in ("egress.run.launcher", "sandbox.environment", "egress.proxy.build", "egress.host.control",
                                   "egress.run.session", "sandbox.linux"))
PREP, EXEC = m["egress.run.prepare"], m["egress.run.execute"]  # the run's steps (egress run = plan -> prepare -> execute)
for name in ("_private_folder", "protect_own_code", "_remove_tree"):
    timed(PREP, name, name)
timed(PREP.Prepared, "write_files", "write_files")
for name in ("seal_policy", "offer_warm", "asker"):
    timed(EXEC, name, name)
timed(E, "command_environment", "command_environment")
timed(W.ProxyBuilder, "open", "ProxyBuilder.open")
timed(X, "begin", "sandbox begin (fork)")
timed(X.Sandbox, "ready", "box.ready (until exec)")
timed(X.Sandbox, "wait", "box.wait")
timed(K.ControlServer, "__init__", "ControlServer()")
timed(K.ControlServer, "close", "ControlServer.close")
timed(S.ProxySession, "serve_lazily", "serve_lazily")
timed(S.ProxySession, "stop", "session.stop")
if children:
    from sandbox import capture, landlock, mounts, namespaces, seccomp
    for module, names in ((namespaces, ("enter", "loopback_up", "mount_proc", "drop_capabilities")),
                          (mounts, ("host_sockets", "build_view")), (landlock, ("restrict_writes",)),
                          (seccomp, ("install",)), (capture, ("setup",)), (X, ("_quiet_signals", "_wait_for_go"))):
        for name in names:
            timed(module, name, f"child {module.__name__.split('.')[-1]}.{name}", child=True)
    timed(os, "posix_spawn", "child posix_spawn", child=True)

MAIN, real_exit = os.getpid(), os._exit
def _exit(status):
    if os.getpid() == MAIN:
        import json
        with open(out, "w") as f:
            json.dump({"start": T_FIRST - spawned, "imports": imports, "phases": phases, "end": time.monotonic()}, f)
    real_exit(status)
os._exit = _exit
m["egress.entry"].main(["run", "--", "true"])
'''


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--proxy", choices=("warm", "lazy"), default="warm")
    parser.add_argument("--children", action="store_true", help="time the helper's and init's steps too")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="egress-launch-phases-"))
    try:
        egress = str(warm_bench.regular_install(tmp, REPO))
        python = str(Path(egress).parent / "python")
        for name in ("home", "state", "tmp", "project"):
            (tmp / name).mkdir()
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(tmp / "home"), "LANG": "C.UTF-8",
               "EGRESS_STATE_DIR": str(tmp / "state"), "TMPDIR": str(tmp / "tmp"), "EGRESS_WARM_IDLE": "900",
               "EGRESS_PROXY": args.proxy}
        project, out, wrapper = tmp / "project", tmp / "phases.json", tmp / "wrapper.py"
        wrapper.write_text(WRAPPER)

        def run(argv):
            return subprocess.run(argv, env=env, cwd=project, capture_output=True, stdin=subprocess.DEVNULL,
                                  timeout=60)

        run([egress, "ca", "path"])
        run([egress, "run", "--", "true"])  # starts the warm server
        if args.proxy == "warm":
            deadline = time.monotonic() + 30
            while warm_bench.warm_server(tmp / "state") is None and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(1.0)
        walls, results, child_steps = [], [], {}
        for round_ in range(args.rounds + 2):
            t0 = time.monotonic()
            done = run([egress, "run", "--", "true"])
            wall = time.monotonic() - t0
            time.sleep(0.05)
            t0 = time.monotonic()
            traced = run([python, str(wrapper), repr(t0), str(out), "1" if args.children else "0", MODULES])
            seen = time.monotonic()
            time.sleep(0.05)
            if done.returncode or traced.returncode:
                print(f"round {round_} failed: {done.stderr[-300:]!r} {traced.stderr[-300:]!r}")
                continue
            if round_ < 2:
                continue
            data = json.loads(out.read_text())
            data["gap"] = seen - data["end"]
            walls.append(wall)
            results.append(data)
            for line in traced.stderr.decode(errors="replace").splitlines():
                if line.startswith("@@ "):
                    label, at, took = line[3:].rsplit(" ", 2)
                    child_steps.setdefault(label, []).append((float(at), float(took)))
        ms = lambda values: statistics.median(values) * 1000  # noqa: E731
        print(f"egress run -- true ({args.proxy}): {ms(walls):.1f} ms median of {len(walls)} (the real one); "
              f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}")
        print(f"  spawn -> the wrapper's first line            {ms([d['start'] for d in results]):7.2f} ms")
        for index, (name, _) in enumerate(results[0]["imports"]):
            print(f"  import {name:<38} {ms([d['imports'][index][1] for d in results]):7.2f} ms")
        steps: dict[str, list] = {}
        for data in results:
            for label, at, took in data["phases"]:
                steps.setdefault(label, []).append((at, took))
        rows = [(statistics.median(a for a, _ in v) * 1000, statistics.median(t for _, t in v) * 1000, label)
                for label, v in steps.items()]
        rows += [(statistics.median(a for a, _ in v), statistics.median(t for _, t in v), label)
                 for label, v in child_steps.items()]
        for at, took, label in sorted(rows):
            print(f"  {label:<45} at {at:7.2f}  took {took:6.2f} ms")
        print(f"  last line -> exit seen                        {ms([d['gap'] for d in results]):7.2f} ms")
        return 0
    finally:
        for record in (tmp / "state" / "warm").glob("*.json"):
            try:
                os.kill(json.loads(record.read_text())["pid"], signal.SIGTERM)
            except (OSError, ValueError, KeyError):
                pass
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
