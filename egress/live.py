"""Live policy: edits to a policy file apply to new requests, a broken edit opens nothing.

The watcher polls the files that went into the policy (includes too) once a
second. It compares what ``os.stat`` sees *through* the path (device, inode,
size, modification time), so an editor's write-and-rename and a Kubernetes
ConfigMap update (an atomic swap of the ``..data`` symlink) are both noticed.
SIGHUP reloads at once. A policy that fails to load is reported and counted in
``egress_policy_load_errors_total``; the last good policy stays in force.

Under ``egress run``, files the command can write are frozen (egress.snapshot):
their edits reload nothing and are reported once each.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Collection
from pathlib import Path
from typing import Callable

POLL_SECONDS = 1.0


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
                forced = True
            except asyncio.TimeoutError:
                forced = False
            self._wake.clear()
            await self.check(forced)

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
        from .policy import PolicyError

        try:
            policy = await asyncio.to_thread(self.load)  # a big policy must not stall the proxy
        except PolicyError as e:
            self.engine.recorder.metrics.policy_load_errors.inc()
            for problem in e.problems:
                self.report(f"policy not reloaded: {problem}")
            self.report("the last good policy stays in force")
            return
        self.engine.replace_policy(policy)
        self._seen = self._marks()
        self.report(f"policy reloaded: {policy.size} from {', '.join(policy.files)}")
