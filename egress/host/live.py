"""Live policy: edits to a policy file apply to new requests, a broken edit opens nothing.

The watcher polls the files that went into the policy (includes too) once a
second. It compares what ``os.stat`` sees *through* the path (device, inode,
size, modification time), so an editor's write-and-rename and a Kubernetes
ConfigMap update (an atomic swap of the ``..data`` symlink) are both noticed.
SIGHUP reloads at once. A policy that fails to load is reported and counted in
``egress_policy_load_errors_total``; the last good policy stays in force.

Under ``egress run``, files the command can write are frozen (egress.run.snapshot):
their edits reload nothing and are reported once each.

A reload builds the new policy in a thread and swaps it in whole, on the loop, between
two requests. The thread paces itself (:class:`Pacer`): a build that never sleeps holds
the GIL, and the loop then waits up to the switch interval (5 ms) for it after each of its
own system calls; with a 1M-entry policy, throughput fell 92% and p99 rose from 10 to
205 ms for the 4.4 s of the reload. The old policy is emptied in that thread too, paced,
a buffer at a time (egress.policy.matcher keeps no object per entry: what a reload frees goes
back whole, and RSS stays where the first policy left it).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Callable, Collection
from pathlib import Path

POLL_SECONDS = 1.0


class Pacer:
    """Called between pieces of work in a thread: once ``work`` seconds went by since it last
    slept, it sleeps ``rest`` seconds for each ``work`` seconds that went by, so that the event
    loop gets the GIL at once and keeps it for a while. Waiting for the GIL counts as work: a
    busier loop gets more of its turns.

    In proportion, not a fixed ``rest``: a piece of work runs past ``work`` before the pause
    after it, by up to its own length, and the loop's share went with the pieces' size. A 1M-entry
    build whose 256-entry batches got faster slept after 3.2 ms of work instead of 2.5: the loop's
    share fell from 44% to 40% (throughput during a reload 0.75x)."""

    def __init__(self, work: float = 0.002, rest: float = 0.002):
        self.work, self.rest = work, rest
        self.since = time.perf_counter()

    def __call__(self) -> None:
        worked = time.perf_counter() - self.since
        if worked >= self.work:
            time.sleep(self.rest * worked / self.work)
            self.since = time.perf_counter()


def _paced(work: Callable, *args):
    """``work(*args)`` with the policy loader pausing through a :class:`Pacer` (in a thread)."""
    from egress.policy.loader import PACE

    PACE.set(Pacer())  # this thread's copy of the context only (asyncio.to_thread)
    return work(*args)


def _let_go(box: list) -> None:
    """Free the policy in ``box`` a piece at a time, if nothing else can reach it any more
    (else just drop it: its last holder frees it), then give the memory back."""
    policy = box.pop()
    if sys.getrefcount(policy) <= 2:  # this name and getrefcount's argument
        from egress.policy.loader import PACE

        policy.dismantle(PACE.get())
    del policy
    trim_heap()


def trim_heap() -> None:
    """Return freed heap memory to the system (egress.proxy.reclaim.trim: glibc's malloc_trim).

    glibc keeps what a reload frees in its heaps, and the next build does not fit in the
    holes: with 1M entries RSS went 262 -> 315 -> 332 -> ... 441 MB over 8 reloads; trimmed,
    264 -> 279 MB. The call releases the GIL (ctypes) and took 6-21 ms.
    """
    from egress.proxy.reclaim import trim

    trim()


def _fingerprint(files: list[str]) -> tuple:
    marks = []
    for path in files:
        try:
            st = os.stat(path)
            marks.append((path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError:
            marks.append((path, None))
    return tuple(marks)


def policy_marks(paths: list[str], policy) -> tuple:
    """What the watcher compares, for these user-given paths and the files ``policy`` read. Taken
    just after the policy loaded and passed to the watcher as ``since``, an edit made while the
    proxy was starting (a second or more) is seen at the first poll, not lost."""
    return _fingerprint([p for p in paths if os.path.exists(p)] + policy.files)


class PolicyWatcher:
    """Reloads the policy when its files change (or on :meth:`reload_now`)."""

    def __init__(self, engine, load: Callable, report: Callable[[str], None], paths: list[str] = (),
                 frozen: Collection[str] = (), since: tuple | None = None):
        """``load()`` returns a new Policy or raises PolicyError; ``report`` gets one line per message.

        ``paths``: the policy paths as the user gave them. The policy itself records the
        files it read with symlinks resolved; a symlink swap changes only the given path.
        ``frozen``: absolute paths of files whose changes must not reload (the command can write them).
        ``since``: :func:`policy_marks` when the policy in force was loaded (default: now).
        """
        self.engine = engine
        self.load = load
        self.report = report
        self.paths = [p for p in paths if os.path.exists(p)]
        self.frozen = frozenset(frozen)
        self._told: set[str] = set()
        self._seen = since if since is not None else self._marks()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _marks(self) -> tuple:
        return _fingerprint(self.paths + self.engine.policy.files)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(self._run(), name="egress policy watcher")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def reload_now(self) -> None:
        """Thread-safe: ask for a reload on the next turn of the loop."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    async def _run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), POLL_SECONDS)
            except TimeoutError:
                pass
            # The event, not how the wait ended: a request that came while wait_for was timing
            # out (it awaits the cancelled wait) ended as a timeout, and was then cleared unseen.
            forced = self._wake.is_set()
            self._wake.clear()
            try:
                await self.check(forced)
            except Exception as e:  # the watcher must outlive any one reload; the policy in force stays
                self.report(f"policy not reloaded: {type(e).__name__}: {e}")
                self.report("the last good policy stays in force")

    async def check(self, forced: bool = False) -> None:
        """Reload if a file that is not frozen changed (or ``forced``); report frozen ones."""
        seen = self._marks()
        changed = {mark[0] for mark in set(seen) ^ set(self._seen)}
        self._seen = seen
        live = {path for path in changed if not self._tell_if_frozen(path)}
        if forced or live:
            await self._reload()

    def _tell_if_frozen(self, path: str) -> bool:
        """True if ``path`` is frozen; its first change is reported, and never reloads."""
        where = str(Path(path).absolute())
        if where not in self.frozen:
            return False
        if where not in self._told:
            self._told.add(where)
            self.report(f"{where} changed, but the command can write it: this run keeps the policy "
                        f"it started with (the edit applies to the next run)")
        return True

    async def _reload(self) -> None:
        from egress.policy.loader import PolicyError

        try:
            policy = await asyncio.to_thread(_paced, self.load)  # a big policy must not stall the proxy
        except PolicyError as e:
            self.engine.recorder.metrics.policy_load_errors.inc()
            for problem in e.problems:
                self.report(f"policy not reloaded: {problem}")
            self.report("the last good policy stays in force")
            return
        old = [self.engine.policy]
        self.engine.replace_policy(policy)
        self._seen = self._marks()
        self.report(f"policy reloaded: {policy.size} from {', '.join(policy.files)}")
        del policy
        await asyncio.to_thread(_paced, _let_go, old)
