"""What relaying one event costs under `egress serve --workers N` (egress/serve/workers.py).

Run:  .venv/bin/python bench/relay_bench.py [--events 200000] [--rounds 5]

A worker hands each event to its EventForwarder (an observer, on a thread of its own). While
someone follows (`egress events`), the forwarder writes the event as one JSON line to its
pipe, and the supervisor's relay thread reads the pipe and gives each line to the control
socket's followers (RunState.publish_line: one queue per follower). While no one follows,
only upstream failures are written (the supervisor prints them once across workers); for the
others the forwarder reads a flag and returns.

Measured here with the real classes, in two real processes: a forked child plays the worker
(the forwarder called ``--events`` times, as the observer thread calls it) and this process
plays the supervisor (Relay, RunState, one follower whose queue a thread drains). CPU time per
event on each side (time.process_time of the process, every thread), medians over rounds.
For scale: the same event through a lone serve's own follower path (RunState.publish: the
JSON and the queue) is measured too, in one process.
"""

from __future__ import annotations

import argparse
import mmap
import os
import queue
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from egress.host.control import RunState  # noqa: E402
from egress.observe.events import Event  # noqa: E402
from egress.serve.workers import EventForwarder, Relay  # noqa: E402


def sample_event(worker: int) -> Event:
    return Event(client="127.0.0.1:52344", method="GET", host="pypi.org", port=443, decision="allow",
                 reason="allowed", rule="pypi.org (/etc/egress/policy.toml:3)", detail="", bytes_sent=0,
                 bytes_received=18532, time=time.time(), worker=worker)


def worker_side(fd: int, count: int, flag_up: bool, report: int) -> None:
    """The child: ``count`` events through the forwarder; writes its CPU seconds to ``report``."""
    flag = mmap.mmap(-1, 1)
    flag[0] = 1 if flag_up else 0
    forward = EventForwarder(fd, flag)
    event = sample_event(os.getpid())
    started = time.process_time()
    for _ in range(count):
        forward(event)
    os.write(report, f"{time.process_time() - started}\n".encode())
    os.close(fd)


def relayed(count: int, flag_up: bool) -> tuple[float, float]:
    """(worker µs per event, supervisor µs per event)."""
    state = RunState("bench", ["bench"])
    follower = state.follow(limit=count + 1)
    got = threading.Event()
    received = [0]

    def drain() -> None:
        while received[0] < count:
            follower.get()
            received[0] += 1
        got.set()

    def on_lines(data: bytes) -> None:
        for line in data.decode().splitlines():
            state.publish_line(line)

    read_end, write_end = os.pipe()
    report_r, report_w = os.pipe()
    child = os.fork()  # before any thread of ours exists
    if child == 0:
        os.close(read_end)
        worker_side(write_end, count, flag_up, report_w)
        os._exit(0)
    os.close(write_end)
    cpu0 = time.process_time()
    relay = Relay(on_lines, None)
    relay.add(read_end, "events")
    if flag_up:
        threading.Thread(target=drain, daemon=True).start()
    os.waitpid(child, 0)
    if flag_up:
        got.wait(120)
    relay.close(10)
    supervisor = time.process_time() - cpu0
    worker = float(os.read(report_r, 64).decode())
    os.close(report_r)
    os.close(report_w)
    return 1e6 * worker / count, 1e6 * supervisor / count


def lone_serve(count: int) -> float:
    """µs per event of RunState.publish with one follower (a lone serve's path), drained alongside."""
    state = RunState("bench", ["bench"])
    follower = state.follow(limit=count + 1)
    event = sample_event(0)
    started = time.process_time()
    for _ in range(count):
        state.publish(event)
    while True:
        try:
            follower.get_nowait()
        except queue.Empty:
            break
    return 1e6 * (time.process_time() - started) / count


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--events", type=int, default=200000)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    up_w, up_s, down_w, lone = [], [], [], []
    for _ in range(args.rounds):
        w, s = relayed(args.events, True)
        up_w.append(w)
        up_s.append(s)
        down_w.append(relayed(args.events, False)[0])
        lone.append(lone_serve(args.events))
    load = os.getloadavg()
    print(f"relay_bench: {args.events} events x {args.rounds} rounds, medians (CPU µs per event); "
          f"{os.cpu_count()} CPUs, load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"  followed, worker side (JSON + one write to its pipe):        {statistics.median(up_w):6.2f}")
    print(f"  followed, supervisor side (read, split, publish_line):      {statistics.median(up_s):6.2f}")
    print(f"  not followed, worker side (the flag read, nothing written):  {statistics.median(down_w):6.2f}")
    print(f"  a lone serve's follower path (RunState.publish), for scale:  {statistics.median(lone):6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
