"""Giving back the memory of connections that have closed.

Measured with bench/soak.py (egress serve, 2 workers, 10,000 passthrough tunnels held, then
closed): every connection leaves ~115 objects in reference cycles (mitmproxy's layers,
contexts and handlers refer to one another), which only the collector frees. Held for a while,
they reach the oldest generation; CPython collects that one only once the objects that reached
it since its last collection number a quarter of those that survived it, i.e. of what the held
tunnels themselves were. A proxy that is then idle, or serves a few keep-alive connections,
never gets there: the workers kept the RSS they had with the tunnels held (541 MB, 201 MB at
rest), cycle after cycle, and one gc.collect() found 461,038 unreachable objects after 4,000.

So when as many connections have closed since the last full collection as are open now (and
at least MIN_CLOSED), one full collection runs once no connection has closed for QUIET seconds
(at most WAIT after the first: a burst of closes makes one collection, after its last close),
then glibc's malloc_trim(0) gives its free pages back to the system. A full collection walks
what is alive besides the objects frozen at start-up; here that is at most what it frees, so the cost
per closed connection is bounded, but it is one pause: 428,344 objects (4,000 tunnels' worth)
took 1.5 s on a busy 2-vCPU machine, the pause CPython's own full collection would make whenever
it came. A keep-alive load opens no connection and never pays it. What still lives pins some of
the allocator's pages: after 4,000 tunnels a worker kept ~35% of what they had taken, not 100%.

Counting connections needs many of them to close. A few can hold a lot: six zstd uploads of 2 KB
each (12 KiB in all) held 360 MiB of decoder windows in their flows' cycles, still held after they
closed, since 6 is not 1000 (P9 of the 2026-12-07 review); a kept-alive connection's flows are in
no count at all. So memory is also reclaimed by what it weighs: :meth:`Reclaimer.check`, asked at
each sweep of Limits (every 5 s at the default head timeout; nothing per request or connection),
reads the resident size (/proc/self/statm, ~20 us) and, once it has grown over what it was after
the last collection (the floor) by GROWTH_SHARE of it and by GROWTH at least, runs the same full
collection and trim. What still lives after it is the new floor: memory held by live connections
costs one collection per half again of growth (CPython's own rule makes one per quarter more
long-lived objects), so the cost per byte taken is bounded as the cost per closed connection is.
Garbage under the bound waits for the other rules, or for the next growth. Where there is no
/proc (macOS), only the count applies.
"""

from __future__ import annotations

import asyncio
import gc
import os

MIN_CLOSED = 1000
QUIET = 1.0
WAIT = 10.0
GROWTH = 64 << 20  # bytes of resident memory over the floor, at least, before a collection by size
GROWTH_SHARE = 0.5  # ... and this share of the floor


class Reclaimer:
    def __init__(self) -> None:
        self.open = 0
        self.closed = 0  # since the last full collection
        self._full = _full_collections()
        self._due: asyncio.TimerHandle | None = None
        self._latest = 0.0  # the time by which it runs, once due
        self.floor: int | None = None  # resident bytes after the last collection (or the least seen since)

    def opened(self) -> None:
        self.open += 1

    def closed_one(self) -> None:
        self.open = max(0, self.open - 1)
        full = _full_collections()  # ~3 us
        if full != self._full:  # the collector ran a full collection itself: count from there
            self._full, self.closed = full, 0
        self.closed += 1
        if self._due is not None:  # due: wait for the burst to end
            loop = asyncio.get_running_loop()
            self._due.cancel()
            self._due = loop.call_at(min(loop.time() + QUIET, self._latest), self.reclaim)
            return
        if self.closed < MIN_CLOSED or self.closed < self.open:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop (a hook called directly)
            self.reclaim()
            return
        self._latest = loop.time() + WAIT
        self._due = loop.call_at(loop.time() + QUIET, self.reclaim)

    def check(self) -> bool:
        """Reclaim now if the resident size has grown past the bound over the floor; True if it did."""
        size = resident_bytes()
        if size is None:
            return False
        if self.floor is None or size < self.floor:
            self.floor = size
            return False
        if size - self.floor < max(GROWTH, self.floor * GROWTH_SHARE) or self._due is not None:
            return False  # within the bound, or a collection is due anyway
        self.reclaim()
        self.floor = resident_bytes() or size
        return True

    def reclaim(self) -> None:
        if self._due is not None:
            self._due.cancel()
        self._due = None
        gc.collect()
        self._full, self.closed = _full_collections(), 0
        trim()
        if self.floor is not None:
            self.floor = resident_bytes() or self.floor

    def cancel(self) -> None:
        if self._due is not None:
            self._due.cancel()
            self._due = None


def _full_collections() -> int:
    return gc.get_stats()[2]["collections"]


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int | None:
    """This process's resident size in bytes (/proc/self/statm); None where there is no /proc."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None


_malloc_trim = None


def trim() -> None:
    """glibc's malloc_trim(0): free pages anywhere in its heaps go back to the system (its own
    trimming only gives back the top of a heap). Nothing where there is no such function (musl)."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            import ctypes

            _malloc_trim = getattr(ctypes.CDLL(None), "malloc_trim", False)
        except OSError:
            _malloc_trim = False
        if _malloc_trim:
            _malloc_trim.argtypes, _malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    if _malloc_trim:
        _malloc_trim(0)
