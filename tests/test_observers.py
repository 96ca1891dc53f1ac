"""Observers (followers, egress run's reports) cannot stall the proxy; the audit log loses nothing.

Before: RunState.publish put() into a follower's queue of 10000 and blocked once it was
full, on the event loop; after ~10k refusals with one `egress events --follow` that
stopped reading, the proxy answered nobody.
"""

from __future__ import annotations

import io
import threading

from egress.control import RunState
from egress.events import Event, Recorder
from egress.metrics import Metrics


def event(i: int) -> Event:
    return Event(client="127.0.0.1:1", method="GET", host=f"h{i}.test", port=80, decision="block",
                 reason="not-allowed")


def test_a_stuck_subscriber_loses_events_counted_and_the_audit_log_none():
    metrics, audit = Metrics(), io.StringIO()
    recorder = Recorder(metrics, audit)
    release = threading.Event()
    got = []
    observer = recorder.subscribe(lambda e: (got.append(e), release.wait()), name="stuck", limit=100)
    for i in range(5000):
        recorder.record(event(i))  # returns whatever the subscriber does
    dropped = metrics.events_dropped.labels("stuck")._value.get()
    assert dropped == observer.dropped and 5000 - 101 <= dropped <= 5000 - 100
    assert len(audit.getvalue().splitlines()) == 5000
    release.set()
    recorder.close()
    assert len(got) == 5000 - dropped


def test_a_follower_that_stopped_reading_never_blocks_publish():
    state = RunState("r", ["x"])
    drops = []
    state.on_drop = lambda: drops.append(1)
    state.follow(limit=100)  # never read
    done = threading.Event()

    def publish():
        for i in range(1000):
            state.publish(event(i))
        done.set()

    thread = threading.Thread(target=publish, daemon=True)
    thread.start()
    thread.join(60)  # a blocking publish would still be stuck at event 101
    assert done.is_set()
    assert state.dropped == 900 and len(drops) == 900


def test_close_delivers_what_is_queued():
    recorder = Recorder(Metrics())
    got = []
    recorder.subscribe(got.append, name="run")
    for i in range(300):
        recorder.record(event(i))
    recorder.close()
    assert [e.host for e in got] == [f"h{i}.test" for i in range(300)]
